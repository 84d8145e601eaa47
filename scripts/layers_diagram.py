"""docs/design.md's picture of the layers and runtime/'s subpackages, drawn from the imports.

Every import statement in kvsnap/ (lazy ones inside functions too) is read with ast; modules are
grouped into layers (kvsnap/<folder>/, runtime/ by subpackage; the top-level modules and the
leaf snapshot/format.py are the base, as tests/test_architecture.py places them), and an arrow
A --> B means B imports A. Arrows a longer path already implies are left out, so the picture
shows the order rather than every import. tests/test_architecture.py fails when the picture in
docs/design.md is not what this script draws from the tree.

    python scripts/layers_diagram.py          # rewrite the picture in docs/design.md
    python scripts/layers_diagram.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvsnap"
DOC = ROOT / "docs" / "design.md"
BEGIN = (
    "<!-- layers diagram: written by scripts/layers_diagram.py from the imports; do not edit -->"
)
END = "<!-- end of layers diagram -->"
# Leaves inside a layer folder that the base needs (the identity reads the file format's
# constants): drawn in the base, as tests/test_architecture.py's BASE places them.
BASE_LEAVES = ("kvsnap.snapshot.format",)
SINGLE_FILE_LAYERS = ("kvsnap.api", "kvsnap.__main__")
RUNTIME = "kvsnap.runtime"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(name: str, path: Path, known) -> set[str]:
    """The ``known`` kvsnap modules ``path`` (module ``name``) imports, relative imports
    resolved, lazy ones inside functions included (tests/test_architecture.py checks these)."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from kvsnap.store import oci`
    return {m for m in found if m in known and m != name}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """kvsnap module -> the kvsnap modules it imports (relative imports resolved)."""
    paths = {module_name(p): p for p in sorted(package.rglob("*.py"))}
    return {name: imports_of(name, path, paths) for name, path in paths.items()}


def group_of(name: str) -> str | None:
    """The box a module is drawn in; None for package markers that hold no code of their own."""
    parts = name.split(".")
    top_file = len(parts) == 2 and not (PACKAGE / parts[1]).is_dir()
    if name in BASE_LEAVES or (top_file and name not in SINGLE_FILE_LAYERS):
        return "base"
    if name in SINGLE_FILE_LAYERS:
        return parts[1]
    if name.startswith(RUNTIME + ".") and len(parts) > 2:
        return f"runtime/{parts[2]}"
    return parts[1] if len(parts) > 1 else None


def layer_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(imported box, importing box) for every import between two boxes."""
    edges = set()
    for name, imported in graph.items():
        to = group_of(name)
        for other in imported:
            frm = group_of(other)
            if to and frm and frm != to:
                edges.add((frm, to))
    return edges


def reduced(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """The edges no longer path implies (a transitive reduction of an acyclic graph)."""
    after: dict[str, set[str]] = {}
    for frm, to in edges:
        after.setdefault(frm, set()).add(to)

    def reachable(start: str, skip: tuple[str, str]) -> set[str]:
        seen, todo = set(), [n for n in after.get(start, ()) if (start, n) != skip]
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(after.get(node, ()))
        return seen

    return sorted(edge for edge in edges if edge[1] not in reachable(edge[0], edge))


def node_id(group: str) -> str:
    return group.replace("/", "_").strip("_")


def depths(edges: list[tuple[str, str]]) -> dict[str, int]:
    """Each box's longest path from a box nothing feeds: the order the picture lists them in."""
    before: dict[str, set[str]] = {}
    for frm, to in edges:
        before.setdefault(to, set()).add(frm)
        before.setdefault(frm, set())
    found: dict[str, int] = {}

    def depth(group: str) -> int:
        if group not in found:
            found[group] = 1 + max((depth(g) for g in before[group]), default=-1)
        return found[group]

    for group in before:
        depth(group)
    return found


def diagram(graph: dict[str, set[str]] | None = None) -> str:
    """The mermaid block: the layers left to right, runtime/'s subpackages inside one box; nodes
    and arrows listed lowest first, so the text reads in order too."""
    edges = reduced(layer_edges(import_graph() if graph is None else graph))
    depth = depths(edges)
    groups = sorted(depth, key=lambda g: (depth[g], g))
    lines = ["```mermaid", "flowchart LR"]
    inner = [g for g in groups if g.startswith("runtime/")]
    if inner:
        lines.append("  subgraph runtime")
        lines += [f'    {node_id(g)}["{g.removeprefix("runtime/")}/"]' for g in inner]
        lines.append("  end")
    for g in groups:
        if not g.startswith("runtime/"):
            label = g if g in ("base", "api", "__main__") else f"{g}/"
            lines.append(f'  {node_id(g)}["{label}"]')
    edges.sort(key=lambda e: (depth[e[0]], depth[e[1]], e))
    lines += [f"  {node_id(frm)} --> {node_id(to)}" for frm, to in edges]
    lines.append("```")
    return "\n".join(lines)


def with_diagram(doc: str, picture: str) -> str:
    """``doc`` with the text between the markers replaced by ``picture``."""
    if doc.count(BEGIN) != 1 or doc.count(END) != 1:
        raise SystemExit(f"{DOC}: expected one {BEGIN!r} and one {END!r} marker")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{picture}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/design.md differs")
    args = parser.parse_args(argv)
    doc = DOC.read_text()
    new = with_diagram(doc, diagram())
    if args.check:
        if new != doc:
            print(f"{DOC} is out of date: run python scripts/layers_diagram.py", file=sys.stderr)
            return 1
        return 0
    if new != doc:
        DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
