"""What the ranks of a sharded model must agree on before they serve or build: that they loaded
the same model, and which rank writes to each store folder.

Both are collectives: every rank calls them at the same point.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from kvsnap.errors import UsageError
from kvsnap.runtime.sharding.ranks import RankGroup

if TYPE_CHECKING:
    from kvsnap.key import ModelIdentity

log = logging.getLogger("kvsnap.sharding")

PROBE_PREFIX = ".kvsnap-rank-probe-"


def elect_writers(ranks: RankGroup, root: Path | None, writable: bool) -> bool:
    """Whether this rank writes to its store folder: the lowest writable rank that sees the
    folder does, so two ranks sharing one folder (one host, or a network share) never race on a
    path, and every host's own copy is written. A collective: every rank calls it."""
    nonce = ranks.from_rank0(secrets.token_hex(8))
    probe = root / f"{PROBE_PREFIX}{nonce}-{ranks.rank}" if root is not None and writable else None
    made = False
    if probe is not None:
        try:
            probe.touch(exist_ok=False)
            made = True
        except OSError as exc:
            log.warning("[kvsnap] rank %d cannot write to %s (%s)", ranks.rank, root, exc)
    ranks.barrier()
    seen = sorted(
        int(p.name.rsplit("-", 1)[1])
        for p in (root.glob(f"{PROBE_PREFIX}{nonce}-*") if root is not None and made else [])
    )
    ranks.barrier()
    if probe is not None and made:
        probe.unlink(missing_ok=True)
    return made and (not seen or seen[0] == ranks.rank)


def agree_identity(ranks: RankGroup, identity: ModelIdentity, model: str) -> None:
    """Refuse to start when the ranks loaded different models (another folder's weights,
    tokenizer or mlx-lm): their keys would differ, and so would their hits."""
    digests = ranks.gather_json(identity.digest)
    for rank, digest in enumerate(digests):
        if digest != digests[0]:
            raise UsageError(
                f"rank {rank}'s model {model} has identity {digest[:12]}, rank 0's has "
                f"{digests[0][:12]}: every host must hold the same model folder (the complete "
                "one: a pipeline rank's partial download is another model to kvsnap) and mlx-lm"
            )
