"""The package tree is the architecture: arrows that must never exist, checked on the import
graph (every import statement, lazy ones inside functions included), and docs/design.md's module
map kept equal to the tree."""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvsnap"

# Every module belongs to one layer; a new top-level module must be placed here on purpose.
# kvsnap.snapshot.format is a leaf (version constants, header field names, the snapshot path) that
# the identity in key.py needs too, so it counts as base; kvsnap.warm_key composes only base
# modules and is shared by build, the runtime and the integrations.
BASE = {
    "kvsnap",
    "kvsnap.errors",
    "kvsnap.key",
    "kvsnap.chat",
    "kvsnap.agent_requests",
    "kvsnap.prompts",
    "kvsnap.profiles",
    "kvsnap.blas",
    "kvsnap.faults",
    "kvsnap.snapshot.format",
    "kvsnap.warm_key",
}
LAYERS = (
    "snapshot",
    "store",
    "runtime",
    "http",
    "build",
    "tools",
    "integrations",
    "commands",
    "api",
)
APPS = {"kvsnap.__main__"}
# The command line: its parser and its command implementations; only __main__ imports it.
CLI = ("kvsnap.commands",)

# importer prefix -> imported prefixes it must never reach
FORBIDDEN = {
    "kvsnap.snapshot": (
        "kvsnap.store",
        "kvsnap.runtime",
        "kvsnap.http",
        "kvsnap.build",
        "kvsnap.commands",
        "kvsnap.tools",
        "kvsnap.integrations",
    ),
    "kvsnap.store": (
        "kvsnap.runtime",
        "kvsnap.http",
        "kvsnap.build",
        "kvsnap.commands",
        "kvsnap.tools",
        "kvsnap.integrations",
    ),
    "kvsnap.runtime": (
        "kvsnap.build",
        "kvsnap.commands",
        "kvsnap.http",
        "kvsnap.tools",
        "kvsnap.integrations",
    ),
    "kvsnap.http": ("kvsnap.build", "kvsnap.commands", "kvsnap.tools", "kvsnap.integrations"),
    # remote stores go through the scheme seam (store/remote.py)
    "kvsnap.integrations": ("kvsnap.store.oci", "kvsnap.build", "kvsnap.commands", "kvsnap.tools"),
    "kvsnap.tools": ("kvsnap.commands",),
    "kvsnap.build": ("kvsnap.http", "kvsnap.commands", "kvsnap.tools", "kvsnap.integrations"),
    # the Python API (reached only through kvsnap/__init__.py's lazy names): the library's
    # layers and the routes' shared base, never a server, the CLI or one upstream's route
    "kvsnap.api": (
        "kvsnap.http",
        "kvsnap.commands",
        "kvsnap.tools",
        "kvsnap.build",
        "kvsnap.integrations.vllm_mlx",
        "kvsnap.integrations.mlx_lm",
    ),
}
BASE_FORBIDDEN = tuple(f"kvsnap.{layer}" for layer in LAYERS)
# Inside integrations: each upstream route imports only the shared base (integrations.common) and
# its own upstream, never the other route; the base imports no route.
ROUTES = ("kvsnap.integrations.vllm_mlx", "kvsnap.integrations.mlx_lm")
SIDEWAYS = {
    "kvsnap.integrations.common": ROUTES,
    **{route: tuple(other for other in ROUTES if other != route) for route in ROUTES},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path) -> set[str]:
    """Absolute names of every kvsnap module ``path`` imports, relative imports resolved (the
    diagram's reading of the imports: one reader for the picture and the rules)."""
    return layers_diagram_script().imports_of(name, path, modules())


def reaches(imported: str, prefix: str) -> bool:
    return imported == prefix or imported.startswith(prefix + ".")


def layer_of(name: str) -> str:
    if name in BASE or name in APPS:
        return name
    if any(reaches(name, p) for p in CLI):
        return "kvsnap.commands"
    for layer in LAYERS:
        if reaches(name, f"kvsnap.{layer}"):
            return f"kvsnap.{layer}"
    return ""


def violations() -> list[str]:
    found = []
    for name, path in modules().items():
        rules = BASE_FORBIDDEN if name in BASE else FORBIDDEN.get(layer_of(name), ())
        rules += next((r for p, r in SIDEWAYS.items() if reaches(name, p)), ())
        for imported in sorted(imports_of(name, path)):
            if imported not in BASE and any(reaches(imported, p) for p in rules):
                found.append(f"{name} -> {imported}")
            elif (
                any(reaches(imported, p) for p in CLI)
                and name != "kvsnap.__main__"
                and layer_of(name) != "kvsnap.commands"
            ):
                found.append(f"{name} -> {imported} (only kvsnap.__main__ may import the CLI)")
    return sorted(set(found))


