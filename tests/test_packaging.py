"""What the wheel holds and which version it carries, checked without building one (CI builds
the wheel, installs it into a fresh venv and runs ``kvsnap quickstart`` from it: .ci/run)."""

from __future__ import annotations

from fnmatch import fnmatch
from importlib.metadata import version
from pathlib import Path

import tomllib
from helpers.cli import run_kvsnap
from setuptools import find_namespace_packages, find_packages

import kvsnap

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def package_files() -> list[Path]:
    return [
        p
        for p in (ROOT / "kvsnap").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    ]


def test_every_folder_with_python_files_is_a_package_the_wheel_finds():
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    # As setuptools finds them from pyproject.toml: namespace folders too unless turned off.
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    found = set(finder(where=str(ROOT), include=find["include"], exclude=find.get("exclude", ())))
    folders = {p.parent.relative_to(ROOT) for p in package_files() if p.suffix == ".py"}
    missing = sorted(".".join(f.parts) for f in folders if ".".join(f.parts) not in found)
    assert not missing, (
        f"{missing}: folders with Python files that the wheel would leave out "
        "(pyproject.toml's [tool.setuptools.packages.find] does not include them)"
    )
    # A folder without __init__.py would ship as a namespace package, by accident.
    plain = sorted(f.as_posix() for f in folders if not (ROOT / f / "__init__.py").is_file())
    assert not plain, f"{plain}: folders with Python files and no __init__.py"


def test_the_package_holds_no_data_file_the_wheel_would_leave_out():
    # setuptools puts only .py files of the found packages in the wheel unless package-data
    # names more: a template or JSON file added under kvsnap/ must be named there.
    declared = PYPROJECT["tool"]["setuptools"].get("package-data", {})
    left_out = []
    for p in package_files():
        package = ".".join(p.parent.relative_to(ROOT).parts)
        patterns = declared.get(package, []) + declared.get("*", [])
        if p.suffix != ".py" and not any(fnmatch(p.name, pattern) for pattern in patterns):
            left_out.append(p.relative_to(ROOT).as_posix())
    assert not left_out, (
        f"{left_out}: not Python and not in [tool.setuptools.package-data]: name them there and "
        "check the wheel holds them (unzip -l dist/*.whl)"
    )


def test_one_version_read_from_the_package_and_printed_by_the_cli():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "kvsnap.__version__"}
    assert version("kvsnap") == kvsnap.__version__, (
        "the installed metadata is older than kvsnap/__init__.py: pip install -e '.[test]' again"
    )
    r = run_kvsnap("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvsnap {kvsnap.__version__}", r
    assert "## [Unreleased]" in (ROOT / "CHANGELOG.md").read_text()


def test_ci_runs_the_quickstart_from_the_wheel_then_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    readme = (ROOT / "README.md").read_text()
    after = readme.split("Run the whole test suite", 1)[1]
    command = after.split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert ci[-1] == command, "the README's test command and .ci/run's last line differ"
    quickstart = [n for n, line in enumerate(ci) if 'wheelvenv/bin/kvsnap" quickstart' in line]
    assert quickstart and quickstart[0] < len(ci) - 1
