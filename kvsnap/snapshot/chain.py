"""A v3 record's chain and its parts' headers: the ``kvsnap.chain`` field proven against the
record's own tokens and model, and a block's or checkpoint's header checked against itself.

A chain's blocks tile the record's tokens in order and every key is the one those tokens and
that model give, so a record can name no block of other tokens or models. Every failure is a
FormatError naming the field and its value. No mlx here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsnap.snapshot.blocks import (
    KV_FORMS,
    QUANTIZED_FORM,
    BlockSettings,
    block_key,
    checkpoint_key,
    is_quantized,
    prefix_digests,
)
from kvsnap.snapshot.cache_classes import needs_checkpoints, split_tensor_names
from kvsnap.snapshot.file import FormatError, Header
from kvsnap.snapshot.format import (
    BLOCK_FORMAT_VERSION,
    BLOCK_KIND,
    CHAIN,
    CHECKPOINT_KIND,
    KEY_RE,
    KV_FORM,
    PART_META,
    snapshot_filename,
)
from kvsnap.snapshot.header_fields import DIGITS_RE, check_count, json_field, show
from kvsnap.snapshot.layer_list import RECORD_NAME_BUDGET, check_offsets, checked_layers


@dataclass(frozen=True)
class Chain:
    """A v3 record's blocks ``(key, start, end)`` and checkpoints ``(key, end)``, checked against
    its tokens."""

    block_tokens: int
    checkpoint_every: int
    blocks: tuple[tuple[str, int, int], ...]
    checkpoints: tuple[tuple[str, int], ...]
    # the prefix digest at each block's end (proving the keys computed them)
    digests: tuple[str, ...]

    def digest_at(self, end: int) -> str:
        return self.digests[[b[2] for b in self.blocks].index(end)]

    def spans(self, upto: int) -> list[tuple[str, int, int, str]]:
        """``(key, start, end, prefix digest)`` of the blocks up to ``upto`` tokens."""
        return [
            (key, start, end, d)
            for (key, start, end), d in zip(self.blocks, self.digests)
            if end <= upto
        ]


@dataclass(frozen=True)
class PartInfo:
    """A block's or checkpoint's header, checked against itself (the chain checks it against the
    record)."""

    kind: str
    key: str
    model_digest: str
    start: int
    end: int
    prefix_digest: str
    layers: list | None
    form: str = ""


def parse_chain(
    meta: dict, model_digest: str, tokens: list[int], layers: list, limit: int, form: str = ""
) -> Chain:
    """Parse ``kvsnap.chain`` and prove it: blocks tile [0, n) in order, and every key is the one
    this record's tokens, model and KV ``form`` give, so a record can name no block of other
    tokens, models or forms. A record written before keys named a form (all its keys without
    one) still proves: its parts are checked against its layer list when read."""
    raw = json_field(meta, CHAIN, limit)
    if not isinstance(raw, dict) or set(raw) != {
        "block_tokens",
        "checkpoint_every",
        "blocks",
        "checkpoints",
    }:
        raise FormatError(
            f"{CHAIN} is {show(raw)}, expected an object of block_tokens, checkpoint_every, blocks "
            f"and checkpoints"
        )
    try:
        settings = BlockSettings(raw["block_tokens"], raw["checkpoint_every"])
    except ValueError as exc:
        raise FormatError(f"{CHAIN}: {exc}") from None
    n = len(tokens)
    blocks, checkpoints = raw["blocks"], raw["checkpoints"]
    if (
        not isinstance(blocks, list)
        or not isinstance(checkpoints, list)
        or len(blocks) > max(n, 1)
        or len(checkpoints) > len(blocks)
    ):
        raise FormatError(
            f"{CHAIN}: blocks and checkpoints must be lists, at most one block per token and one "
            f"checkpoint per block"
        )
    ends, start = [], 0
    for i, item in enumerate(blocks):
        if not (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[0], str)
            and KEY_RE.fullmatch(item[0])
        ):
            raise FormatError(f"{CHAIN}.blocks[{i}] is {show(item)}, expected [key, start, end]")
        if (
            check_count(f"{CHAIN}.blocks[{i}][1]", item[1]) != start
            or not start < check_count(f"{CHAIN}.blocks[{i}][2]", item[2], 1, n)
            or item[2] - start > settings.block_tokens
        ):
            raise FormatError(
                f"{CHAIN}.blocks[{i}] covers [{item[1]}, {item[2]}); blocks must tile the {n} "
                f"tokens in order, each at most {settings.block_tokens}"
            )
        ends.append(item[2])
        start = item[2]
    if start != n:
        raise FormatError(f"{CHAIN}: the blocks cover {start} of the record's {n} tokens")
    digests = dict(zip(ends, prefix_digests(tokens, ends)))
    if form and blocks and blocks[0][0] == block_key(model_digest, 0, digests[blocks[0][2]]):
        form = ""  # written before keys named a form: every key of the record must then be so
    for i, item in enumerate(blocks):
        if item[0] != block_key(model_digest, item[1], digests[item[2]], form):
            raise FormatError(
                f"{CHAIN}.blocks[{i}] key {item[0]} is not the key of these tokens [{item[1]}, "
                f"{item[2]}) and this model"
            )
    last = 0
    for i, item in enumerate(checkpoints):
        if not (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and KEY_RE.fullmatch(item[0])
            and item[1] in digests
            and item[1] > last
        ):
            raise FormatError(
                f"{CHAIN}.checkpoints[{i}] is {show(item)}, expected [key, end] at a block end, "
                f"ends increasing"
            )
        if item[0] != checkpoint_key(model_digest, digests[item[1]], form):
            raise FormatError(
                f"{CHAIN}.checkpoints[{i}] key {item[0]} is not the key of these tokens [0, "
                f"{item[1]}) and this model"
            )
        last = item[1]
    if needs_checkpoints(layers) and last != n:
        raise FormatError(
            f"{CHAIN}: the model has layers only a checkpoint restores, and no checkpoint is at "
            f"the record's end ({n})"
        )
    return Chain(
        settings.block_tokens,
        settings.checkpoint_every,
        tuple((b[0], b[1], b[2]) for b in blocks),
        tuple((c[0], c[1]) for c in checkpoints),
        tuple(digests[e] for e in ends),
    )


def inspect_part(path: Path, header: Header) -> PartInfo:
    """Check a block's or checkpoint's header against itself: fields, the key its fields hash to,
    its file name, and its tensors against its layer list (a checkpoint's; a block's when it has
    one)."""
    meta = header.metadata
    missing = [k for k in PART_META if k not in meta]
    if missing:
        raise FormatError(f"not a kvsnap block or checkpoint: metadata lacks {', '.join(missing)}")
    if meta["kvsnap.format"] != str(BLOCK_FORMAT_VERSION):
        raise FormatError(
            f"block format version {meta['kvsnap.format'][:20]!r} is not the supported "
            f"{BLOCK_FORMAT_VERSION}; rebuild the store with this kvsnap"
        )
    kind = meta["kvsnap.kind"]
    if kind not in (BLOCK_KIND, CHECKPOINT_KIND):
        raise FormatError(
            f"kvsnap.kind is {show(kind)}, expected {BLOCK_KIND!r} or {CHECKPOINT_KIND!r}"
        )
    for field in ("kvsnap.key", "kvsnap.model_digest", "kvsnap.prefix_digest"):
        if not KEY_RE.fullmatch(meta[field]):
            raise FormatError(f"{field} is {show(meta[field])}, expected 32 lowercase hex digits")
    for field in ("kvsnap.start", "kvsnap.end"):
        if not DIGITS_RE.fullmatch(meta[field]):
            raise FormatError(f"{field} is {show(meta[field])}, expected a decimal token count")
    start, end = int(meta["kvsnap.start"]), int(meta["kvsnap.end"])
    if not start < end or (kind == CHECKPOINT_KIND and start != 0):
        raise FormatError(f"kvsnap.start {start} and kvsnap.end {end} do not make a {kind}")
    form = meta.get(KV_FORM, "")
    if KV_FORM in meta and form not in KV_FORMS:
        raise FormatError(f"{KV_FORM} is {show(form)}, expected one of {', '.join(KV_FORMS)}")
    key = (
        block_key(meta["kvsnap.model_digest"], start, meta["kvsnap.prefix_digest"], form)
        if kind == BLOCK_KIND
        else checkpoint_key(meta["kvsnap.model_digest"], meta["kvsnap.prefix_digest"], form)
    )
    if key != meta["kvsnap.key"]:
        raise FormatError(f"its fields do not hash to the recorded key {meta['kvsnap.key']}")
    if path.name != snapshot_filename(key):
        raise FormatError(
            f"file name does not match its key {key} (renamed or copied over another {kind})"
        )
    layers = None
    if "kvsnap.layers" in meta:
        layers, _ = checked_layers(
            json_field(meta, "kvsnap.layers", len(header.raw)), RECORD_NAME_BUDGET
        )
        check_offsets(layers, end)
        sliced, whole = split_tensor_names(layers)
        names = set(sliced if kind == BLOCK_KIND else whole)
        if set(header.tensors) != names:
            raise FormatError(
                f"tensors do not match the layer list (missing "
                f"{sorted(names - set(header.tensors))[:3]}, extra "
                f"{sorted(set(header.tensors) - names)[:3]})"
            )
        if form and (form == QUANTIZED_FORM) != is_quantized(layers):
            raise FormatError(f"{KV_FORM} is {form!r}, its layer list says otherwise")
    elif kind == CHECKPOINT_KIND:
        raise FormatError("a checkpoint has no kvsnap.layers")
    return PartInfo(
        kind,
        key,
        meta["kvsnap.model_digest"],
        start,
        end,
        meta["kvsnap.prefix_digest"],
        layers,
        form,
    )