def test_every_module_sits_in_a_layer():
    unplaced = [name for name in modules() if not layer_of(name)]
    assert not unplaced, (
        f"place these modules in a layer (kvsnap/<layer>/) or add them to BASE in {__file__}: "
        f"{unplaced}"
    )


def test_no_forbidden_arrow():
    assert violations() == []


@pytest.mark.parametrize(
    "source, importer, arrow",
    [
        (
            "from kvsnap.build.pipeline import build_snapshots\n",
            "kvsnap/runtime/engine/engine.py",
            "kvsnap.runtime.engine.engine -> kvsnap.build.pipeline",
        ),
        (
            "def f():\n    from kvsnap.commands.cli import main\n",
            "kvsnap/tools/quickstart.py",
            "kvsnap.tools.quickstart -> kvsnap.commands.cli",
        ),
        (
            "from kvsnap.store import oci\n",
            "kvsnap/integrations/vllm_mlx/launcher.py",
            "kvsnap.integrations.vllm_mlx.launcher -> kvsnap.store.oci",
        ),
        (
            "def f():\n    from kvsnap.integrations.vllm_mlx.launcher import split_persist_argv\n",
            "kvsnap/integrations/mlx_lm/launcher.py",
            "kvsnap.integrations.mlx_lm.launcher -> kvsnap.integrations.vllm_mlx.launcher",
        ),
        (
            "from kvsnap.integrations.mlx_lm import cache\n",
            "kvsnap/integrations/vllm_mlx/session.py",
            "kvsnap.integrations.vllm_mlx.session -> kvsnap.integrations.mlx_lm.cache",
        ),
        (
            "from kvsnap.integrations.vllm_mlx.pin import Pins\n",
            "kvsnap/integrations/common/warm_plan.py",
            "kvsnap.integrations.common.warm_plan -> kvsnap.integrations.vllm_mlx.pin",
        ),
        (
            "from ..runtime.cache.prefix import PrefixCache\n",
            "kvsnap/store/local.py",
            "kvsnap.store.local -> kvsnap.runtime.cache.prefix",
        ),
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


# runtime/'s subpackages, lowest first: each imports only those before it (lazy imports too).
# model loads; sharding splits a loaded model over ranks; prefill runs a model over tokens; cache
# holds and checks the states; persist writes them; warmup fills the cache at start; engine serves.
RUNTIME_ORDER = ("model", "sharding", "prefill", "cache", "persist", "warmup", "engine")


def runtime_subpackage(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kvsnap", "runtime"] else None


def runtime_order_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a runtime subpackage to one at or above it in RUNTIME_ORDER (an unlisted
    subpackage is reported too: each new one is placed on purpose)."""
    rank = {sub: i for i, sub in enumerate(RUNTIME_ORDER)}
    found = []
    for name, imported in graph.items():
        low = runtime_subpackage(name)
        for other in sorted(imported):
            high = runtime_subpackage(other)
            if low is None or high is None or low == high:
                continue
            unplaced = [s for s in (low, high) if s not in rank]
            if unplaced:
                found.append(f"{name} -> {other} (place {unplaced} in RUNTIME_ORDER)")
            elif rank[high] > rank[low]:
                found.append(f"{name} -> {other} ({low} sits below {high})")
    return sorted(found)


def test_runtime_subpackages_import_only_those_below_them():
    wrong = runtime_order_violations(import_graph())
    order = " -> ".join(RUNTIME_ORDER)
    assert wrong == [], f"runtime/ imports against its order ({order}):\n" + "\n".join(wrong)


def test_every_runtime_subpackage_is_placed_in_the_order():
    subpackages = {p.name for p in (PACKAGE / "runtime").iterdir() if (p / "__init__.py").is_file()}
    assert sorted(subpackages) == sorted(RUNTIME_ORDER)


@pytest.mark.parametrize(
    "graph, expected",
    [
        (  # the arrow this order removed: a model module reaching the cache
            {"kvsnap.runtime.model.shapes": {"kvsnap.runtime.cache.composed"}},
            [
                "kvsnap.runtime.model.shapes -> kvsnap.runtime.cache.composed "
                "(model sits below cache)"
            ],
        ),
        (
            {"kvsnap.runtime.persist.writeback": {"kvsnap.runtime.warmup.recipe"}},
            [
                "kvsnap.runtime.persist.writeback -> kvsnap.runtime.warmup.recipe "
                "(persist sits below warmup)"
            ],
        ),
        (
            {"kvsnap.runtime.hub.fetch": {"kvsnap.runtime.cache.prefix"}},
            [
                "kvsnap.runtime.hub.fetch -> kvsnap.runtime.cache.prefix (place ['hub'] in "
                "RUNTIME_ORDER)"
            ],
        ),
        (  # downward, inside one subpackage, and out of runtime: all fine
            {
                "kvsnap.runtime.engine.engine": {"kvsnap.runtime.cache.prefix"},
                "kvsnap.runtime.warmup.run": {"kvsnap.runtime.warmup.store", "kvsnap.key"},
            },
            [],
        ),
    ],
)
def test_the_order_check_sees_an_arrow_against_it(graph, expected):
    assert runtime_order_violations(graph) == expected


def test_the_order_check_sees_a_lazy_upward_import_in_the_tree(monkeypatch):
    """On the real graph: a lazy import of the engine inside the cache is reported."""
    real = Path.read_text
    target = PACKAGE / "runtime" / "cache" / "trie.py"
    lazy = "\ndef _breakage():\n    from kvsnap.runtime.engine.types import EngineConfig\n"

    def patched(self, *a, **k):
        return real(self, *a, **k) + (lazy if self == target else "")

    monkeypatch.setattr(Path, "read_text", patched)
    assert runtime_order_violations(import_graph()) == [
        "kvsnap.runtime.cache.trie -> kvsnap.runtime.engine.types (cache sits below engine)"
    ]


def import_graph() -> dict[str, set[str]]:
    return {name: imports_of(name, path) for name, path in modules().items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Modules reached from ``start`` by one import or more (``start`` only through a cycle)."""
    seen, todo = set(), list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def _shortest_cycle(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """A shortest import path from ``start`` back to itself, inside its group."""
    paths, frontier = {start: [start]}, [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ()) & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in an import cycle but no path leads back to it")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per group of modules that import each other (directly or through others), as a
    path that ends where it starts; a group of n modules is named once, not n times."""
    reach = {node: _reachable(graph, node) for node in graph}
    found, placed = [], set()
    for node in sorted(graph):
        if node in placed or node not in reach[node]:
            continue
        group = {other for other in reach[node] if node in reach[other]}
        placed |= group
        found.append(_shortest_cycle(graph, node, group))
    return found


def test_no_import_cycle():
    """Modules that import each other (lazy imports included) cannot be understood, tested or
    moved alone; a lazy import that closes a cycle only hides it from the interpreter."""
    cycles = [" -> ".join(cycle) for cycle in import_cycles(import_graph())]
    fix = "break each by moving the shared part down a layer"
    assert cycles == [], f"import cycles; {fix}:\n" + "\n".join(cycles)


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c", "a"]]),
        ({"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}}, [["a", "b", "a"], ["c", "d", "c"]]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, []),  # a diamond shares a module, no cycle
    ],
)
def test_the_cycle_check_names_each_cycle(graph, expected):
    assert import_cycles(graph) == expected


def test_the_cycle_check_sees_a_lazy_import_that_closes_a_cycle(monkeypatch):
    """prefill is imported by warmup; a lazy import of warmup inside prefill closes a cycle."""
    real = Path.read_text
    target = PACKAGE / "runtime" / "prefill" / "chunked.py"
    lazy = "\ndef _breakage():\n    from kvsnap.runtime.warmup.run import run_warmup\n"

    def patched(self, *a, **k):
        return real(self, *a, **k) + (lazy if self == target else "")

    monkeypatch.setattr(Path, "read_text", patched)
    cycles = import_cycles(import_graph())
    pair = {"kvsnap.runtime.prefill.chunked", "kvsnap.runtime.warmup.run"}
    assert any(pair <= set(cycle) for cycle in cycles), cycles


# warm prompt -> prefix tokens (warm_prefix) and prompt digest (prompt_identity): composed in one
# place, so build writes exactly the key each server's warm-up looks up.
WARM_KEY_OWNER = "kvsnap.warm_key"
WARM_KEY_STEPS = ("prompt_identity", "warm_prefix")


def warm_key_step_callers() -> list[str]:
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            called = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if called in WARM_KEY_STEPS and name != WARM_KEY_OWNER:
                found.append(f"{name} calls {called}")
    return sorted(set(found))


def test_only_warm_key_turns_a_warm_prompt_into_tokens_digest_and_key():
    callers = warm_key_step_callers()
    assert callers == [], f"call {WARM_KEY_OWNER}.warm_key instead: {callers}"


def test_the_owner_check_sees_a_second_composer(monkeypatch):
    real = Path.read_text
    target = PACKAGE / "build" / "pipeline.py"
    extra = "\ndef _breakage(tok, p):\n    return kvsnap.prompts.warm_prefix(tok, p)\n"

    def patched(self, *a, **k):
        return real(self, *a, **k) + (extra if self == target else "")

    monkeypatch.setattr(Path, "read_text", patched)
    assert warm_key_step_callers() == ["kvsnap.build.pipeline calls warm_prefix"]


def declared_dependencies() -> dict[str, str]:
    """pyproject's runtime dependencies: the import name each one gives -> the line declaring it."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S)
    assert block, "pyproject.toml has no [project] dependencies list"
    found = {}
    for line in re.findall(r'"([^"]+)"', block.group(1)):
        name = re.match(r"[A-Za-z0-9_.-]+", line).group(0)
        found[name.lower().replace("-", "_")] = line
    return found


def imported_packages() -> set[str]:
    """Top-level names of every package kvsnap imports (lazy imports included)."""
    found = set()
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
    return found


def test_every_declared_dependency_is_imported():
    """A dependency nothing imports only costs installs (and a reader's trust in the list)."""
    used = imported_packages()
    unused = sorted(line for name, line in declared_dependencies().items() if name not in used)
    assert unused == [], (
        f"pyproject.toml declares packages kvsnap never imports; drop them: {unused}"
    )


def test_design_doc_module_map_matches_the_tree():
    doc = (ROOT / "docs" / "design.md").read_text()
    table = doc.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    named = set(
        re.findall(
            r"^\| `((?:[a-z_]+/)*[a-z_]+\.py)`(?:, `((?:[a-z_]+/)*[a-z_]+\.py)`)?", table, re.M
        )
    )
    named = {path for row in named for path in row if path}
    tree = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    assert sorted(tree - named) == [], "modules missing from docs/design.md's module map"
    assert sorted(named - tree) == [], "docs/design.md names modules that do not exist"


# A row of the module map says its module's job in a line; the detail is the module's docstring.
OWNS_LIMIT = 160


def long_owns_cells(doc: str) -> list[str]:
    table = doc.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip(" |").split(" | ") for line in table.splitlines() if line.startswith("| `")]
    return [f"{row[0]}: {len(row[1])}" for row in rows if len(row[1]) > OWNS_LIMIT]


def test_the_module_map_says_each_job_in_a_line():
    long = long_owns_cells((ROOT / "docs" / "design.md").read_text())
    assert long == [], (
        f"docs/design.md's module map: cut these 'owns' cells to {OWNS_LIMIT} characters and say "
        f"the rest in the module's docstring: {long}"
    )


def test_the_row_check_sees_a_long_cell():
    doc = "\n## Modules\n\n| `a.py` | " + "x" * (OWNS_LIMIT + 1) + " | no | none: - |\n"
    assert long_owns_cells(doc) == [f"`a.py`: {OWNS_LIMIT + 1}"]


@functools.cache
def layers_diagram_script():
    """scripts/layers_diagram.py, loaded by path once (scripts/ is no package)."""
    path = ROOT / "scripts" / "layers_diagram.py"
    spec = importlib.util.spec_from_file_location("layers_diagram", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_design_doc_layers_picture_is_drawn_from_the_imports():
    script = layers_diagram_script()
    doc = (ROOT / "docs" / "design.md").read_text()
    fix = "docs/design.md's layers picture is out of date: run python scripts/layers_diagram.py"
    assert script.with_diagram(doc, script.diagram()) == doc, fix


def test_the_picture_places_the_base_as_this_test_does():
    script = layers_diagram_script()
    drawn = {name for name in modules() if script.group_of(name) == "base"}
    assert drawn == BASE - {"kvsnap"}


def test_the_picture_check_sees_a_new_arrow():
    """An import the tree does not have yet (the store reaching sharding) changes the picture."""
    script = layers_diagram_script()
    graph = script.import_graph()
    graph["kvsnap.runtime.sharding.ranks"].add("kvsnap.store.local")
    doc = (ROOT / "docs" / "design.md").read_text()
    assert "store --> runtime_sharding" in script.diagram(graph)
    assert script.with_diagram(doc, script.diagram(graph)) != doc
