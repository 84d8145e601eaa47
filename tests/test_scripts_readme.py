"""scripts/README.md lists every script in scripts/, and every script it lists exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def listed() -> set[str]:
    """The names the README's list items start with: "- `name`: purpose — command"."""
    text = (SCRIPTS / "README.md").read_text()
    return set(re.findall(r"^- `([^`]+)`", text, flags=re.MULTILINE))


def on_disk() -> set[str]:
    scripts = {p.name for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh")}
    folders = {p.name + "/" for p in SCRIPTS.iterdir() if p.is_dir() and p.name[0] not in "._"}
    return scripts | folders


def test_every_script_is_listed_in_the_readme():
    missing = on_disk() - listed()
    assert missing == set(), f"add a line for each to scripts/README.md: {sorted(missing)}"


def test_every_script_the_readme_lists_exists():
    gone = listed() - on_disk()
    assert gone == set(), f"scripts/README.md lists scripts that are not there: {sorted(gone)}"


def test_the_check_reads_the_readme():
    # A test that cannot fail is a defect: the list must hold the real scripts.
    assert {"mutation_check.py", "check_duplicates.sh"} <= listed()
