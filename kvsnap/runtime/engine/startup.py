"""The engine's start-up pieces that need no engine state: the snapshot prefetch while the
model loads, the warm-up prefill (one prompt or a batch), and the parked engine thread.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx

from kvsnap.runtime.cache.composed import BlockPool
from kvsnap.runtime.engine.types import EngineConfig
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.model.source import resolve_model
from kvsnap.runtime.prefill.batched import prefill_batched
from kvsnap.runtime.prefill.chunked import prefill
from kvsnap.runtime.warmup.prefetch import Prefetched, prefetch

log = logging.getLogger("kvsnap.runtime.engine.engine")


def prefetch_snapshots(
    cfg: EngineConfig, stream: Callable[[], mx.Stream], pool: BlockPool | None = None
) -> Prefetched | None:
    """Read and checksum the snapshots to pin, on the engine's own stream, while the model
    loads; None when there is no local store or the prefetch failed."""
    if not cfg.snapshots or "://" in cfg.snapshots:
        return None
    try:
        model_dir = resolve_model(cfg.model).path
        names = [p.name for p in cfg.warm_prompts.entries] if cfg.warm_prompts else []
        with mx.stream(stream()):
            return prefetch(
                cfg.snapshots,
                model_dir,
                cfg.settings,
                int(cfg.cache_memory_mb * 2**20),
                names,
                pool,
            )
    except Exception as exc:  # an optimisation only: the warm-up reads the files itself
        log.warning("[kvsnap] snapshot prefetch skipped: %s", exc)
        return None


def start_prefetch(cfg: EngineConfig) -> tuple[BlockPool, Future]:
    """``prefetch_snapshots`` on a thread of its own, started before mlx-lm is imported: the
    snapshots' reads (I/O and page faults, outside the GIL) then run beside that ~1 s of
    imports instead of after them. Returns the block pool the prefetch fills (the engine's
    own, ``Engine.pool``) and the prefetch's future result (give it to ``Engine.prefetched``)."""
    pool = BlockPool()
    done: Future = Future()

    def read() -> None:
        stream = mx.new_stream(mx.default_device())
        done.set_result(prefetch_snapshots(cfg, lambda: stream, pool))

    thread = threading.Thread(
        target=run_then_park, args=([read],), name="kvsnap-prefetch", daemon=True
    )
    thread.start()
    return pool, done


def prefill_concurrency(cfg: EngineConfig, kv_bits: int | None) -> int:
    """At most this many warm prompts are prefilled at once, as one batch.

    1 with a quantized KV: mlx-lm's batch caches cannot hold one.
    """
    n = max(1, int(cfg.warm_prompts_concurrency or 1))
    return n if kv_bits is None else 1


def prefill_many(
    lm: LoadedModel,
    new_generator: Callable[[int, int], Any],
    token_lists: Sequence[Sequence[int]],
) -> list:
    """Prefill warm prefixes: one alone exactly as ``kvsnap build`` does, several as one batch."""
    if len(token_lists) <= 1 or lm.settings.kv_bits is not None:
        return [prefill(lm, tokens) for tokens in token_lists]
    return prefill_batched(new_generator(len(token_lists), len(token_lists)), token_lists)


def run_then_park(box: list[Callable[[], None]]) -> None:
    """Run the engine loop, then park this daemon thread for good instead of ending it.

    mlx keeps a compile cache per thread; its destructor runs when the thread ends and
    needs the GIL. A thread ending while the interpreter finalizes (right after
    ``shutdown``) then aborts the process ("terminate called without an active
    exception"). A parked daemon thread never runs that destructor; the process exits
    around it.
    """
    main = box.pop()
    try:
        main()
    finally:
        del main
        threading.Event().wait()
