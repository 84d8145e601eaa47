"""``--warm-prompts`` under ``kvsnap vllm-mlx serve --kv-snapshots``: warm prefixes from the store.

For each warm-prompt entry: the warm prefix as vllm-mlx tokenizes that agent's requests
(``EngineTokenization``), its key, the store's snapshot when it has one, else one prefill
with kvsnap's ``prefill`` on the model vllm-mlx loaded, captured exactly at the prefix
boundary and written back when the store is writable. Every warm entry goes into
vllm-mlx's prefix cache through its own ``store`` and is pinned there. The same pass runs
at start and for each re-warm after ``DELETE /v1/cache/prefix``.

Runs on the thread that owns the model (mlx arrays belong to a thread's stream).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvsnap.chat import Tokenization
from kvsnap.errors import KvsnapError, SnapshotError, StoreError
from kvsnap.prompts import WarmPromptSet

log = logging.getLogger("kvsnap.vllm_mlx")


@dataclass
class AgentResult:
    name: str
    source: str  # snapshot | prefilled | skipped
    tokens: int = 0
    key: str = ""
    written: bool = False
    reason: str = ""


def upstream_model(model_name: str, model: Any, tokenizer: Any) -> Any:
    """The model an upstream server (vllm-mlx, mlx_lm.server) loaded, as kvsnap's LoadedModel:
    its folder (a hub id: the cached files it loaded) and config beside the live objects. Its
    live KV is mlx-lm's default cache: no KV quantization, no bound."""
    from kvsnap.key import KVSettings, read_config
    from kvsnap.runtime.model.loading import LoadedModel
    from kvsnap.runtime.model.source import resolve_model

    model_dir = resolve_model(model_name).path
    return LoadedModel(
        path=model_dir,
        model=model,
        tokenizer=tokenizer,
        config=read_config(model_dir),
        settings=KVSettings(),
    )


