"""Which requests wait and which run: the engine's queue and batch slots. No mlx here.

Requests start in arrival order. Batched, up to ``max_batch_size`` run at once (keyed by
the BatchGenerator's uid); sequential (quantized KV, or continuous batching off), one runs
at a time (keyed by its negated request id, which no uid can be).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsnap.runtime.engine.types import RequestState


def uses_batching(continuous_batching: bool, kv_bits: int | None) -> bool:
    """mlx-lm's batch caches cannot hold a quantized KV: those requests run one at a time."""
    return continuous_batching and kv_bits is None


@dataclass
class Scheduler:
    max_batch_size: int
    pending: list[RequestState] = field(default_factory=list)  # waiting, oldest first
    active: dict[int, RequestState] = field(default_factory=dict)  # slot key -> running request
    max_batch_seen: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.active or self.pending)

    @property
    def room(self) -> int:
        return self.max_batch_size - len(self.active)

    def submit(self, state: RequestState) -> None:
        self.pending.append(state)

    def next_batch(self) -> list[RequestState]:
        """The requests that would start now if every one of them started: a batch's peers."""
        return self.pending[: max(0, self.room)]

    def next_to_admit(self) -> RequestState | None:
        """The oldest waiting request, taken from the queue, if a batch slot is free."""
        if self.pending and self.room > 0:
            return self.pending.pop(0)
        return None

    def next_sequential(self) -> RequestState | None:
        """The oldest waiting request, taken from the queue, once nothing runs."""
        if not self.active and self.pending:
            return self.pending.pop(0)
        return None

    def activate(self, key: int, state: RequestState) -> None:
        self.active[key] = state
        self.max_batch_seen = max(self.max_batch_seen, len(self.active))

    def release(self, key: int) -> None:
        self.active.pop(key, None)

    def withdraw(self, state: RequestState) -> int | None:
        """Take a cancelled request out: the slot key it held if it ran, else None."""
        if state in self.pending:
            self.pending.remove(state)
        elif state.uid is not None and state.uid in self.active:
            self.active.pop(state.uid)
            return state.uid
        return None

    def take_all(self) -> list[RequestState]:
        """Every running and waiting request (running first); both queues end empty."""
        states = list(self.active.values()) + self.pending
        self.active.clear()
        self.pending = []
        return states

    def rows(self, tenant: str | None = None) -> list[dict]:
        """The ``requests`` of ``/v1/status``; with ``tenant``, only that tenant's."""
        return [
            {
                "id": s.id,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "computed_tokens": s.computed_tokens,
                "completion_tokens": s.completion_tokens,
            }
            for s in list(self.active.values()) + list(self.pending)
            if tenant is None or s.request.tenant == tenant
        ]
