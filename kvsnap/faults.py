"""Named fault points in the write path, for crash tests. Inert unless asked for.

``KVSNAP_FAULT=point[,point...]`` with an action per point (``point=kill`` by default,
``point=enospc``, ``point=erofs``, ``point=crash`` (a RuntimeError) or ``point=pause`` (sleeps
``PAUSE_S`` there, so a test's SIGKILL sent once the point is logged lands inside it); the server's
``write-probe``
point with ``erofs``
simulates a read-only store, which root cannot get from chmod); ``KVSNAP_FAULT_LOG=FILE`` appends
every point reached, so a test
can assert the point was really hit before the process died.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass, field

# In write order. "model-loaded" is only logged (a marker for kills at random times).
POINTS = (
    "model-loaded",
    "after-prefill",
    "mid-write",
    "after-write",
    "after-fsync",
    "after-rename",
)
KILL_POINTS = POINTS[1:]
# Long enough for a test polling the fault log to see the point and send its kill.
PAUSE_S = 0.5
# The conversation writer's own points (``--persist-requests``), in write order: after the
# first new block of a record, after all its parts, after the record, after the superseded
# record is gone.
CONVERSATION_POINTS = (
    "conversation-mid-parts",
    "conversation-before-record",
    "conversation-after-record",
    "conversation-after-supersede",
)


@dataclass
class FaultHook:
    actions: dict[str, str] = field(default_factory=dict)
    log_path: str | None = None

    @classmethod
    def from_env(cls, environ=os.environ) -> "FaultHook":
        actions = {}
        for item in filter(None, (environ.get("KVSNAP_FAULT") or "").split(",")):
            point, _, action = item.partition("=")
            actions[point.strip()] = (action or "kill").strip()
        return cls(actions=actions, log_path=environ.get("KVSNAP_FAULT_LOG"))

    def __call__(self, point: str) -> None:
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(point + "\n")
                f.flush()
                os.fsync(f.fileno())
        action = self.actions.get(point)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif action == "erofs":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        elif action == "pause":
            time.sleep(PAUSE_S)
        elif action == "crash":  # an unexpected error, not an I/O one
            raise RuntimeError(f"injected fault at {point}")


DAMAGED_COPY_ENV = "KVSNAP_FAULT_DAMAGED_COPY"


def damaged_on_rank(rank: int, relpath: str, environ=os.environ) -> bool:
    """Whether ``KVSNAP_FAULT_DAMAGED_COPY=RANK:RELPATH[,...]`` says this rank's copy of the store
    file ``relpath`` is damaged: a sharded test on one host, where every rank reads one folder,
    gives one rank a bad copy (its reader then flips a byte of what it read)."""
    for item in filter(None, (environ.get(DAMAGED_COPY_ENV) or "").split(",")):
        who, _, path = item.partition(":")
        if who.strip() == str(rank) and path.strip() == relpath:
            return True
    return False
