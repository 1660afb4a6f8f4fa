"""docs/integrations.md: the six sections, every block in one, and the frameworks named once."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

from integration_recipes import sections

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ["Hugging Face transformers Trainer", "PyTorch Lightning", "torchtitan", "heavyball", "pytorch-optimizer",
            "NVIDIA Emerging-Optimizers"]


def test_the_page_has_a_section_per_framework_and_no_code_outside_them():
    found = sections()
    assert list(found)[1:] == SECTIONS
    assert found[""] == []


def requirements(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_the_integrations_extra_is_the_test_requirements():
    """`pip install spectral-ops[integrations]` installs what the tests ran against."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["integrations"] == requirements(ROOT / "requirements-integrations.txt")


def test_the_readme_links_the_page():
    assert re.search(r"\]\(docs/integrations\.md\)", (ROOT / "README.md").read_text())
