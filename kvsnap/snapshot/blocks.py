"""Where a warm prefix is cut into content-addressed blocks, and what each block is called.

A prefix of ``n`` tokens becomes a chain of blocks ``[start, end)`` cut at every multiple of
``block_tokens`` and of ``checkpoint_every`` and at ``n``: a grid fixed from token 0 that no
other prefix moves, so adding, editing or removing one agent never renames another's blocks.
The build may also cut at a branch point (a depth where another warm prefix leaves this one)
inside a block nobody stored whole yet, so siblings store that block's shared head once
(``build._Build.split_points`` decides; here they are ``splits``). Non-trimmable layers (SSM
state, rotating windows) are stored whole only at checkpoints: every multiple of
``checkpoint_every``, the prefix's end, and each branch point (exactly, where it is cut; else
rounded down to the block grid), so a sibling restores there.

Keys are content addresses: a block's is a hash of the model identity digest, its start and
every token up to its end; a checkpoint's of the model identity digest and every token up to
its position. Two prompts that share their first 2,000 tokens therefore name the same blocks,
whatever else differs (template, name, agents file). Where the same tokens have two forms (KV
quantized from a start above token 0: unquantized below it, quantized from it) the key also
names the form, so a record never names a block of the other form. Pure: no mlx, no files.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Collection, Sequence

import xxhash

from kvsnap.key import ModelIdentity, pack_tokens
from kvsnap.prompts import common_prefix_length
from kvsnap.snapshot.format import BLOCK_FORMAT_VERSION

DEFAULT_BLOCK_TOKENS = 256
DEFAULT_CHECKPOINT_EVERY = 1024
MAX_BLOCK_TOKENS = 1 << 20


@dataclass(frozen=True)
class BlockSettings:
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY

    def __post_init__(self) -> None:
        for name in ("block_tokens", "checkpoint_every"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= MAX_BLOCK_TOKENS:
                raise ValueError(
                    f"{name} is {value!r}; give a whole number of tokens from 1 to "
                    f"{MAX_BLOCK_TOKENS}"
                )

    def as_dict(self) -> dict:
        return {"block_tokens": self.block_tokens, "checkpoint_every": self.checkpoint_every}


@dataclass(frozen=True)
class Cut:
    start: int
    end: int
    checkpoint: bool  # non-trimmable layers' state is stored at ``end``


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    return common_prefix_length((a, b))  # the one common-prefix function (C-speed slices)


def branch_points(prefixes: Sequence[Sequence[int]]) -> list[set[int]]:
    """Per prefix, the depths ``0 < d < len`` where another prefix leaves it or ends: the branch
    points of the token trie on its path. Sorted neighbours suffice: the common prefix with a
    farther prefix is the running minimum of the neighbour ones."""
    order = sorted(range(len(prefixes)), key=lambda i: tuple(prefixes[i]))
    adjacent = [_lcp(prefixes[order[j]], prefixes[order[j + 1]]) for j in range(len(order) - 1)]
    out: list[set[int]] = [set() for _ in prefixes]
    for pos, i in enumerate(order):
        n = len(prefixes[i])
        for step in (-1, 1):  # walk left, then right, while something is still shared
            low = n
            j = pos
            while 0 <= j + step < len(order):
                between = adjacent[min(j, j + step)]
                low = min(low, between)
                if low == 0:
                    break
                if low < n:
                    out[i].add(low)
                j += step
    return out


def plan_cuts(
    n_tokens: int, branches: set[int], settings: BlockSettings, splits: Collection[int] = ()
) -> list[Cut]:
    """The chain of a prefix of ``n_tokens``: block boundaries and which of them are checkpoints.

    Without ``splits`` the boundaries depend on ``n_tokens`` and ``settings`` only; ``branches``
    only adds checkpoints, each at the block boundary at or before its branch point. ``splits``
    (branch points the build chose to cut at, so siblings share the head of the block they
    leave) are also boundaries, and checkpoints exactly there; a multiple of ``checkpoint_every``
    less than a block past one is then no checkpoint: the split's serves it, and past a split
    every sibling would store its own."""
    if n_tokens <= 0:
        return []
    b, c = settings.block_tokens, settings.checkpoint_every
    cut = {d for d in splits if 0 < d < n_tokens}
    ends = set(range(b, n_tokens, b)) | set(range(c, n_tokens, c)) | {n_tokens} | cut
    on_grid = {d // b * b for d in branches if 0 < d < n_tokens and d not in cut} - {0}
    every_c = {m for m in range(c, n_tokens, c) if not any(0 < m - d < b for d in cut)}
    checkpoints = on_grid | cut | {n_tokens} | every_c
    cuts, start = [], 0
    for end in sorted(ends):
        cuts.append(Cut(start, end, end in checkpoints))
        start = end
    return cuts


def prefix_digests(tokens: Sequence[int], ends: Sequence[int]) -> list[str]:
    """The digest of ``tokens[:end]`` for every end, in one pass over the tokens."""
    h = xxhash.xxh3_128()
    # the same bytes key.tokens_digest hashes: a whole prefix's digest is its tokens digest
    h.update(b"tokens:int32le:")
    out, done = [], 0
    for end in ends:
        h.update(pack_tokens(tokens[done:end]))
        done = end
        out.append(h.hexdigest())
    return out


QUANTIZED_FORM = "quantized"
UNQUANTIZED_FORM = "unquantized"
KV_FORMS = (QUANTIZED_FORM, UNQUANTIZED_FORM)  # "" (no form in the key): the model has one


def has_two_forms(identity: ModelIdentity) -> bool:
    """Whether a prefix of this model can be stored both ways: mlx-lm quantizes the KV once its
    offset reaches the start, so below a start above 0 it is still unquantized."""
    return identity.kv_bits is not None and (identity.quantized_kv_start or 0) > 0


def is_quantized(layers: Sequence[dict]) -> bool:
    """Whether a state's attention KV is quantized (mlx-lm converts every layer at once)."""
    return any(meta.get("class") == "QuantizedKVCache" for meta in layers)


