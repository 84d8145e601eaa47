"""Whether this process was started by ``mlx.launch`` as one of several ranks.

Only then is mlx's distributed group joined (a collective every rank makes): a plain start
never imports mlx here. ``mlx.launch`` sets ``MLX_RANK`` (ring, JACCL); MPI sets its own.
"""

from __future__ import annotations

import os

from kvsnap.errors import UsageError

LAUNCH_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_ranks() -> int:
    """How many ranks this process's launch started (1 when it was started alone)."""
    if not any(name in os.environ for name in LAUNCH_ENV):
        return 1
    from kvsnap.blas import preload_openblas

    preload_openblas()  # before mlx is imported
    import mlx.core as mx

    return mx.distributed.init().size()


def refuse_sharded(command: str, why: str) -> None:
    """A UsageError when ``command`` was started as one of several ranks; ``why`` says what to
    run instead."""
    ranks = launched_ranks()
    if ranks > 1:
        raise UsageError(f"{command} runs as one process, not as {ranks} mlx.launch ranks: {why}")
