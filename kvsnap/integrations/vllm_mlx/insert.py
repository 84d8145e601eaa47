"""``kvsnap vllm-mlx serve --kv-snapshots``: the store's snapshots of the running model, checked,
decoded and handed to vllm-mlx's ``MemoryAwarePrefixCache`` through its own ``store``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvsnap.errors import KvsnapError, SnapshotError

log = logging.getLogger("kvsnap.vllm_mlx")
PROBE_TEXT = "kvsnap probe: hello"


@dataclass
class InsertReport:
    store: str = ""
    inserted: int = 0
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skip(self, path: Any, reason: str) -> None:
        self.skipped.append((str(path), reason))
        log.warning("[kvsnap] skipped snapshot %s: %s", path, reason)

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    def summary(self) -> str:
        return (
            f"[kvsnap] Warm start from {self.store}: {self.inserted} snapshot(s) inserted into "
            f"vllm-mlx's prefix cache "
            f"({self.tokens} tokens, {self.nbytes / 2**20:.1f} MiB) in {self.seconds:.2f}s, 0 "
            f"tokens prefilled; "
            f"{len(self.skipped)} skipped"
        )


def prepended_special_tokens(tokenizer: Any) -> list[int]:
    """Tokens vllm-mlx's ``tokenizer.encode(prompt)`` puts in front of what the template rendered.

    kvsnap tokenizes rendered prompts without special tokens (the template carries BOS);
    vllm-mlx encodes with the tokenizer's defaults. Where those prepend a BOS, no kvsnap
    snapshot can be a prefix of a vllm-mlx request.
    """
    try:
        full = list(tokenizer.encode(PROBE_TEXT))
        plain = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
    except TypeError:
        return []
    if not plain or full[: len(plain)] == plain:
        return []
    for start in range(1, len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return full[: max(0, len(full) - len(plain))]


def reads_enable_thinking(tokenizer: Any) -> bool:
    """Whether the chat template renders differently with ``enable_thinking`` on and off."""
    from kvsnap.chat import render_messages

    probe = [{"role": "user", "content": "hi"}]
    try:
        return render_messages(
            tokenizer, probe, None, {"enable_thinking": True}
        ) != render_messages(tokenizer, probe, None, {"enable_thinking": False})
    except KvsnapError:
        return False


def insert_snapshots(
    prefix_cache: Any,
    model: Any,
    tokenizer: Any,
    model_path: str,
    store: Any,
    digests: Any = None,
    pins: Any = None,
    enable_thinking: bool = True,
) -> InsertReport:
    """Put every snapshot of this model into vllm-mlx's ``MemoryAwarePrefixCache``; never prefills.

    ``pins``: where inserted keys are pinned against eviction (``vllm_mlx.pin``).
    ``enable_thinking``: what this vllm-mlx renders with, for the warning on snapshots
    built for kvsnap serve's rendering. Runs on the thread that owns the model (mlx
    arrays belong to a thread's stream).
    """
    from kvsnap.integrations.common.warm_plan import upstream_model
    from kvsnap.runtime.cache.shapes import ModelShapes
    from kvsnap.runtime.warmup.prefetch import context_tokens

    t0 = time.perf_counter()
    report = InsertReport(store=str(store.root))
    # A hub id: the same cached files vllm-mlx loaded.
    lm = upstream_model(model_path, model, tokenizer)
    model_dir = lm.path
    identity = lm.identity(digests)
    # Every state is checked against it before vllm-mlx sees it.
    shapes = ModelShapes(lm)
    good, bad = store.scan(identity, max_tokens=context_tokens(model_dir))
    for problem in bad:
        report.skip(problem.path, problem.reason)
    config = getattr(prefix_cache, "_config", None)
    min_tokens = int(getattr(config, "min_prefix_tokens", 1) or 1)
    for info in sorted(
        usable_renderings(good, tokenizer, enable_thinking, report), key=lambda i: (i.name, i.key)
    ):
        if info.n_tokens < min_tokens:
            report.skip(
                info.path,
                f"holds {info.n_tokens} tokens, under vllm-mlx's minimum reusable prefix of "
                f"{min_tokens} tokens",
            )
            continue
        insert_one(prefix_cache, store, identity, info, pins, report, shapes)
    report.seconds = time.perf_counter() - t0
    return report


def usable_renderings(
    good: list, tokenizer: Any, enable_thinking: bool, report: InsertReport
) -> list:
    """The snapshots whose rendering a vllm-mlx request can match; the rest skipped, doubtful ones
    warned about."""
    from kvsnap.profiles import recorded_tokenization

    lead = prepended_special_tokens(tokenizer)
    thinking_matters = None
    usable = []
    for info in good:
        built_for = recorded_tokenization(info.recorded)
        if built_for is not None and built_for.get("server") == "vllm-mlx":
            built_thinking = (built_for.get("template_defaults") or {}).get("enable_thinking")
            if built_thinking is not None and built_thinking != enable_thinking:
                log.warning(
                    "[kvsnap] snapshot %s (%s) was built for vllm-mlx rendering with "
                    "enable_thinking=%s, this vllm-mlx renders with %s: it matches only where the "
                    "template ignores it; rebuild with the MODEL name you serve (`kvsnap build … "
                    "--for vllm-mlx --served-model-name NAME`)",
                    info.path.name,
                    info.name or "unnamed",
                    built_thinking,
                    enable_thinking,
                )
            usable.append(info)
            continue
        # Built for kvsnap serve's rendering: template tokens only, the entry's own kwargs.
        if lead:
            report.skip(
                info.path,
                f"built for kvsnap serve's tokenization (template tokens only), but vllm-mlx "
                f"encodes every prompt with the tokenizer's special tokens, which puts {lead} in "
                f"front of the template's own, so no request could match; rebuild with `kvsnap "
                f"build … --for vllm-mlx`",
            )
            continue
        if thinking_matters is None:
            thinking_matters = reads_enable_thinking(tokenizer)
        if thinking_matters:
            log.warning(
                "[kvsnap] snapshot %s (%s) was built for kvsnap serve's rendering; this vllm-mlx "
                "renders with enable_thinking=%s, so it matches only if the agents file set that "
                "in chat_template_kwargs; build with `kvsnap build … --for vllm-mlx` to be sure",
                info.path.name,
                info.name or "unnamed",
                enable_thinking,
            )
        usable.append(info)
    return usable


def insert_one(
    prefix_cache: Any,
    store: Any,
    identity: Any,
    info: Any,
    pins: Any,
    report: InsertReport,
    shapes: Any,
) -> None:
    """Read, check (``shapes``: the model's ``ModelShapes``) and decode one snapshot and hand it
    to vllm-mlx's cache, within its budget."""
    from kvsnap.integrations.common.warm_plan import checked_state
    from kvsnap.snapshot.codec import cache_nbytes_of

    limit = float(getattr(prefix_cache, "memory_limit_mb", float("inf"))) * 2**20
    used = float(getattr(prefix_cache, "memory_usage_mb", 0.0)) * 2**20
    if used + info.nbytes > limit:
        report.skip(
            info.path,
            f"does not fit vllm-mlx's prefix-cache budget ({used / 2**20:.1f} of "
            f"{limit / 2**20:.1f} MiB used, needs {info.nbytes / 2**20:.1f} MiB); raise "
            f"--cache-memory-mb",
        )
        return
    try:
        state = checked_state(store, info, identity, shapes)
        tokens = store.read_tokens(info)
    except SnapshotError as exc:
        report.skip(exc.path, exc.reason)
        return
    nbytes = cache_nbytes_of(state)
    # The cache's own store: it copies the arrays (detached from ours) and indexes the tokens.
    # evict_prefixes=False: a snapshot never evicts another that is its prefix.
    if not prefix_cache.store(list(tokens), state, evict_prefixes=False):
        report.skip(info.path, "vllm-mlx's prefix cache refused it (its log line above says why)")
        return
    if pins is not None:
        pins.add(tokens)
    report.inserted += 1
    report.tokens += len(tokens)
    report.nbytes += nbytes
    report.names.append(info.name)
    log.info(
        "[kvsnap] inserted %s (%s, %d tokens, %.1f MiB)",
        info.path.name,
        info.name or "unnamed",
        len(tokens),
        nbytes / 2**20,
    )
