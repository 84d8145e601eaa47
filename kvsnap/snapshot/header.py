"""What a snapshot's ``__metadata__`` must say, checked field by field before anything is built from it.

The field names and the version are ``format.py``'s. The file layer (``file.parse_header``)
proves the header is bounded JSON with sane tensor offsets; this module checks kvsnap's
own fields: exact-width digests, a decimal token count, an identity that hashes to its
digest, tokens that hash to the key, and a layer list whose every count is bounded *by the
tensors the header really holds* before any name is generated from it (a
``"parts": 10**9`` once built a billion names before the checksum was read). Every failure is a FormatError naming the field and its value.

Layer fields, tensor names and nesting are asked of ``cache_classes`` (one object per mlx-lm
cache class); a class none describes is refused. No mlx here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvsnap.key import ModelIdentity, key_from_digests, tokens_digest_of_bytes, unpack_tokens
from kvsnap.snapshot.blocks import BlockSettings, block_key, checkpoint_key, prefix_digests
from kvsnap.snapshot.cache_classes import UnknownCacheClass, cache_class, member_path, needs_checkpoints, split_tensor_names
from kvsnap.snapshot.file import FormatError, Header, tensor_bytes
from kvsnap.snapshot.format import (
    BLOCK_FORMAT_VERSION, BLOCK_KIND, CHAIN, CHECKPOINT_KIND, FORMAT_VERSION, KEY_RE, PART_META, REQUIRED_META, TOKENS, TOKENS_DTYPE,
    check_format_field, snapshot_filename, snapshot_relpath,
)

DIGITS_RE = re.compile(r"[0-9]{1,12}")  # ASCII only: int() would also take " 7", "7_0" and other scripts' digits

MAX_NAME_CHARS = 4096
MAX_MODEL_JSON = 1 << 20  # the identity; a per-layer quantization config is its largest part
MAX_RECORDED_JSON = 64 << 10
MAX_IDENTITY_FIELDS = 64
MAX_LAYERS = 4096  # per list; real models have under 200
MAX_LAYER_OBJECTS = 65536  # in all, CacheList members included
MAX_CACHE_NESTING = 4  # a CacheList inside a CacheList inside ...
MAX_PARTS = 8  # QuantizedKVCache: packed data, scales, biases
MAX_ARRAYS = 256  # ArraysCache slots (SSM conv + recurrent state: 2)
MAX_COUNT = 2**53
RECORD_NAME_BUDGET = 2 * MAX_PARTS * MAX_LAYERS  # a v3 record holds no layer tensors; its layer list may still name this many
# Tokens a record may hold (4,194,304): checked before any token is read, so a header claiming
# 25M tokens costs nothing; a reader that knows the model bounds it by the model's context.
MAX_TOKENS = 1 << 22

@dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot's header says, after the checks that need no data read."""

    path: Path
    key: str
    name: str
    model_digest: str
    model: dict
    prompt_digest: str
    n_tokens: int
    layers: list
    recorded: dict
    nbytes: int
    tokens: tuple[int, ...] = ()  # read in the same pass as the header: nothing re-reads the file for them
    chain: "Chain | None" = None  # v3: the blocks and checkpoints holding the state; None: a v2 file holds it itself

    @property
    def relpath(self) -> str:
        return snapshot_relpath(self.key)  # the file's name is its key (inspect_header checks)


@dataclass(frozen=True)
class Chain:
    """A v3 record's blocks ``(key, start, end)`` and checkpoints ``(key, end)``, checked against its tokens."""

    block_tokens: int
    checkpoint_every: int
    blocks: tuple[tuple[str, int, int], ...]
    checkpoints: tuple[tuple[str, int], ...]
    digests: tuple[str, ...]  # the prefix digest at each block's end (proving the keys computed them)

    def digest_at(self, end: int) -> str:
        return self.digests[[b[2] for b in self.blocks].index(end)]

    def spans(self, upto: int) -> list[tuple[str, int, int, str]]:
        """``(key, start, end, prefix digest)`` of the blocks up to ``upto`` tokens."""
        return [(key, start, end, d) for (key, start, end), d in zip(self.blocks, self.digests) if end <= upto]


@dataclass(frozen=True)
class PartInfo:
    """A block's or checkpoint's header, checked against itself (the chain checks it against the record)."""

    kind: str
    key: str
    model_digest: str
    start: int
    end: int
    prefix_digest: str
    layers: list | None


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_field(meta: dict, field: str, limit: int) -> object:
    text = meta[field]
    if len(text) > limit:
        raise FormatError(f"{field} is {len(text)} characters, over the {limit} limit")
    try:
        return json.loads(text)
    except RecursionError:
        raise FormatError(f"{field} is nested too deeply") from None
    except ValueError as exc:
        raise FormatError(f"{field} is not valid JSON ({str(exc)[:120]})") from None


