"""scripts/mutation_check.py's breakages survive reformatting and moves: each names its target
by module and function, and `--check-applies` proves every one still applies in seconds, on the
tree as it is and on a copy formatted at another width with a target moved. A pattern matching
its function zero times or twice fails loudly, naming the breakage, module and function."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "mutation_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


mc = _script()


def check_applies(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check-applies", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def tree_copy(tmp_path: Path) -> Path:
    """A root whose kvsnap/ is a real copy (to reformat) and whose other parts are links."""
    root = tmp_path / "tree"
    root.mkdir()
    ignore = mc.shutil.ignore_patterns("__pycache__", "*.pyc")
    mc.shutil.copytree(ROOT / "kvsnap", root / "kvsnap", ignore=ignore)
    for name in ("tests", "contrib", "docs", "pyproject.toml"):
        (root / name).symlink_to(ROOT / name)
    return root


def move_to_the_end(path: Path, qualname: str) -> None:
    """Move a top-level def (decorators and all) from its place to the end of its module."""
    lines = path.read_text().splitlines(keepends=True)
    first, last = next(
        (f, la) for q, f, la in mc.definitions(ast.parse("".join(lines))) if q == qualname
    )
    moved = lines[first - 1 : last]
    path.write_text("".join(lines[: first - 1] + lines[last:] + ["\n\n"] + moved))


def test_every_breakage_applies_to_the_tree_as_it_is():
    r = check_applies(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(mc.BREAKAGES)} breakages" in r.stdout


def test_every_breakage_applies_after_ruff_format_at_80_columns_and_a_move(tmp_path):
    root = tree_copy(tmp_path)
    # a top-level function some breakage targets, moved below everything else in its module
    patch = next(
        p
        for b in mc.BREAKAGES
        for p in b.patches
        if p.function and "." not in p.function and p.module.startswith("kvsnap.")
    )
    target = root / mc.module_path(patch.module, root)
    before = target.read_text()
    move_to_the_end(target, patch.function)
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--no-cache", "--line-length", "80", "kvsnap"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert fmt.returncode == 0, fmt.stderr
    assert "files reformatted" in fmt.stdout and target.read_text() != before
    r = check_applies(root)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_function_that_is_gone_fails_the_check_naming_breakage_module_and_function(tmp_path):
    root = tree_copy(tmp_path)
    b = mc.BREAKAGES[0]
    patch = b.patches[0]
    target = root / mc.module_path(patch.module, root)
    name = patch.function.rsplit(".", 1)[-1]
    target.write_text(target.read_text().replace(f"def {name}(", f"def {name}_renamed("))
    r = check_applies(root)
    assert r.returncode == 1
    assert f"{b.name}: no def or class {patch.function} in {patch.module}" in r.stdout
    # and it says where the pattern went, so the fix is one string
    renamed = patch.function.removesuffix(name) + f"{name}_renamed"
    assert f"its pattern now matches in: {patch.module}, in {renamed}" in r.stdout


MODULE = """
def first(a):
    x = compute(a,
                1)
    return x


def second(a):
    x = compute(a, 1)
    if x:
        x = compute(a, 1)
    return x


class Holder:
    @staticmethod
    def third(a):
        return compute(
            a,
            2,
        )
"""


@pytest.fixture
def pkg(tmp_path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(MODULE)
    return tmp_path


def breakage(function: str | None, old: str, new: str):
    return mc.Breakage("a-breakage", "c", "w", (mc.Patch("pkg.mod", function, old, new),), ())


def test_a_pattern_matches_only_inside_its_function_and_blind_to_whitespace(pkg):
    out = mc.patched_files(breakage("first", "x = compute(a, 1)", "x = compute(a, 9)"), pkg)
    text = out["pkg/mod.py"]
    assert "x = compute(a, 9)" in text
    # only the target changed: second() still computes with 1, twice
    assert text.split("def second")[1] == MODULE.split("def second")[1]
    # a method, decorators included, whose call the formatter wrapped with a trailing comma
    out = mc.patched_files(breakage("Holder.third", "compute(a, 2)", "compute(a, 3)"), pkg)
    assert "compute(a, 3)" in out["pkg/mod.py"]


def test_a_pattern_matching_its_function_twice_fails_loudly(pkg):
    with pytest.raises(mc.PatchError) as exc:
        mc.patched_files(breakage("second", "x = compute(a, 1)\n", "x = 0\n"), pkg)
    assert "a-breakage" in str(exc.value)
    assert "matches 2 times in pkg.mod, in second" in str(exc.value)


def test_a_pattern_matching_its_function_zero_times_fails_loudly(pkg):
    # the snippet is in the module, but not in the function named
    with pytest.raises(mc.PatchError) as exc:
        mc.patched_files(breakage("first", "if x:", "if not x:"), pkg)
    assert "a-breakage" in str(exc.value)
    assert "matches 0 times in pkg.mod, in first" in str(exc.value)


def test_a_function_that_is_not_there_fails_loudly(pkg):
    with pytest.raises(mc.PatchError) as exc:
        mc.patched_files(breakage("fourth", "x", "y"), pkg)
    assert "a-breakage: no def or class fourth in pkg.mod" in str(exc.value)


def test_a_breakage_without_guards_runs_the_tests_of_the_modules_it_patches():
    b = mc.Breakage("b", "c", "w", (mc.Patch("kvsnap.key", "hash_file", "a", "b"),), ())
    guards = mc.guards_of(b, ROOT)
    assert guards[0] == "tests/test_key.py"  # the mirrored file first, then the map's column
    assert all((ROOT / g).is_file() for g in guards)


def test_every_guard_names_a_test_that_is_there():
    parsed: dict = {}
    assert mc.guard_problem("tests/test_key.py::no_such_test", ROOT, parsed) is not None
    problems = [
        f"{b.name}: {problem}"
        for b in mc.BREAKAGES
        for g in b.guards
        if (problem := mc.guard_problem(g, ROOT, parsed))
    ]
    assert problems == []
