"""Which requests admitted together share a prefix worth computing once. No mlx here.

Cold requests that arrive together with one system prompt would each prefill it inside
the batch. Instead the engine prefills the shared part once, puts it in the prefix cache,
and every member then hits it (as radix-sharing schedulers do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvsnap.prompts import common_prefix_length

MIN_SHARED_TOKENS = 32  # below this, one extra forward pass costs more than it saves


@dataclass(frozen=True)
class SharedGroup:
    members: tuple[int, ...]  # indices into the admitted batch
    length: int  # tokens all members share; each member has at least one token more


def shared_groups(
    token_lists: Sequence[Sequence[int]],
    namespaces: Sequence[str],
    min_shared: int = MIN_SHARED_TOKENS,
) -> list[SharedGroup]:
    """Groups of two or more requests of one namespace sharing at least ``min_shared`` leading
    tokens.

    Greedy: the first unassigned request collects every other one that shares enough with
    it; the group's length is what all of them share, always less than the shortest member.
    """
    left = list(range(len(token_lists)))
    groups: list[SharedGroup] = []
    while left:
        first = left.pop(0)
        head = token_lists[first]
        members = [first] + [
            j
            for j in left
            if namespaces[j] == namespaces[first]
            and common_prefix_length((head, token_lists[j])) >= min_shared
        ]
        if len(members) < 2:
            continue
        length = min(
            min(common_prefix_length((head, token_lists[j])) for j in members[1:]),
            min(len(token_lists[j]) for j in members) - 1,
        )
        if length >= min_shared:
            groups.append(SharedGroup(tuple(members), length))
            left = [j for j in left if j not in members]
    return groups