def _count(field: str, value: object, low: int = 0, high: int = MAX_COUNT) -> int:
    if type(value) is not int or not low <= value <= high:  # not bool: JSON true is no count
        raise FormatError(f"{field} is {_show(value)}, expected an integer from {low} to {high}")
    return value


# --- the layer list ---------------------------------------------------------------------


class _LayerWalk:
    """Checks a layer list and yields its tensor names, never more than the header holds."""

    def __init__(self, budget: int):
        self.budget = budget  # tensor names the header has room for
        self.names: set[str] = set()
        self.objects = 0

    def add(self, field: str, names: list[str]) -> None:
        if len(self.names) + len(names) > self.budget:
            raise FormatError(f"{field} implies more tensors than the {self.budget} the header holds besides tokens")
        self.names.update(names)

    def layers(self, field: str, layers: object, parent: str | None, depth: int) -> None:
        if not isinstance(layers, list):
            raise FormatError(f"{field} is {_show(layers)}, expected a JSON list of layers")
        if len(layers) > MAX_LAYERS:
            raise FormatError(f"{field} lists {len(layers)} layers, over the {MAX_LAYERS} limit")
        for i, meta in enumerate(layers):
            self.layer(f"{field}[{i}]", meta, str(i) if parent is None else member_path(parent, i), depth)

    def layer(self, field: str, meta: object, path: str, depth: int) -> None:
        self.objects += 1
        if self.objects > MAX_LAYER_OBJECTS:
            raise FormatError(f"kvsnap.layers holds over {MAX_LAYER_OBJECTS} layer objects")
        if not isinstance(meta, dict):
            raise FormatError(f"{field} is {_show(meta)}, expected a JSON object")
        try:
            spec = cache_class(meta.get("class"), f"{field}.class")
        except UnknownCacheClass as exc:
            raise FormatError(f"{exc.reason}; {exc.fix}") from None
        cls = spec.name
        empty = meta.get("empty", False)
        if empty is not False and not (empty is True and spec.can_be_empty):
            raise FormatError(f"{field}.empty is {_show(empty)}, not valid for a {cls} layer")
        allowed = {"class", "empty", *spec.fields, *spec.filled_fields}
        required = set(spec.fields) | (set() if empty else set(spec.filled_fields))
        unknown = sorted(set(meta) - allowed)
        missing = sorted(required - set(meta))
        if unknown or missing:
            raise FormatError(f"{field} ({cls}) has {'unknown field ' + _show(unknown[0]) if unknown else 'no field ' + _show(missing[0])}")
        self.fields(field, meta)
        broken = spec.consistent(meta)
        if broken is not None:
            raise FormatError(f"{field}.{broken}")
        if spec.members_field:
            if depth >= MAX_CACHE_NESTING:
                raise FormatError(f"{field}: {cls} nested more than {MAX_CACHE_NESTING} deep")
            self.layers(f"{field}.{spec.members_field}", spec.members(meta), path, depth + 1)
        self.add(field, spec.tensor_names(meta, path))

    def fields(self, field: str, meta: dict) -> None:
        """Each number in range; the offset is the token count (the state was captured at its boundary)."""
        for name, value in meta.items():
            where = f"{field}.{name}"
            if name in ("class", "empty", "caches"):
                continue
            if name == "present":
                if not isinstance(value, list) or len(value) > MAX_ARRAYS:
                    raise FormatError(f"{where} is {_show(value)}, expected a list of at most {MAX_ARRAYS} slot numbers")
                size = _count(f"{field}.size", meta["size"], 0, MAX_ARRAYS)
                for j in value:
                    _count(where, j, 0, size - 1)
                if value != sorted(set(value)):
                    raise FormatError(f"{where} is {_show(value)}, expected increasing slot numbers without repeats")
            elif name == "parts":
                _count(where, value, 1, min(MAX_PARTS, self.budget))
            elif name == "bits":
                _count(where, value, 1, 8)
            elif name == "size":
                _count(where, value, 0, MAX_ARRAYS)
            else:
                _count(where, value)


def expected_tensor_names(layers: object, budget: int) -> set[str]:
    """The tensor names a layer list implies; FormatError (field and value) if any field is off or they outnumber ``budget``."""
    walk = _LayerWalk(budget)
    walk.layers("kvsnap.layers", layers, None, 0)
    return walk.names


