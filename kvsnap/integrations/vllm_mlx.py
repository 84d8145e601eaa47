"""vllm-mlx's own server, warm from a kvsnap store.

    kvsnap vllm-mlx serve MODEL [vllm-mlx's flags] --kv-snapshots DIR

vllm-mlx 0.6 has no plugin hook in its command line, so kvsnap launches it instead of
adding a flag to it: it takes ``--kv-snapshots DIR`` out of the arguments, checks the rest
with vllm-mlx's own parser, replaces the two functions vllm-mlx's lifespan calls to load
and save its disk prefix cache (``vllm_mlx.server._load_prefix_cache_from_disk`` and
``_save_prefix_cache_to_disk``), then runs vllm-mlx's own ``main`` with the rest.

The replacement loader runs where vllm-mlx would read its disk cache: after the model is
loaded, before its warm-up and before the port opens. On the thread that owns the model
it checks every snapshot against the running model's identity, decodes the matching ones
and hands them to vllm-mlx's memory-aware prefix cache through the cache's own ``store``.
Nothing is prefilled. vllm-mlx's disk cache (``~/.cache/vllm-mlx/prefix_cache``) is
neither read nor written in such a run: the kvsnap store is the warm state.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import KvsnapError, SnapshotError, StoreError, UsageError

log = logging.getLogger("kvsnap.vllm_mlx")

OPTION = "--kv-snapshots"
TESTED_VLLM_MLX = ("0.6.0",)
HOOKS = ("_load_prefix_cache_from_disk", "_save_prefix_cache_to_disk", "_engine")
PROBE_TEXT = "kvsnap probe: hello"

USAGE = f"""\
usage: kvsnap vllm-mlx serve MODEL [vllm-mlx serve options] {OPTION} DIR

Runs vllm-mlx's own OpenAI-compatible server with the kvsnap snapshots of MODEL in its
prefix cache before it accepts requests (no warm-up prefill). Snapshots built for another
model, KV setting or mlx-lm minor are skipped with a warning. vllm-mlx's own disk prefix
cache (~/.cache/vllm-mlx/prefix_cache) is neither read nor written in such a run.

kvsnap's option:
  {OPTION} DIR   a store made by `kvsnap build` run under the same mlx-lm minor as
                      vllm-mlx (0.31.x for vllm-mlx 0.6), or oci://HOST/REPO:TAG to pull
                      one first (see docs/deploy.md); needs --continuous-batching

Every other argument goes to `vllm-mlx serve` unchanged. See docs/vllm-mlx.md.
"""


# --- arguments -----------------------------------------------------------------------


def split_argv(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Take ``--kv-snapshots DIR`` (or ``--kv-snapshots=DIR``) out; the rest go to vllm-mlx in order."""
    found: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg == OPTION:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise UsageError(f"{OPTION} needs a directory, e.g. {OPTION} ./snaps")
            value, i = argv[i + 1], i + 2
        elif arg.startswith(OPTION + "="):
            value, i = arg[len(OPTION) + 1 :], i + 1
        else:
            rest.append(arg)
            i += 1
            continue
        if not value:
            raise UsageError(f"{OPTION} needs a directory, e.g. {OPTION} ./snaps")
        if found is not None:
            raise UsageError(f"{OPTION} given twice ({found!r} and {value!r}); give one store directory")
        found = value
    return found, rest


def check_serve_args(ns: Any) -> None:
    """The vllm-mlx settings under which snapshots can go into its prefix cache; else a UsageError."""
    problems = []
    if getattr(ns, "models_config", None):
        problems.append("--models-config is not supported (serve one MODEL)")
    if not getattr(ns, "continuous_batching", False):
        problems.append("add --continuous-batching (vllm-mlx's prefix cache lives in its batched engine)")
    if getattr(ns, "disable_prefix_cache", False):
        problems.append("drop --disable-prefix-cache (the snapshots go into that cache)")
    if getattr(ns, "no_memory_aware_cache", False):
        problems.append("drop --no-memory-aware-cache (kvsnap fills the memory-aware cache)")
    if getattr(ns, "use_paged_cache", False):
        problems.append("drop --use-paged-cache (kvsnap fills the memory-aware cache, not the paged one)")
    if getattr(ns, "mllm", False):
        problems.append("drop --mllm (multimodal models keep their prefix cache elsewhere)")
    if (getattr(ns, "max_kv_size", None) or 0) > 0:
        problems.append("drop --max-kv-size (vllm-mlx bounds KV layers as RotatingKVCache(keep=0), kvsnap's build as mlx-lm's keep=4, so vllm-mlx would discard every snapshot)")
    if problems:
        raise UsageError(f"{OPTION} cannot work with these vllm-mlx options: " + "; ".join(problems))


# --- inserting snapshots ----------------------------------------------------------------


