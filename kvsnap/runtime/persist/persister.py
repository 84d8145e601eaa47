"""``--persist-requests``: the engine's side of persisted request prefixes. Engine thread.

A captured request prefix is noted at capture (``captured``) and, after the decode step
that evaluates it (``pump``), cut on the store's block grid: only the blocks the store lacks
(and a hybrid's checkpoint at the end) are copied to the host and handed to the writer
thread with the record's header. A request whose namespace has a persisted record longer
than what memory holds gets it indexed first (``offer``): it loads on that first hit,
like a snapshot. The record's key binds the namespace's tag, so no other namespace finds it.

Damage never spreads: a record that fails its checks at lookup (torn, flipped, forged) is
warned about once, counted in ``load_errors`` and passed over for the next-longest one (the
next write of that conversation replaces it); a block or checkpoint a load found bad is
copied again at the next capture reaching it, and the writer rewrites it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

from kvsnap.errors import SnapshotError, StoreError
from kvsnap.key import ModelIdentity, tokens_digest
from kvsnap.runtime.cache.composed import BlockPool
from kvsnap.runtime.cache.prefix import Entry, PrefixCache
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.persist.options import PersistOptions, TierOptions
from kvsnap.runtime.persist.shared_tier import SharedTier, TierPush
from kvsnap.snapshot.blocks import (
    BlockSettings,
    ChainLink,
    Cut,
    chain_field,
    chain_of,
    kv_form,
    plan_cuts,
    without_checkpoint,
)
from kvsnap.store.conversation_writer import ConversationWrite, ConversationWriter, PartWrite
from kvsnap.store.conversations import (
    ConversationIndex,
    conversation_digest,
    longest_persisted,
    namespace_tag,
    namespace_tenant,
    read_parts,
    record_key,
    record_path,
    store_secret,
    tenant_digest,
)
from kvsnap.store.fileio import check_store_folders, probe_writable
from kvsnap.store.local import Store

log = logging.getLogger("kvsnap.persist")

PERSISTED = "persisted"  # an Entry's source: a conversation record from the store
MAX_UNREADABLE = 64  # records found unreadable, remembered (warned once, skipped by lookups)
MAX_PASSED_OVER = 8  # unreadable records one lookup passes over before it gives up


@dataclass
class Persister:
    store: Store  # the engine's (reads)
    identity: ModelIdentity
    secret: bytes
    writer: ConversationWriter
    recorded: dict  # the records' kvsnap.recorded
    options: PersistOptions
    settings: BlockSettings = field(default_factory=BlockSettings)
    index: ConversationIndex | None = None
    pending: list = field(default_factory=list)  # (entry, tokens of the entries it extends)
    # the engine's cache, given at construction: persisted records are indexed into it
    # (``offer``), and a warm entry's end is a block end too, so its last block is shared
    prefix: PrefixCache | None = None
    disk_hits: int = 0  # records indexed for a request (each loads on that hit)
    load_errors: int = 0
    unreadable: dict = field(default_factory=dict)  # record key -> its token count
    failed_loads: dict = field(default_factory=dict)  # the same, of records a load failed on
    tier: SharedTier | None = None  # --shared-tier: written behind, fetched on a local miss
    # the engine's blocks: a persisted record loads as blocks shared with every state using them
    pool: BlockPool | None = None

    @classmethod
    def open(
        cls,
        store: Store,
        lm: LoadedModel,
        identity: ModelIdentity,
        options: PersistOptions,
        pool: BlockPool | None = None,
        prefix: PrefixCache | None = None,
    ) -> Persister:
        """Start persisting into ``store`` (writable); StoreError if its secret is unusable.
        ``prefix``: the engine's prefix cache (None: the vllm-mlx route, which looks records
        up itself)."""
        from kvsnap.faults import FaultHook
        from kvsnap.runtime.persist.writeback import recorded_fields

        writable = Store.open(store.root, fault=FaultHook.from_env())
        with writable.lock():  # a gc removes temp files: never the secret's before its link
            secret = store_secret(store.root, store.fsync)
        writer = ConversationWriter(
            writable, max_bytes=options.max_bytes, max_queued=options.max_queued
        )
        persister = cls(
            store=store,
            identity=identity,
            secret=secret,
            writer=writer,
            recorded=recorded_fields(lm.settings),
            options=options,
            index=ConversationIndex(store.root),
            pool=pool,
            prefix=prefix,
        )
        if options.shared_tier is not None:
            persister.tier = persister._open_tier(options.shared_tier)
            writer.on_written = persister._write_behind
        writer.start()
        return persister

    def _open_tier(self, options: TierOptions) -> SharedTier:
        from kvsnap.store.tier_backends import open_backend

        index = self.index
        return SharedTier(
            open_backend(options.spec, options.budget_s),
            options,
            self.identity,
            self.store.root,
            local_conv_digest=self._digest,
            local_tenant=lambda ns: tenant_digest(self.secret, namespace_tenant(ns)),
            on_fetched=index.forget if index is not None else lambda: None,
        )

    def _write_behind(self, write: ConversationWrite) -> None:
        """The writer's thread, once ``write``'s record is on disk: the tier gets it next (the
        writer calls it only with a tier, for writes that name their namespace)."""
        assert self.tier is not None and write.namespace is not None
        meta = write.metadata
        self.tier.push(
            TierPush(
                namespace=write.namespace,
                local_key=write.key,
                n_tokens=int(meta["kvsnap.n_tokens"]),
                tokens_digest=meta["kvsnap.tokens_digest"],
                reaches=list(write.reaches),
                nbytes=write.nbytes,
            )
        )

    def _digest(self, namespace: str) -> str:
        return conversation_digest(namespace_tag(self.secret, namespace))

    def _key(self, namespace: str, tokens: Sequence[int]) -> str:
        return record_key(
            self.identity.digest, self._digest(namespace), tokens_digest(tokens), len(tokens)
        )

    # --- capture ----------------------------------------------------------------------------

    def captured(
        self,
        entry: Entry,
        extends: Sequence[tuple[int, ...]],
        computed: int = 0,
        seconds: float = 0.0,
    ) -> None:
        """A request prefix was just captured (its arrays may be evaluated only after the next
        decode step): persist it at the next ``pump``. ``computed`` tokens were prefilled in
        ``seconds`` for it (the tier weighs a fetch against that rate)."""
        self.pending.append((entry, extends))
        if self.tier is not None:
            self.tier.note_prefill(computed, seconds)

    def pump(self) -> None:
        """Hand the captured prefixes to the writer: the new blocks copied to the host."""
        from kvsnap.snapshot.codec import CaptureError

        items, self.pending = self.pending, []
        if self.writer.stats.disabled:  # disk full: no work on the serving path for nothing
            return
        copied: set[str] = set()  # parts already copied in this pump: written by the first
        for entry, extends in items:
            try:
                write = self._prepare(entry, extends, copied)
            except (CaptureError, SnapshotError, StoreError, ValueError, RuntimeError) as exc:
                log.warning("[kvsnap] a request prefix is not persisted: %s", exc)
                continue
            if write is not None:
                self.writer.submit(write)

    def _prepare(
        self, entry: Entry, extends: Sequence[tuple[int, ...]], copied: set[str]
    ) -> ConversationWrite | None:
        from kvsnap.snapshot.cache_classes import needs_checkpoints, split_tensor_names
        from kvsnap.snapshot.codec import encode_cache, to_out_tensors
        from kvsnap.snapshot.format import BLOCK_KIND, CHECKPOINT_KIND, TOKENS
        from kvsnap.store.paths import has_part
        from kvsnap.store.writing import block_metadata, checkpoint_metadata

        namespace, tokens, digest = entry.namespace or "", entry.tokens, self.identity.digest
        conv_digest = self._digest(namespace)
        tdigest = tokens_digest(tokens)
        key = record_key(digest, conv_digest, tdigest, len(tokens))
        # Persisted already: the writer refreshes its last use if it is sound, else rewrites it.
        self.unreadable.pop(key, None)
        bad = self.writer.health.bad_parts()  # copied again, and rewritten
        arrays, layers = encode_cache(entry.state, tokens)
        hybrid = needs_checkpoints(layers)
        warm_ends = self.prefix.shared_ends(tokens) if self.prefix is not None else []
        cuts = _cuts(len(tokens), warm_ends, self.settings)
        # keyed by the state's KV form: a prefix captured before the quantization start is
        # unquantized, one past it quantized, and a record names only blocks of its own form
        links = _end_checkpoint_only(
            chain_of(digest, tokens, cuts, hybrid, kv_form(layers, self.identity))
        )
        sliced, whole = split_tensor_names(layers)
        parts = []
        after = None  # the tier's keeper is storing parts of this record: written after it
        for link in links:
            block = (BLOCK_KIND, link.key)
            kept = self.tier.keeping(*block) if self.tier is not None else None
            if kept is not None and block not in bad and not kept.is_set():
                after = kept  # fetched, in memory, being stored: not copied again
            elif link.key not in copied and (block in bad or not has_part(self.store, *block)):
                copied.add(link.key)
                sl = {name: arrays[name][..., link.start : link.end, :] for name in sliced}
                meta = block_metadata(link, digest, layers, dense=not hybrid)
                parts.append(
                    PartWrite(BLOCK_KIND, link.key, to_out_tensors(sl), meta, block in bad)
                )
            checkpoint = (CHECKPOINT_KIND, link.checkpoint_key or "")
            if link.checkpoint_key and (checkpoint in bad or not has_part(self.store, *checkpoint)):
                meta = checkpoint_metadata(link, digest, layers)
                whole_state = {name: arrays[name] for name in whole}
                parts.append(
                    PartWrite(
                        CHECKPOINT_KIND,
                        link.checkpoint_key,
                        to_out_tensors(whole_state),
                        meta,
                        checkpoint in bad,
                    )
                )
        chain = chain_field(links, self.settings)
        # the key's digest, whatever the cache_salt: the budget's unit (kvsnap.tenant)
        tenant = tenant_digest(self.secret, namespace_tenant(namespace))
        metadata = _record_header(
            self.identity, key, conv_digest, tokens, tdigest, layers, self.recorded, chain, tenant
        )
        reaches = [(BLOCK_KIND, link.key) for link in links] + [
            (CHECKPOINT_KIND, link.checkpoint_key) for link in links if link.checkpoint_key
        ]
        # a longer record serves all they did
        supersedes = tuple(
            self._key(namespace, older)
            for older in dict.fromkeys(extends)
            if entry.trimmable and 0 < len(older) < len(tokens)
        )
        if self.tier is not None:
            self.tier.note_local(key)
        return ConversationWrite(
            key=key,
            tensors=to_out_tensors({TOKENS: arrays[TOKENS]}),
            metadata=metadata,
            parts=parts,
            reaches=reaches,
            supersedes=supersedes,
            nbytes=sum(len(t.data) for p in parts for t in p.tensors),
            damaged=self._damaged_prefixes(conv_digest, tokens),
            namespace=namespace if self.tier is not None else None,
            after=after,
        )

    def _damaged_prefixes(self, conv_digest: str, tokens: Sequence[int]) -> list[str]:
        """Keys of the records found unreadable that hold a strict prefix of ``tokens`` in
        this namespace: the record of ``tokens`` serves all they did (the writer removes them)."""
        found = []
        for known in (self.unreadable, self.failed_loads):
            covered = [
                key
                for key, n in known.items()
                if n < len(tokens)
                and key
                == record_key(self.identity.digest, conv_digest, tokens_digest(tokens[:n]), n)
            ]
            for key in covered:
                del known[key]
            found += covered
        return found

    # --- lookup -----------------------------------------------------------------------------

    def offer(self, tokens: Sequence[int], namespace: str) -> None:
        """Index the namespace's longest persisted record for ``tokens`` into the prefix cache
        when it is longer than what memory holds; it loads on this request's fetch."""
        from kvsnap.runtime.cache.entries import fetched_loader, snapshot_loader
        from kvsnap.snapshot.cache_classes import layers_trimmable

        prefix = self.prefix
        assert prefix is not None, "offer needs the persister built with the engine's cache"
        match = prefix.lookup(tokens, namespace)
        above = match.n_cached if match else 0
        fetched = self.tier.take_fresh(tokens, namespace, above) if self.tier else None
        if fetched is not None:  # just fetched from the tier: its parts load from memory
            info = fetched.info
            load = fetched_loader(
                self.store, info, fetched.parts, self.pool, prefix.check_state, fetched.buffers
            )
        else:
            info = self.persisted_for(tokens, namespace, above)
            if info is None:
                return
            # as pooled blocks: the request's kept prefix shares them (nothing assembled)
            load = snapshot_loader(self.store, info, pool=self.pool, check=prefix.check_state)

        def loader():
            try:
                loaded = load()
            except (SnapshotError, OSError):  # reported by the cache; a longer record replaces it
                _remember(self.failed_loads, info.key, info.n_tokens)
                raise
            self.writer.health.mark_good(read_parts(info))  # checked as they were read
            return loaded

        prefix.add(
            Entry(
                tokens=tuple(info.tokens),
                state=None,
                nbytes=info.nbytes,
                trimmable=layers_trimmable(info.layers, str(info.path)),
                pinned=False,
                source=PERSISTED,
                name="",
                key=info.key,
                loader=loader,
                namespace=namespace,
            )
        )

    def persisted_for(self, tokens: Sequence[int], namespace: str, above: int):
        """The header (``SnapshotInfo``, tokens read) of the namespace's longest sound
        persisted record holding more than ``above`` tokens of ``tokens`` (at least one left to
        compute), or None; a hit is recorded as a use. A record that fails its checks (torn,
        damaged, forged) is passed over for the next-longest: warned once, counted in
        ``load_errors``."""
        keys = self.index.current() if self.index is not None else set()
        if not keys:
            return None
        conv_digest = self._digest(namespace)
        for _ in range(MAX_PASSED_OVER):
            found = longest_persisted(
                keys, self.identity.digest, conv_digest, tokens, above, exclude=self.unreadable
            )
            if found is None:
                return None
            n, key = found
            path = record_path(self.store.root, key)
            try:
                info = self._checked_record(path, n, conv_digest, tokens)
            except SnapshotError as exc:
                if os.path.lexists(path):
                    self._unreadable(key, n, exc)
                else:  # removed meanwhile (superseded, evicted)
                    keys.discard(key)
                continue
            self.disk_hits += 1
            self.writer.touch(key)
            return info
        return None

    def _checked_record(self, path, n: int, conv_digest: str, tokens: Sequence[int]):
        """The record's header, its checksum checked (a small file: its tokens and chain), and
        its tokens, namespace and model equal to what its name promised; else SnapshotError."""
        from kvsnap.snapshot.file import FormatError, check_data, read_header

        info = self.store.inspect(path, max_tokens=n)
        try:
            check_data(path, read_header(path))
        except FormatError as exc:
            raise SnapshotError(str(path), str(exc)) from None
        except OSError as exc:
            raise SnapshotError(str(path), f"cannot be read ({exc.strerror or exc})") from None
        if (
            info.prompt_digest != conv_digest
            or info.model_digest != self.identity.digest
            or tuple(info.tokens) != tuple(tokens[:n])
        ):  # the key said so; the header must too (a forged file, or a hash collision)
            raise SnapshotError(
                str(path), "holds another prefix than its file name's key", "delete it"
            )
        return info

    def _unreadable(self, key: str, n: int, exc: SnapshotError) -> None:
        _remember(self.unreadable, key, n)
        self.load_errors += 1
        log.warning(
            "[kvsnap] persisted conversation %s not used: %s; a shorter record of it is tried, "
            "and its next persisted turn replaces it",
            exc.path,
            exc.reason,
        )

    def load_error(self, where: str, exc: BaseException) -> None:
        """A persisted record failed to load on its hit (removed meanwhile, or bad): the
        request prefills instead."""
        self.load_errors += 1
        self.part_failed(exc)
        log.warning("[kvsnap] persisted conversation %s not used: %s", where, exc)

    def part_failed(self, exc: BaseException) -> None:
        """A load failed on a block or checkpoint (the error names its file): the next capture
        reaching it copies it and the writer rewrites it; till then no record names it."""
        from kvsnap.store.paths import part_of_path

        where = getattr(exc, "path", None) or getattr(exc, "filename", None)
        part = part_of_path(self.store, where) if isinstance(where, str) else None
        if part is not None:
            self.writer.health.mark_bad(*part)

    # --- admin and shutdown -----------------------------------------------------------------

    def purge(self, timeout: float = 60.0) -> int | None:
        """Forget what was captured and remove every persisted conversation."""
        self.pending.clear()
        removed = self.writer.purge(timeout)
        if self.index is not None:
            self.index.forget()
        return removed

    def close(self) -> int:
        self.pump()
        left = self.writer.close(self.options.flush_timeout_s)
        if self.tier is not None:  # what the writer put is written behind, within the bound
            self.tier.close(self.options.flush_timeout_s)
        return left

    def as_dict(self) -> dict:
        return {
            "enabled": True,
            **self.writer.as_dict(),
            "disk_hits": self.disk_hits,
            "load_errors": self.load_errors,
            "max_bytes": self.options.max_bytes,
            "shared_tier": self.tier.as_dict() if self.tier is not None else {"enabled": False},
        }


