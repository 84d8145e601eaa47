"""Code health in CI: ruff's lint and format, mypy on the whole package,
and a size limit per module that only structure can meet (the formatter packs no lines)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvsnap"
# Formatted lines. Cohesion decides a module's size: the cap only catches a module that has
# quietly taken on a second job (at 500 it made modules split by length instead).
MAX_MODULE_LINES = 900


def run_tool(*args: str) -> subprocess.CompletedProcess:
    # No timeout: a busy machine makes mypy slow, not wrong.
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing():
    r = run_tool("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_tree_is_formatted():
    r = run_tool("ruff", "format", "--check", "--no-cache", ".")
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout + r.stderr


# A minute or more on 2 cores: out of the quick loop.
@pytest.mark.slow
def test_mypy_passes_on_the_whole_package():
    r = run_tool("mypy", "--no-incremental")  # files and settings: pyproject.toml [tool.mypy]
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_module_is_over_the_size_limit():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")
    }
    over = {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines: split them by what they do"


def test_the_size_check_sees_every_module():
    # A test that cannot fail is a defect: the limit must apply to the package's real modules.
    assert len(list(PACKAGE.rglob("*.py"))) > 50


def test_every_mutation_breakage_has_a_row_in_the_design_doc():
    """docs/design.md's mutation table names every breakage scripts/mutation_check.py makes."""
    import re

    script = (ROOT / "scripts" / "mutation_check.py").read_text()
    names = re.findall(r'Breakage\(\s+"([a-z0-9-]+)"', script)
    table = (ROOT / "docs" / "design.md").read_text().split("\n## Mutation check\n", 1)[1]
    assert len(names) > 40
    assert [n for n in names if f"`{n}`" not in table] == []


def test_no_line_is_over_100_characters():
    """ruff's E501 lets a line ending in a pragma or holding one long word pass; this does not."""
    over = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("kvsnap", "tests", "scripts")
        for path in (ROOT / folder).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert over == [], "split these lines"
