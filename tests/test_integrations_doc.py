"""docs/integrations.md: every Python snippet runs, on CPU tensors with backend="reference"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def snippets_by_section() -> dict[str, list[str]]:
    """The page's ```python blocks under each ``## `` heading."""
    sections, current = {}, None
    for part in re.split(r"^(## .*)$", PAGE.read_text(), flags=re.M):
        if part.startswith("## "):
            current = part[3:].strip()
            sections[current] = []
        elif current is not None:
            sections[current] += re.findall(r"^```python\n(.*?)^```", part, flags=re.M | re.S)
    return sections


def test_the_page_has_a_section_per_adapter():
    sections = snippets_by_section()
    assert list(sections) == ["FlashInfer", "SGLang", "vLLM"]
    assert len(sections["FlashInfer"]) == len(sections["SGLang"]) == len(sections["vLLM"]) == 1


@pytest.mark.parametrize("section", ["FlashInfer", "SGLang", "vLLM"])
def test_snippet_runs(section):
    for snippet in snippets_by_section()[section]:
        assert 'backend="reference"' in snippet  # so it runs here, on CPU tensors
        exec(compile(snippet, f"{PAGE.name} ({section})", "exec"), {})