def check_offsets(layers: list, n_tokens: int, field: str = "kvsnap.layers") -> None:
    """Every layer's offset is the token count: a state is captured exactly at its tokens.

    Run after the checksum (a flipped digit is reported as the corruption it is); this
    catches a header that is consistent but lies. ``layers`` was checked by ``expected_tensor_names``.
    """
    for i, meta in enumerate(layers):
        spec = cache_class(meta["class"])
        if spec.members_field:
            check_offsets(spec.members(meta), n_tokens, f"{field}[{i}].{spec.members_field}")
        elif "offset" in meta and meta["offset"] != n_tokens:
            raise FormatError(f"{field}[{i}].offset is {meta['offset']}, but the snapshot holds {n_tokens} tokens (a state is captured exactly at its tokens)")


# --- identity, tokens, recorded -----------------------------------------------------------


def _identity(meta: dict) -> tuple[dict, ModelIdentity]:
    model = _json_field(meta, "kvsnap.model", MAX_MODEL_JSON)
    if not isinstance(model, dict) or len(model) > MAX_IDENTITY_FIELDS:
        raise FormatError(f"kvsnap.model is {_show(model)}, expected an object of at most {MAX_IDENTITY_FIELDS} identity fields")
    for name, value in model.items():
        where = f"kvsnap.model.{name}"
        if name == "layout":
            if not isinstance(value, list) or len(value) > MAX_LAYERS or not all(isinstance(c, str) and len(c) <= 64 for c in value):
                raise FormatError(f"{where} is {_show(value)}, expected a list of at most {MAX_LAYERS} cache class names")
        elif value is not None and not isinstance(value, str):
            _count(where, value)
    try:
        identity = ModelIdentity.from_dict(model)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"kvsnap.model is not a model identity ({type(exc).__name__}: {str(exc)[:120]})") from None
    if identity.digest != meta["kvsnap.model_digest"]:
        raise FormatError("model identity does not hash to the recorded model digest (edited header?)")
    return model, identity


def key_of(identity: ModelIdentity, prompt_digest: str, tokens_digest: str, n_tokens: int) -> str:
    """``key.snapshot_key`` from a tokens digest (one formula: ``key.key_from_digests``)."""
    return key_from_digests(identity.digest, prompt_digest, tokens_digest, n_tokens)


def _recorded(meta: dict) -> dict:
    if "kvsnap.recorded" not in meta:
        return {}
    recorded = _json_field(meta, "kvsnap.recorded", MAX_RECORDED_JSON)
    if not isinstance(recorded, dict):
        raise FormatError(f"kvsnap.recorded is {_show(recorded)}, expected a JSON object")
    for name, value in recorded.items():
        if not (value is None or isinstance(value, (str, int, float, bool))):
            raise FormatError(f"kvsnap.recorded.{name} is {_show(value)}, expected a string or a number")
    if not isinstance(recorded.get("created", ""), str):
        raise FormatError(f"kvsnap.recorded.created is {_show(recorded['created'])}, expected a date string")
    return recorded