@dataclass
class WarmReport:
    """What one warm-up (or re-warm) did; tests and ``GET /v1/kvsnap/status`` read this, not the
    log."""

    completed: int = 0
    skipped: int = 0
    from_snapshots: int = 0
    prefilled: int = 0
    written: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    agents: list[AgentResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        from kvsnap.runtime.warmup.report import warmup_line

        return warmup_line(self)

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        log.warning("[kvsnap] %s", text)

    def skip(self, name: str, reason: str, tokens: int = 0) -> None:
        self.skipped += 1
        self.agents.append(AgentResult(name=name, source="skipped", tokens=tokens, reason=reason))
        log.warning("[kvsnap] warm prompt %s skipped: %s", name, reason)

    def as_dict(self) -> dict:
        return asdict(self)


def checked_state(store: Any, info: Any, identity: Any, shapes: Any) -> list:
    """One snapshot read and decoded; a SnapshotError (naming file and tensor) when its tensors
    are not this model's cache: a forged block would otherwise fail mlx-lm's generation step."""
    from kvsnap.runtime.warmup.entries import SHAPE_FIX
    from kvsnap.snapshot.codec import decode_cache

    arrays = store.load_arrays(info, identity)
    why = shapes.problem(arrays)  # before decoding: the arrays are what a forger wrote
    if why:
        raise SnapshotError(str(info.path), why, SHAPE_FIX)
    return decode_cache(arrays, info.layers)


@dataclass
class WarmPlan:
    """Everything a warm-up needs, fixed at start; ``run`` may be called again for each re-warm."""

    prefix_cache: Any  # vllm-mlx's MemoryAwarePrefixCache
    pins: Any  # vllm_mlx_pin.Pins, or None where the cache cannot be pinned
    lm: Any  # kvsnap LoadedModel around the model vllm-mlx loaded
    identity: Any  # its ModelIdentity
    store: Any  # kvsnap Store
    writable: bool
    prompts: WarmPromptSet
    agents_file: str
    tokenization: Tokenization
    shapes: Any = None  # runtime.state_shapes.ModelShapes of ``lm``, learned on first use

    def run(self) -> WarmReport:
        from kvsnap.runtime.warmup.prefetch import context_tokens

        t0 = time.perf_counter()
        report = WarmReport()
        for problem in self.prompts.problems:
            report.skip(f"entry {problem.index}", str(problem))
        # Foreign and broken files (and records longer than the context): not ours to report
        # per entry.
        infos, _bad = self.store.scan(self.identity, max_tokens=context_tokens(self.lm.path))
        by_key = {info.key: info for info in infos}
        for prompt in self.prompts.entries:
            found = self._warm_prefix(prompt, report)
            if found is None:
                continue
            tokens, digest, key = found
            info = by_key.get(key) or self._same_tokens(infos, tokens)
            state = self._restore(prompt, info, report) if info is not None else None
            source, written = "snapshot", False
            if state is None:
                self._warn_other_renderings(prompt, infos, key, info, report)
                state, source = self._prefill(tokens), "prefilled"
                report.prefilled += 1
                written = self._write_back(prompt, digest, tokens, state, report)
            if self._insert(prompt.name, tokens, state, report):
                report.completed += 1
                report.prompt_tokens += len(tokens)
                report.from_snapshots += source == "snapshot"
                report.agents.append(
                    AgentResult(
                        name=prompt.name,
                        source=source,
                        tokens=len(tokens),
                        key=key,
                        written=written,
                    )
                )
                log.info(
                    "[kvsnap] warm prompt %s: %d tokens %s",
                    prompt.name,
                    len(tokens),
                    "from snapshot " + key
                    if source == "snapshot"
                    else "prefilled" + (", written back as " + key if written else ""),
                )
            del state
        report.seconds = time.perf_counter() - t0
        return report

    def _warm_prefix(self, prompt, report: WarmReport) -> tuple[tuple, str, str] | None:
        """(tokens, prompt digest, key) as vllm-mlx tokenizes this agent; None (and a skip) when it
        cannot be warmed."""
        from kvsnap.runtime.warmup.recipe import warm_key

        try:
            warm = warm_key(self.lm.tokenizer, self.identity, prompt, self.tokenization)
        except KvsnapError as exc:
            report.skip(prompt.name, str(exc))
            return None
        # vllm-mlx's own rendering raises jinja's and its own types: one entry must not
        # stop the rest
        except Exception as exc:
            report.skip(prompt.name, f"vllm-mlx cannot render it ({type(exc).__name__}: {exc})")
            return None
        tokens = warm.tokens
        config = getattr(self.prefix_cache, "_config", None)
        min_tokens = int(getattr(config, "min_prefix_tokens", 1) or 1)
        if len(tokens) < min_tokens:
            report.skip(
                prompt.name,
                f"its warm prefix holds {len(tokens)} tokens, under vllm-mlx's minimum reusable "
                f"prefix of {min_tokens} tokens",
                len(tokens),
            )
            return None
        return tokens, warm.prompt_digest, warm.key

    def _restore(self, prompt, info, report: WarmReport) -> list | None:
        from kvsnap.runtime.model.shapes import ModelShapes

        if self.shapes is None:
            self.shapes = ModelShapes(self.lm)
        try:
            return checked_state(self.store, info, self.identity, self.shapes)
        except SnapshotError as exc:
            report.warn(
                f"{prompt.name}: snapshot {exc.path} cannot be used ({exc.reason}); prefilling "
                f"instead"
            )
            return None

    def _warn_other_renderings(
        self, prompt, infos: list, key: str, info, report: WarmReport
    ) -> None:
        """Say so when this agent's snapshot exists but was keyed for another server's rendering."""
        from kvsnap.profiles import describe, recorded_tokenization

        for other in infos:
            if other.name == prompt.name and other.key != key and other is not info:
                report.warn(
                    f"{prompt.name}: snapshot {other.path.name} was built for a rendering vllm-mlx "
                    f"will not use "
                    f"({describe(recorded_tokenization(other.recorded))}; this server tokenizes as "
                    f"{describe(self.tokenization.descriptor())}); "
                    "prefilling instead; build for it with `kvsnap build … --for vllm-mlx`"
                )

    def _prefill(self, tokens: tuple) -> list:
        from kvsnap.runtime.prefill.chunked import prefill
        from kvsnap.snapshot.codec import check_captured_at

        state = prefill(self.lm, tokens)
        check_captured_at(state, len(tokens))
        return state

    def _write_back(
        self, prompt, digest: str, tokens: tuple, state: list, report: WarmReport
    ) -> bool:
        from kvsnap.runtime.persist.writeback import commit_snapshot

        if not self.writable:
            return False
        try:
            commit_snapshot(
                self.lm,
                self.store,
                self.identity,
                prompt,
                digest,
                tokens,
                state,
                self.agents_file,
                tokenization=self.tokenization.descriptor(),
            )
        except (StoreError, SnapshotError, OSError) as exc:
            report.warn(
                f"{prompt.name}: write-back to {self.store.root} failed ({exc}); served from "
                f"memory only"
            )
            return False
        report.written += 1
        return True

    def _insert(self, name: str, tokens: tuple, state: list, report: WarmReport) -> bool:
        # vllm-mlx's own insert copies the arrays; evict_prefixes=False: never evict another warm
        # entry.
        if not self.prefix_cache.store(list(tokens), state, evict_prefixes=False):
            report.skip(
                name,
                f"vllm-mlx's prefix cache refused it ({len(tokens)} tokens; "
                f"{self.prefix_cache.memory_usage_mb:.1f} of "
                f"{self.prefix_cache.memory_limit_mb:.1f} MiB used): raise --cache-memory-mb",
                len(tokens),
            )
            return False
        if self.pins is not None:
            self.pins.add(tokens)
        return True

    def _same_tokens(self, infos: list, tokens: tuple) -> Any:
        """A snapshot of this model holding exactly these tokens, whatever rendering it was keyed
        for.

        The KV state depends only on the model identity (already matched) and the tokens, so
        a snapshot built for kvsnap serve whose tokens equal vllm-mlx's is exactly right here.
        """
        for info in infos:
            if info.n_tokens != len(tokens):
                continue
            try:
                if tuple(self.store.read_tokens(info)) == tuple(tokens):
                    return info
            except SnapshotError as exc:
                log.debug("[kvsnap] %s: %s", exc.path, exc.reason)
        return None