def _remember(known: dict, key: str, n: int) -> None:
    """Note a record that failed (key -> token count), the oldest forgotten past the bound."""
    if key not in known and len(known) >= MAX_UNREADABLE:
        del known[next(iter(known))]
    known[key] = n


def _cuts(n: int, extra_ends: Sequence[int], settings: BlockSettings) -> list[Cut]:
    """The block grid of ``n`` tokens, also cut where a warm entry ends: that agent's partial
    last block (its record's) is then the conversation's too, not a second copy of its
    tokens in a block of the conversation's own."""
    base = plan_cuts(n, set(), settings)
    checkpoints = {c.end for c in base if c.checkpoint}
    ends = sorted({c.end for c in base} | {e for e in extra_ends if 0 < e < n})
    cuts, start = [], 0
    for end in ends:
        cuts.append(Cut(start, end, end in checkpoints))
        start = end
    return cuts


def _end_checkpoint_only(links: list[ChainLink]) -> list[ChainLink]:
    """A request prefix is captured at its end only: the chain names no other checkpoint."""
    n = links[-1].end if links else 0
    return [
        link if link.end == n or link.checkpoint_key is None else without_checkpoint(link)
        for link in links
    ]


def _record_header(
    identity: ModelIdentity,
    key: str,
    conv_digest: str,
    tokens: Sequence[int],
    tdigest: str,
    layers: list,
    recorded: dict,
    chain: dict,
    tenant: str,
) -> dict[str, str]:
    from kvsnap.snapshot.format import header_metadata

    return header_metadata(
        key=key,
        name="",
        model=identity.as_dict(),
        model_digest=identity.digest,
        prompt_digest=conv_digest,
        n_tokens=len(tokens),
        tokens_digest=tdigest,
        layers=layers,
        recorded=recorded,
        chain=chain,
        tenant=tenant,
    )