def _chain(meta: dict, model_digest: str, tokens: list[int], layers: list, limit: int) -> Chain:
    """Parse ``kvsnap.chain`` and prove it: blocks tile [0, n) in order, and every key is the one
    this record's tokens and model give, so a record can name no block of other tokens or models."""
    raw = _json_field(meta, CHAIN, limit)
    if not isinstance(raw, dict) or set(raw) != {"block_tokens", "checkpoint_every", "blocks", "checkpoints"}:
        raise FormatError(f"{CHAIN} is {_show(raw)}, expected an object of block_tokens, checkpoint_every, blocks and checkpoints")
    try:
        settings = BlockSettings(raw["block_tokens"], raw["checkpoint_every"])
    except ValueError as exc:
        raise FormatError(f"{CHAIN}: {exc}") from None
    n = len(tokens)
    blocks, checkpoints = raw["blocks"], raw["checkpoints"]
    if not isinstance(blocks, list) or not isinstance(checkpoints, list) or len(blocks) > max(n, 1) or len(checkpoints) > len(blocks):
        raise FormatError(f"{CHAIN}: blocks and checkpoints must be lists, at most one block per token and one checkpoint per block")
    ends, start = [], 0
    for i, item in enumerate(blocks):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and KEY_RE.fullmatch(item[0])):
            raise FormatError(f"{CHAIN}.blocks[{i}] is {_show(item)}, expected [key, start, end]")
        if _count(f"{CHAIN}.blocks[{i}][1]", item[1]) != start or not start < _count(f"{CHAIN}.blocks[{i}][2]", item[2], 1, n) or item[2] - start > settings.block_tokens:
            raise FormatError(f"{CHAIN}.blocks[{i}] covers [{item[1]}, {item[2]}); blocks must tile the {n} tokens in order, each at most {settings.block_tokens}")
        ends.append(item[2])
        start = item[2]
    if start != n:
        raise FormatError(f"{CHAIN}: the blocks cover {start} of the record's {n} tokens")
    digests = dict(zip(ends, prefix_digests(tokens, ends)))
    for i, item in enumerate(blocks):
        if item[0] != block_key(model_digest, item[1], digests[item[2]]):
            raise FormatError(f"{CHAIN}.blocks[{i}] key {item[0]} is not the key of these tokens [{item[1]}, {item[2]}) and this model")
    last = 0
    for i, item in enumerate(checkpoints):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and KEY_RE.fullmatch(item[0]) and item[1] in digests and item[1] > last):
            raise FormatError(f"{CHAIN}.checkpoints[{i}] is {_show(item)}, expected [key, end] at a block end, ends increasing")
        if item[0] != checkpoint_key(model_digest, digests[item[1]]):
            raise FormatError(f"{CHAIN}.checkpoints[{i}] key {item[0]} is not the key of these tokens [0, {item[1]}) and this model")
        last = item[1]
    if needs_checkpoints(layers) and last != n:
        raise FormatError(f"{CHAIN}: the model has layers only a checkpoint restores, and no checkpoint is at the record's end ({n})")
    return Chain(settings.block_tokens, settings.checkpoint_every, tuple((b[0], b[1], b[2]) for b in blocks), tuple((c[0], c[1]) for c in checkpoints), tuple(digests[e] for e in ends))


def inspect_part(path: Path, header: Header) -> PartInfo:
    """Check a block's or checkpoint's header against itself: fields, the key its fields hash to,
    its file name, and its tensors against its layer list (a checkpoint's; a block's when it has one)."""
    meta = header.metadata
    missing = [k for k in PART_META if k not in meta]
    if missing:
        raise FormatError(f"not a kvsnap block or checkpoint: metadata lacks {', '.join(missing)}")
    if meta["kvsnap.format"] != str(BLOCK_FORMAT_VERSION):
        raise FormatError(f"block format version {meta['kvsnap.format'][:20]!r} is not the supported {BLOCK_FORMAT_VERSION}; rebuild the store with this kvsnap")
    kind = meta["kvsnap.kind"]
    if kind not in (BLOCK_KIND, CHECKPOINT_KIND):
        raise FormatError(f"kvsnap.kind is {_show(kind)}, expected {BLOCK_KIND!r} or {CHECKPOINT_KIND!r}")
    for field in ("kvsnap.key", "kvsnap.model_digest", "kvsnap.prefix_digest"):
        if not KEY_RE.fullmatch(meta[field]):
            raise FormatError(f"{field} is {_show(meta[field])}, expected 32 lowercase hex digits")
    for field in ("kvsnap.start", "kvsnap.end"):
        if not DIGITS_RE.fullmatch(meta[field]):
            raise FormatError(f"{field} is {_show(meta[field])}, expected a decimal token count")
    start, end = int(meta["kvsnap.start"]), int(meta["kvsnap.end"])
    if not start < end or (kind == CHECKPOINT_KIND and start != 0):
        raise FormatError(f"kvsnap.start {start} and kvsnap.end {end} do not make a {kind}")
    key = block_key(meta["kvsnap.model_digest"], start, meta["kvsnap.prefix_digest"]) if kind == BLOCK_KIND else checkpoint_key(meta["kvsnap.model_digest"], meta["kvsnap.prefix_digest"])
    if key != meta["kvsnap.key"]:
        raise FormatError(f"its fields do not hash to the recorded key {meta['kvsnap.key']}")
    if path.name != snapshot_filename(key):
        raise FormatError(f"file name does not match its key {key} (renamed or copied over another {kind})")
    layers = None
    if "kvsnap.layers" in meta:
        layers = _json_field(meta, "kvsnap.layers", len(header.raw))
        expected_tensor_names(layers, RECORD_NAME_BUDGET)
        check_offsets(layers, end)
        sliced, whole = split_tensor_names(layers)
        names = set(sliced if kind == BLOCK_KIND else whole)
        if set(header.tensors) != names:
            raise FormatError(f"tensors do not match the layer list (missing {sorted(names - set(header.tensors))[:3]}, extra {sorted(set(header.tensors) - names)[:3]})")
    elif kind == CHECKPOINT_KIND:
        raise FormatError("a checkpoint has no kvsnap.layers")
    return PartInfo(kind, key, meta["kvsnap.model_digest"], start, end, meta["kvsnap.prefix_digest"], layers)


