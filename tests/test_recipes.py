"""docs/recipes.md runs as written: each ```python block in a namespace of its own (a recipe stands
alone), and each ends by checking its decay against the FP64 SVD."""

import re
from pathlib import Path

import pytest

RECIPES = Path(__file__).parents[1] / "docs" / "recipes.md"
BLOCKS = re.findall(r"^## (.*?)\n.*?```python\n(.*?)```", RECIPES.read_text(), flags=re.DOTALL | re.MULTILINE)


def test_there_is_a_recipe_per_client_family():
    assert [title for title, _ in BLOCKS] == [
        "torch's Muon and AdamW, with `attach`", "A dion-style Muon that calls the op inside its update",
        "An optimizer that is not a `torch.optim.Optimizer`", "A banked bf16 parameter with its mantissa",
        "An MoE layer with stacked experts"]


@pytest.mark.parametrize("title, code", BLOCKS, ids=[title for title, _ in BLOCKS])
def test_the_recipe_runs_and_its_check_holds(title, code):
    exec(compile(code, str(RECIPES), "exec"), {"__name__": "recipe"})
