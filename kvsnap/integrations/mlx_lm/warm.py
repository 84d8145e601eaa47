"""``warm_prompt_cache``: the one public function that warms mlx_lm.server from a kvsnap store.

``kvsnap mlx-lm serve`` and the patched ``mlx_lm.server --kv-snapshots``
(contrib/mlx-lm/) both call it from mlx-lm's ``run``, in place of
``LRUPromptCache(args.prompt_cache_size)``, before the generation thread starts and
before the port opens. It loads mlx-lm's default model (so the generation thread finds it
loaded), puts the store's matching snapshots into a ``PinnedPromptCache`` as protected
``system`` entries and returns that cache. With ``warm_prompts`` only those entries are
warmed: each from its snapshot, else prefilled once with kvsnap's ``prefill`` on the model
mlx-lm loaded, captured at the exact prefix boundary, and written back to a writable store.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvsnap.errors import KvsnapError, SnapshotError, UsageError
from kvsnap.integrations.common.store import open_store
from kvsnap.integrations.common.warm_plan import (
    StateSource,
    WarmPlan,
    WarmReport,
    load_warm_prompt_file,
    upstream_model,
)
from kvsnap.profiles import describe, mlx_lm_tokenization, recorded_tokenization
from kvsnap.prompts import WarmPrompt

if TYPE_CHECKING:
    from kvsnap.store.local import SnapshotInfo

log = logging.getLogger("kvsnap.mlx_lm")


def check_cli_args(args: Any) -> None:
    """mlx_lm.server settings under which a store's snapshots are valid; else a UsageError."""
    problems = []
    if getattr(args, "adapter_path", None):
        problems.append("drop --adapter-path (an adapter changes the weights the snapshots hold)")
    if getattr(args, "draft_model", None):
        problems.append("drop --draft-model (its cache layers are not in the snapshots)")
    if getattr(args, "kv_bits", None) is not None:
        problems.append("drop --kv-bits (the snapshots hold full-precision KV)")
    # The snapshots hold the tokens of the model's own template; another renders other tokens.
    if getattr(args, "chat_template", None):
        problems.append(
            "drop --chat-template (the snapshots hold the model's own chat template's tokens: "
            "no request rendered with another template would hit; put the template in the "
            "model's tokenizer_config.json and rebuild instead)"
        )
    if getattr(args, "use_default_chat_template", False):
        problems.append(
            "drop --use-default-chat-template (the snapshots hold the model's own chat "
            "template's tokens, not the tokenizer's default template's)"
        )
    if getattr(args, "model", None) is None:
        problems.append("add --model MODEL (the snapshots are loaded for mlx-lm's default model)")
    if problems:
        raise UsageError(
            "--kv-snapshots cannot work with these mlx_lm.server options: " + "; ".join(problems)
        )


@dataclass
class InsertReport(WarmReport):
    """``--kv-snapshots`` alone: every snapshot of the model, as read from the store."""

    nbytes: int = 0
    rejected: list[str] = field(default_factory=list)


@dataclass
class MlxLmWarmPlan(WarmPlan):
    """The shared warm plan, pinning into mlx_lm.server's prompt cache (``PinnedPromptCache``)
    under ``model_key``, mlx-lm's key of the loaded model."""

    route_name = "mlx_lm.server"
    build_for = "mlx-lm"

    model_key: Any = None

    def _min_prefix_tokens(self) -> int:
        # mlx-lm reuses any cached prefix of a prompt.
        return 1

    def _insert(self, name: str, tokens: tuple, state: list, report: WarmReport) -> bool:
        self.prefix_cache.pin(self.model_key, list(tokens), state)
        return True

    def _warn_other_renderings(
        self,
        prompt: WarmPrompt,
        infos: list[SnapshotInfo],
        key: str,
        info: SnapshotInfo | None,
        report: WarmReport,
    ) -> None:
        server = self.tokenization.descriptor()
        for other in infos:
            if other.name == prompt.name and other.key != key and other is not info:
                recorded = recorded_tokenization(other.recorded)
                report.warn(
                    f"{prompt.name}: snapshot {other.path.name} {other_profile(recorded, server)}"
                    "; prefilling instead"
                )


