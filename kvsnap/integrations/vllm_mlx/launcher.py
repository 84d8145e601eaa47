"""vllm-mlx's own server, warm from a kvsnap store.

    kvsnap vllm-mlx serve MODEL [vllm-mlx's flags] --kv-snapshots DIR [--warm-prompts FILE]

vllm-mlx 0.6 has no plugin hook in its command line, so kvsnap launches it instead of
adding a flag to it: it takes ``--kv-snapshots DIR`` out of the arguments, parses the rest
with vllm-mlx's own parser and calls ``use_kv_snapshots`` (the one function the upstream
patch in contrib/vllm-mlx/ calls too), which checks them and replaces the two functions
vllm-mlx's lifespan calls to load and save its disk prefix cache
(``vllm_mlx.server._load_prefix_cache_from_disk`` and ``_save_prefix_cache_to_disk``);
then it runs vllm-mlx's own ``main`` with the rest.

The replacement loader runs where vllm-mlx would read its disk cache: after the model is
loaded, before its warm-up and before the port opens. On the thread that owns the model
it checks every snapshot against the running model's identity, decodes the matching ones
and hands them to vllm-mlx's memory-aware prefix cache through the cache's own ``store``.
Nothing is prefilled. vllm-mlx's disk cache (``~/.cache/vllm-mlx/prefix_cache``) is
neither read nor written in such a run: the kvsnap store is the warm state.

With ``--kv-snapshots``, kvsnap also takes ``--warm-prompts FILE`` out of the arguments:
vllm-mlx's own warm-up never runs; the shared ``WarmPlan`` (``integrations.common.warm_plan``)
serves each entry from the store and prefills (and writes back) only what the store lacks.
``session`` glues this to vllm-mlx's lifespan and its ``DELETE /v1/cache/prefix``; ``pin``
keeps the warm entries from eviction; ``kvsnap.profiles`` says how vllm-mlx tokenizes.

``--persist-requests`` (with ``--persist-max-gb GB`` and ``--persist-flush-timeout S``) is
kvsnap's too: the prefix entries vllm-mlx keeps are written behind into the store and read
back after a restart (``persist``), in place of vllm-mlx's shutdown save.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Sequence

from kvsnap.errors import UsageError
from kvsnap.integrations.common.argv import (
    OPTION,
    WARM_OPTION,
    asks_help,
    run_main,
    serve_args,
    split_argv,
)
from kvsnap.integrations.common.options import (
    KV_SNAPSHOTS,
    PERSIST_FLUSH_TIMEOUT,
    PERSIST_MAX_GB,
    PERSIST_REQUESTS,
    ROUTE_OPTIONS,
    WARM_PROMPTS,
    route_usage,
)
from kvsnap.integrations.common.store import open_store
from kvsnap.integrations.common.warm_plan import load_warm_prompt_file

if TYPE_CHECKING:
    from kvsnap.integrations.vllm_mlx.session import Session
    from kvsnap.runtime.persist.options import PersistOptions

log = logging.getLogger("kvsnap.vllm_mlx")

PERSIST_OPTION = PERSIST_REQUESTS.flag
PERSIST_VALUES = (PERSIST_MAX_GB, PERSIST_FLUSH_TIMEOUT)
TESTED_VLLM_MLX = ("0.6.0",)
HOOKS = ("_load_prefix_cache_from_disk", "_save_prefix_cache_to_disk", "_engine")

USAGE = f"""\
usage: kvsnap vllm-mlx serve MODEL [vllm-mlx serve options] {OPTION} DIR [{WARM_OPTION} FILE]
           [{PERSIST_OPTION} [--persist-max-gb GB] [--persist-flush-timeout S]]

Runs vllm-mlx's own OpenAI-compatible server with the kvsnap snapshots of MODEL in its
prefix cache before it accepts requests (no warm-up prefill). Snapshots built for another
model, KV setting or mlx-lm minor are skipped with a warning. vllm-mlx's own disk prefix
cache (~/.cache/vllm-mlx/prefix_cache) is neither read nor written in such a run. The
snapshots are kept from eviction, and DELETE /v1/cache/prefix puts them back.

