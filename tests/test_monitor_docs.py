"""docs/monitoring.md: its sections, its code inside the host sections only, and its links from the README
and from every framework section of docs/integrations.md."""

from __future__ import annotations

import re
from pathlib import Path

from integration_recipes import INTEGRATIONS, MONITORING, sections

ROOT = Path(__file__).resolve().parent.parent
HOSTS = ["Hugging Face transformers Trainer", "PyTorch Lightning", "A plain loop: TensorBoard and CSV"]


def test_the_page_has_its_sections_and_code_only_in_the_hosts():
    found = sections(MONITORING)
    assert {"What it reports, and why you would watch it", "Options", *HOSTS, "Plotting a run",
            "Accuracy of `s_max`", "Cost", "Distributed"} <= set(found)
    assert [title for title, blocks in found.items() if blocks] == HOSTS


def test_the_readme_and_every_framework_section_of_the_integrations_page_link_it():
    assert re.search(r"\]\(docs/monitoring\.md\)", (ROOT / "README.md").read_text())
    text = INTEGRATIONS.read_text()
    bodies = re.split(r"^## .+$", text, flags=re.MULTILINE)[1:]
    assert len(bodies) == len(sections(INTEGRATIONS)) - 1
    assert all("](monitoring.md)" in body for body in bodies)


def test_the_figure_it_shows_is_committed():
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", MONITORING.read_text())
    assert figures and all((MONITORING.parent / figure).is_file() for figure in figures)
