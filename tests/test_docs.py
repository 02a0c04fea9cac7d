"""The README stays short and points only at files in the repository."""

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
README = (REPO_ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def test_readme_is_at_most_1500_words():
    assert len(README.split()) <= 1500


def test_readme_opens_with_the_two_commands():
    block = README.split("```")[1].splitlines()
    assert [line.split("#")[0].strip() for line in block[1:3]] == ["bash scripts/main.sh", "bash .ci/run"]


def test_support_table_cells_are_short():
    rows = [line for line in _section("Support").splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 5
    for row in rows:
        for cell in row.strip().strip("|").split(" | "):
            assert len(cell.split()) <= 40, cell


def test_readme_points_only_at_files_that_exist():
    paths = set(re.findall(r"`((?:docs|bench|scripts|examples|tests|specdec_kernels)/[\w./-]+\.(?:md|py|sh))`", README))
    assert len(paths) > 5
    assert not [path for path in paths if not (REPO_ROOT / path).is_file()]
    assert "shared/design" not in README


def test_the_first_call_runs_as_written():
    """The README's first Python snippet, executed: every name it uses is defined in it."""
    snippet = README.split("```python\n")[1].split("```")[0]
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["tokens"].shape == (2, 5) and namespace["num_accepted"].shape == (2,)
