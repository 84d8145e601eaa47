"""`kvsnap serve` (kvsnap's OpenAI-compatible server), `kvsnap vllm-mlx` and `kvsnap mlx-lm`
(vllm-mlx's and mlx-lm's own servers, started warm). Serve's flags are rows of
``serve_options.SERVE_OPTIONS`` and its start-up checks live in ``serve_checks``; here is the
start-up itself, in order: check, bind, load, serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path

from kvsnap.commands.common import EXIT_BAD, EXIT_OK, kv_settings
from kvsnap.commands.serve_checks import (
    check_flags,
    check_store,
    persist_options,
    warn_if_open,
    warn_without_openblas,
)
from kvsnap.commands.serve_options import SERVE_OPTIONS
from kvsnap.integrations.common.options import add_options, config_fields

log = logging.getLogger("kvsnap")


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server that starts warm from snapshots")
    add_options(p, SERVE_OPTIONS)
    p.set_defaults(run=cmd_serve)


def log_level(args) -> int:
    """--log-level, else -v's debug, else info; set on the root logger (kvsnap's lines and,
    through it, uvicorn's)."""
    name = args.log_level or ("debug" if args.verbose else "info")
    level = getattr(logging, name.upper())
    logging.getLogger().setLevel(level)
    return level


def cmd_serve(args) -> int:
    from kvsnap.runtime.sharding.launch import refuse_sharded

    # Continuous batching, persistence and re-warm each decide per process; ranks would diverge.
    refuse_sharded(
        "kvsnap serve",
        "serve a sharded model with `mlx.launch ... kvsnap mlx-lm serve --model M "
        "--kv-snapshots DIR [--pipeline]`, which starts every rank warm (docs/distributed.md)",
    )
    from kvsnap.http.agent_recorder import AgentRecorder
    from kvsnap.http.listen import bind_socket
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.runtime.model.loading import resolve_model
    from kvsnap.store.remote import resolve_kv_snapshots

    level = log_level(args)
    auth = check_flags(args)  # sets args.model: the positional or --model
    sock = bind_socket(args.host, args.port)  # a busy port fails now, not after the model loads
    source = resolve_model(args.model, args.revision)
    warn_if_open(auth, args.host)
    check_store(args)  # a file for a store and contradicting flags fail before the model loads
    prompts = load_warm_prompts(args.warm_prompts) if args.warm_prompts else None
    # a file that is not a list of entries fails now, not on the first request
    recorder = AgentRecorder(Path(args.record_agents)) if args.record_agents else None
    for problem in prompts.problems if prompts else []:
        log.warning("[kvsnap] skipped warm prompt %s", problem)
    # a remote URL (oci://…) is pulled into a local cache folder first
    args.kv_snapshots = resolve_kv_snapshots(args.kv_snapshots)
    config = engine_config(args, source.path, prompts)
    # the snapshots are read beside the ~1 s of importing mlx-lm and the engine
    from kvsnap.runtime.engine.startup import start_prefetch

    early_prefetch = start_prefetch(config)
    from kvsnap.runtime.engine.engine import Engine

    # The weights are read after warm, once the API is built: on two cores the read would
    # otherwise slow the port's opening and the first /health by ~0.3 s.
    api_settled = threading.Event()
    engine = Engine(config, early_prefetch=early_prefetch, read_weights_when=api_settled)
    from kvsnap.http.staged import StagedApp

    server_config = serve_config(args, source, auth)

    def build_api():
        # fastapi, pydantic and the routes: imported on their own thread once the port is open
        from kvsnap.http.server import create_app

        return create_app(engine, server_config, recorder)

    def stop_serving(_exc: BaseException) -> None:
        server.should_exit = True

    app = StagedApp(
        engine,
        server_config.served_model_name,
        build_api,
        engine.shutdown,
        stop_serving,
        settled=api_settled,
    )
    engine.start()  # load (map) the model on the main thread, before the port opens
    from kvsnap.http.connections import (
        ConnectionGuard,
        effective_max_connections,
        raise_open_files_limit,
    )
    from kvsnap.http.listen import make_server, uvicorn_log_config
    from kvsnap.http.watch import exit_when_warm_up_fails

    warn_without_openblas()
    # After the load: importing mlx-lm sets the open-files limit itself (2048, hard 4096).
    max_connections = effective_max_connections(args.max_connections, raise_open_files_limit())
    guard_fields = config_fields(SERVE_OPTIONS, args, "guard")
    guard = ConnectionGuard(**{**guard_fields, "max_connections": max_connections})
    server = make_server(
        app,
        guard,
        log_level=level,
        log_config=uvicorn_log_config(),
        timeout_graceful_shutdown=5,
        **config_fields(SERVE_OPTIONS, args, "uvicorn"),
    )
    exit_when_warm_up_fails(engine, server)
    app.start_building()
    log.info(
        "[kvsnap] listening on http://%s:%d (at most %d connections)",
        args.host,
        args.port,
        max_connections,
    )
    server.run(sockets=[sock])
    if engine.failed:
        print(f"kvsnap serve: error: warm-up failed: {engine.failed}", file=sys.stderr)
        return EXIT_BAD
    if app.failed:
        print(f"kvsnap serve: error: the HTTP API failed to start: {app.failed}", file=sys.stderr)
        return EXIT_BAD
    return EXIT_OK


