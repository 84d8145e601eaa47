"""tests/ mirrors kvsnap/: a module's tests are where a contributor looks first,
tests/<same folders>/test_<name>.py (kvsnap/runtime/cache/trie.py ->
tests/runtime/cache/test_trie.py), or docs/design.md's module map says where they are (its
"tests" column names existing files).
Shared builders live in tests/helpers/ and fixtures in conftest.py files: a test file never
imports another one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvsnap"
TESTS = ROOT / "tests"
MODULE = r"`((?:[a-z_]+/)*[a-z_]+\.py)`"


def modules() -> list[str]:
    """Every module the map lists: relative to kvsnap/, package __init__ and __main__ aside."""
    return sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )


def mirrored(module: str) -> Path:
    path = Path(module)
    return TESTS / path.parent / f"test_{path.stem}.py"


def map_tests_cells() -> dict[str, str]:
    """module -> the last cell of its row in docs/design.md's "## Modules" tables."""
    doc = (ROOT / "docs" / "design.md").read_text()
    section = doc.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    cells = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first, *_, last = (cell.strip() for cell in line.strip().strip("|").split(" | "))
        for module in re.findall(MODULE, first):
            cells[module] = last
    return cells


def test_every_module_has_tests_at_its_mirrored_path_or_the_map_names_them():
    cells = map_tests_cells()
    missing = []
    for module in modules():
        if mirrored(module).is_file():
            continue
        cell = cells.get(module, "")
        named = re.findall(r"`(tests/[^`]+\.py)`", cell)
        if not named and not cell.startswith("none: "):
            missing.append(
                f"kvsnap/{module}: no {mirrored(module).relative_to(ROOT)}, and its row in "
                "docs/design.md's module map names no test file in its tests column"
            )
    assert missing == [], (
        "add the mirrored test file, or name the tests that cover the module in the map "
        "(or 'none: <why>'):\n" + "\n".join(missing)
    )


def test_the_maps_tests_column_names_only_test_files_that_exist():
    stale = [
        f"{module}: {path}"
        for module, cell in map_tests_cells().items()
        for path in re.findall(r"`(tests/[^`]+\.py)`", cell)
        if not (ROOT / path).is_file()
    ]
    assert stale == [], "docs/design.md's module map names test files that do not exist:\n" + (
        "\n".join(stale)
    )


def test_no_test_file_imports_another():
    """Shared code goes to tests/helpers/ (builders) or a conftest.py (fixtures)."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[-1].startswith("test_") or name == "conftest":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert found == [], "\n".join(found)


def test_test_files_sit_in_a_folder_that_mirrors_the_package():
    """tests/<folder>/ exists only where kvsnap/<folder>/ does, plus helpers/, fixtures/ and e2e/
    (slow end-to-end runs across the package)."""
    extra = {"helpers", "fixtures", "e2e"}
    wrong = [
        str(folder.relative_to(ROOT))
        for folder in sorted(TESTS.rglob("*"))
        if folder.is_dir()
        and folder.name != "__pycache__"
        and "__pycache__" not in folder.parts
        and folder.relative_to(TESTS).parts[0] not in extra
        and not (PACKAGE / folder.relative_to(TESTS)).is_dir()
    ]
    assert wrong == [], f"test folders with no kvsnap/ counterpart: {wrong}"