def check_token_count(header: Header, max_tokens: int = MAX_TOKENS) -> int:
    """The header's token count, refused over ``max_tokens`` before a token is read."""
    if "kvsnap.n_tokens" not in header.metadata:  # a file that is not ours says so, not "n_tokens is ''"
        raise FormatError("not a kvsnap snapshot: metadata lacks kvsnap.n_tokens")
    raw = header.metadata["kvsnap.n_tokens"]
    if not DIGITS_RE.fullmatch(raw):
        raise FormatError(f"kvsnap.n_tokens is {_show(raw)}, expected a decimal token count")
    n = int(raw)
    if n > max_tokens:
        raise FormatError(
            f"kvsnap.n_tokens is {n}, over the {max_tokens} a record may hold here (kvsnap's limit is {MAX_TOKENS}, "
            "and the model's context when it is known); a prefix that long cannot be served: rebuild the store for this model"
        )
    return n


def inspect_header(path: Path, header: Header, tokens_raw: bytes | None = None, max_tokens: int = MAX_TOKENS) -> SnapshotInfo:
    """Check a header's identity fields against themselves and the tokens; no checksum yet.

    ``tokens_raw``: the ``tokens`` tensor's bytes when the caller already holds them (read
    through the descriptor it parsed the header from); else they are read here, after the
    token count was bounded by ``max_tokens``."""
    meta = header.metadata
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise FormatError(f"not a kvsnap snapshot: metadata lacks {', '.join(missing)}")
    wrong_version = check_format_field(meta["kvsnap.format"])
    if wrong_version:
        raise FormatError(wrong_version)
    for field in ("kvsnap.key", "kvsnap.model_digest", "kvsnap.prompt_digest", "kvsnap.tokens_digest"):
        if not KEY_RE.fullmatch(meta[field]):
            raise FormatError(f"{field} is {_show(meta[field])}, expected 32 lowercase hex digits")
    n_tokens = check_token_count(header, max_tokens)
    name = meta.get("kvsnap.name", "")
    if len(name) > MAX_NAME_CHARS:
        raise FormatError(f"kvsnap.name is {len(name)} characters, over the {MAX_NAME_CHARS} limit")
    model, identity = _identity(meta)
    tok = header.tensors.get(TOKENS)
    if tok is None or tok.dtype != TOKENS_DTYPE or tok.shape != (n_tokens,):
        raise FormatError(f"tokens tensor missing or not int32[{n_tokens}]")
    if tokens_raw is None:
        tokens_raw = tensor_bytes(path, header, TOKENS)
    if len(tokens_raw) != tok.nbytes or tokens_digest_of_bytes(tokens_raw) != meta["kvsnap.tokens_digest"]:
        raise FormatError("tokens do not match the recorded tokens digest")
    key = key_of(identity, meta["kvsnap.prompt_digest"], meta["kvsnap.tokens_digest"], n_tokens)
    if key != meta["kvsnap.key"]:
        raise FormatError("tokens and identity do not hash to the recorded key")
    if path.name != snapshot_filename(key):
        raise FormatError(f"file name does not match its key {key} (renamed or copied over another snapshot)")
    layers = _json_field(meta, "kvsnap.layers", len(header.raw))
    names = set(header.tensors) - {TOKENS}
    record = meta["kvsnap.format"] == str(FORMAT_VERSION)
    if record != (CHAIN in meta):
        raise FormatError(f"format {meta['kvsnap.format']} " + ("needs" if record else "cannot have") + f" a {CHAIN}")
    expected = expected_tensor_names(layers, RECORD_NAME_BUDGET if record else len(names))
    if names != (set() if record else expected):
        raise FormatError(f"tensors do not match the layer list (missing {sorted(expected - names)[:3]}, extra {sorted(names - expected)[:3]})")
    tokens = unpack_tokens(bytes(tokens_raw))
    chain = _chain(meta, meta["kvsnap.model_digest"], tokens, layers, len(header.raw)) if record else None
    return SnapshotInfo(
        path=path,
        key=key,
        name=name,
        model_digest=meta["kvsnap.model_digest"],
        model=model,
        prompt_digest=meta["kvsnap.prompt_digest"],
        n_tokens=n_tokens,
        layers=layers,
        recorded=_recorded(meta),
        nbytes=header.file_size,
        tokens=tuple(tokens),
        chain=chain,
    )