def kv_form(layers: Sequence[dict], identity: ModelIdentity) -> str:
    """The form a state's blocks and checkpoints are keyed by: "" where the model has one form
    (keys as before forms existed), else quantized or unquantized (bits and group size are in
    the model digest)."""
    if not has_two_forms(identity):
        return ""
    return QUANTIZED_FORM if is_quantized(layers) else UNQUANTIZED_FORM


def kv_form_at(n_tokens: int, identity: ModelIdentity) -> str:
    """The form a prefill of exactly ``n_tokens`` ends in, before it runs: its last step leaves
    the offset at ``n_tokens``, and mlx-lm quantizes once the offset reaches the start."""
    if not has_two_forms(identity):
        return ""
    return QUANTIZED_FORM if n_tokens >= (identity.quantized_kv_start or 0) else UNQUANTIZED_FORM


def _form_suffix(form: str) -> str:
    return f"|{form}" if form else ""


def block_key(model_digest: str, start: int, prefix_digest: str, form: str = "") -> str:
    return xxhash.xxh3_128_hexdigest(
        f"kvsnap-block-v{BLOCK_FORMAT_VERSION}|{model_digest}|{start}|{prefix_digest}"
        f"{_form_suffix(form)}".encode()
    )


def checkpoint_key(model_digest: str, prefix_digest: str, form: str = "") -> str:
    return xxhash.xxh3_128_hexdigest(
        f"kvsnap-checkpoint-v{BLOCK_FORMAT_VERSION}|{model_digest}|{prefix_digest}"
        f"{_form_suffix(form)}".encode()
    )


@dataclass(frozen=True)
class ChainLink:
    start: int
    end: int
    key: str  # the block's
    prefix_digest: str  # of tokens[:end]
    checkpoint_key: str | None  # set where the plan stores a checkpoint (hybrids only)
    form: str = ""  # the state's KV form its keys name ("" where the model has one)


def chain_of(
    model_digest: str,
    tokens: Sequence[int],
    cuts: Sequence[Cut],
    with_checkpoints: bool,
    form: str = "",
) -> list[ChainLink]:
    digests = prefix_digests(tokens, [c.end for c in cuts])
    return [
        ChainLink(
            c.start,
            c.end,
            block_key(model_digest, c.start, d, form),
            d,
            checkpoint_key(model_digest, d, form) if (with_checkpoints and c.checkpoint) else None,
            form,
        )
        for c, d in zip(cuts, digests)
    ]


def without_checkpoint(link: ChainLink) -> ChainLink:
    """``link`` naming no checkpoint (a plan's checkpoint that was not captured)."""
    return replace(link, checkpoint_key=None)


def chain_field(links: Sequence[ChainLink], settings: BlockSettings) -> dict:
    """What a v3 record's ``kvsnap.chain`` holds."""
    return {
        **settings.as_dict(),
        "blocks": [[link.key, link.start, link.end] for link in links],
        "checkpoints": [[link.checkpoint_key, link.end] for link in links if link.checkpoint_key],
    }


def restore_point(
    ends: Sequence[int], checkpoint_ends: Sequence[int], limit: int, needs_checkpoint: bool
) -> int:
    """The longest prefix at or before ``limit`` a chain can restore: any block end for trimmable
    models, the last checkpoint for hybrids (0: nothing)."""
    candidates = sorted(checkpoint_ends if needs_checkpoint else ends)
    i = bisect.bisect_right(candidates, limit)
    return candidates[i - 1] if i else 0
