"""kvsnap's vllm-mlx route (``kvsnap vllm-mlx serve`` and the patched ``vllm-mlx serve``).

``use_kv_snapshots`` is also reachable as ``kvsnap.integrations.vllm_mlx.use_kv_snapshots``, the
path vllm-mlx servers patched before the route became a package import; loaded on first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "use_kv_snapshots":
        from kvsnap.integrations.vllm_mlx.launcher import use_kv_snapshots

        return use_kv_snapshots
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
