"""A compressed token trie over one namespace's prefix entries: the lookup walks the request's
tokens once, whatever the number of entries (mlx-lm's ``PromptTrie``, with edges of many tokens).

No mlx and no lock here: ``PrefixCache`` owns the entries, the rules' callers and the lock.
Each node counts the trimmable entries below it by (pinned, loaded), so the best trimmable
candidate under a node is found by walking down the counts, not by visiting every entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsnap.prompts import common_prefix_length

Rank = tuple[bool, bool]  # (pinned, loaded): ties go to a warm entry, then one in memory
RANKS: tuple[Rank, ...] = ((True, True), (True, False), (False, True), (False, False))


def rank_of(entry: Any) -> Rank:
    return (bool(entry.pinned), bool(entry.loaded))


class _Node:
    __slots__ = ("edge", "children", "entry", "rank", "counts", "parent")

    def __init__(self, edge: tuple[int, ...], parent: "_Node | None") -> None:
        self.edge = edge  # the tokens from the parent to this node
        self.children: dict[int, _Node] = {}  # first token of a child's edge -> child
        self.entry: Any = None  # the entry whose tokens end exactly here
        self.rank: Rank = (False, False)  # the entry's rank as counted (kept current by set_loaded)
        self.counts = dict.fromkeys(RANKS, 0)  # trimmable entries in this subtree, by rank
        self.parent = parent


@dataclass(frozen=True)
class Candidate:
    usable: int  # tokens this entry would save
    rank: Rank
    entry: Any


class TokenTrie:
    """Entries keyed by their tokens; ``best`` applies the lookup rules of
    ``PrefixCache.lookup``."""

    def __init__(self) -> None:
        self._root = _Node((), None)
        self._nodes: dict[int, _Node] = {}  # id(entry) -> the node holding it

    def __len__(self) -> int:
        return len(self._nodes)

    # --- updates --------------------------------------------------------------

    def insert(self, entry: Any) -> None:
        """Index ``entry`` under its tokens, replacing whatever entry held them."""
        tokens = tuple(entry.tokens)
        node = self._node_for(tokens)
        if node.entry is not None:
            self.remove(node.entry)
            node = self._node_for(tokens)  # the removal may have merged it away
        node.entry, node.rank = entry, rank_of(entry)
        self._nodes[id(entry)] = node
        self._count(node, +1)

    def remove(self, entry: Any) -> None:
        node = self._nodes.get(id(entry))
        if node is None or node.entry is not entry:
            return
        del self._nodes[id(entry)]
        self._count(node, -1)
        node.entry = None
        self._prune(node)

    def set_loaded(self, entry: Any, loaded: bool) -> None:
        """Recount ``entry`` as loaded or not (``PrefixCache`` calls this as it loads or
        unloads)."""
        node = self._nodes.get(id(entry))
        if node is None or node.entry is not entry or node.rank[1] == loaded:
            return
        self._count(node, -1)
        node.rank = (node.rank[0], loaded)
        self._count(node, +1)

    def _count(self, node: _Node, delta: int) -> None:
        if not node.entry.trimmable:
            return
        walk: _Node | None = node
        while walk is not None:
            walk.counts[node.rank] += delta
            walk = walk.parent

    def _node_for(self, tokens: tuple[int, ...]) -> _Node:
        """The node at exactly ``tokens``, splitting an edge or adding a leaf as needed."""
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(tokens[depth:], node)
                node.children[tokens[depth]] = leaf
                return leaf
            rest = tokens[depth : depth + len(child.edge)]
            if rest == child.edge:
                node, depth = child, depth + len(child.edge)
                continue
            node = self._split(child, common_prefix_length((child.edge, rest)))
            depth += len(node.edge)
        return node

    @staticmethod
    def _split(child: _Node, at: int) -> _Node:
        """Put a node ``at`` tokens into ``child``'s edge; returns it."""
        parent = child.parent
        if parent is None:
            raise ValueError("the trie's root has no edge to split")
        middle = _Node(child.edge[:at], parent)
        middle.counts = dict(child.counts)
        parent.children[child.edge[0]] = middle
        child.edge, child.parent = child.edge[at:], middle
        middle.children[child.edge[0]] = child
        return middle

    def _prune(self, node: _Node) -> None:
        """Drop an empty leaf, and merge a node that no longer branches into its only child."""
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge, child.parent = node.edge + child.edge, node.parent
            node.parent.children[child.edge[0]] = child

    # --- lookup ---------------------------------------------------------------

    def best(self, tokens: tuple[int, ...]) -> Candidate | None:
        """The entry saving the most of ``tokens``: an entry that is a strict prefix (any), or a
        trimmable one cut to the common prefix and leaving one token to compute; ties by rank."""
        path, partial, matched = self._walk(tokens)
        last = len(tokens) - 1
        best: Candidate | None = None
        if partial is not None:  # every entry past the part-way edge shares ``matched`` tokens
            best = self._best_trimmable(partial, None, min(matched, last))
        below = partial
        # Deepest first: a node ``d`` tokens deep offers at most ``d``, so the walk up stops
        # once the best found is longer.
        for node, d in reversed(path):
            if best is not None and best.usable > d:
                break
            options = [self._best_trimmable(node, below, min(d, last))]
            if node.entry is not None and d < len(tokens):
                options.append(Candidate(d, node.rank, node.entry))
            for cand in options:
                if (
                    cand is not None
                    and cand.usable > 0
                    and (best is None or (cand.usable, cand.rank) > (best.usable, best.rank))
                ):
                    best = cand
            below = node
        return best

    def entry_ends(self, tokens: tuple[int, ...]) -> list[int]:
        """The lengths of the entries that are whole prefixes of ``tokens``."""
        path, _, _ = self._walk(tokens)
        return [d for node, d in path if node.entry is not None]

    def _walk(self, tokens: tuple[int, ...]) -> tuple[list[tuple[_Node, int]], _Node | None, int]:
        """The nodes ``tokens`` reaches whole (with their depths), the child whose edge they
        leave part-way (or None), and how many tokens match in all."""
        node, depth = self._root, 0
        path = [(node, 0)]
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            seen = tokens[depth : depth + len(child.edge)]
            if seen == child.edge:
                node, depth = child, depth + len(child.edge)
                path.append((node, depth))
                continue
            return path, child, depth + common_prefix_length((child.edge, seen))
        return path, None, depth

    @staticmethod
    def _best_trimmable(node: _Node, skip: _Node | None, usable: int) -> Candidate | None:
        """The best-ranked trimmable entry under ``node`` but not under its child ``skip``."""
        if usable <= 0:
            return None  # the request's last token always runs; nothing here would be saved
        for rank in RANKS:
            if node.counts[rank] - (skip.counts[rank] if skip is not None else 0) > 0:
                return Candidate(usable, rank, _find(node, skip, rank))
        return None


def _find(node: _Node, skip: _Node | None, rank: Rank) -> Any:
    """A trimmable entry of ``rank`` under ``node`` (not under ``skip``), down the counts."""
    while True:
        e = node.entry
        if e is not None and e.trimmable and node.rank == rank:
            return e
        node = next(c for c in node.children.values() if c is not skip and c.counts[rank] > 0)
        skip = None
