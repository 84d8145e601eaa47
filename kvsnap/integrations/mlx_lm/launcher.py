"""mlx-lm's own server, warm from a kvsnap store.

    kvsnap mlx-lm serve [--model] MODEL [mlx_lm.server's flags] --kv-snapshots DIR
                        [--warm-prompts FILE]

mlx_lm.server builds its parser inside ``main`` and has no hook, so kvsnap takes
``--kv-snapshots`` and ``--warm-prompts`` out of the arguments, replaces the module's
``run`` (which ``main`` calls with mlx-lm's own ``ModelProvider``) with ``warm_run``, and
runs mlx-lm's ``main`` with every other argument unchanged. ``warm_run`` is what the
upstream patch (contrib/mlx-lm/) makes ``run`` itself: the prompt cache comes from
``mlx_lm.warm.warm_prompt_cache`` instead of ``LRUPromptCache(...)``, so the model is
loaded and the warm entries are in the cache before the generation thread starts and
before the port opens. Without ``--kv-snapshots`` mlx_lm.server runs with its own prompt
cache. Either way a request that names another model, adapter or draft model than the
served one is refused (``mlx_lm.models``), unless ``--allow-request-models`` is given,
and every request is held to kvsnap serve's rules for template kwargs and sampling values
(``mlx_lm.request_checks``). MODEL may come first without ``--model``, as ``kvsnap serve`` takes it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

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
    ROUTE_OPTIONS,
    WARM_PROMPTS,
    route_usage,
)
from kvsnap.integrations.mlx_lm.models import ALLOW_OPTION, guard_request_models
from kvsnap.integrations.mlx_lm.request_checks import guard_requests

log = logging.getLogger("kvsnap.mlx_lm")

TESTED_MLX_LM = ("0.32",)

# The route's own option, after the ones it shares with `kvsnap serve` (ROUTE_OPTIONS).
ALLOW_USAGE = f"""\
  {ALLOW_OPTION}  let a request's `model`, `adapters` and `draft_model` load other
                      models from the server's disk, as mlx_lm.server does; by default a
                      request naming another than the served one is refused with a 400
"""

USAGE = f"""\
usage: kvsnap mlx-lm serve [--model] MODEL [mlx_lm.server options] {OPTION} DIR
                           [{WARM_OPTION} FILE] [{ALLOW_OPTION}]

Runs mlx-lm's own OpenAI-compatible server (mlx_lm.server) with the kvsnap snapshots of
MODEL in its prompt cache before the port opens (no warm-up prefill). They are protected
'system' entries: no --prompt-cache-size / --prompt-cache-bytes eviction removes them, and
their memory comes on top of those limits. Snapshots of another model, KV setting or
mlx-lm minor are skipped.

kvsnap's options:
{route_usage("mlx-lm", ROUTE_OPTIONS)}{ALLOW_USAGE}
Every other argument goes to mlx_lm.server unchanged. See docs/mlx-lm.md.
"""


def import_mlx_lm_server() -> Any:
    from importlib import metadata

    import mlx_lm.server as server

    version = metadata.version("mlx-lm")
    missing = [
        n
        for n in ("main", "run", "ResponseGenerator", "_run_http_server")
        if not hasattr(server, n)
    ]
    if missing:
        raise UsageError(
            f"mlx-lm {version}'s server lacks {', '.join(missing)}, which "
            f"kvsnap mlx-lm hooks; it is tested with mlx-lm {TESTED_MLX_LM[0]}.x"
        )
    if ".".join(version.split(".")[:2]) not in TESTED_MLX_LM:
        log.warning("[kvsnap] mlx-lm %s is untested (tested: %s.x)", version, TESTED_MLX_LM[0])
    return server


def make_warm_run(server: Any, store_dir: str | None, warm_file: str | None):
    """mlx_lm.server's ``run`` with the prompt cache from the store: the upstream patch's
    ``run``."""

    def warm_run(host, port, model_provider, server_class=None, handler_class=None):
        import mlx.core as mx

        from kvsnap.integrations.mlx_lm.warm import warm_prompt_cache

        prompt_cache = warm_prompt_cache(model_provider, store_dir, warm_file)
        response_generator = server.ResponseGenerator(model_provider, prompt_cache)
        if mx.distributed.init().rank() != 0:
            # As mlx-lm's own run: only rank 0 serves HTTP; the others follow its requests.
            response_generator.join()
            return
        extra = {
            k: v
            for k, v in (("server_class", server_class), ("handler_class", handler_class))
            if v is not None
        }
        server._run_http_server(host, port, response_generator, **extra)

    return warm_run


def take_flag(argv: list[str], flag: str) -> tuple[bool, list[str]]:
    """Whether ``flag`` (no value) is in ``argv`` before any ``--``, and the other arguments."""
    end = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:end] if a != flag]
    return len(head) < end, head + argv[end:]


def positional_model(args: list[str]) -> list[str]:
    """``MODEL ...`` as ``--model MODEL ...``: mlx_lm.server takes no positional argument, so
    a first argument that is not an option can only be the model."""
    if not args or args[0].startswith("-"):
        return args
    if any(a == "--model" or a.startswith("--model=") for a in args[1:]):
        raise UsageError(
            f"kvsnap mlx-lm serve got the model twice: {args[0]} and --model; give one"
        )
    return ["--model", *args]


def run_mlx_lm(server: Any, args: list[str]) -> int:
    """mlx-lm's own ``main``, as if run as ``mlx_lm.server ARGS``; its exit status is returned."""
    return run_main(server.main, ["mlx_lm.server", *args])


def main(argv: Sequence[str]) -> int:
    args = serve_args(argv, USAGE, "mlx-lm", "mlx_lm.{}")
    if isinstance(args, int):
        return args
    args = positional_model(args)
    store_dir, rest = split_argv(args, KV_SNAPSHOTS.flag, KV_SNAPSHOTS.needs)
    warm_file, rest = split_argv(rest, WARM_PROMPTS.flag, WARM_PROMPTS.needs)
    allow_request_models, rest = take_flag(rest, ALLOW_OPTION)
    from kvsnap.store.remote import check_kv_snapshots

    check_kv_snapshots(store_dir)  # an unknown scheme fails before mlx-lm is imported
    if warm_file and not store_dir:
        raise UsageError(
            f"{WARM_OPTION} {warm_file} needs {OPTION} DIR (the store its entries "
            "are read from and written back to)"
        )
    from kvsnap.blas import preload_openblas

    preload_openblas()  # before mlx-lm imports mlx: the same BLAS kvsnap build uses
    server = import_mlx_lm_server()
    if asks_help(rest):
        print(USAGE)
        return run_mlx_lm(server, ["--help"])
    from kvsnap.runtime.sharding.launch import launched_ranks

    if store_dir is not None:
        server.run = make_warm_run(server, store_dir, warm_file)
    elif launched_ranks() > 1:
        # No snapshots, but sharded: the prompt cache whose evictions rank 0 decides.
        server.run = make_warm_run(server, None, None)
    else:
        log.info("[kvsnap] no %s: running mlx_lm.server's own prompt cache", OPTION)
    guard_requests(server)
    if not allow_request_models:
        guard_request_models(server)
    return run_mlx_lm(server, rest)
