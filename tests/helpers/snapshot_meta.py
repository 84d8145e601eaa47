"""A fixed model identity and a snapshot header's metadata built from it, for tests and scripts
that write snapshot files by hand."""

from __future__ import annotations

import json

from kvsnap.key import ModelIdentity, snapshot_key, tokens_digest
from kvsnap.snapshot.format import WHOLE_FILE_FORMAT


def fixed_identity(
    layout, kv_dtype: str = "float32", *, weights: str = "a" * 32, max_kv_size: int | None = None
) -> ModelIdentity:
    """An identity with made-up digests: ``layout`` (cache class names) and ``kv_dtype`` vary."""
    return ModelIdentity(
        weights,
        "b" * 32,
        "c" * 32,
        "{}",
        kv_dtype,
        None,
        None,
        None,
        max_kv_size,
        tuple(layout),
        1,
        "0.32",
    )


def snapshot_metadata(
    identity: ModelIdentity, tokens: list[int], layers_text: str, version: int = WHOLE_FILE_FORMAT
) -> dict[str, str]:
    """A header's metadata for ``tokens`` under ``identity``: its key and digests agree."""
    return {
        "kvsnap.format": str(version),
        "kvsnap.key": snapshot_key(identity, "d" * 32, tokens),
        "kvsnap.name": "agent",
        "kvsnap.model": json.dumps(identity.as_dict()),
        "kvsnap.model_digest": identity.digest,
        "kvsnap.prompt_digest": "d" * 32,
        "kvsnap.n_tokens": str(len(tokens)),
        "kvsnap.tokens_digest": tokens_digest(tokens),
        "kvsnap.layers": layers_text,
        "kvsnap.recorded": json.dumps({"created": "2026-11-30T00:00:00Z"}),
    }