def _rendering(descriptor: dict | None) -> tuple:
    """What decides the tokens: kvsnap serve's profile (None) renders as mlx-lm's without args."""
    d = descriptor or {}
    return bool(d.get("add_special_tokens")), d.get("template_defaults") or {}, d.get("text")


def other_profile(recorded: dict | None, server: dict | None) -> str:
    """Why a snapshot built for ``recorded`` may not match this server, and how to rebuild."""
    args = (server or {}).get("template_defaults") or {}
    fix = "--for mlx-lm" + (f" --chat-template-args '{json.dumps(args)}'" if args else "")
    return (
        f"was built for {describe(recorded)} tokenization, but this mlx_lm.server tokenizes as "
        f"{describe(server)}; rebuild it with `kvsnap build … {fix}`"
    )


def pin_store(
    cache: Any,
    model_key: Any,
    store: Any,
    identity: Any,
    lm: Any,
    tokenization: Any = None,
    source: StateSource | None = None,
) -> InsertReport:
    """Pin every snapshot of this model (its own tokens); foreign and broken files, records longer
    than ``lm``'s context and states that are not its cache's shapes are skipped. A snapshot built
    for another profile than ``tokenization`` (the server's) is pinned with a warning. ``source``
    reads each (a sharded rank: its slice, the entries agreed by every rank, rank 0's order)."""
    from kvsnap.runtime.cache.shapes import ModelShapes
    from kvsnap.runtime.warmup.prefetch import context_tokens
    from kvsnap.snapshot.codec import cache_nbytes_of

    source = source or StateSource()
    t0 = time.perf_counter()
    report = InsertReport(quiet=source.quiet)
    shapes = ModelShapes(lm)
    good, bad = store.scan(identity, max_tokens=context_tokens(lm.path))
    report.rejected = [f"{p.path}: {p.reason}" for p in bad]
    server = (tokenization or mlx_lm_tokenization()).descriptor()

    def other(info) -> bool:
        return _rendering(recorded_tokenization(info.recorded)) != _rendering(server)

    # This server's profile first: a record of the same tokens built for another is then skipped.
    good.sort(key=lambda i: (other(i), i.name, i.key))
    order, seen = [], set()
    for info in good:
        try:
            tokens = tuple(store.read_tokens(info))
        except SnapshotError as exc:
            report.skip(info.name or info.path.name, f"{exc.path}: {exc.reason}")
            continue
        if tokens not in seen:
            seen.add(tokens)
            order.append((info, tokens))
    by_key = {info.key: (info, tokens) for info, tokens in order}
    keys = source.candidates([info.key for info, _ in order])
    loaded: list = []
    for key in keys:
        info, tokens = by_key.get(key, (None, ()))
        state, reason = None, None
        if info is not None:
            try:
                state = source.load(store, info, identity, shapes)
            except SnapshotError as exc:
                reason = f"{exc.path}: {exc.reason}"
                report.skip(info.name or info.path.name, reason)
        loaded.append((info, tokens, state, reason))
    verdict = source.agree([info for info, *_ in loaded], [reason for *_, reason in loaded])
    for use, (info, tokens, state, _) in zip(verdict, loaded):
        if not use or state is None:
            continue
        if other(info):  # pinned anyway: its tokens may still start some requests
            report.warn(
                f"{info.name or info.path.name}: snapshot {info.path.name} "
                f"{other_profile(recorded_tokenization(info.recorded), server)}; its "
                "requests may not start with its tokens (then no hit)"
            )
        cache.pin(model_key, list(tokens), state)
        report.completed += 1
        report.from_snapshots += 1
        report.prompt_tokens += len(tokens)
        report.nbytes += cache_nbytes_of(state)
    report.seconds = time.perf_counter() - t0
    return report


