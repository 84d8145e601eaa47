"""What a snapshot's ``__metadata__`` must say, checked field by field before anything is built
from it.

The field names and the version are ``format.py``'s. The file layer (``file.parse_header``)
proves the header is bounded JSON with sane tensor offsets; this module checks kvsnap's
own fields: exact-width digests, a decimal token count, an identity that hashes to its
digest, tokens that hash to the key, the layer list (``layer_list.py``) and a v3 record's
chain (``chain.py``). Every failure is a FormatError naming the field and its value. No mlx here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsnap.key import ModelIdentity, key_from_digests, tokens_digest_of_bytes, unpack_tokens
from kvsnap.snapshot.blocks import kv_form
from kvsnap.snapshot.chain import Chain, parse_chain
from kvsnap.snapshot.file import FormatError, Header, tensor_bytes
from kvsnap.snapshot.format import (
    CHAIN,
    FORMAT_VERSION,
    KEY_RE,
    REQUIRED_META,
    TENANT,
    TOKENS,
    TOKENS_DTYPE,
    check_format_field,
    snapshot_filename,
    snapshot_relpath,
)
from kvsnap.snapshot.header_fields import DIGITS_RE, check_count, json_field, show
from kvsnap.snapshot.layer_list import MAX_LAYERS, RECORD_NAME_BUDGET, checked_layers

MAX_NAME_CHARS = 4096
MAX_MODEL_JSON = 1 << 20  # the identity; a per-layer quantization config is its largest part
MAX_RECORDED_JSON = 64 << 10
MAX_IDENTITY_FIELDS = 64
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
    # read in the same pass as the header: nothing re-reads the file for them
    tokens: tuple[int, ...] = ()
    # v3: the blocks and checkpoints holding the state; None: a v2 file holds it itself
    chain: Chain | None = None
    # a conversation record's kvsnap.tenant (its API key's digest); "": none (an agent's
    # record, a keyless request's, or one written before the field)
    tenant: str = ""

    @property
    def relpath(self) -> str:
        return snapshot_relpath(self.key)  # the file's name is its key (inspect_header checks)


def _identity(meta: dict) -> tuple[dict, ModelIdentity]:
    model = json_field(meta, "kvsnap.model", MAX_MODEL_JSON)
    if not isinstance(model, dict) or len(model) > MAX_IDENTITY_FIELDS:
        raise FormatError(
            f"kvsnap.model is {show(model)}, expected an object of at most {MAX_IDENTITY_FIELDS} "
            f"identity fields"
        )
    for name, value in model.items():
        where = f"kvsnap.model.{name}"
        if name == "layout":
            if (
                not isinstance(value, list)
                or len(value) > MAX_LAYERS
                or not all(isinstance(c, str) and len(c) <= 64 for c in value)
            ):
                raise FormatError(
                    f"{where} is {show(value)}, expected a list of at most {MAX_LAYERS} cache "
                    f"class names"
                )
        elif value is not None and not isinstance(value, str):
            check_count(where, value)
    try:
        identity = ModelIdentity.from_dict(model)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(
            f"kvsnap.model is not a model identity ({type(exc).__name__}: {str(exc)[:120]})"
        ) from None
    if identity.digest != meta["kvsnap.model_digest"]:
        raise FormatError(
            "model identity does not hash to the recorded model digest (edited header?)"
        )
    return model, identity


def key_of(identity: ModelIdentity, prompt_digest: str, tokens_digest: str, n_tokens: int) -> str:
    """``key.snapshot_key`` from a tokens digest (one formula: ``key.key_from_digests``)."""
    return key_from_digests(identity.digest, prompt_digest, tokens_digest, n_tokens)


def _recorded(meta: dict) -> dict:
    if "kvsnap.recorded" not in meta:
        return {}
    recorded = json_field(meta, "kvsnap.recorded", MAX_RECORDED_JSON)
    if not isinstance(recorded, dict):
        raise FormatError(f"kvsnap.recorded is {show(recorded)}, expected a JSON object")
    for name, value in recorded.items():
        if not (value is None or isinstance(value, (str, int, float, bool))):
            raise FormatError(
                f"kvsnap.recorded.{name} is {show(value)}, expected a string or a number"
            )
    if not isinstance(recorded.get("created", ""), str):
        raise FormatError(
            f"kvsnap.recorded.created is {show(recorded['created'])}, expected a date string"
        )
    return recorded


def check_token_count(header: Header, max_tokens: int = MAX_TOKENS) -> int:
    """The header's token count, refused over ``max_tokens`` before a token is read."""
    # a file that is not ours says so, not "n_tokens is ''"
    if "kvsnap.n_tokens" not in header.metadata:
        raise FormatError("not a kvsnap snapshot: metadata lacks kvsnap.n_tokens")
    raw = header.metadata["kvsnap.n_tokens"]
    if not DIGITS_RE.fullmatch(raw):
        raise FormatError(f"kvsnap.n_tokens is {show(raw)}, expected a decimal token count")
    n = int(raw)
    if n > max_tokens:
        raise FormatError(
            f"kvsnap.n_tokens is {n}, over the {max_tokens} a record may hold here (kvsnap's limit "
            f"is {MAX_TOKENS}, "
            "and the model's context when it is known); a prefix that long cannot be served: "
            "rebuild the store for this model"
        )
    return n


def inspect_header(
    path: Path, header: Header, tokens_raw: bytes | None = None, max_tokens: int = MAX_TOKENS
) -> SnapshotInfo:
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
    for field in (
        "kvsnap.key",
        "kvsnap.model_digest",
        "kvsnap.prompt_digest",
        "kvsnap.tokens_digest",
    ):
        if not KEY_RE.fullmatch(meta[field]):
            raise FormatError(f"{field} is {show(meta[field])}, expected 32 lowercase hex digits")
    tenant = meta.get(TENANT, "")
    if TENANT in meta and not KEY_RE.fullmatch(tenant):
        raise FormatError(f"{TENANT} is {show(tenant)}, expected 32 lowercase hex digits")
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
    if (
        len(tokens_raw) != tok.nbytes
        or tokens_digest_of_bytes(tokens_raw) != meta["kvsnap.tokens_digest"]
    ):
        raise FormatError("tokens do not match the recorded tokens digest")
    key = key_of(identity, meta["kvsnap.prompt_digest"], meta["kvsnap.tokens_digest"], n_tokens)
    if key != meta["kvsnap.key"]:
        raise FormatError("tokens and identity do not hash to the recorded key")
    if path.name != snapshot_filename(key):
        raise FormatError(
            f"file name does not match its key {key} (renamed or copied over another snapshot)"
        )
    raw_layers = json_field(meta, "kvsnap.layers", len(header.raw))
    names = set(header.tensors) - {TOKENS}
    record = meta["kvsnap.format"] == str(FORMAT_VERSION)
    if record != (CHAIN in meta):
        raise FormatError(
            f"format {meta['kvsnap.format']} "
            + ("needs" if record else "cannot have")
            + f" a {CHAIN}"
        )
    layers, expected = checked_layers(raw_layers, RECORD_NAME_BUDGET if record else len(names))
    if names != (set() if record else expected):
        raise FormatError(
            f"tensors do not match the layer list (missing {sorted(expected - names)[:3]}, extra "
            f"{sorted(names - expected)[:3]})"
        )
    tokens = unpack_tokens(bytes(tokens_raw))
    chain = (
        parse_chain(
            meta,
            meta["kvsnap.model_digest"],
            tokens,
            layers,
            len(header.raw),
            kv_form(layers, identity),
        )
        if record
        else None
    )
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
        tenant=tenant,
    )