kvsnap's options:
{route_usage("vllm-mlx", ROUTE_OPTIONS)}
Every other argument goes to `vllm-mlx serve` unchanged. See docs/vllm-mlx.md.
"""


# --- arguments -----------------------------------------------------------------------


def split_persist_argv(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Take ``--persist-requests`` and its two settings out: ``{"persist_requests": bool,
    "persist_max_gb": float | None, "persist_flush_timeout": float | None}`` and the rest."""
    rest = list(argv)
    cut = rest.index("--") if "--" in rest else len(rest)
    found: dict[str, bool | float | None] = {PERSIST_REQUESTS.name: PERSIST_OPTION in rest[:cut]}
    rest = [a for i, a in enumerate(rest) if i >= cut or a != PERSIST_OPTION]
    for option in PERSIST_VALUES:
        text, rest = split_argv(rest, option.flag, option.needs)
        value = None
        if text is not None:
            try:
                value = float(text)
            except ValueError:
                value = -1.0
            if not value > 0:
                raise UsageError(
                    f"{option.flag} {text!r} is not a positive number; e.g. {option.flag} 5"
                )
        found[option.name] = value
    return found, rest


def persist_options(args: Any) -> PersistOptions | None:
    """``--persist-requests`` and its settings as ``PersistOptions``, None when off; a
    UsageError for flags that contradict each other (as ``kvsnap serve``'s)."""
    from kvsnap.runtime.persist import options

    conflicts = []
    if getattr(args, "kv_cache_quantization", False):
        conflicts.append(
            "cannot write the entries --kv-cache-quantization makes (vllm-mlx's own quantized "
            "wrapper, not an mlx-lm cache)"
        )
    return options.persist_options(
        getattr(args, PERSIST_REQUESTS.name, False),
        getattr(args, PERSIST_MAX_GB.name, None),
        getattr(args, PERSIST_FLUSH_TIMEOUT.name, None),
        has_store=bool(getattr(args, KV_SNAPSHOTS.name, None)),
        conflicts=conflicts,
    )


def check_serve_args(ns: Any) -> None:
    """The vllm-mlx settings under which snapshots can go into its prefix cache; else a
    UsageError."""
    problems = []
    if getattr(ns, "models_config", None):
        problems.append("--models-config is not supported (serve one MODEL)")
    if not getattr(ns, "continuous_batching", False):
        problems.append(
            "add --continuous-batching (vllm-mlx's prefix cache lives in its batched engine)"
        )
    if getattr(ns, "disable_prefix_cache", False):
        problems.append("drop --disable-prefix-cache (the snapshots go into that cache)")
    if getattr(ns, "no_memory_aware_cache", False):
        problems.append("drop --no-memory-aware-cache (kvsnap fills the memory-aware cache)")
    if getattr(ns, "use_paged_cache", False):
        problems.append(
            "drop --use-paged-cache (kvsnap fills the memory-aware cache, not the paged one)"
        )
    if getattr(ns, "mllm", False):
        problems.append("drop --mllm (multimodal models keep their prefix cache elsewhere)")
    if (getattr(ns, "max_kv_size", None) or 0) > 0:
        problems.append(
            "drop --max-kv-size (vllm-mlx bounds KV layers as RotatingKVCache(keep=0), kvsnap's "
            "build as mlx-lm's keep=4, so vllm-mlx would discard every snapshot)"
        )
    if problems:
        raise UsageError(
            f"{OPTION} cannot work with these vllm-mlx options: " + "; ".join(problems)
        )


# --- inserting snapshots ----------------------------------------------------------------


def install(server: Any, session: Any) -> None:
    """Replace vllm-mlx's disk-cache load and save with the session's warm start and a no-op;
    extend its routes."""
    from kvsnap.integrations.vllm_mlx.agents import adapt_request_paths
    from kvsnap.integrations.vllm_mlx.sampling import guard_sampling
    from kvsnap.integrations.vllm_mlx.session import install_routes

    async def skip_disk_cache_save(engine: Any = None) -> None:
        # Called at shutdown and before an idle unload: the engine's model is about to go.
        await session.flush_persisted()  # --persist-requests: the queued writes, within a bound
        session.release()
        log.info(
            "[kvsnap] vllm-mlx's prefix cache is not saved to ~/.cache/vllm-mlx/prefix_cache in a "
            "--kv-snapshots run (the kvsnap store is the warm state)"
        )

    server._load_prefix_cache_from_disk = session.load
    server._save_prefix_cache_to_disk = skip_disk_cache_save
    install_routes(server, session)
    adapt_request_paths(server)  # /v1/messages, /v1/responses: later system messages in place
    guard_sampling(server)  # each request's sampling values its own, settled as kvsnap serve's


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
    missing = [name for name in HOOKS if not hasattr(server, name)] + [
        name for name in ("create_parser", "main") if not hasattr(cli, name)
    ]
    if missing:
        raise UsageError(
            f"vllm-mlx {version} lacks {', '.join(missing)}, which kvsnap's integration hooks; it "
            f"is tested with vllm-mlx {', '.join(TESTED_VLLM_MLX)}"
        )
    if version not in TESTED_VLLM_MLX:
        log.warning(
            "[kvsnap] vllm-mlx %s is untested (tested: %s); the hook points are present",
            version,
            ", ".join(TESTED_VLLM_MLX),
        )
    return cli, server, version


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
    return run_main(cli.main, ["vllm-mlx", *args])