def start_persister(
    options: PersistOptions,
    store: Store | None,
    lm: LoadedModel,
    identity: ModelIdentity,
    pool: BlockPool | None = None,
    prefix: PrefixCache | None = None,
) -> tuple[Persister | None, str]:
    """The persister, or None and why not (the server serves on, persisting nothing).
    ``prefix``: the engine's prefix cache, which the persister indexes records into."""
    if store is None:
        return None, "no store (--kv-snapshots DIR) to persist into"
    try:
        # The budget and DELETE must be able to remove what is written: never through a link.
        check_store_folders(store.root)
    except StoreError as exc:
        log.warning("[kvsnap] request prefixes are not persisted: %s", exc)
        return None, str(exc)
    why = probe_writable(store.root, store.fault)
    if why is not None:
        note = f"{store.root} is not writable here ({why}): request prefixes are not persisted"
        log.warning("[kvsnap] %s", note)
        return None, note
    try:
        persister = Persister.open(store, lm, identity, options, pool, prefix)
    except (OSError, StoreError) as exc:
        log.warning("[kvsnap] request prefixes are not persisted: %s", exc)
        return None, str(exc)
    log.info(
        "[kvsnap] persisting request prefixes into %s (budget %.1f GiB)",
        store.root,
        options.max_bytes / 2**30,
    )
    return persister, ""
