"""The package tree is the architecture: arrows that must never exist, checked on the import
graph (every import statement, lazy ones inside functions included), and docs/design.md's module
map kept equal to the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvsnap"

# Every module belongs to one layer; a new top-level module must be placed here on purpose.
# kvsnap.snapshot.format is a leaf (version constants, header field names, the snapshot path) that
# the identity in key.py needs too, so it counts as base.
BASE = {"kvsnap", "kvsnap.errors", "kvsnap.key", "kvsnap.prompts", "kvsnap.blas", "kvsnap.faults", "kvsnap.snapshot.format"}
LAYERS = ("snapshot", "store", "runtime", "http", "tools", "integrations")
APPS = {"kvsnap.build", "kvsnap.cli", "kvsnap.__main__"}
CLI = ("kvsnap.cli", "kvsnap.commands")  # the command line: its parser and its command implementations

# importer prefix -> imported prefixes it must never reach
FORBIDDEN = {
    "kvsnap.snapshot": ("kvsnap.store", "kvsnap.runtime", "kvsnap.http", "kvsnap.build", "kvsnap.cli", "kvsnap.tools", "kvsnap.integrations"),
    "kvsnap.store": ("kvsnap.runtime", "kvsnap.http", "kvsnap.build", "kvsnap.cli", "kvsnap.tools", "kvsnap.integrations"),
    "kvsnap.runtime": ("kvsnap.build", "kvsnap.cli", "kvsnap.http", "kvsnap.tools", "kvsnap.integrations"),
    "kvsnap.http": ("kvsnap.build", "kvsnap.cli", "kvsnap.tools", "kvsnap.integrations"),
    "kvsnap.integrations": ("kvsnap.store.oci", "kvsnap.build", "kvsnap.cli", "kvsnap.tools"),  # remote stores through the scheme seam
    "kvsnap.tools": ("kvsnap.cli",),
    "kvsnap.build": ("kvsnap.http", "kvsnap.cli", "kvsnap.tools", "kvsnap.integrations"),
}
BASE_FORBIDDEN = tuple(f"kvsnap.{layer}" for layer in LAYERS) + ("kvsnap.build", "kvsnap.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path) -> set[str]:
    """Absolute names of every kvsnap module ``path`` imports, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from kvsnap.store import oci`
    known = modules()
    return {m for m in found if m in known and m != name}


def reaches(imported: str, prefix: str) -> bool:
    return imported == prefix or imported.startswith(prefix + ".")


def layer_of(name: str) -> str:
    if name in BASE or name in APPS:
        return name
    if any(reaches(name, p) for p in CLI):
        return "kvsnap.cli"
    for layer in LAYERS:
        if reaches(name, f"kvsnap.{layer}"):
            return f"kvsnap.{layer}"
    return ""


def violations() -> list[str]:
    found = []
    for name, path in modules().items():
        rules = BASE_FORBIDDEN if name in BASE else FORBIDDEN.get(layer_of(name), ())
        for imported in sorted(imports_of(name, path)):
            if imported not in BASE and any(reaches(imported, p) for p in rules):
                found.append(f"{name} -> {imported}")
            elif any(reaches(imported, p) for p in CLI) and name != "kvsnap.__main__" and layer_of(name) != "kvsnap.cli":
                found.append(f"{name} -> {imported} (only kvsnap.__main__ may import the CLI)")
    return sorted(set(found))


def test_every_module_sits_in_a_layer():
    unplaced = [name for name in modules() if not layer_of(name)]
    assert not unplaced, f"place these modules in a layer (kvsnap/<layer>/) or add them to BASE in {__file__}: {unplaced}"


def test_no_forbidden_arrow():
    assert violations() == []


@pytest.mark.parametrize(
    "source, importer, arrow",
    [
        ("from kvsnap.build import build_snapshots\n", "kvsnap/runtime/engine.py", "kvsnap.runtime.engine -> kvsnap.build"),
        ("def f():\n    from kvsnap.cli import main\n", "kvsnap/tools/quickstart.py", "kvsnap.tools.quickstart -> kvsnap.cli"),
        ("from kvsnap.store import oci\n", "kvsnap/integrations/vllm_mlx.py", "kvsnap.integrations.vllm_mlx -> kvsnap.store.oci"),
        ("from ..runtime.prefix import PrefixCache\n", "kvsnap/store/local.py", "kvsnap.store.local -> kvsnap.runtime.prefix"),
    ],
)
def test_the_check_sees_a_forbidden_arrow(source, importer, arrow, monkeypatch):
    """Each kind of import (plain, lazy, `from package import module`, relative) is seen."""
    real = Path.read_text
    target = PACKAGE.parent / importer

    def patched(self, *a, **k):
        return real(self, *a, **k) + ("\n" + source if self == target else "")

    monkeypatch.setattr(Path, "read_text", patched)
    assert any(v.startswith(arrow) for v in violations()), violations()


def test_design_doc_module_map_matches_the_tree():
    doc = (ROOT / "docs" / "design.md").read_text()
    table = doc.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `((?:[a-z_]+/)*[a-z_]+\.py)`(?:, `((?:[a-z_]+/)*[a-z_]+\.py)`)?", table, re.M))
    named = {path for row in named for path in row if path}
    tree = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert sorted(tree - named) == [], "modules missing from docs/design.md's module map"
    assert sorted(named - tree) == [], "docs/design.md names modules that do not exist"
