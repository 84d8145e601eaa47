"""A SharedTier in process, as a replica opens one, with the local hooks a test needs fixed."""

from __future__ import annotations

from pathlib import Path

from kvsnap.key import ModelIdentity
from kvsnap.runtime.persist.options import TierOptions
from kvsnap.runtime.persist.shared_tier import SharedTier
from kvsnap.store.tier_backends import TierBackend


def open_shared_tier(
    backend: TierBackend, options: TierOptions, identity: ModelIdentity, store: Path
) -> SharedTier:
    """One replica's tier over ``store``: every namespace's conversations under one digest
    ("d" * 32) and no tenant; nothing to do when a fetch lands."""
    return SharedTier(
        backend,
        options,
        identity,
        store,
        local_conv_digest=lambda ns: "d" * 32,
        local_tenant=lambda ns: "",
        on_fetched=lambda: None,
    )