def main(argv: Sequence[str]) -> int:
    args = serve_args(argv, USAGE, "vllm-mlx", "vllm-mlx {}")
    if isinstance(args, int):
        return args
    store_dir, rest = split_argv(args, KV_SNAPSHOTS.flag, KV_SNAPSHOTS.needs)
    persist, rest = split_persist_argv(rest)
    from kvsnap.store.remote import check_kv_snapshots

    # An unknown scheme and contradicting persist flags are usage errors before vllm-mlx is
    # imported.
    check_kv_snapshots(store_dir)
    persist_options(SimpleNamespace(kv_snapshots=store_dir, **persist))
    from kvsnap.blas import preload_openblas

    preload_openblas()  # before vllm-mlx imports mlx: the same BLAS kvsnap build uses
    if asks_help(rest):
        print(USAGE)
        cli, _, _ = import_vllm_mlx()
        return run_vllm_mlx(cli, ["serve", "--help"])
    cli, server, version = import_vllm_mlx()
    if store_dir is None:
        from kvsnap.integrations.vllm_mlx.sampling import guard_sampling

        log.info("[kvsnap] no %s: running vllm-mlx %s's own prefix cache", OPTION, version)
        guard_sampling(server)  # sampling values are held to kvsnap serve's rules all the same
        return run_vllm_mlx(cli, ["serve", *rest])
    # --warm-prompts is kvsnap's in such a run: vllm-mlx never sees it, so its own warm-up never
    # runs.
    warm_file, rest = split_argv(rest, WARM_PROMPTS.flag, WARM_PROMPTS.needs)
    ns = parse_serve_args(cli, rest)
    ns.kv_snapshots, ns.warm_prompts = store_dir, warm_file
    vars(ns).update(persist)
    use_kv_snapshots(server, ns)  # what the patched `vllm-mlx serve --kv-snapshots` calls
    return run_vllm_mlx(cli, ["serve", *rest])


def use_kv_snapshots(server: Any, args: Any) -> Session:
    """Warm ``vllm-mlx serve`` from the kvsnap store ``args.kv_snapshots``: the one public entry.

    ``server`` is the ``vllm_mlx.server`` module, ``args`` vllm-mlx's parsed ``serve``
    arguments; call it before ``load_model``. It checks the options, reads
    ``args.warm_prompts`` (then set to None: the entries are served from the store, so
    vllm-mlx's own warm-up never runs), opens the store (an oci:// one is pulled first) and
    hooks the prefix-cache load, save and routes. ``kvsnap vllm-mlx serve`` and the patched
    ``vllm-mlx serve --kv-snapshots`` (contrib/vllm-mlx/) both run it. Returns the session;
    raises a KvsnapError naming the option, its value and the fix.
    """
    from kvsnap.integrations.vllm_mlx.session import Session
    from kvsnap.runtime.model.loading import default_digest_cache
    from kvsnap.store.remote import check_kv_snapshots

    store_dir, warm_file = args.kv_snapshots, getattr(args, "warm_prompts", None)
    check_kv_snapshots(store_dir)
    check_serve_args(args)
    persist = persist_options(args)
    prompts = load_warm_prompt_file(warm_file) if warm_file else None
    store, writable = open_store(store_dir, want_write=prompts is not None or persist is not None)
    session = Session(
        server=server,
        store=store,
        writable=writable and prompts is not None,
        prompts=prompts,
        agents_file=str(warm_file or ""),
        digests=default_digest_cache(),
        persist=persist,
    )
    install(server, session)
    args.warm_prompts = None
    what = f"warm prompts of {warm_file} from" if prompts is not None else "snapshots from"
    log.info(
        "[kvsnap] vllm-mlx: %s %s go into its prefix cache at start-up%s%s",
        what,
        store.root,
        " (write-back on)" if session.writable else "",
        "; the entries it keeps are persisted there" if persist is not None else "",
    )
    return session