def engine_config(args, model_dir: Path, prompts):
    """The engine's settings from the serve flags (``args.kv_snapshots`` already a local folder)."""
    from kvsnap.runtime.engine.types import EngineConfig
    from kvsnap.runtime.model.loading import default_digest_cache

    return EngineConfig(
        model=str(model_dir),
        settings=kv_settings(args),
        warm_prompts=prompts,
        digest_cache=default_digest_cache(),
        persist=persist_options(args),
        weights_after_warm=True,  # /health does not wait for the weights to be read
        **config_fields(SERVE_OPTIONS, args, "engine"),
    )


def serve_config(args, source, auth):
    """The HTTP layer's settings: the served name, limits, keys and request defaults."""
    from kvsnap.http.config import SamplingDefaults, ServerConfig
    from kvsnap.http.limits import context_length

    model_dir = source.path
    config_json = json.loads((model_dir / "config.json").read_text())
    names = args.served_model_name or []
    name = (
        (names[0] if names else None)
        or source.repo_id
        or Path(args.model).expanduser().name
        or model_dir.name
    )
    return ServerConfig(
        served_model_name=name,
        model_aliases=(args.model, str(model_dir)),
        context_length=context_length(config_json),
        auth=auth,
        sampling=SamplingDefaults(**config_fields(SERVE_OPTIONS, args, "sampling")),
        **config_fields(SERVE_OPTIONS, args, "server"),
    )


def add_vllm_mlx(sub) -> None:
    p = sub.add_parser(
        "vllm-mlx",
        help="run vllm-mlx's own server warm from a store: kvsnap vllm-mlx serve MODEL [its flags] "
        "--kv-snapshots DIR",
        description="Run vllm-mlx's own server (installed beside kvsnap) with the store's "
        "snapshots of MODEL in its prefix cache before it accepts requests. "
        "Every argument but --kv-snapshots goes to `vllm-mlx serve` unchanged; `kvsnap vllm-mlx "
        "serve --help` shows both. See docs/vllm-mlx.md.",
    )
    p.add_argument(
        "vllm_mlx_args",
        nargs=argparse.REMAINDER,
        metavar="serve MODEL [vllm-mlx flags] --kv-snapshots DIR",
    )
    p.set_defaults(run=cmd_vllm_mlx)


def cmd_vllm_mlx(args) -> int:
    from kvsnap.integrations.vllm_mlx.launcher import main as vllm_mlx_main
    from kvsnap.runtime.sharding.launch import refuse_sharded

    refuse_sharded(
        "kvsnap vllm-mlx",
        "vllm-mlx has no sharded mode; serve a sharded model with `mlx.launch ... kvsnap "
        "mlx-lm serve --model M --kv-snapshots DIR [--pipeline]` (docs/distributed.md)",
    )

    # vllm-mlx logs through the root logger: give its lines a time, level and source, like `serve`.
    logging.basicConfig(
        force=True,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    rc = vllm_mlx_main(args.vllm_mlx_args)
    if args.vllm_mlx_args[:1] == ["serve"]:
        # vllm-mlx has shut down cleanly. Skip interpreter finalization: a thread that ran mlx
        # work and ends there aborts the process ("terminate called without an active
        # exception", mlx's per-thread compile cache), turning a clean exit into SIGABRT.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    return rc


def add_mlx_lm(sub) -> None:
    p = sub.add_parser(
        "mlx-lm",
        help="run mlx-lm's own server warm from a store: "
        "kvsnap mlx-lm serve --model MODEL [its flags] --kv-snapshots DIR",
        description="Run mlx_lm.server with the store's snapshots of MODEL in its prompt "
        "cache before the port opens. Every argument but --kv-snapshots and --warm-prompts "
        "goes to mlx_lm.server unchanged; `kvsnap mlx-lm serve --help` shows both. "
        "See docs/mlx-lm.md.",
    )
    p.add_argument(
        "mlx_lm_args",
        nargs=argparse.REMAINDER,
        metavar="serve --model MODEL [mlx_lm.server flags] --kv-snapshots DIR",
    )
    p.set_defaults(run=cmd_mlx_lm)


def cmd_mlx_lm(args) -> int:
    from kvsnap.integrations.mlx_lm.launcher import main as mlx_lm_main

    rc = mlx_lm_main(args.mlx_lm_args)
    if args.mlx_lm_args[:1] == ["serve"]:
        # As for vllm-mlx: a thread that ran mlx work ending in interpreter finalization
        # can abort the process; mlx_lm.server has already shut down cleanly here.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    return rc
