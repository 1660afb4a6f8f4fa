"""The README's code runs as written: every ```python block of it, in order, in one namespace."""

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_every_python_block_of_the_readme_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 2  # the quickstart and the optimizer example
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["optimizer"].state  # the optimizer example took its step