@dataclass
class InsertReport:
    store: str = ""
    inserted: int = 0
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skip(self, path: Any, reason: str) -> None:
        self.skipped.append((str(path), reason))
        log.warning("[kvsnap] skipped snapshot %s: %s", path, reason)

    def summary(self) -> str:
        return (
            f"[kvsnap] Warm start from {self.store}: {self.inserted} snapshot(s) inserted into vllm-mlx's prefix cache "
            f"({self.tokens} tokens, {self.nbytes / 2**20:.1f} MiB) in {self.seconds:.2f}s, 0 tokens prefilled; "
            f"{len(self.skipped)} skipped"
        )


def prepended_special_tokens(tokenizer: Any) -> list[int]:
    """Tokens vllm-mlx's ``tokenizer.encode(prompt)`` puts in front of what the template rendered.

    kvsnap tokenizes rendered prompts without special tokens (the template carries BOS);
    vllm-mlx encodes with the tokenizer's defaults. Where those prepend a BOS, no kvsnap
    snapshot can be a prefix of a vllm-mlx request.
    """
    try:
        full = list(tokenizer.encode(PROBE_TEXT))
        plain = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
    except TypeError:
        return []
    if not plain or full[: len(plain)] == plain:
        return []
    for start in range(1, len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return full[: max(0, len(full) - len(plain))]


def insert_snapshots(prefix_cache: Any, model: Any, tokenizer: Any, model_path: str, store: Any, digests: Any = None) -> InsertReport:
    """Put every snapshot of this model into vllm-mlx's ``MemoryAwarePrefixCache``; never prefills.

    Runs on the thread that owns the model (mlx arrays belong to a thread's stream).
    """
    from ..key import KVSettings, read_config
    from ..modeling import LoadedModel, check_model_dir
    from ..snapshot import cache_nbytes_of, decode_cache

    t0 = time.perf_counter()
    report = InsertReport(store=str(store.root))
    model_dir = check_model_dir(model_path)
    # vllm-mlx's live KV is mlx-lm's default cache: no KV quantization, no bound.
    lm = LoadedModel(path=model_dir, model=model, tokenizer=tokenizer, config=read_config(model_dir), settings=KVSettings())
    identity = lm.identity(digests)
    good, bad = store.scan(identity)
    for problem in bad:
        report.skip(problem.path, problem.reason)
    lead = prepended_special_tokens(tokenizer)
    if lead:
        for info in good:
            report.skip(info.path, f"vllm-mlx encodes every prompt with the tokenizer's special tokens, which puts {lead} in front of the template's own; kvsnap snapshots hold the template's tokens only, so no request could match")
        good = []
    config = getattr(prefix_cache, "_config", None)
    min_tokens = int(getattr(config, "min_prefix_tokens", 1) or 1)
    limit = float(getattr(prefix_cache, "memory_limit_mb", float("inf"))) * 2**20
    for info in sorted(good, key=lambda i: (i.name, i.key)):
        if info.n_tokens < min_tokens:
            report.skip(info.path, f"holds {info.n_tokens} tokens, under vllm-mlx's minimum reusable prefix of {min_tokens} tokens")
            continue
        used = float(getattr(prefix_cache, "memory_usage_mb", 0.0)) * 2**20
        if used + info.nbytes > limit:
            report.skip(info.path, f"does not fit vllm-mlx's prefix-cache budget ({used / 2**20:.1f} of {limit / 2**20:.1f} MiB used, needs {info.nbytes / 2**20:.1f} MiB); raise --cache-memory-mb")
            continue
        try:
            arrays = store.load_arrays(info, identity)
            tokens = store.read_tokens(info)
        except SnapshotError as exc:
            report.skip(exc.path, exc.reason)
            continue
        state = decode_cache(arrays, info.layers)
        nbytes = cache_nbytes_of(state)
        # The cache's own store: it copies the arrays (detached from ours) and indexes the tokens.
        # evict_prefixes=False: a snapshot never evicts another that is its prefix.
        if not prefix_cache.store(list(tokens), state, evict_prefixes=False):
            report.skip(info.path, "vllm-mlx's prefix cache refused it (its log line above says why)")
            continue
        report.inserted += 1
        report.tokens += len(tokens)
        report.nbytes += nbytes
        report.names.append(info.name)
        log.info("[kvsnap] inserted %s (%s, %d tokens, %.1f MiB)", info.path.name, info.name or "unnamed", len(tokens), nbytes / 2**20)
        del arrays, state
    report.seconds = time.perf_counter() - t0
    return report


def scheduler_of(engine: Any) -> Any:
    """BatchedEngine -> AsyncEngineCore -> EngineCore -> Scheduler, or None."""
    core = getattr(getattr(engine, "_engine", None), "engine", None)
    return getattr(core, "scheduler", None)


def install(server: Any, store: Any, digests: Any = None) -> None:
    """Replace vllm-mlx's disk-cache load and save with the snapshot loader and a no-op."""

    async def load_kvsnap_snapshots(engine: Any = None) -> None:
        target = engine or server._engine
        if target is None:
            return
        scheduler = scheduler_of(target)
        prefix_cache = getattr(scheduler, "memory_aware_cache", None)
        if prefix_cache is None:
            log.warning("[kvsnap] no snapshots loaded: this vllm-mlx engine (%s) has no memory-aware prefix cache; it starts cold", type(target).__name__)
            return
        model_path = getattr(target, "_model_path", None) or getattr(server, "_model_path", None)

        def work() -> InsertReport:
            return insert_snapshots(prefix_cache, scheduler.model, scheduler.tokenizer, model_path, store, digests)

        try:
            run = getattr(target, "_run_on_generation_worker", None)
            report = await run(work) if run is not None else work()
        except KvsnapError as exc:
            log.warning("[kvsnap] no snapshots loaded (%s); vllm-mlx starts cold", exc)
            return
        except Exception as exc:  # a broken store must not stop vllm-mlx from serving
            log.error("[kvsnap] no snapshots loaded (%s: %s); vllm-mlx starts cold", type(exc).__name__, exc, exc_info=True)
            return
        log.info("%s", report.summary())

    async def skip_disk_cache_save(engine: Any = None) -> None:
        log.info("[kvsnap] vllm-mlx's prefix cache is not saved to ~/.cache/vllm-mlx/prefix_cache in a --kv-snapshots run (the kvsnap store is the warm state)")

    server._load_prefix_cache_from_disk = load_kvsnap_snapshots
    server._save_prefix_cache_to_disk = skip_disk_cache_save


# --- the launcher -----------------------------------------------------------------------


def import_vllm_mlx() -> tuple[Any, Any, str]:
    from importlib import metadata

    try:
        import vllm_mlx.cli as cli
        import vllm_mlx.server as server
    except ImportError as exc:
        raise UsageError(
            f"vllm-mlx is not installed in this environment ({sys.executable}: {exc}); "
            "install it beside kvsnap (pip install vllm-mlx==0.6.0; see docs/vllm-mlx.md)"
        ) from None
    try:
        version = metadata.version("vllm-mlx")
    except metadata.PackageNotFoundError:
        version = "unknown"
    missing = [name for name in HOOKS if not hasattr(server, name)] + [name for name in ("create_parser", "main") if not hasattr(cli, name)]
    if missing:
        raise UsageError(f"vllm-mlx {version} lacks {', '.join(missing)}, which kvsnap's integration hooks; it is tested with vllm-mlx {', '.join(TESTED_VLLM_MLX)}")
    if version not in TESTED_VLLM_MLX:
        log.warning("[kvsnap] vllm-mlx %s is untested (tested: %s); the hook points are present", version, ", ".join(TESTED_VLLM_MLX))
    return cli, server, version


def open_store(path: str) -> Any:
    from ..store import Store

    store = Store.open(path, readonly=True)
    if not store.is_initialized():
        raise StoreError(f"{store.root} is not a kvsnap store (no manifest.json, no snapshots/); give the folder passed to `kvsnap build --out`")
    return store


def parse_serve_args(cli: Any, rest: list[str]) -> Any:
    """vllm-mlx's own parser on the arguments; its usage errors exit 2 here, named as vllm-mlx's."""
    saved = sys.argv
    sys.argv = ["vllm-mlx", "serve", *rest]
    try:
        return cli.create_parser().parse_args(["serve", *rest])
    finally:
        sys.argv = saved


def run_vllm_mlx(cli: Any, args: list[str]) -> int:
    """vllm-mlx's own ``main``, as if run as ``vllm-mlx ARGS``; its exit status is returned."""
    saved = sys.argv
    sys.argv = ["vllm-mlx", *args]
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] != "serve":
        raise UsageError(f"`kvsnap vllm-mlx {argv[0]}` is not supported: only `serve` takes {OPTION}; run `vllm-mlx {argv[0]} ...` directly")
    store_dir, rest = split_argv(argv[1:])
    from ..blas import preload_openblas

    preload_openblas()  # before vllm-mlx imports mlx: the same BLAS kvsnap build uses
    if any(a in ("-h", "--help") for a in rest):
        print(USAGE)
        cli, _, _ = import_vllm_mlx()
        return run_vllm_mlx(cli, ["serve", "--help"])
    cli, server, version = import_vllm_mlx()
    if store_dir is None:
        log.info("[kvsnap] no %s: running vllm-mlx %s unchanged", OPTION, version)
        return run_vllm_mlx(cli, ["serve", *rest])
    ns = parse_serve_args(cli, rest)
    check_serve_args(ns)
    if store_dir.startswith("oci://"):
        from ..oci import resolve_kv_snapshots

        store_dir = resolve_kv_snapshots(store_dir)  # pulled into kvsnap's cache folder first, as `kvsnap serve` does
    store = open_store(store_dir)
    if getattr(ns, "warm_prompts", None):
        log.warning("[kvsnap] --warm-prompts with %s: vllm-mlx still prefills every warm prompt after the snapshots are in; drop --warm-prompts to start with no prefill", OPTION)
    from ..modeling import default_digest_cache

    install(server, store, default_digest_cache())
    log.info("[kvsnap] vllm-mlx %s: snapshots from %s go into its prefix cache at start-up", version, store.root)
    return run_vllm_mlx(cli, ["serve", *rest])
