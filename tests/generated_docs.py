"""The sections of docs/*.md that a function of the package generates, as the docs hold them."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def generated_section(doc: str, generator: str) -> str:
    """The text of ``doc`` (a file of docs/) between ``<!-- generated: generator -->`` and its end marker."""
    text = (DOCS / doc).read_text()
    start = f"<!-- generated: {generator} -->\n"
    return text[text.index(start) + len(start):text.index(f"<!-- end: {generator} -->")].strip()