def warm_prompt_cache(
    model_provider: Any, kv_snapshots: str | None = None, warm_prompts: str | None = None
) -> Any:
    """mlx_lm.server's prompt cache, warm from the store ``kv_snapshots`` (a folder or oci://…).

    ``kv_snapshots`` and ``warm_prompts`` default to ``model_provider.cli_args``'
    ``kv_snapshots`` / ``warm_prompts`` (the patched server's flags). Runs on the thread
    that calls mlx-lm's ``run``, before its generation thread starts. Called that way (by the
    patched server), a refused option or store ends the process with one line, as argparse
    does; ``kvsnap mlx-lm serve`` passes both and reports kvsnap's errors itself.
    """
    if kv_snapshots is not None or warm_prompts is not None:
        return _warm_prompt_cache(model_provider, kv_snapshots, warm_prompts)
    try:
        return _warm_prompt_cache(model_provider, None, None)
    except KvsnapError as exc:
        print(f"mlx_lm.server: error: {exc}", file=sys.stderr)
        raise SystemExit(2 if isinstance(exc, UsageError) else 1) from None


def _warm_prompt_cache(
    model_provider: Any, kv_snapshots: str | None, warm_prompts: str | None
) -> Any:
    from kvsnap.integrations.mlx_lm.cache import AgreedPromptCache, PinnedPromptCache
    from kvsnap.integrations.mlx_lm.sharded import ShardedSource
    from kvsnap.runtime.model.loading import default_digest_cache
    from kvsnap.runtime.model.sharded import logical_layout
    from kvsnap.runtime.sharding.agreement import agree_identity, elect_writers
    from kvsnap.runtime.sharding.ranks import RankGroup
    from kvsnap.runtime.sharding.topology import shard_view_of

    args = model_provider.cli_args
    kv_snapshots = kv_snapshots or getattr(args, "kv_snapshots", None)
    warm_prompts = warm_prompts or getattr(args, "warm_prompts", None)
    ranks = RankGroup.world()
    # Sharded, every rank must evict alike, snapshots or not: rank 0 decides.
    cache = (
        AgreedPromptCache(ranks, args.prompt_cache_size)
        if ranks.sharded
        else PinnedPromptCache(args.prompt_cache_size)
    )
    if not kv_snapshots:
        if warm_prompts:
            raise UsageError(
                f"--warm-prompts {warm_prompts} needs --kv-snapshots DIR "
                "(the store its entries are read from and written back to)"
            )
        return cache
    check_cli_args(args)
    prompts = load_warm_prompt_file(warm_prompts) if warm_prompts else None
    store, writable = open_store(kv_snapshots, want_write=prompts is not None)
    model_provider.load_default()  # here, not on the generation thread: the port opens warm
    model_key = model_provider.model_key
    lm = upstream_model(model_key[0], model_provider.model, model_provider.tokenizer)
    source = StateSource()
    view = shard_view_of(lm.model, ranks)
    if view is not None:
        # The whole model's layout, so keys do not depend on the topology.
        lm = replace(lm, logical_layout=logical_layout(lm.path, lm.settings.max_kv_size))
        local_root = getattr(store, "root", None) if writable else None
        source = ShardedSource(ranks, view)
        source.writes = elect_writers(ranks, local_root, writable and prompts is not None)
    identity = lm.identity(default_digest_cache())
    if view is not None:
        agree_identity(ranks, identity, str(model_key[0]))
    tokenization = mlx_lm_tokenization(getattr(args, "chat_template_args", None))
    report: WarmReport
    if prompts is None:
        report = pin_store(cache, model_key, store, identity, lm, tokenization, source)
    else:
        plan = MlxLmWarmPlan(
            prefix_cache=cache,
            lm=lm,
            identity=identity,
            store=store,
            writable=writable,
            prompts=prompts,
            agents_file=str(warm_prompts),
            tokenization=tokenization,
            model_key=model_key,
            source=source,
        )
        report = plan.run()
    cache.report = report
    if isinstance(source, ShardedSource):
        log.info(
            "[kvsnap] %s read %.1f MiB in %d files (%d read whole)",
            view.describe() if view is not None else "rank",
            source.meter.nbytes / 2**20,
            source.meter.files,
            source.meter.whole_files,
        )
    if source.quiet:
        return cache
    log.info("%s", report.summary())
    log.info(
        "[kvsnap] mlx_lm.server prompt cache: %d warm entries (%.1f MiB) from %s, protected "
        "from eviction, beside --prompt-cache-size %d",
        cache.pinned_count,
        cache.pinned_nbytes / 2**20,
        store.root,
        args.prompt_cache_size,
    )
    return cache
