"""Break each contract of docs/design.md on purpose and check that the tests notice.

For every named breakage: copy kvsnap/, tests/, contrib/ and pyproject.toml to a temp folder,
apply the breakage's patches there, and run the tests that guard that contract with the copy
first on PYTHONPATH (so the copy, not the editable install, is what gets imported, in pytest
and in every `python -m kvsnap` the tests start). A breakage is caught when at least one
guard fails; missed when they all pass.

A patch names its target by module and qualified name (`Patch("kvsnap.store.local",
"Store.put", old, new)`) and changes that definition only: the module is laid out the one
canonical way (ruff at 100 columns, magic trailing commas ignored), the definition found with
ast (decorators included), and `old` matched there blind to whitespace, so reformatting the
tree at another width or moving the function inside its module leaves the list as it is.
A target that is gone, or an `old` matching it zero times or twice, fails loudly naming the
breakage, the module and the function (and, with --check-applies, where `old` matches now).
A breakage's guards are its own test node ids; one naming none runs the tests of the modules
it patches (docs/design.md's module map).
Before any breakage the guards run once on an unbroken copy, so "caught" never means
"was already failing".

    python scripts/mutation_check.py            # all breakages (about 45 minutes on 2 cores)
    python scripts/mutation_check.py --list     # names, contracts, targets and guards
    python scripts/mutation_check.py --check-applies   # every patch applies: seconds, no test
    python scripts/mutation_check.py --only skip-checksum --only zero-one-key

Exit status: 0 when every breakage is caught (or, with --check-applies, applies); 1 when one
is missed, a patch no longer applies or the unbroken copy fails its guards.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# contrib: the upstream patches the tests apply
COPIED = ("kvsnap", "tests", "contrib", "pyproject.toml")
TIMEOUT_S = 900


@dataclass(frozen=True)
class Patch:
    """One change inside one definition; `old` must match there exactly once."""

    module: str  # dotted ("kvsnap.store.local"), or the path of a file that is not Python
    function: str | None  # qualified name of a def or class ("Store.put"); None: the module
    old: str
    new: str


@dataclass(frozen=True)
class Breakage:
    name: str
    contract: str
    what: str
    patches: tuple[Patch, ...]
    guards: tuple[str, ...]  # pytest node ids; () runs the tests of the modules it patches


ZERO_KEY = """
        if path == "1":  # breakage: one middle token's key zeroed in layer 1
            import mlx.core as _mx

            _k = _mx.array(c.keys)
            _k[..., c.offset // 2, :] = 0
            c.keys = _k
"""

ENGINE_FIRST = (
    "tests/runtime/engine/test_engine.py::"
    "test_first_request_per_agent_computes_only_its_suffix_and_matches_a_full_prefill"
)
SERVER_EXACT = (
    "tests/http/test_server.py::test_answers_over_http_come_from_the_exact_snapshot_state"
)
FORGED_INTEGRATIONS = "tests/integrations/test_forged_states.py::"
CRASH = "tests/runtime/persist/test_crash.py::"
KILLED_AT = (
    CRASH + "test_killed_at_each_writer_fault_point_the_store_verifies_and_the_next_turn_is_served"
)
DAMAGE = "tests/runtime/persist/test_damage.py::"
API_IMPORTS = "tests/test_api_forged_imports.py::"
TOOL_CALLS = "tests/http/test_tool_calls.py::"
LOGPROBS = "tests/http/test_logprobs.py::"

METRICS = "tests/http/test_metrics.py::"
QUANTIZED_START = "tests/runtime/persist/test_quantized_start.py::"
VLLM_MLX_SAMPLING = "tests/integrations/vllm_mlx/test_sampling.py::"
TIER_VALUES = "tests/store/test_tier_values.py::"
TIER_UNIT = "tests/runtime/persist/test_shared_tier.py::"
TIER_FAULTS = "tests/runtime/persist/test_shared_tier_faults.py::"

BREAKAGES = (
    Breakage(
        "prefix-skips-last-token",
        "2. strict prefix",
        "the trie walk compares each edge with the request except the edge's last token",
        (
            Patch(
                "kvsnap.runtime.cache.trie",
                "TokenTrie._walk",
                "            if seen == child.edge:\n",
                "            if seen[:-1] == child.edge[:-1] and len(seen) == len(child.edge):\n",
            ),
        ),
        (
            "tests/runtime/cache/test_prefix.py::"
            "test_an_untrimmable_entry_that_differs_only_at_its_last_token_"
            "is_not_used",
            "tests/runtime/engine/test_engine.py::"
            "test_a_request_differing_from_an_untrimmable_snapshot_only_at_"
            "its_last_token_is_prefilled",
            "tests/runtime/cache/test_trie.py::test_the_trie_lookup_equals_a_scan_over_every_entry",
        ),
    ),
    Breakage(
        "untrimmable-entries-trimmed",
        "2. strict prefix",
        "lookup trims every entry, SSM state included",
        (
            Patch(
                "kvsnap.runtime.cache.trie",
                "TokenTrie._count",
                "        if not node.entry.trimmable:\n            return\n",
                "        if False:\n            return\n",
            ),
            Patch(
                "kvsnap.runtime.cache.trie",
                "_find",
                "if e is not None and e.trimmable and node.rank == rank:",
                "if e is not None and node.rank == rank:",
            ),
        ),
        (
            "tests/runtime/cache/test_prefix.py::"
            "test_prompt_equal_to_untrimmable_entry_falls_back_to_a_shorter_"
            "entry_or_cold",
            "tests/runtime/engine/test_engine.py::"
            "test_prompt_equal_to_a_cached_untrimmable_prefix_still_works",
            "tests/runtime/cache/test_trie.py::test_the_trie_lookup_equals_a_scan_over_every_entry",
        ),
    ),
    Breakage(
        "digest-first-chunk-only",
        "3. never stale",
        "a weight file's digest covers only its first read chunk",
        (
            Patch(
                "kvsnap.key",
                "hash_file",
                '    h = xxhash.xxh3_128()\n    with open(path, "rb") as f:\n        while chunk '
                ":= f.read(chunk_size):\n            h.update(chunk)\n",
                '    h = xxhash.xxh3_128()\n    with open(path, "rb") as f:\n        '
                "h.update(f.read(chunk_size))\n",
            ),
        ),
        (
            "tests/test_key.py::test_a_weight_byte_past_the_first_digest_chunk_changes_the_key",
            "tests/test_key.py::test_a_byte_past_the_default_digest_chunk_changes_the_file_digest",
        ),
    ),
    Breakage(
        "key-ignores-kv-bits",
        "3. never foreign",
        "the model identity drops the KV quantization bits",
        (
            Patch(
                "kvsnap.key",
                "model_identity",
                "        kv_bits=settings.kv_bits,\n",
                "        kv_bits=None,\n",
            ),
        ),
        (
            "tests/test_key.py::test_config_kv_settings_layout_and_tokens_are_keyed",
            "tests/runtime/engine/test_engine.py::"
            "test_a_store_built_without_kv_bits_is_not_used_by_a_kv_bits_"
            "engine",
        ),
    ),
    Breakage(
        "store-padded-buffer",
        "snapshot bytes = exact KV (format.md)",
        "each block stores the attention KV from its start to the prompt's end (the buffer's "
        "tail), not just its own tokens",
        (
            Patch(
                "kvsnap.store.writing",
                "write_chain",
                "            part = {name: arrays[name][..., link.start : link.end, :] for name in "
                "sliced}\n",
                "            part = {name: arrays[name][..., link.start :, :] for name in "
                "sliced}\n",
            ),
        ),
        ("tests/snapshot/test_equivalence.py::test_snapshot_size_is_exact_kv_bytes",),
    ),
    Breakage(
        "skip-checksum",
        "4. nothing half-written (corrupt files detected)",
        "restore never compares the data checksum",
        (
            Patch(
                "kvsnap.snapshot.file",
                "verify_checksum",
                "    h.update(data)\n    _compare(header, h.hexdigest())\n",
                "    h.update(data)\n",
            ),
            # block and checkpoint reads hash as they read, and compare here
            Patch(
                "kvsnap.snapshot.file",
                "finish_checksum",
                "    _compare(header, state.hexdigest())\n",
                "    state.hexdigest()\n",
            ),
        ),
        (
            "tests/runtime/engine/test_engine.py::"
            "test_rejected_snapshots_are_reported_and_replaced_by_a_prefill",
            "tests/runtime/engine/test_engine.py::"
            "test_a_corrupt_snapshot_loaded_lazily_is_rejected_on_first_hit",
        ),
    ),
    Breakage(
        "cold-part-through-the-cache",
        "restore at a plain read's CPU cost (issue 41)",
        "a part not in the page cache is read through it (the kernel fills its cache, then copies)",
        (
            Patch(
                "kvsnap.store.fileio",
                "read_tensors",
                "        cold = not data_cached(f.fileno(), size)\n",
                "        cold = False\n",
            ),
        ),
        ("tests/store/test_fileio.py::test_a_part_not_in_the_page_cache_is_read_with_o_direct",),
    ),
    Breakage(
        "write-in-place",
        "4. nothing half-written (atomic writes)",
        "snapshots are written straight to their final name instead of a temp file",
        (
            Patch(
                "kvsnap.store.fileio",
                "atomic_write",
                'fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + target.name + ".", '
                "dir=target.parent)",
                "fd, tmp = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "
                "str(target)",
            ),
        ),
        (
            "tests/e2e/test_hardening.py::"
            "test_build_killed_at_each_fault_point_leaves_a_sound_store_"
            "that_resumes[mid-write]",
        ),
    ),
    Breakage(
        "zero-one-key",
        "1. same answer",
        "restoring a KVCache zeroes one middle token's key in layer 1 (greedy text survives it)",
        (
            Patch(
                "kvsnap.snapshot.cache_classes",
                "_kv_decode",
                '            int(meta["offset"]),\n        )\n',
                '            int(meta["offset"]),\n        )\n' + ZERO_KEY.lstrip("\n"),
            ),
        ),
        # The engine and server tests alone: the bitwise equivalence test caught this before they
        # did.
        (
            f"{ENGINE_FIRST}[dense]",
            f"{ENGINE_FIRST}[sliding]",
            f"{SERVER_EXACT}[dense]",
            f"{SERVER_EXACT}[sliding]",
        ),
    ),
    Breakage(
        "zero-one-key-at-build",
        "1. same answer",
        "encoding a KVCache writes one middle token's key of layer 1 as zeros",
        (
            Patch(
                "kvsnap.snapshot.cache_classes",
                "_kv_encode",
                '    out[f"{path}.keys"] = _slice_tokens(c.keys, c.offset)\n    '
                'out[f"{path}.values"] = _slice_tokens(c.values, c.offset)\n    return {"offset": '
                "c.offset}\n",
                '    out[f"{path}.keys"] = _slice_tokens(c.keys, c.offset)\n    '
                'out[f"{path}.values"] = _slice_tokens(c.values, c.offset)\n'
                '    if path == "1":  # breakage\n        _k = out[f"{path}.keys"] * 1\n        '
                '_k[..., c.offset // 2, :] = 0\n        out[f"{path}.keys"] = _k\n'
                '    return {"offset": c.offset}\n',
            ),
        ),
        (
            "tests/snapshot/test_equivalence.py::test_restored_snapshot_matches_fresh_"
            "prefill[dense]",
            f"{ENGINE_FIRST}[dense]",
            f"{SERVER_EXACT}[sliding]",
        ),
    ),
    Breakage(
        "shared-mutable-cache",
        "5. no shared mutable cache",
        "a fetch hands out the stored cache objects instead of a private copy",
        (
            Patch(
                "kvsnap.snapshot.codec",
                "copy_cache",
                "    return decode_cache({k: v[...] for k, v in arrays.items()}, layers)\n",
                "    return list(cache)\n",
            ),
        ),
        (
            "tests/snapshot/test_codec.py::test_copies_never_share_appends",
            "tests/runtime/cache/test_prefix.py::"
            "test_fetching_a_pinned_entry_three_times_through_a_trim_leaves_"
            "it_unchanged",
        ),
    ),
    Breakage(
        "capture-not-checked",
        "6. captured at the boundary",
        "a state holding a generated token is encoded anyway",
        (
            Patch(
                "kvsnap.snapshot.codec",
                "check_captured_at",
                "            if offset != n_tokens:\n",
                "            if False:\n",
            ),
        ),
        (
            "tests/snapshot/test_equivalence.py::test_capture_refuses_a_state_with_a_generated_"
            "token",
        ),
    ),
    Breakage(
        "api-key-first-chars",
        "tenant isolation: API keys (server.md#security)",
        "an API key is compared on its first 8 characters only",
        (
            Patch(
                "kvsnap.http.guard",
                "Auth._match",
                "            found |= hmac.compare_digest(given.encode(), k.encode())\n",
                "            found |= hmac.compare_digest(given[:8].encode(), k[:8].encode())\n",
            ),
        ),
        ("tests/http/test_security.py::test_near_miss_keys_are_refused_and_do_not_pass_for_admin",),
    ),
    Breakage(
        "api-key-any-case",
        "tenant isolation: API keys (server.md#security)",
        "an API key is compared case-insensitively",
        (
            Patch(
                "kvsnap.http.guard",
                "Auth._match",
                "            found |= hmac.compare_digest(given.encode(), k.encode())\n",
                "            found |= hmac.compare_digest(given.lower().encode(), "
                "k.lower().encode())\n",
            ),
        ),
        ("tests/http/test_security.py::test_near_miss_keys_are_refused_and_do_not_pass_for_admin",),
    ),
    Breakage(
        "api-key-prefix",
        "tenant isolation: API keys (server.md#security)",
        "a prefix of a valid API key, or a valid key plus a suffix, passes",
        (
            Patch(
                "kvsnap.http.guard",
                "Auth._match",
                "            found |= hmac.compare_digest(given.encode(), k.encode())\n",
                "            found |= k.startswith(given) or given.startswith(k)\n",
            ),
        ),
        ("tests/http/test_security.py::test_near_miss_keys_are_refused_and_do_not_pass_for_admin",),
    ),
    Breakage(
        "ignore-namespaces",
        "no shared mutable cache / tenant isolation (server.md#security)",
        "a request prefix of one key or cache_salt matches requests of another",
        (
            Patch(
                "kvsnap.runtime.cache.prefix",
                "PrefixCache.lookup",
                "            tries = (self._tries.get(None) if shared else None, "
                "self._tries.get(namespace))\n",
                "            tries = tuple(self._tries.values())\n",
            ),
        ),
        (
            "tests/http/test_security.py::test_prefixes_of_two_namespaces_never_match_each_other",
            "tests/runtime/cache/test_shared_prefix.py::"
            "test_requests_of_two_namespaces_never_share_a_computed_"
            "prefix",
        ),
    ),
    Breakage(
        "never-match-prefix",
        "7. honest accounting / reuse",
        "lookup never returns an entry",
        (
            Patch(
                "kvsnap.runtime.cache.prefix",
                "PrefixCache.lookup",
                "        return Match(best.entry, best.usable)\n",
                "        return None\n",
            ),
        ),
        (
            "tests/runtime/cache/test_prefix.py::"
            "test_longest_strict_prefix_wins_and_state_is_a_copy",
            f"{ENGINE_FIRST}[dense]",
        ),
    ),
    Breakage(
        "recompute-cached-prompt",
        "7. honest accounting",
        "the engine reports the cached tokens but runs the whole prompt on a fresh cache",
        (
            Patch(
                "kvsnap.runtime.engine.batch_runner",
                "BatchRunner.admit",
                "                    [list(suffix)],\n"
                "                    max_tokens=[r.max_tokens],\n"
                "                    caches=[self._batch_cache(r.tokens, cache, len(suffix))],\n",
                "                    [list(r.tokens)],\n"
                "                    max_tokens=[r.max_tokens],\n"
                "                    caches=[self.lm.make_cache()],\n",
            ),
        ),
        (
            f"{ENGINE_FIRST}[dense]",
            "tests/runtime/engine/test_engine.py::test_computed_tokens_come_from_mlx_lm_counter",
        ),
    ),
    Breakage(
        "chain-not-proven",
        "3. never stale, never foreign",
        "a record's chain is read without checking that its block keys follow from its own tokens "
        "and model",
        (
            Patch(
                "kvsnap.snapshot.chain",
                "parse_chain",
                "        if item[0] != block_key(model_digest, item[1], digests[item[2]], form):\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/snapshot/test_blocks.py::"
            "test_a_record_cannot_name_another_models_or_prefixs_block",
        ),
    ),
    Breakage(
        "block-key-ignores-kv-form",
        "4. nothing lost",
        "with --kv-bits and a quantization start above 0, a block's key does not name its KV form: "
        "a quantized record names the unquantized blocks of a shorter prefix (verify: BAD)",
        (
            Patch(
                "kvsnap.snapshot.blocks",
                "_form_suffix",
                '    return f"|{form}" if form else ""\n',
                '    return ""\n',
            ),
        ),
        (
            "tests/runtime/persist/test_quantized_start.py::"
            "test_a_conversation_crossing_the_start_verifies_after_"
            "sigterm_and_resumes_whole",
            "tests/runtime/persist/test_quantized_start.py::"
            "test_a_build_whose_agents_sit_on_both_sides_of_the_"
            "start_verifies",
        ),
    ),
    Breakage(
        "kv-bits-on-rotating-cache-accepted",
        "1. same answer (a setting accepted at start serves)",
        "--kv-bits on a model with a sliding-window cache (RotatingKVCache) is accepted: the "
        "server says ready and fails every request reaching the start with a 500, build with a "
        "traceback",
        (
            Patch(
                "kvsnap.runtime.model.loading", "load_model", "    check_kv_quantizable(lm)\n", ""
            ),
        ),
        (
            "tests/runtime/persist/test_quantized_start.py::"
            "test_kv_bits_on_a_sliding_window_model_is_refused_at_"
            "load_naming_the_layer",
        ),
    ),
    Breakage(
        "quantized-chain-checkpoint-below-start",
        "4. nothing lost",
        "a hybrid's quantized chain keeps a checkpoint below the quantization start (an "
        "unquantized state stamped quantized: verify BAD right after a build)",
        (
            Patch(
                "kvsnap.runtime.persist.writeback",
                "ChainPlan.links",
                "        if form == QUANTIZED_FORM:\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/runtime/persist/test_quantized_start.py::"
            "test_a_build_whose_agents_sit_on_both_sides_of_the_"
            "start_verifies[hybrid]",
        ),
    ),
    Breakage(
        "shapes-know-one-kv-form",
        "1. same answer",
        "with a quantization start above 0 the shape check knows only the quantized form: a "
        "prefix captured below the start is rejected at the next turn",
        (
            Patch(
                "kvsnap.runtime.cache.shapes",
                "ModelShapes._learn",
                "        if s.kv_bits is None or s.quantized_kv_start > 0:\n",
                "        if s.kv_bits is None:\n",
            ),
        ),
        (
            "tests/runtime/persist/test_quantized_start.py::"
            "test_a_prefix_captured_below_the_start_serves_the_"
            "turns_that_reach_past_it",
        ),
    ),
    Breakage(
        "records-before-kv-form-refused",
        "4. nothing lost",
        "a record written before keys named the KV form (its keys without one) fails the chain "
        "proof: an upgraded --quantized-kv-start store is reported BAD and rebuilt",
        (
            Patch(
                "kvsnap.snapshot.chain",
                "parse_chain",
                '        form = ""  # written before keys named a form: every key of the '
                "record must then be so\n",
                "        pass\n",
            ),
        ),
        (
            "tests/runtime/persist/test_quantized_start.py::"
            "test_a_store_written_before_keys_named_the_form_still_"
            "verifies_and_serves",
        ),
    ),
    Breakage(
        "gc-drops-shared-blocks",
        "4. nothing lost",
        "gc removes every block a dropped record reached, shared ones included",
        (
            Patch(
                "kvsnap.store.collecting",
                "collect",
                "            reached: set[str] | None = reached_parts([inspect_record(store, p) "
                "for p in kept])\n",
                "            reached: set[str] | None = set()\n",
            ),
        ),
        (
            "tests/store/test_local.py::"
            "test_gc_removes_a_dropped_entry_but_never_one_another_model_uses",
            "tests/snapshot/test_blocks.py::test_gc_keeps_every_block_a_record_reaches",
        ),
    ),
    Breakage(
        "restored-shapes-not-checked",
        "4. hostile files",
        "a restored state is served without comparing its tensors with the model's own cache",
        (
            Patch(
                "kvsnap.runtime.warmup.run",
                "run_warmup",
                "    if prefix.check_state is None:  # every state served",
                "    if False:  # every state served",
            ),
        ),
        (
            "tests/snapshot/test_forged_shapes.py::"
            "test_regression_forged_head_dim_blocks_are_dropped_and_"
            "never_fail_a_batch",
        ),
    ),
    Breakage(
        "shape-check-runs-the-model",
        "start-up",
        "the model's cache shapes are learned from an evaluated one-token pass: its kernel "
        "compiles run before warm",
        (
            Patch(
                "kvsnap.runtime.cache.shapes",
                "ModelShapes._learn",
                "        self._per_token = set().union(*(_token_axis_names(layers) for layers, "
                "_ in "
                "forms))\n",
                "        mx.eval([a for _, arrays in forms for a in arrays.values()])\n"
                "        self._per_token = set().union(*(_token_axis_names(layers) for layers, "
                "_ in "
                "forms))\n",
            ),
        ),
        (
            "tests/runtime/engine/test_startup.py::"
            "test_regression_kv_snapshots_alone_does_the_work_of_warm_"
            "prompts",
        ),
    ),
    Breakage(
        "verify-model-ignores-shapes",
        "4. hostile files",
        "verify --model trusts the parts' tensor shapes",
        (
            Patch(
                "kvsnap.commands.store",
                "cmd_verify",
                "            if shapes is not None:\n",
                "            if False:\n",
            ),
        ),
        (
            "tests/snapshot/test_forged_shapes.py::"
            "test_verify_with_the_model_names_the_forged_block_shapes",
        ),
    ),
    Breakage(
        "verify-model-fails-on-other-models",
        "3. never foreign",
        "verify --model counts another model's sound records as bad",
        (
            Patch(
                "kvsnap.commands.store",
                "cmd_verify",
                "            info = store.verify_file(path)\n",
                "            info = store.verify_file(path, expected)\n",
            ),
        ),
        (
            "tests/snapshot/test_forged_shapes.py::"
            "test_verify_with_the_model_reports_another_models_"
            "records_and_exits_0",
        ),
    ),
    Breakage(
        "token-count-unbounded",
        "4. hostile files",
        "a record's token count is not bounded before its tokens are read",
        (
            Patch(
                "kvsnap.snapshot.header",
                "check_token_count",
                "    if n > max_tokens:\n",
                "    if False:\n",
            ),
        ),
        (
            "tests/snapshot/test_forged_token_counts.py::"
            "test_regression_a_25m_token_record_is_refused_by_"
            "ls_and_scan_before_its_tokens_are_read",
        ),
    ),
    Breakage(
        "start-scan-ignores-context",
        "4. hostile files",
        "the start scan reads records longer than the model's context",
        (
            Patch(
                "kvsnap.runtime.warmup.prefetch",
                "prefetch",
                "store.scan(max_tokens=context_tokens(model_dir))",
                "store.scan()",
            ),
        ),
        (
            "tests/snapshot/test_forged_token_counts.py::"
            "test_regression_a_record_longer_than_the_models_"
            "context_is_refused_by_the_start_scan",
        ),
    ),
    Breakage(
        "integration-restored-shapes-not-checked",
        "4. hostile files",
        "kvsnap mlx-lm and vllm-mlx pin or insert a restored state without comparing its tensors "
        "with the model's own cache",
        (
            Patch(
                "kvsnap.integrations.common.warm_plan",
                "check_shapes",
                "    if why:\n        raise SnapshotError(where, why, SHAPE_FIX)\n",
                "    if False:\n        raise SnapshotError(where, why, SHAPE_FIX)\n",
            ),
        ),
        (
            f"{FORGED_INTEGRATIONS}test_regression_mlx_lm_serve_skips_a_forged_agent_and_answers_"
            "it_cold",
            f"{FORGED_INTEGRATIONS}test_regression_vllm_mlx_insert_skips_a_forged_snapshot_and_"
            "inserts_the_good_one",
            f"{FORGED_INTEGRATIONS}test_regression_vllm_mlx_warm_plan_prefills_an_agent_whose_"
            "snapshot_is_forged",
            f"{FORGED_INTEGRATIONS}test_regression_mlx_lm_pin_store_skips_a_forged_snapshot",
            f"{FORGED_INTEGRATIONS}test_regression_vllm_mlx_serve_skips_a_forged_snapshot_and_"
            "answers_it_cold",
        ),
    ),
    Breakage(
        "mlx-lm-scan-ignores-context",
        "4. hostile files",
        "kvsnap mlx-lm's --kv-snapshots scan reads records longer than the model's context",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.warm",
                "pin_store",
                "store.scan(identity, max_tokens=context_tokens(lm.path))",
                "store.scan(identity)",
            ),
        ),
        (
            f"{FORGED_INTEGRATIONS}test_regression_mlx_lm_pin_store_refuses_a_record_longer_than_"
            "the_context",
        ),
    ),
    Breakage(
        "vllm-mlx-insert-scan-ignores-context",
        "4. hostile files",
        "kvsnap vllm-mlx's insert scan reads records longer than the model's context",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.insert",
                "insert_snapshots",
                "store.scan(identity, max_tokens=context_tokens(model_dir))",
                "store.scan(identity)",
            ),
        ),
        (
            f"{FORGED_INTEGRATIONS}test_regression_vllm_mlx_insert_refuses_a_record_longer_than_"
            "the_context",
        ),
    ),
    Breakage(
        "warm-plan-scan-ignores-context",
        "4. hostile files",
        "the --warm-prompts plan of kvsnap vllm-mlx and mlx-lm reads records longer than the "
        "model's context",
        (
            Patch(
                "kvsnap.integrations.common.warm_plan",
                "WarmPlan.run",
                "self.store.scan(self.identity, max_tokens=context_tokens(self.lm.path))",
                "self.store.scan(self.identity)",
            ),
        ),
        (
            f"{FORGED_INTEGRATIONS}test_regression_warm_plans_never_take_a_record_longer_than_the_"
            "context_for_the_agent",
        ),
    ),
    Breakage(
        "mlx-lm-warm-entries-evictable",
        "2. strict prefix (warm stays warm)",
        "kvsnap mlx-lm pins its warm entries as ordinary mlx-lm 'system' LRU entries",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.cache",
                "PinnedPromptCache.pin",
                "        # A plain dict trie insert: the pinned set never drops a warm prefix of "
                "another.\n",
                "        return super().insert_cache(model, list(tokens), prompt_cache, "
                'cache_type="system")\n',
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_route.py::"
            "test_pinned_warm_entries_survive_size_bytes_and_prefix_"
            "eviction_and_are_private_copies",
            "tests/integrations/mlx_lm/test_route.py::"
            "test_agents_stay_warm_under_prompt_cache_size_and_bytes_"
            "pressure",
        ),
    ),
    Breakage(
        "mlx-lm-request-loads-any-model",
        "hostile requests: kvsnap mlx-lm serve loads only its model (mlx-lm.md#security)",
        "kvsnap mlx-lm serve passes a request's model, adapters and draft_model to mlx-lm, "
        "which loads whatever path they name",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.models",
                "model_refusal.check",
                "        refused = served.refusal(body)\n",
                "        refused = None\n",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_security.py::"
            "test_request_fields_that_load_another_model_are_"
            "refused_and_nothing_is_loaded",
        ),
    ),
    Breakage(
        "mlx-lm-template-kwargs-unchecked",
        "hostile requests: kvsnap mlx-lm serve renders only the model's template (mlx-lm.md)",
        "a request's chat_template_kwargs reach mlx-lm's apply_chat_template unchecked: an "
        "injected chat_template renders, a nested loop hangs the server",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.request_checks",
                "guard_requests.run_http_server.check",
                "            return sampling_refusal(body) or template_refusal(body, template)\n",
                "            return sampling_refusal(body)\n",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_requests.py::"
            "test_an_injected_chat_template_is_refused_and_a_nested_loop_never_renders",
        ),
    ),
    Breakage(
        "mlx-lm-nan-sampling-unchecked",
        "hostile requests: one request's sampling kills no generation thread (mlx-lm.md)",
        "a NaN min_p passes mlx-lm's range checks and apply_min_p raises in the batch",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.request_checks",
                "guard_requests.run_http_server.check",
                "            return sampling_refusal(body) or template_refusal(body, template)\n",
                "            return template_refusal(body, template)\n",
            ),
        ),
        ("tests/integrations/mlx_lm/test_requests.py::test_a_nan_sampling_value_is_refused",),
    ),
    Breakage(
        "mlx-lm-sampler-unsettled",
        "hostile requests: one request's sampling kills no generation thread (mlx-lm.md)",
        "mlx-lm samples with the request's values as sent: a top_k of the vocabulary raises in "
        "the batch (the generation thread dies), a temperature of 1e-39 draws uniformly",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.request_checks",
                "guard_requests",
                "    server._make_sampler = settled_sampler(server._make_sampler)\n",
                "",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_requests.py::"
            "test_one_requests_sampling_values_do_not_kill_the_generation_thread",
            "tests/integrations/mlx_lm/test_requests.py::"
            "test_values_that_overflow_float32_answer_as_greedy",
        ),
    ),
    Breakage(
        "mlx-lm-models-without-hf-cache",
        "kvsnap mlx-lm serve answers like kvsnap serve (mlx-lm.md)",
        "/v1/models on a machine without a Hugging Face cache folder is an empty 200",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.request_checks",
                "guard_requests",
                "    server.scan_cache_dir = models_without_cache(server.scan_cache_dir)\n",
                "",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_requests.py::"
            "test_models_lists_the_served_model_without_a_hugging_face_cache_folder",
        ),
    ),
    Breakage(
        "mlx-lm-positional-model",
        "kvsnap mlx-lm serve answers like kvsnap serve (mlx-lm.md)",
        "`kvsnap mlx-lm serve MODEL` (no --model) goes to mlx_lm.server, which refuses it",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.launcher",
                "main",
                "    args = positional_model(args)\n",
                "",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_requests.py::"
            "test_the_model_may_come_first_without_model",
        ),
    ),
    Breakage(
        "mlx-lm-negative-length-unchecked",
        "hostile requests: kvsnap mlx-lm serve loads only its model (mlx-lm.md#security)",
        "a request with Content-Length: -1 goes to mlx-lm unchecked, which reads its body to "
        "the end of the stream and loads the model it names",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.models",
                "refusing_handler.RequestModelGuard.do_POST",
                "            if length is None:\n",
                "            if length is None or length < 0:\n",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_security.py::"
            "test_a_body_of_unknown_length_cannot_carry_another_"
            "model_past_the_check",
        ),
    ),
    Breakage(
        "sampler-top-k-unclamped",
        "hostile requests: one tenant's sampling fails no other's (server.md#security)",
        "a top_k of the vocabulary or more reaches mlx-lm's apply_top_k, which raises for the "
        "whole batch: another key's greedy request gets a 500 too",
        (
            Patch(
                "kvsnap.runtime.engine.sampling",
                "make_request_sampler.sample",
                "        if top_k_applies(top_k, logprobs.shape[-1]):\n",
                "        if top_k > 0:\n",
            ),
        ),
        (
            "tests/runtime/engine/test_sampling.py::"
            "test_a_top_k_of_the_vocabulary_or_more_is_off_as_zero_is",
            "tests/http/test_security.py::"
            "test_one_tenants_sampling_values_do_not_fail_another_tenants_batched_request_issue_39",
        ),
    ),
    Breakage(
        "sampler-failure-fails-batch",
        "hostile requests: one tenant's sampling fails no other's (server.md#security)",
        "a request whose sampler raises fails the whole step: every request in its batch errors",
        (
            Patch(
                "kvsnap.runtime.engine.sampling",
                "batch_sampler",
                "    return sampler if sampler is greedy else OwnSampler(sampler)\n",
                "    return sampler\n",
            ),
        ),
        (
            "tests/runtime/engine/test_engine.py::"
            "test_a_request_whose_sampler_raises_errors_alone_and_its_batch_goes_on_issue_39",
        ),
    ),
    Breakage(
        "tiny-temperature-samples",
        "hostile requests: sampling values at their edges (server.md)",
        "a temperature of 1e-39 is sampled: 1/T overflows float32 and the draw is uniform",
        (
            Patch(
                "kvsnap.runtime.engine.sampling",
                "is_greedy",
                "    return not temperature >= TEMPERATURE_FLOOR\n",
                "    return not temperature > 0\n",
            ),
        ),
        (
            "tests/runtime/engine/test_sampling.py::test_a_temperature_below_the_floor_is_greedy",
            "tests/http/test_security.py::"
            "test_a_temperature_below_the_floor_answers_as_greedy_issue_39",
        ),
    ),
    Breakage(
        "mlx-lm-profile-bos-on-encode",
        "2. strict prefix",
        "the --for mlx-lm profile encodes with the tokenizer's special tokens (a second BOS on "
        "Llama 3)",
        (
            Patch(
                "kvsnap.profiles",
                "mlx_lm_tokenization",
                "server=MLX_LM, add_special_tokens=False,",
                "server=MLX_LM, add_special_tokens=True,",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_route.py::"
            "test_mlx_lm_profile_prefix_is_a_strict_prefix_of_mlx_lm_"
            "servers_own_tokens[llama]",
            "tests/integrations/mlx_lm/test_route.py::"
            "test_real_llama3_tokenizer_mlx_lm_requests_start_with_"
            "one_bos_and_hit",
        ),
    ),
    Breakage(
        "warm-key-drops-the-servers-profile",
        "3. never foreign",
        "warm_key digests every server's warm prompts as kvsnap's own request path",
        (
            Patch(
                "kvsnap.warm_key",
                "_prompt_digest",
                "    profile = tokenization.descriptor() if tokenization is not None else None\n",
                "    profile = None\n",
            ),
        ),
        (
            "tests/test_prompts.py::test_warm_key_keys_another_servers_tokenization_apart_from_"
            "kvsnaps",
        ),
    ),
    Breakage(
        "lazy-import-cycle",
        "shape of the code",
        "a lazy import inside a function closes an import cycle (warm_key <-> warmup.run)",
        (
            Patch(
                "kvsnap.warm_key",
                "_prompt_digest",
                "    template = resolve_chat_template(tokenizer, prompt.tools)\n",
                "    from kvsnap.runtime.warmup.run import run_warmup  # noqa: F401\n"
                "    template = resolve_chat_template(tokenizer, prompt.tools)\n",
            ),
        ),
        ("tests/test_architecture.py::test_no_import_cycle",),
    ),
    Breakage(
        "slowloris-head-deadline-off",
        "server under attack",
        "a connection whose request head never completes is left open (slowloris)",
        (
            Patch(
                "kvsnap.http.connections",
                "guarded_protocol.GuardedProtocol",
                "            self.close_slow()\n\n        def close_slow",
                "            pass\n\n        def close_slow",
            ),
        ),
        (
            "tests/http/test_connections.py::test_slowloris_connections_are_closed_and_health_"
            "still_answers",
        ),
    ),
    Breakage(
        "slow-body-deadline-off",
        "server under attack",
        "a request body trickling one byte at a time keeps its connection for as long as it likes",
        (
            Patch(
                "kvsnap.http.connections",
                "guarded_protocol.GuardedProtocol._await",
                'timeout = guard.header_timeout_s if what == "head" else guard.body_timeout_s',
                'timeout = guard.header_timeout_s if what == "head" else 3600.0',
            ),
        ),
        (
            "tests/http/test_connections.py::test_slow_bodies_from_one_valid_key_lock_out_"
            "neither_health_nor_another_key",
        ),
    ),
    Breakage(
        "slow-body-not-evictable",
        "server under attack",
        "at the cap only connections waiting for a head are pushed out: slow bodies fill every "
        "slot and /health and real clients are refused",
        (
            Patch(
                "kvsnap.http.connections",
                "guarded_protocol.GuardedProtocol._await",
                "            guard.waiting[self] = what\n",
                '            guard.waiting.update({self: what} if what == "head" else {})\n',
            ),
        ),
        (
            "tests/http/test_connections.py::test_slow_bodies_from_one_valid_key_lock_out_"
            "neither_health_nor_another_key",
        ),
    ),
    Breakage(
        "unread-answer-deadline-off",
        "server under attack",
        "a client that never reads its streamed answer keeps its connection for ever",
        (
            Patch(
                "kvsnap.http.connections",
                "guarded_protocol.GuardedProtocol.pause_writing",
                "self._stall = self.loop.call_later(guard.write_timeout_s, self._unread)",
                "self._stall = self.loop.call_later(3600.0, self._unread)",
            ),
        ),
        (
            "tests/http/test_connections.py::test_clients_that_never_read_a_long_answer_hold_"
            "no_slot_for_ever",
        ),
    ),
    Breakage(
        "unread-answer-not-evictable",
        "server under attack",
        "at the cap a connection whose client reads none of its answer is never pushed out: "
        "such clients fill every slot and /health is refused",
        (
            Patch(
                "kvsnap.http.connections",
                "guarded_protocol.GuardedProtocol.pause_writing",
                '            guard.waiting.setdefault(self, "reader")\n',
                "",
            ),
        ),
        (
            "tests/http/test_connections.py::test_clients_that_never_read_a_long_answer_hold_"
            "no_slot_for_ever",
        ),
    ),
    Breakage(
        "accept-errors-flood-the-log",
        "server under attack",
        "EMFILE on accept() goes to asyncio's handler, one traceback per attempt",
        (
            Patch(
                "kvsnap.http.connections",
                "ConnectionGuard.exception_handler",
                "exc.errno in ACCEPT_ERRNOS:",
                "exc.errno in ():",
            ),
        ),
        (
            "tests/http/test_connections.py::test_accept_errors_from_running_out_of_descriptors_"
            "are_logged_rate_limited",
        ),
    ),
    Breakage(
        "cached-tokens-own-entry-leaks-match",
        "server under attack",
        "a tenant's own entry is not kept when a shared match left nothing to prefill: its "
        "existence spells out the match",
        (
            Patch(
                "kvsnap.runtime.engine.request_cache",
                "RequestCaches.keep_private",
                "            self.capture(state, found.cache)\n",
                "            pass\n",
            ),
        ),
        (
            "tests/http/test_security.py::"
            "test_cached_tokens_binary_search_against_own_entries_learns_"
            "only_the_rounded_match",
        ),
    ),
    Breakage(
        "cached-tokens-rounded-without-keys",
        "honest accounting",
        "a server without keys rounds partial shared matches too: a request containing a whole "
        "warm prompt reports less, and the responses no longer add up to /v1/status",
        (
            Patch(
                "kvsnap.http.context",
                "ServerContext.reported_usage",
                "step = self.config.cached_tokens_granularity if self.config.auth.enabled else 1",
                "step = self.config.cached_tokens_granularity",
            ),
        ),
        (
            "tests/http/test_cached_tokens.py::test_sequential_requests_report_every_reused_token_"
            "without_keys",
            "tests/http/test_cached_tokens.py::test_concurrent_requests_report_every_reused_token_"
            "without_keys",
        ),
    ),
    Breakage(
        "cached-tokens-below-whole-warm-prompt",
        "honest accounting",
        "with keys, a request containing a whole warm prompt that matches part of a longer one "
        "is rounded below the whole warm prompt",
        (
            Patch(
                "kvsnap.runtime.engine.accounting",
                "reported_cached_tokens",
                "told_exactly = max(state.own_cached_tokens, state.whole_shared_tokens)",
                "told_exactly = state.own_cached_tokens",
            ),
        ),
        (
            "tests/http/test_cached_tokens.py::"
            "test_with_keys_a_whole_warm_prompt_is_never_rounded_away",
        ),
    ),
    Breakage(
        "cached-tokens-checkpoint-counts-as-whole",
        "server under attack",
        "a checkpoint inside a warm prompt lifts the rounded count like a whole warm prompt: its "
        "exact length tells how far a request agrees with the operator's prompt",
        (
            Patch(
                "kvsnap.runtime.cache.prefix",
                "PrefixCache.whole_shared_prefix",
                "return max((n for n in ends if not self._entries[(None, tokens[:n])].inner), "
                "default=0)",
                "return max(ends, default=0)",
            ),
        ),
        (
            "tests/http/test_cached_tokens.py::"
            "test_a_checkpoint_inside_a_warm_prompt_is_not_a_whole_"
            "warm_prompt",
        ),
    ),
    Breakage(
        "tenant-status-shows-cache-counters",
        "server under attack",
        "a non-admin key sees the cache-wide counters again",
        (
            Patch(
                "kvsnap.http.routes_status",
                None,
                'TENANT_STATUS_FIELDS = ("warm", "requests", "rewarm_in_progress")',
                'TENANT_STATUS_FIELDS = ("warm", "requests", "rewarm_in_progress", "cache")',
            ),
        ),
        (
            "tests/http/test_security.py::test_tenant_status_shows_nothing_that_moves_with_other_"
            "tenants_traffic",
        ),
    ),
    Breakage(
        "generation-failed-carries-exception-text",
        "server under attack",
        "a generation_failed 500 carries the exception text to the client",
        (
            Patch(
                "kvsnap.http.routes_generation",
                "failure_message",
                'return f"generation failed ({kind}); the server log has the details"',
                'return f"generation failed: {detail}"',
            ),
        ),
        ("tests/http/test_api_errors.py::test_generation_failed_500_names_only_the_error_type",),
    ),
    Breakage(
        "busy-port-found-after-model-load",
        "server under attack",
        "the port is bound only when uvicorn starts, after the model loads",
        (
            Patch(
                "kvsnap.commands.serve",
                "cmd_serve",
                "    sock = bind_socket(args.host, args.port)  # a busy port fails now, not after "
                "the model loads\n",
                "",
            ),
            Patch(
                "kvsnap.commands.serve",
                "cmd_serve",
                "    server.run(sockets=[sock])",
                "    server.run(sockets=[bind_socket(args.host, args.port)])",
            ),
        ),
        (
            "tests/http/test_connections.py::test_a_busy_port_fails_before_the_model_loads_with_"
            "exit_2",
        ),
    ),
    Breakage(
        "closed-pipe-traceback",
        "command line",
        "a reader closing the output early (`| head`) ends the command in a BrokenPipeError "
        "traceback, and rich tables exit 1 (a failed check)",
        (
            Patch(
                "kvsnap.commands.cli",
                "main",
                "    except BrokenPipeError:\n",
                "    except ZeroDivisionError:\n",
            ),
            Patch(
                "kvsnap.commands.common",
                "console.PipeAwareConsole.on_broken_pipe",
                "            raise BrokenPipeError\n",
                "            super().on_broken_pipe()\n",
            ),
        ),
        (
            "tests/commands/test_cli_newcomer.py::"
            "test_a_pipe_closed_after_the_first_line_ends_the_command_"
            "quietly",
            "tests/commands/test_cli_newcomer.py::"
            "test_a_pipe_closed_before_any_output_ends_every_command_"
            "quietly",
        ),
    ),
    Breakage(
        "broken-pipe-from-anywhere-hidden",
        "command line",
        "any BrokenPipeError (a socket's, a child's) ends a command quietly as if its reader had "
        "closed stdout",
        (
            Patch(
                "kvsnap.commands.cli",
                "main",
                "        if not stdout_is_a_pipe():  # a terminal or a file cannot be closed by a "
                "reader\n            raise\n",
                "",
            ),
        ),
        (
            "tests/commands/test_cli_newcomer.py::"
            "test_a_broken_pipe_that_is_not_stdout_is_not_hidden",
        ),
    ),
    Breakage(
        "piped-tables-cut-to-80-columns",
        "command line",
        "tables written to a pipe or a file (CI logs) are cut to rich's default 80 columns",
        (
            Patch(
                "kvsnap.commands.common",
                "console",
                "        out.width = UNWRAPPED_WIDTH\n",
                "        pass\n",
            ),
        ),
        ("tests/commands/test_cli_newcomer.py::test_build_and_ls_print_whole_rows_into_a_pipe",),
    ),
    Breakage(
        "serve-two-models-accepted",
        "command line",
        "`serve A --model B` serves A and ignores B without a word",
        (
            Patch(
                "kvsnap.commands.serve_checks",
                "served_model",
                "    if positional is not None and flag is not None and positional != flag:\n",
                "    if False:\n",
            ),
        ),
        (
            "tests/commands/test_cli_newcomer.py::"
            "test_serve_without_a_model_or_with_two_says_how_to_name_it",
        ),
    ),
    Breakage(
        "system-prompt-file-must-be-regular",
        "command line",
        "bench-serve refuses a FIFO or a process substitution (<(...)) as not a file",
        (
            Patch(
                "kvsnap.tools.bench_serve",
                "read_text_file",
                '    try:\n        with open(path, encoding="utf-8") as f:\n',
                "    if not path.is_file():\n"
                '        raise UsageError(f"{flag} {path}: no such file")\n'
                '    try:\n        with open(path, encoding="utf-8") as f:\n',
            ),
        ),
        (
            "tests/commands/test_cli_newcomer.py::"
            "test_bench_serve_takes_a_process_substitution_and_a_fifo",
        ),
    ),
    Breakage(
        "system-prompt-trailing-newline-sent",
        "command line",
        "bench-serve sends the system prompt file's trailing newline, missing the warm prefix",
        (
            Patch(
                "kvsnap.tools.bench_serve",
                "read_system_prompt",
                '    return text[:-1] if text.endswith("\\n") else text\n',
                "    return text\n",
            ),
        ),
        (
            "tests/commands/test_cli_newcomer.py::"
            "test_bench_serve_drops_one_trailing_newline_so_the_warm_"
            "prefix_hits",
        ),
    ),
    Breakage(
        "unused-dependency-declared",
        "shape of the code",
        "pyproject.toml declares safetensors again, which kvsnap never imports",
        (
            Patch(
                "pyproject.toml",
                None,
                '    "xxhash>=3.0",\n',
                '    "safetensors>=0.4",\n    "xxhash>=3.0",\n',
            ),
        ),
        ("tests/test_architecture.py::test_every_declared_dependency_is_imported",),
    ),
    Breakage(
        "install-merge-replaces-record",
        "shipped content",
        "a shipped record with an existing id replaces the store's (an empty one erases it for gc)",
        (
            Patch(
                "kvsnap.store.manifest",
                "merge_manifests",
                "        records[rid] = _merge_record(records[rid], record) if rid in records else "
                "record\n",
                "        records[rid] = record\n",
            ),
        ),
        (
            "tests/store/test_install.py::test_regression_a_tiny_tarball_with_an_empty_record_"
            "cannot_erase_a_store",
        ),
    ),
    Breakage(
        "install-overwrites-good-block",
        "shipped content",
        "unpack and pull move shipped bytes over a store's good block of the same name",
        (
            Patch(
                "kvsnap.store.install",
                "StagedInstall._keeps_existing",
                "        if not existing_file_is_good(store, relpath):\n            return False",
                "        if True:\n            return False",
            ),
        ),
        (
            "tests/store/test_install.py::test_regression_unpack_never_overwrites_a_good_block_"
            "with_a_forged_one",
        ),
    ),
    Breakage(
        "pull-downloads-over-good-block",
        "shipped content",
        "pull downloads a blob under the name of a good store file and does not report it",
        (
            Patch(
                "kvsnap.store.oci.download",
                "pull",
                "        report.kept = _kept_existing(dest_path, layers, have)\n",
                "        report.kept = []\n",
            ),
        ),
        (
            "tests/store/oci/test_hostile_registry.py::"
            "test_regression_pull_never_overwrites_a_good_block_"
            "with_a_forged_one",
        ),
    ),
    Breakage(
        "credentials-to-redirect-target",
        "shipped content",
        "every host counts as the registry's own origin: a redirect target gets the credentials "
        "and its 401 is answered with them (the origin check is the one guard, in two places)",
        (
            Patch(
                "kvsnap.store.oci.client",
                "is_same_origin",
                "    return origin_of(url) == origin_of(base)\n",
                "    return True\n",
            ),
        ),
        (
            "tests/store/oci/test_client.py::test_regression_registry_credentials_never_reach_a_"
            "redirect_target",
        ),
    ),
    Breakage(
        "registry-request-without-deadline",
        "shipped content",
        "registry reads are bounded per read only, not by the request's deadline",
        (
            Patch(
                "kvsnap.store.oci.deadlines",
                "RequestClock.bound",
                "        left = self.remaining()\n        if left is None:\n            return "
                "timeout",
                "        left = None\n        if left is None:\n            return timeout",
            ),
        ),
        (
            "tests/store/oci/test_client.py::test_regression_a_trickling_registry_hits_the_request_"
            "deadline",
        ),
    ),
    Breakage(
        "declared-layer-size-unbounded",
        "shipped content",
        "a layer's declared size is not bounded before the download",
        (
            Patch(
                "kvsnap.store.oci.artifact",
                "_parse_layer",
                "    if size > cap:\n",
                "    if False:\n",
            ),
        ),
        (
            "tests/store/oci/test_client.py::test_regression_an_oversize_declared_layer_is_refused_"
            "before_any_download",
        ),
    ),
    Breakage(
        "unpack-expansion-unbounded",
        "shipped content",
        "unpack writes an entry before checking how far the archive expands",
        (
            Patch(
                "kvsnap.store.archive",
                "unpack",
                "                too_big = guard.admit(member.size)\n",
                "                too_big = None\n",
            ),
        ),
        (
            "tests/store/test_install.py::test_regression_a_gzip_bomb_is_refused_before_"
            "anything_is_written",
        ),
    ),
    Breakage(
        "killed-pull-not-resumed",
        "shipped content",
        "a pull never takes over a killed pull's stage: everything is downloaded again, the stage "
        "stays",
        (
            Patch(
                "kvsnap.store.oci.download",
                "pull",
                "        with StagedInstall(dest_path, resume=True) as staging:",
                "        with StagedInstall(dest_path) as staging:",
            ),
        ),
        (
            "tests/store/oci/test_hostile_registry.py::"
            "test_regression_a_killed_pull_resumes_from_its_stage_"
            "and_downloads_only_what_is_missing",
        ),
    ),
    Breakage(
        "stop-earliest-start",
        "served text",
        "a stop string that starts earlier wins over one that completes first: the cut depends on "
        "the chunking (issue 24)",
        (
            Patch(
                "kvsnap.runtime.engine.stop_strings",
                "scan_stop_strings",
                "        _, start, matched = min(hits)\n",
                "        _, start, matched = min(hits, key=lambda hit: hit[1])\n",
            ),
        ),
        (
            "tests/runtime/engine/test_engine_parts.py::"
            "test_a_stop_string_that_completes_first_wins_over_one_"
            "that_starts_earlier_issue_24",
            "tests/runtime/engine/test_engine_parts.py::"
            "test_any_chunking_sends_what_one_scan_of_the_whole_text_"
            "sends",
        ),
    ),
    Breakage(
        "golden-tensor-bytes-exact",
        "tests hold on any CPU",
        "the golden check wants tensor values bit for bit: another CPU's OpenBLAS kernels fail it "
        "(issue 24)",
        (Patch("tests.helpers.golden_summary", None, "RTOL = 1e-4\n", "RTOL = 0.0\n"),),
        (
            "tests/build/test_golden.py::"
            "test_golden_tensor_bytes_changed_on_another_cpu_is_float_noise_"
            "not_a_failure[Prescott]",
        ),
    ),
    Breakage(
        "golden-blind-to-values",
        "tests hold on any CPU",
        "the golden check's tolerance swallows real changes (a zeroed token, a 1e-3 scale)",
        (Patch("tests.helpers.golden_summary", None, "RTOL = 1e-4\n", "RTOL = 0.1\n"),),
        (
            "tests/build/test_golden.py::"
            "test_the_golden_comparison_sees_a_real_change[one-token-zeroed]",
            "tests/build/test_golden.py::"
            "test_the_golden_comparison_sees_a_real_change[one-tensor-scaled-"
            "1e-3]",
        ),
    ),
    Breakage(
        "cuts-follow-branch-points",
        "4. nothing lost (block store)",
        "every branch point with another agent is a block end again: an unrelated agent moves "
        "every chain's cuts",
        (
            Patch(
                "kvsnap.snapshot.blocks",
                "plan_cuts",
                "    ends = set(range(b, n_tokens, b)) | set(range(c, n_tokens, c)) | {n_tokens} | "
                "cut\n",
                "    ends = set(range(b, n_tokens, b)) | set(range(c, n_tokens, c)) | {n_tokens} | "
                "cut | {d for d in branches if 0 < d < n_tokens}\n",
            ),
        ),
        (
            "tests/store/test_block_store_cuts.py::"
            "test_adding_an_unrelated_agent_never_moves_another_"
            "chains_blocks",
        ),
    ),
    Breakage(
        "siblings-store-their-shared-head-each",
        "4. nothing lost (block store)",
        "the build never cuts where siblings part inside a block: each stores that block's shared "
        "head, and a hybrid sibling or edit restores from the grid point before the branch",
        (
            Patch(
                "kvsnap.build.pipeline",
                "_Build.split_points",
                "                    out[who[0]].add(who[1])\n",
                "                    pass\n",
            ),
        ),
        (
            "tests/store/test_block_store_cuts.py::"
            "test_agents_sharing_a_preamble_store_their_unique_kv_"
            "and_an_edit_prefills_one_block",
            "tests/snapshot/test_blocks.py::test_agents_sharing_a_preamble_store_it_once",
        ),
    ),
    Breakage(
        "stored-block-cut-again",
        "4. nothing lost (block store)",
        "a block stored whole is cut again where a sibling added later parts: the edited agent "
        "finds no head there and re-prefills its whole tail",
        (
            Patch(
                "kvsnap.build.pipeline",
                "_Build.split_points",
                "                if cell is None or has_part(self.store, BLOCK_KIND, cell.key):\n",
                "                if cell is None:\n",
            ),
        ),
        (
            "tests/store/test_block_store_cuts.py::"
            "test_a_block_stored_whole_is_never_cut_again_when_a_"
            "sibling_arrives",
        ),
    ),
    Breakage(
        "conversation-ignores-its-agents-cuts",
        "conversations",
        "a conversation is cut on the grid and at its agent's end only, not where the agent's "
        "record is cut: the head shared with a sibling and the agent's tail are copied again",
        (
            Patch(
                "kvsnap.runtime.cache.entries",
                "make_entry",
                "        block_ends=tuple(end for _, _, end in info.chain.blocks) if info.chain "
                "else (),\n",
                "",
            ),
        ),
        (
            "tests/store/test_block_store_cuts.py::"
            "test_a_conversation_on_an_agent_cut_where_it_parts_"
            "names_that_agents_blocks",
        ),
    ),
    Breakage(
        "intermediate-checkpoint-never-repaired",
        "4. nothing half-written (bad parts rewritten)",
        "a rebuild does not check the stored checkpoints its restore does not read",
        (
            Patch(
                "kvsnap.build.pipeline",
                "restore_longest",
                "                check_checkpoint(store, key, identity.digest, link.end, "
                "link.prefix_digest)\n",
                "                pass\n",
            ),
        ),
        (
            "tests/store/test_block_store_repair.py::"
            "test_a_bad_intermediate_checkpoint_of_a_hybrid_is_"
            "rewritten_by_a_rebuild[flipped]",
        ),
    ),
    Breakage(
        "chain-decided-before-the-lock",
        "4. nothing lost (gc during a build)",
        "a build's chain names the checkpoints its restore saw, though a gc may have removed them "
        "since",
        (
            Patch(
                "kvsnap.runtime.persist.writeback",
                "put_snapshot",
                "        plan.keep_stored(store, identity, tokens)\n",
                "        pass\n",
            ),
        ),
        (
            "tests/store/test_block_store_repair.py::"
            "test_gc_between_a_hybrid_builds_prefill_and_its_"
            "commit_never_breaks_it",
        ),
    ),
    Breakage(
        "new-folder-not-fsynced",
        "4. nothing lost (durable folders)",
        "a folder the store creates is not fsynced in its parent",
        (
            Patch(
                "kvsnap.store.fileio",
                "make_dirs",
                "        # even when another writer made it: it may not have got this far\n"
                "        fsync_dir(new.parent, fsync)\n",
                "        pass\n",
            ),
        ),
        (
            "tests/store/test_block_store_durability.py::"
            "test_every_folder_a_store_creates_is_fsynced_in_"
            "its_parent_before_it_is_used",
        ),
    ),
    Breakage(
        "install-new-folder-not-fsynced",
        "4. nothing lost (durable folders)",
        "unpack and pull create a store's missing blocks/ or checkpoints/ with mkdir alone",
        (
            Patch(
                "kvsnap.store.install",
                "StagedInstall.commit",
                "                    make_dirs((store.root / relpath).parent, store.fsync)\n",
                "                    (store.root / relpath).parent.mkdir(exist_ok=True)\n",
            ),
        ),
        (
            "tests/store/test_block_store_durability.py::"
            "test_folders_an_unpack_adds_to_an_existing_store_are_fsynced_in_its_root",
        ),
    ),
    Breakage(
        "prepared-requests-not-counted-for-429",
        "server under attack",
        "a request takes its in-flight slot only after its prompt is rendered (heavy requests "
        "never see 429)",
        (
            Patch(
                "kvsnap.http.routes_generation",
                "prepared",
                "    ctx.admit()\n    try:\n        async with ctx.preparing():",
                "    try:\n        async with ctx.preparing():",
            ),
            Patch(
                "kvsnap.http.routes_generation",
                "submit",
                "    bridge = _Bridge(ctx.handoffs.current(), ctx.release)\n    try:\n",
                "    bridge = _Bridge(ctx.handoffs.current(), ctx.release)\n    ctx.admit()\n  "
                "  try:\n",
            ),
            Patch(
                "kvsnap.http.routes_generation",
                "prepared",
                "            return await run_in_threadpool(prepare)\n    except BaseException:\n"
                "        ctx.release()\n        raise\n",
                "            return await run_in_threadpool(prepare)\n    except BaseException:\n"
                "        raise\n",
            ),
        ),
        ("tests/http/test_limits.py::test_requests_being_prepared_count_toward_429",),
    ),
    Breakage(
        "handoff-wakes-loop-per-token",
        "serving cost (issue 41 item 1)",
        "every engine event schedules its own loop callback: the loop wakes once per token",
        (
            Patch(
                "kvsnap.http.handoff",
                "LoopHandoff.send",
                "            if len(self._pending) > 1:",
                "            if False:",
            ),
        ),
        (
            "tests/http/test_routes_generation.py::"
            "test_a_steps_events_from_the_engine_thread_wake_the_loop_once_in_order",
        ),
    ),
    Breakage(
        "openblas-default-spin",
        "serving cost (issue 41 item 1)",
        "OpenBLAS is loaded with its own idle spin (2^28 cycles after every call)",
        (
            Patch(
                "kvsnap.blas",
                "preload_openblas",
                '    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)\n',
                "",
            ),
        ),
        ("tests/test_blas.py::test_openblas_loads_with_a_short_idle_spin_unless_the_user_set_one",),
    ),
    Breakage(
        "shared-prefix-copied-per-row",
        "serving cost (issue 41 item 1)",
        "rows on one cached prefix each hold a copy of it in the batch",
        (
            Patch(
                "kvsnap.runtime.engine.batch_cache",
                "RoomyBatchKVCache.merge",
                "        if all(isinstance(c, PrefixedKVCache) for c in caches):\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/runtime/engine/test_batch_shared_prefix.py::"
            "test_rows_read_a_shared_hit_once_and_answer_as_a_cold_prefill",
        ),
    ),
    Breakage(
        "decode-steps-on-every-blas-thread",
        "serving cost (issue 41 item 1)",
        "a step that only decodes splits its thin matmuls over every OpenBLAS thread",
        (
            Patch(
                "kvsnap.runtime.engine.step_threads",
                "StepThreads.before_step",
                "        want = self.decoding_threads() if decoding_only else self.blas.default\n",
                "        want = self.blas.default\n",
            ),
        ),
        (
            "tests/runtime/engine/test_engine.py::"
            "test_a_step_that_only_decodes_runs_on_one_blas_thread_and_prompts_on_all_issue_41",
        ),
    ),
    Breakage(
        "decode-threads-blind-to-busy-cores",
        "serving cost (issue 41 item 1)",
        "a decode step on cores other processes fill still splits over every OpenBLAS thread",
        (
            Patch(
                "kvsnap.runtime.engine.step_threads",
                "threads_for_idle_cores",
                "    return max(1, min(most, round(idle)))\n",
                "    return most\n",
            ),
        ),
        (
            "tests/runtime/engine/test_step_threads.py::"
            "test_a_decode_step_on_busy_cores_takes_one_thread_and_a_prompt_step_every_thread",
        ),
    ),
    Breakage(
        "shared-row-kept-from-the-concatenation",
        "serving cost (issue 41 item 1)",
        "a shared row's kept prompt slices its own tokens from the prefix's whole concatenation",
        (
            Patch(
                "kvsnap.runtime.engine.request_cache",
                "_kept_from_views",
                "    own = _own_tokens(cache, n)\n",
                "    own: dict = {}\n",
            ),
        ),
        (
            "tests/runtime/engine/test_batch_shared_prefix.py::"
            "test_a_shared_row_keeps_its_prompt_copying_only_its_own_tokens",
        ),
    ),
    Breakage(
        "message-count-checked-after-rendering",
        "server under attack",
        "the message count is not checked before the messages are normalised and rendered",
        (
            Patch(
                "kvsnap.http.routes_generation",
                "generation_router.chat",
                "        ctx.check_sizes(req)\n",
                "",
            ),
        ),
        (
            "tests/http/test_limits.py::test_a_hundred_thousand_messages_are_refused_before_"
            "rendering_and_health_stays_fast",
        ),
    ),
    Breakage(
        "mlx-lm-profile-not-compared",
        "3. never foreign (another tokenization)",
        "kvsnap mlx-lm serve pins a snapshot built for another profile without a word",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.warm",
                "pin_store.other",
                "        return _rendering(recorded_tokenization(info.recorded)) != "
                "_rendering(server)\n",
                "        return False\n",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_profile.py::"
            "test_a_store_built_for_another_profile_warns_once_per_agent",
        ),
    ),
    Breakage(
        "mlx-lm-patch-import-unguarded",
        "upstream patches",
        "the patched mlx_lm.server ends in a traceback when kvsnap is not installed",
        (
            Patch(
                "contrib/mlx-lm/0001-server-kv-snapshots.patch",
                None,
                "+            sys.exit(2)\n",
                "+            raise\n",
            ),
        ),
        (
            "tests/integrations/test_contrib_patches.py::"
            "test_patched_mlx_lm_server_without_kvsnap_refuses_in_one_line",
        ),
    ),
    Breakage(
        "engine-lookup-counted-as-request",
        "observability",
        "the lookup of a prefix computed once for a batch is counted in /v1/status hits/misses",
        (
            Patch(
                "kvsnap.runtime.engine.request_cache",
                "RequestCaches._prefill_shared",
                "first.namespace, count=False\n",
                "first.namespace\n",
            ),
        ),
        (
            "tests/runtime/cache/test_shared_prefix.py::"
            "test_concurrent_cold_requests_sharing_a_system_prompt_"
            "compute_it_once",
        ),
    ),
    Breakage(
        "superseded-turn-dropped-whole",
        "conversations",
        "a superseded turn's record goes whole, not kept up to its last full block",
        (
            Patch(
                "kvsnap.store.conversation_writer",
                "ConversationWriter._supersede",
                "        kept = self._write_whole_blocks_record(info)\n",
                "        kept: set = set()\n",
            ),
        ),
        (
            "tests/store/test_conversations.py::test_a_forked_conversation_keeps_its_shared_turn_"
            "across_a_restart",
        ),
    ),
    Breakage(
        "conversation-blocks-ignore-warm-ends",
        "conversations",
        "a conversation's chain is cut on the grid only, not also where its agent's record ends",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "Persister._prepare",
                "warm_ends = self.prefix.shared_ends(tokens) if self.prefix is not None else []",
                "warm_ends = []",
            ),
        ),
        (
            "tests/store/test_conversations.py::"
            "test_a_conversation_shares_its_agents_partial_last_block",
        ),
    ),
    Breakage(
        "persisted-conversation-rewarmed-as-shared",
        "tenants",
        "a re-warm re-indexes a persisted conversation (file-backed) as a warm entry",
        (
            Patch(
                "kvsnap.runtime.warmup.rewarm",
                "start_rewarm",
                '        if e.source == "persisted":\n            continue',
                '        if e.source == "persisted" and False:\n            continue',
            ),
        ),
        (
            "tests/runtime/engine/test_engine_parts.py::"
            "test_a_rewarm_drops_a_tenants_persisted_conversation_"
            "and_never_shares_it_issue_23",
        ),
    ),
    Breakage(
        "persisted-records-ignore-namespace",
        "tenants",
        "every namespace's conversation records are keyed (and looked up) as the empty one's",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "Persister._digest",
                "        return conversation_digest(namespace_tag(self.secret, namespace))\n",
                '        return conversation_digest(namespace_tag(self.secret, ""))\n',
            ),
        ),
        (
            "tests/store/test_conversations.py::"
            "test_tenants_stay_apart_across_a_restart_and_nothing_"
            "on_disk_names_them",
        ),
    ),
    Breakage(
        "namespace-tag-without-secret",
        "tenants",
        "a namespace's tag on disk is an unsalted sha256 of it: the store's secret is ignored",
        (
            Patch(
                "kvsnap.store.conversations",
                "namespace_tag",
                "    return hmac.new(secret, namespace.encode(), hashlib.sha256)"
                ".hexdigest()[:32]\n",
                "    return hashlib.sha256(namespace.encode()).hexdigest()[:32]\n",
            ),
        ),
        (
            "tests/store/test_conversations.py::"
            "test_the_namespace_tag_is_keyed_by_the_stores_secret",
        ),
    ),
    Breakage(
        "conversation-removal-ignores-agent-parts",
        "4",
        "removing conversations (budget, purge, gc) also removes the blocks agents' records reach",
        (
            Patch(
                "kvsnap.store.conversation_space",
                "remove_records",
                "        gone = [rel for rel in unreached if rel not in reach.agent_parts]\n",
                "        gone = unreached\n",
            ),
        ),
        (
            "tests/store/test_conversations.py::test_remove_records_never_deletes_a_part_another_"
            "record_reaches",
            "tests/store/test_conversations.py::test_delete_prefix_cache_removes_persisted_"
            "conversations_and_only_their_blocks",
        ),
    ),
    Breakage(
        "budget-off-while-an-agent-record-is-unreadable",
        "bounded disk",
        "an agent record that cannot be read keeps every block: the budget removes records only",
        (
            Patch(
                "kvsnap.store.conversation_space",
                "remove_records",
                "    elif not reach.unreadable:\n        unreached = ",
                "    elif reach.complete:\n        unreached = ",
            ),
        ),
        (
            "tests/store/test_conversation_space.py::test_regression_an_unreadable_agent_record_no_"
            "longer_switches_the_budget_off",
            "tests/store/test_conversation_space.py::test_the_servers_budget_holds_while_an_agent_"
            "record_cannot_be_read",
        ),
    ),
    Breakage(
        "budget-one-global-lru",
        "tenants / bounded disk",
        "budget eviction takes the least recently used record of any namespace (one global "
        "LRU), not the namespace holding the most",
        (
            Patch(
                "kvsnap.store.conversation_space",
                "budget_victims",
                "        namespace = max(busy, key=lambda ns: "
                "(held[ns], -queues[ns][0].last_use))\n",
                "        namespace = min(busy, key=lambda ns: queues[ns][0].last_use)\n",
            ),
        ),
        (
            "tests/store/test_conversation_space.py::"
            "test_regression_one_tenants_flood_evicts_its_own_"
            "conversations_not_anothers",
            "tests/store/test_conversation_space.py::"
            "test_the_namespace_holding_the_most_gives_first_"
            "and_shares_split_shared_blocks",
        ),
    ),
    Breakage(
        "store-folder-link-followed",
        "nothing lost",
        "a store folder that is a symbolic link is listed and removed through (gc, DELETE, the "
        "budget reach files outside the store)",
        (
            Patch(
                "kvsnap.store.fileio",
                "store_folder",
                "        st = folder.lstat()\n",
                "        st = folder.stat()\n",
            ),
        ),
        (
            "tests/store/test_links.py::test_regression_a_linked_store_folder_is_refused_and_"
            "nothing_outside_is_removed",
            "tests/store/test_links.py::test_regression_delete_prefix_cache_never_removes_"
            "through_a_linked_conversations_folder",
        ),
    ),
    Breakage(
        "build-through-linked-folder",
        "nothing lost",
        "kvsnap build writes through a store folder that is a symbolic link (a store every "
        "reader then refuses)",
        (
            Patch(
                "kvsnap.build.pipeline",
                "build_snapshots",
                "    check_store_folders(store.root)\n",
                "",
            ),
        ),
        (
            "tests/store/test_links.py::test_build_into_a_store_with_a_linked_folder_is_refused_"
            "before_any_prefill",
        ),
    ),
    Breakage(
        "lock-file-link-followed",
        "nothing lost",
        "the writers' lock file is opened through a symbolic link: a dangling one makes every "
        "writer create its target, a file outside the store",
        (
            Patch(
                "kvsnap.store.local",
                "Store._open_lock_file",
                "os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE",
                "os.O_RDWR | os.O_CREAT, FILE_MODE",
            ),
        ),
        (
            "tests/store/test_links.py::test_a_lock_file_that_is_a_link_is_refused_and_its_"
            "target_never_made",
        ),
    ),
    Breakage(
        "gc-claims-odd-entries-removed",
        "nothing lost",
        "kvsnap gc --yes lists a FIFO named like a block or record as removed, and counts it, "
        "though it never removes one",
        (
            Patch(
                "kvsnap.store.collecting",
                "collect",
                "            doomed = [p for p in candidates if file_or_link(p)]\n",
                "            doomed = list(candidates)\n",
            ),
        ),
        ("tests/store/test_links.py::test_gc_never_claims_to_remove_a_fifo_or_a_folder_it_leaves",),
    ),
    Breakage(
        "odd-entry-keeps-every-block",
        "nothing lost",
        "a folder or FIFO named like a record counts as an unread record that might reach any "
        "block: DELETE, the budget and gc leave every conversation block for good",
        (
            Patch(
                "kvsnap.store.fileio",
                "file_or_link",
                "    return stat.S_ISREG(mode) or stat.S_ISLNK(mode)\n",
                "    return True\n",
            ),
        ),
        (
            "tests/store/test_conversation_space.py::test_regression_a_folder_or_fifo_named_like_a_"
            "record_never_keeps_the_blocks",
        ),
    ),
    Breakage(
        "unreadable-agent-blocks-removed-outside-budget",
        "nothing lost",
        "the purge, gc's unused-for drop and the sweep remove conversations' blocks while an agent "
        "record that might reach them cannot be read (only the budget may not wait for it)",
        (
            Patch(
                "kvsnap.store.conversation_space",
                "remove_records",
                "    if reach.unreadable_agents and not budget:\n",
                "    if False:\n",
            ),
            Patch(
                "kvsnap.store.conversation_space",
                "sweep_orphans",
                "        if not reach.complete:\n",
                "        if reach.unreadable:\n",
            ),
        ),
        (
            "tests/store/test_conversation_space.py::"
            "test_outside_the_budget_an_unreadable_agent_record_"
            "keeps_every_block",
        ),
    ),
    Breakage(
        "persist-through-folder-linked-while-serving",
        "nothing lost",
        "a store folder swapped for a symbolic link while the server runs gets every later "
        "record and block written through it, outside the store",
        (
            Patch(
                "kvsnap.store.conversation_writer",
                "ConversationWriter._write",
                "            check_store_folders(store.root)\n",
                "",
            ),
        ),
        (
            "tests/store/test_links.py::test_a_folder_swapped_for_a_link_while_serving_gets_"
            "nothing_written_through_it",
        ),
    ),
    Breakage(
        "persist-through-linked-folder",
        "nothing lost",
        "--persist-requests writes conversations through a store folder that is a symbolic link "
        "(what the budget and DELETE then cannot remove)",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "start_persister",
                "        check_store_folders(store.root)\n",
                "        pass\n",
            ),
        ),
        (
            "tests/store/test_links.py::test_regression_delete_prefix_cache_never_removes_"
            "through_a_linked_conversations_folder",
        ),
    ),
    Breakage(
        "unreadable-conversation-kept",
        "tenants / bounded disk",
        "an unreadable conversation record survives the purge and the budget, and stops every "
        "block removal",
        (
            Patch(
                "kvsnap.store.conversation_space",
                "drop_unreadable",
                "    if not paths:\n        return reach, 0, 0\n",
                "    if True:\n        return reach, 0, 0\n",
            ),
        ),
        (
            "tests/store/test_conversations.py::test_regression_an_unreadable_conversation_record_"
            "goes_first_and_then_blocks_go",
        ),
    ),
    Breakage(
        "verify-reports-superseded-conversation",
        "4",
        "verify counts a conversation record superseded since its listing as bad",
        (
            Patch(
                "kvsnap.commands.conversations",
                "verify_conversations",
                "            if not os.path.lexists(path):\n                continue\n",
                "            if False:\n                continue\n",
            ),
        ),
        (
            "tests/store/test_conversations.py::test_regression_verify_skips_a_record_superseded_"
            "while_it_runs",
        ),
    ),
    Breakage(
        "conversation-record-before-parts",
        "4. nothing lost, nothing half-written (persisted conversations)",
        "the conversation writer writes the record before the new blocks and checkpoint it names",
        (
            Patch(
                "kvsnap.store.conversation_writer",
                "ConversationWriter._write",
                "            for n, part in enumerate(item.parts):\n",
                "            atomic_write(record_path(store.root, item.key), lambda f: "
                "write_snapshot(f, item.tensors, item.metadata), store.fault, store.fsync)\n"
                "            for n, part in enumerate(item.parts):\n",
            ),
        ),
        (
            KILLED_AT + "[dense-conversation-mid-parts]",
            KILLED_AT + "[hybrid-conversation-mid-parts]",
        ),
    ),
    Breakage(
        "superseded-conversation-removed-first",
        "4. nothing lost, nothing half-written (persisted conversations)",
        "the record a longer one supersedes is removed before the new record is written",
        (
            Patch(
                "kvsnap.store.conversation_writer",
                "ConversationWriter._write",
                '            store.fault("conversation-before-record")\n',
                "            for old in item.supersedes:\n"
                "                self._supersede(item, old)\n"
                '            store.fault("conversation-before-record")\n',
            ),
        ),
        (
            KILLED_AT + "[dense-conversation-before-record]",
            KILLED_AT + "[dense-conversation-after-supersede]",
        ),
    ),
    Breakage(
        "conversation-enospc-not-stopping",
        "4. nothing lost, nothing half-written (persisted conversations)",
        "a full disk counts as one failed write: persisting goes on, a warning per write",
        (
            Patch(
                "kvsnap.store.conversation_writer",
                "ConversationWriter._write_guarded",
                "            if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:\n",
                "            if False:\n",
            ),
        ),
        (CRASH + "test_a_full_disk_stops_persisting_with_one_warning_and_serving_goes_on",),
    ),
    Breakage(
        "flush-write-under-way-not-counted",
        "4. nothing lost, nothing half-written (persisted conversations)",
        "the shutdown line counts only the queued writes, not the one stuck under way",
        (
            Patch(
                "kvsnap.store.conversation_writer",
                "ConversationWriter.close",
                "            under_way = int(self._busy and self._busy_write)\n",
                "            under_way = 0\n",
            ),
        ),
        (
            CRASH + "test_sigterm_with_writes_stuck_behind_another_writer_exits_within_the_"
            "flush_bound",
        ),
    ),
    Breakage(
        "bad-part-never-copied-again",
        "4. nothing lost, nothing half-written (persisted conversations)",
        "a block a load found bad is never copied again: the writer keeps refusing to name it, "
        "the conversation is never persisted again",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "Persister._prepare",
                "        bad = self.writer.health.bad_parts()  # copied again, and rewritten\n",
                "        bad = frozenset()\n",
            ),
        ),
        (
            DAMAGE
            + "test_a_bad_block_is_rewritten_by_the_next_write_and_every_record_naming_it_heals",
        ),
    ),
    Breakage(
        "stored-part-named-unchecked",
        "4. nothing lost, nothing half-written (persisted conversations)",
        "the conversation writer names a stored block it has not checked (only its existence): "
        "a bad one spreads into every new record",
        (
            Patch(
                "kvsnap.store.conversation_writer",
                "ConversationWriter._write",
                "            if has_part(store, *part) and not self.health.sound(store, *part)\n",
                "            if False\n",
            ),
        ),
        (
            DAMAGE
            + "test_a_bad_block_is_rewritten_by_the_next_write_and_every_record_naming_it_heals",
        ),
    ),
    Breakage(
        "write-back-names-bad-part",
        "4. nothing lost, nothing half-written",
        "the server's write-back of a warm prompt names the stored blocks it did not read, bad "
        "ones too",
        (
            Patch(
                "kvsnap.runtime.persist.writeback",
                "commit_snapshot",
                "        plan=ChainPlan(check_stored=True),\n",
                "        plan=ChainPlan(),\n",
            ),
        ),
        (DAMAGE + "test_a_bad_agent_block_is_rewritten_by_the_servers_write_back",),
    ),
    Breakage(
        "torn-record-hides-shorter",
        "4. a corrupt file is detected and the server falls back",
        "a persisted record that fails its checks at lookup ends the lookup (a shorter sound "
        "record of the conversation is not tried)",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "Persister.persisted_for",
                "                    self._unreadable(key, n, exc)\n",
                "                    return None\n",
            ),
        ),
        (
            DAMAGE + "test_a_torn_newest_record_falls_back_to_the_next_longest_and_is_replaced",
            DAMAGE
            + "test_an_unreadable_record_is_warned_about_once_and_passed_over_by_every_lookup",
        ),
    ),
    Breakage(
        "damaged-record-touched-not-rewritten",
        "4. a corrupt file is detected and the server falls back",
        "a persisted record already there is only touched at the next write of its prefix, "
        "damaged or not",
        (
            Patch(
                "kvsnap.store.conversation_writer",
                "ConversationWriter._write",
                "            if self._holds(target, item):",
                "            if target.exists():",
            ),
        ),
        (
            DAMAGE
            + "test_a_damaged_record_is_rewritten_when_its_turn_comes_again_and_never_kept_young",
        ),
    ),
    Breakage(
        "failed-load-record-kept",
        "4. a corrupt file is detected and the server falls back",
        "a persisted record that failed to load stays once a longer record serves it (a "
        "hybrid's own bad checkpoint is never rewritten: BAD for good)",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "Persister.offer.loader",
                "                _remember(self.failed_loads, info.key, info.n_tokens)\n",
                "                pass\n",
            ),
        ),
        (
            DAMAGE + "test_a_hybrid_record_whose_own_checkpoint_is_bad_goes_once_a_longer_one_"
            "serves_it",
        ),
    ),
    Breakage(
        "persisted-record-checksum-unchecked-at-lookup",
        "4. a corrupt file is detected and the server falls back",
        "the lookup takes (and touches) a persisted record on its header alone: a damaged one "
        "stays young and hides a shorter sound one",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "Persister._checked_record",
                "            check_data(path, read_header(path))\n",
                "            read_header(path)\n",
            ),
        ),
        (
            DAMAGE
            + "test_a_damaged_record_is_rewritten_when_its_turn_comes_again_and_never_kept_young",
        ),
    ),
    Breakage(
        "persisted-header-tokens-unchecked",
        "3. never stale, never foreign (persisted conversations)",
        "the lookup takes a persisted record whose header holds other tokens than the request's "
        "prefix its file name's key promised",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "Persister._checked_record",
                "            or tuple(info.tokens) != tuple(tokens[:n])\n",
                "",
            ),
        ),
        (DAMAGE + "test_a_record_whose_header_holds_other_tokens_than_its_name_is_refused",),
    ),
    Breakage(
        "vllm-mlx-persist-only-what-vllm-mlx-keys",
        "conversations survive restarts (the vllm-mlx route)",
        "the vllm-mlx route persists only vllm-mlx's prompt + reply entry, not its prompt-only cut",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.persist",
                "PersistHooks._capture",
                "        if 0 < n_prompt < n:\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/integrations/vllm_mlx/test_persist.py::"
            "test_hooks_persist_the_entry_and_its_prompt_only_"
            "cut_superseding_the_turn_they_continue",
            "tests/integrations/vllm_mlx/test_persist.py::"
            "test_a_conversation_survives_kill_9_and_its_next_"
            "turn_answers_as_if_never_restarted[dense]",
        ),
    ),
    Breakage(
        "vllm-mlx-delete-keeps-persisted",
        "conversations survive restarts (the vllm-mlx route)",
        "DELETE /v1/cache/prefix under kvsnap vllm-mlx serve clears memory only",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.session",
                "install_routes.clear_prefix_cache_and_rewarm",
                '                answer["persisted_removed"] = await session.purge_persisted()\n',
                '                answer["persisted_removed"] = 0\n',
            ),
        ),
        (
            "tests/integrations/vllm_mlx/test_persist.py::"
            "test_a_conversation_survives_kill_9_and_its_next_"
            "turn_answers_as_if_never_restarted[dense]",
        ),
    ),
    Breakage(
        "vllm-mlx-restore-not-shape-checked",
        "4. nothing lost, nothing half-written (persisted conversations, the vllm-mlx route)",
        "a persisted record is put into vllm-mlx's cache without comparing its tensors with the "
        "model's own cache",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.persist",
                "PersistHooks._restore",
                "            state = checked_state(self.persister.store, info, self.identity, "
                "self.shapes)\n",
                "            from kvsnap.snapshot.codec import decode_cache\n\n"
                "            state = decode_cache(\n"
                "                self.persister.store.load_arrays(info, self.identity), "
                "info.layers\n"
                "            )\n",
            ),
        ),
        (
            "tests/integrations/vllm_mlx/test_persist.py::"
            "test_a_forged_persisted_block_is_refused_and_the_"
            "turn_is_served_cold[all]",
        ),
    ),
    Breakage(
        "cache-grown-256-at-a-time",
        "build linear in prompt length",
        "a prefill lets mlx-lm grow each layer's KV buffer 256 tokens at a time, copying the whole "
        "cache at every growth",
        (
            Patch(
                "kvsnap.runtime.prefill.reserve",
                "reserve",
                "        layer.step = max(type(layer).step, n_tokens)\n",
                "        pass\n",
            ),
        ),
        (
            "tests/runtime/prefill/test_reserve.py::"
            "test_a_build_of_a_prompt_many_blocks_long_allocates_each_layers_buffer_once",
            "tests/runtime/engine/test_sequential.py::"
            "test_a_long_prompt_is_prefilled_into_one_buffer_per_layer_then_decode_grows_as_"
            "mlx_lm",
        ),
    ),
    Breakage(
        "manifest-written-per-entry",
        "build linear in agents",
        "the build reads, checks and rewrites the whole manifest after every entry",
        (
            Patch(
                "kvsnap.build.pipeline",
                "build_snapshots",
                "            if build.batch.due():\n",
                "            if True:\n",
            ),
        ),
        (
            "tests/build/test_record_batch.py::"
            "test_n_agents_write_the_manifest_a_constant_number_of_times[30]",
        ),
    ),
    Breakage(
        "gc-ignores-running-builds",
        "4. nothing lost (gc during a build)",
        "gc does not count the records a running build's pending file lists",
        (
            Patch(
                "kvsnap.store.collecting",
                "collect",
                "            live |= held\n",
                "",
            ),
        ),
        (
            "tests/store/test_pending.py::"
            "test_gc_keeps_a_running_builds_unlisted_record_and_removes_it_once_the_build_died",
            "tests/store/test_local.py::"
            "test_regression_gc_during_a_build_cannot_delete_a_snapshot_before_its_record",
        ),
    ),
    Breakage(
        "vllm-mlx-restore-error-fails-request",
        "4. nothing lost, nothing half-written (persisted conversations, the vllm-mlx route)",
        "an mlx error reading a persisted record (blocks that do not fit together) escapes into "
        "vllm-mlx's add_request",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.persist",
                "PersistHooks._restore",
                "        except (KvsnapError, OSError, ValueError, RuntimeError) as exc:\n",
                "        except (KvsnapError, OSError) as exc:\n",
            ),
        ),
        (
            "tests/integrations/vllm_mlx/test_persist.py::"
            "test_a_forged_persisted_block_is_refused_and_the_"
            "turn_is_served_cold[own]",
        ),
    ),
    Breakage(
        "sharded-rank-keeps-what-another-refused",
        "ranks agree (sharded mlx_lm.server)",
        "each rank pins the snapshots it could load itself, whatever the other ranks could",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.sharded",
                "ShardedSource.agree",
                "            verdict.append(not refusals)\n",
                "            verdict.append(everyone[self.ranks.rank][i] is None)\n",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_sharded.py::"
            "test_a_damaged_copy_on_one_rank_is_skipped_on_every_rank_with_one_warning",
        ),
    ),
    Breakage(
        "shard-rows-unchecked",
        "3. never a stale or foreign snapshot (a rank's slice)",
        "a rank serves the rows it read of a block without checking them against their digests",
        (
            Patch(
                "kvsnap.store.shard_read",
                "read_part_slice",
                "            digests.check(r.entry, r.first_row, part)\n",
                "            pass\n",
            ),
        ),
        (
            "tests/store/test_shard_read.py::"
            "test_a_damaged_copy_on_one_rank_is_refused_there_by_name",
        ),
    ),
    Breakage(
        "sharded-eviction-by-own-bytes",
        "ranks agree (sharded mlx_lm.server)",
        "each rank trims its prompt cache to --prompt-cache-bytes by its own bytes",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.cache",
                "AgreedPromptCache.trim_to",
                "        evicted: list = []\n",
                "        return super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)\n"
                "        evicted: list = []\n",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_sharded.py::"
            "test_evictions_stay_in_step_across_unequal_pipeline_stages",
        ),
    ),
    Breakage(
        "sharded-keys-from-the-slice",
        "one store, any topology",
        "a pipeline rank keys snapshots by its own slice's cache layout, not the whole model's",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.warm",
                "_warm_prompt_cache",
                "        lm = replace(lm, logical_layout=logical_layout(lm.path, "
                "lm.settings.max_kv_size))\n",
                "        pass\n",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_sharded.py::"
            "test_a_store_built_by_one_process_starts_both_ranks_warm_answering_as_"
            "cold[hybrid-extra1]",
        ),
    ),
    Breakage(
        "hit-copied-by-the-batch",
        "the first warm request at its compute (issue 32)",
        "a hit's copy goes into mlx-lm's BatchGenerator as it is: merged into a buffer sized to "
        "the prompt, grown by the first prompt step, gathered on the way to decoding",
        (
            Patch(
                "kvsnap.runtime.engine.batch_runner",
                "BatchRunner._batch_cache",
                "            return for_batch(cache, new)\n        key",
                "            return cache\n        key",
            ),
            Patch(  # the hit then goes in as the request's own copy, not shared
                "kvsnap.runtime.engine.batch_runner",
                "BatchRunner.__init__",
                "self.shares_prefixes = install_shared_attention(self.lm.model)",
                "self.shares_prefixes = False",
            ),
        ),
        (
            "tests/runtime/engine/test_engine.py::"
            "test_regression_a_hit_copies_its_cached_tokens_once",
        ),
    ),
    Breakage(
        "kept-prefix-copied-whole",
        "the first warm request at its compute (issue 32)",
        "the prompt prefix a hit keeps copies the warm tokens instead of sharing their blocks",
        (
            Patch(
                "kvsnap.runtime.engine.batch_runner",
                "BatchRunner.step",
                "self._heads.get(r.uid),",
                "None,",
            ),
        ),
        (
            "tests/runtime/engine/test_engine.py::"
            "test_regression_a_hit_copies_its_cached_tokens_once",
        ),
    ),
    Breakage(
        "priming-skipped",
        "ready as soon as mlx_lm.server (issue 41)",
        "the kernel priming after warm is dropped: the first request pays mlx's kernel compile",
        (
            Patch(
                "kvsnap.runtime.engine.engine",
                "Engine._serve",
                "        self._prime_kernels()\n        self.serving_started.set()\n",
                "        self.serving_started.set()\n",
            ),
        ),
        (
            "tests/runtime/engine/test_startup.py::"
            "test_the_kernel_priming_runs_after_warm_and_before_the_first_request",
        ),
    ),
    Breakage(
        "weights-read-by-the-first-request",
        "ready as soon as mlx_lm.server (issue 41)",
        "the weights mapped at load are left for the first request to read: an unreadable "
        "weight file fails requests one by one instead of ending the engine",
        (
            Patch(
                "kvsnap.runtime.engine.engine",
                "Engine._read_weights",
                "        if not self.config.weights_after_warm:\n",
                "        if True:\n",
            ),
        ),
        (
            "tests/runtime/engine/test_startup.py::"
            "test_weights_unreadable_after_warm_end_the_engine_with_the_error",
        ),
    ),
    Breakage(
        "health-waits-for-the-api",
        "ready as soon as mlx_lm.server (issue 41)",
        "the staged app holds /health until the HTTP API is imported, as any other request",
        (
            Patch(
                "kvsnap.http.staged",
                "StagedApp.__call__",
                "            if not self._built.done():\n",
                "            if False:\n",
            ),
        ),
        (
            "tests/http/test_staged.py::"
            "test_health_answers_before_the_api_is_built_and_requests_wait_for_it",
        ),
    ),
    Breakage(
        "tier-buffer-through-python-reader",
        "never stuck (issue 40)",
        "a shared-tier fetch makes its part buffers through mx.load's Python reader beside the "
        "engine's steps: with mlx-lm's clear_cache the process hangs",
        (
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "_mlx_buffer",
                "    return on_mlx_thread(unfilled_tensors, header, True)\n",
                "    return on_mlx_thread(unfilled_tensors, header, False)\n",
            ),
        ),
        (
            "tests/runtime/persist/test_tier_buffers.py::"
            "test_a_fetch_making_buffers_beside_the_engines_steps_never_hangs",
        ),
    ),
    Breakage(
        "fetched-record-concatenated-at-admission",
        "fleet failover cost (issue 40)",
        "a record fetched into one buffer per tensor is copied as its blocks' concatenation, "
        "as if it were not (the batch's shared prefix then copies all of its KV)",
        (
            Patch(
                "kvsnap.runtime.cache.composed",
                "ComposedState.materialize",
                "        if self.buffers is not None and not whole:\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/store/test_reading.py::"
            "test_a_fetched_record_read_as_a_shared_prefix_copies_nothing",
        ),
    ),
    Breakage(
        "fetched-room-written-a-token-late",
        "fleet: every answer a never-killed server's (issue 40)",
        "the request that continues a fetched record writes its own tokens' KV one position "
        "late in the buffers' room: its kept prefix holds a stale token",
        (
            Patch(
                "kvsnap.store.tier_layout",
                "RecordBuffers.extend",
                "                    at = (lead * self.capacity + self.n + done) * row\n",
                "                    at = (lead * self.capacity + self.n + done + 1) * row\n",
            ),
        ),
        (
            "tests/store/test_reading.py::"
            "test_a_fetched_records_buffers_take_the_tokens_that_continue_it_once",
        ),
    ),
    Breakage(
        "fetched-early-blocks-left-out",
        "fleet: every answer a never-killed server's (issue 40)",
        "the blocks a fetch received before the record's buffers were made are not copied "
        "into them: those tokens read zeros",
        (
            Patch(
                "kvsnap.store.tier_layout",
                "ChainLayout.finish",
                "                run[:] = data[at : at + len(run)]\n",
                "                pass\n",
            ),
        ),
        (
            "tests/store/test_reading.py::"
            "test_blocks_received_before_the_buffers_are_made_are_copied_in",
        ),
    ),
    Breakage(
        "fetched-blocks-in-buffers-of-their-own",
        "fleet failover cost (issue 40)",
        "a fetch of every block of a record receives each into a buffer of its own (the record "
        "has no contiguous form)",
        (
            Patch(
                "kvsnap.store.tier_layout",
                "ChainLayout.finish",
                "        if self._refused or not set(self.spans)",
                "        if True or self._refused or not set(self.spans)",
            ),
        ),
        (
            "tests/store/test_reading.py::"
            "test_a_records_blocks_received_into_one_buffer_per_tensor_are_views_of_it",
        ),
    ),
    Breakage(
        "fetched-buffers-sized-by-a-forged-header",
        "shared tier security: a value is used only when its MAC holds (issue 40)",
        "a fetched record's buffers are sized by a block's header before its MAC is checked, "
        "not bounded by the record's sealed part sizes: a planted header has a replica zero GBs",
        (
            Patch(
                "kvsnap.store.tier_layout",
                "ChainLayout.place",
                "        if sealed is not None and header.file_size != sealed:",
                "        if False:",
            ),
            Patch(
                "kvsnap.store.tier_layout",
                "ChainLayout._within_sealed",
                "        if self._sizes is None:",
                "        if True:",
            ),
        ),
        (
            "tests/store/test_reading.py::"
            "test_a_forged_block_header_makes_no_buffers_past_what_its_record_sealed",
            "tests/runtime/persist/test_shared_tier_fetch.py::"
            "test_a_block_header_planted_without_the_secret_makes_no_buffers",
        ),
    ),
    Breakage(
        "fetched-layout-runs-unchecked",
        "shared tier security: a value is used only when its MAC holds (issue 40)",
        "a block received straight into a fetched record's buffers (runs, not a buffer of its "
        "own) skips the MAC check: a flipped or foreign block is served",
        (
            Patch(
                "kvsnap.store.tier_values",
                "receive_part",
                "    _check_mac(header, mac.hexdigest())\n",
                "    if isinstance(placed, memoryview):\n"
                "        _check_mac(header, mac.hexdigest())\n",
            ),
        ),
        (
            "tests/store/test_reading.py::"
            "test_a_placed_block_flipped_or_foreign_leaves_its_record_without_buffers",
        ),
    ),
    Breakage(
        "fetched-buffers-with-a-refused-block",
        "shared tier security: a value is used only when its MAC holds (issue 40)",
        "a record whose every block went into its buffers yields them though a block was refused "
        "after (its MAC failed): the refused bytes are served",
        (
            Patch(
                "kvsnap.store.tier_layout",
                "ChainLayout.finish",
                "not set(self.spans) <= self._placed & set(received)",
                "not set(self.spans) <= self._placed",
            ),
        ),
        (
            "tests/store/test_reading.py::"
            "test_a_placed_block_flipped_or_foreign_leaves_its_record_without_buffers",
        ),
    ),
    Breakage(
        "fetched-record-dropped-for-its-buffers",
        "shared tier: a failover is served from what was fetched (issue 40)",
        "the fetched record's buffers failing to be made (out of memory, cancelled, past the "
        "deadline) throws the checked fetch away, or waits on them without a bound",
        (
            Patch(
                "kvsnap.store.tier_layout",
                "ChainLayout.finish",
                "            except Exception as exc:\n",
                "            except ZeroDivisionError as exc:\n",
            ),
        ),
        (
            "tests/store/test_reading.py::"
            "test_a_record_whose_buffers_were_not_made_is_served_block_by_block",
            "tests/runtime/persist/test_shared_tier_fetch.py::"
            "test_a_fetch_whose_buffers_cannot_be_made_is_served_from_its_blocks",
        ),
    ),
    Breakage(
        "fetch-miss-leaves-its-buffers-queued",
        "shared tier: a failed fetch costs the engine nothing more (issue 40)",
        "a shared-tier fetch that misses a part or runs past its budget does not abandon its "
        "record's layout: the buffers asked for are zeroed for nothing",
        (
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "SharedTier._fetch_record",
                "                layout.abandon()  # failed",
                "                pass  # failed",
            ),
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "SharedTier._fetch_part",
                "                layout.abandon()\n            raise\n",
                "                pass\n            raise\n",
            ),
        ),
        (
            "tests/runtime/persist/test_shared_tier_fetch.py::"
            "test_a_fetch_that_misses_a_block_never_makes_the_records_buffers",
        ),
    ),
    Breakage(
        "fetched-buffers-zeroed-after-a-miss",
        "shared tier: a failed fetch costs the engine nothing more (issue 40)",
        "a fetch that missed or ran past its budget leaves its record's buffers to be zeroed "
        "(GBs beside the engine's steps, for nothing)",
        (
            Patch(
                "kvsnap.store.tier_layout",
                "ChainLayout.abandon",
                "            made.cancel()\n",
                "            pass\n",
            ),
        ),
        ("tests/store/test_reading.py::test_an_abandoned_fetch_never_makes_its_records_buffers",),
    ),
    Breakage(
        "fetched-blocks-zeroed-twice",
        "shared tier: a failover's fetch pays for its memory once (issue 40)",
        "a fetched record's blocks are received into buffers of their own while the record's "
        "buffers are made (the same fresh pages paid twice on the same cores, then a copy)",
        (
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "_layout_for",
                "        wait=True,\n",
                "        wait=False,\n",
            ),
        ),
        (
            "tests/runtime/persist/test_shared_tier_fetch.py::"
            "test_blocks_wait_for_the_records_buffers_instead_of_zeroing_their_own",
        ),
    ),
    Breakage(
        "ranged-read-past-an-eviction",
        "shared tier: a value evicted while read is a miss (issue 40)",
        "a GETRANGE shorter than asked (the value evicted mid-read) is taken as its bytes",
        (
            Patch(
                "kvsnap.store.tier_backends",
                "_RangedValue._next_range",
                "        if got != wanted:\n",
                "        if got is None:\n",
            ),
        ),
        (
            "tests/store/test_tier_backends.py::"
            "test_a_redis_value_evicted_while_read_in_ranges_is_a_miss",
        ),
    ),
    Breakage(
        "partial-match-copies-whole-entry",
        "serving cost (issue 41)",
        "a partial prefix match copies the whole entry, then trims it: a 1-token match on a "
        "2k-token snapshot copies all of its KV",
        (
            Patch(
                "kvsnap.runtime.cache.prefix",
                "PrefixCache._copy",
                "        if self.copy_head is not None and match.n_cached < len(entry.tokens):\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/runtime/cache/test_prefix.py::"
            "test_a_partial_match_copies_only_the_tokens_it_uses",
        ),
    ),
    Breakage(
        "import-without-model",
        "3. never foreign (issue 39)",
        "a save_prompt_cache file whose metadata names no model is imported unchecked",
        (
            Patch(
                "kvsnap.api",
                "_require_same_model",
                "    if recorded is None:\n        raise UsageError(",
                "    if recorded is None:\n        return\n        raise UsageError(",
            ),
        ),
        (API_IMPORTS + "test_a_file_naming_no_model_is_refused",),
    ),
    Breakage(
        "import-other-tokenizer",
        "3. never foreign (issue 39)",
        "a file from a copy of the model with another tokenizer counts as the same model",
        (
            Patch(
                "kvsnap.api",
                "_same_files",
                "        and tokenizer_digest(a) == tokenizer_digest(b)\n",
                "",
            ),
        ),
        (API_IMPORTS + "test_a_file_from_a_copy_of_the_model_with_another_tokenizer_is_refused",),
    ),
    # --- tool calls and logprobs (issue 39): breakages an independent mutation run made
    Breakage(
        "cut-call-reported-as-tool-calls",
        "tool calls (issue 39)",
        "a call cut at max_tokens is reported with finish_reason tool_calls, not length",
        (
            Patch(
                "kvsnap.http.tool_calls",
                "AnswerSplitter.finish_reason",
                'return "tool_calls" if reason == "stop" and self.tool_calls else reason',
                'return "tool_calls" if self.tool_calls else reason',
            ),
        ),
        (
            TOOL_CALLS + "test_a_call_cut_by_max_tokens_is_what_was_generated_with_finish_reason_"
            "length",
            TOOL_CALLS + "test_splitter_a_call_cut_after_its_json_is_a_call_with_finish_reason_"
            "length",
        ),
    ),
    Breakage(
        "streamed-calls-all-index-0",
        "tool calls (issue 39)",
        "every streamed call has index 0: a client merges two parallel calls into one",
        (
            Patch(
                "kvsnap.http.tool_calls",
                "AnswerSplitter._end_call",
                'call["index"] = len(self.tool_calls)',
                'call["index"] = 0',
            ),
        ),
        (
            TOOL_CALLS + "test_two_calls_in_one_answer_come_back_as_two",
            TOOL_CALLS + "test_splitter_numbers_parallel_calls",
        ),
    ),
    Breakage(
        "cut-call-dropped",
        "tool calls (issue 39)",
        "a call cut before its end marker (max_tokens) is dropped",
        (
            Patch(
                "kvsnap.http.tool_calls",
                "AnswerSplitter.finish",
                "            deltas += self._end_call(closed=False)\n",
                '            self._tool_text = ""\n',
            ),
        ),
        (
            TOOL_CALLS + "test_a_call_cut_by_max_tokens_is_what_was_generated_with_finish_reason_"
            "length",
            TOOL_CALLS + "test_splitter_a_call_cut_inside_its_json_is_content_as_written",
        ),
    ),
    Breakage(
        "parameters-call-empty",
        "tool calls (issue 39)",
        'a call written with "parameters" (Llama-3.1\'s key) arrives with arguments {}',
        (
            Patch(
                "kvsnap.http.tool_calls",
                "_openai_call",
                'parsed.get("arguments", parsed.get("parameters", {}))',
                'parsed.get("arguments", {})',
            ),
        ),
        (
            TOOL_CALLS + "test_deepseek_r1_reasons_from_the_first_token_and_reads_parameters",
            TOOL_CALLS + "test_splitter_reads_parameters_as_arguments",
        ),
    ),
    Breakage(
        "deepseek-r1-waits-for-think",
        "tool calls (issue 39)",
        "--reasoning-parser deepseek_r1 starts an answer as content, so one that never opens "
        "<think> keeps its reasoning and </think> in content",
        (
            Patch(
                "kvsnap.http.tool_calls",
                "output_rules",
                'reasoning_first=reasoning_parser == "deepseek_r1",',
                "reasoning_first=False,",
            ),
        ),
        (
            TOOL_CALLS + "test_deepseek_r1_reasons_from_the_first_token_and_reads_parameters",
            TOOL_CALLS + "test_splitter_deepseek_r1_answers_start_as_reasoning",
        ),
    ),
    Breakage(
        "logprob-of-the-top-token",
        "logprobs (issue 39)",
        "the sampled token's logprob is the likeliest token's (greedy runs cannot tell)",
        (
            Patch(
                "kvsnap.runtime.engine.sampling",
                "token_logprob",
                "    chosen = cast(float, logprobs[token].item())\n",
                "    chosen = cast(float, logprobs.max().item())\n",
            ),
        ),
        (
            LOGPROBS + "test_a_sampled_tokens_logprob_is_its_own",
            LOGPROBS + "test_token_logprob_is_the_chosen_tokens_value",
        ),
    ),
    Breakage(
        "top-logprobs-all-the-chosen-token",
        "logprobs (issue 39)",
        "every top_logprobs entry carries the chosen token's text and bytes",
        (
            Patch(
                "kvsnap.http.logprobs",
                "chat_logprobs",
                '"top_logprobs": [one(i, v) for i, v in e.top]',
                '"top_logprobs": [one(e.token, v) for i, v in e.top]',
            ),
        ),
        (
            LOGPROBS + "test_chat_logprobs_equal_mlx_lm_servers",
            LOGPROBS + "test_a_sampled_tokens_logprob_is_its_own",
            LOGPROBS + "test_chat_top_logprobs_name_their_own_tokens",
        ),
    ),
    Breakage(
        "alike-texts-keep-the-less-likely",
        "logprobs (issue 39)",
        "in a completion's top_logprobs, tokens whose texts are alike keep the less likely value",
        (
            Patch(
                "kvsnap.http.logprobs",
                "completion_logprobs",
                "            alike.setdefault(_text(token_bytes(i)), v)\n",
                "            alike[_text(token_bytes(i))] = v\n",
            ),
        ),
        (LOGPROBS + "test_completion_top_logprobs_of_texts_alike_keep_the_likeliest",),
    ),
    # --- issue 39: the metrics, cached_tokens at a whole warm prompt, persistence --------------
    Breakage(
        "metrics-tpot-over-all-tokens",
        "metrics (issue 39)",
        "the time per output token divides the decode time by every output token, the first "
        "included: decoding looks faster than it is",
        (
            Patch(
                "kvsnap.http.metrics",
                "Metrics.finished",
                "self.tpot.observe((done - first) / (state.completion_tokens - 1))",
                "self.tpot.observe((done - first) / state.completion_tokens)",
            ),
        ),
        (METRICS + "test_time_per_output_token_is_over_the_tokens_after_the_first",),
    ),
    Breakage(
        "metrics-bytes-of-unloaded-entries",
        "metrics (issue 39)",
        "kvsnap_cache_bytes adds the size of entries only indexed, not in memory",
        (
            Patch(
                "kvsnap.http.metrics",
                "EngineCollector._entries",
                "nbytes[kind] += entry.nbytes if entry.loaded else 0",
                "nbytes[kind] += entry.nbytes",
            ),
        ),
        (METRICS + "test_cache_bytes_count_only_the_entries_in_memory",),
    ),
    Breakage(
        "metrics-persist-enabled-after-full-disk",
        "metrics (issue 39)",
        "kvsnap_persist_enabled stays 1 after a full disk stopped persisting",
        (
            Patch(
                "kvsnap.http.metrics",
                "EngineCollector._persist",
                'int(bool(persist.get("enabled")) and not persist.get("disabled"))',
                'int(bool(persist.get("enabled")))',
            ),
        ),
        (METRICS + "test_a_full_disk_turns_persist_enabled_to_0",),
    ),
    Breakage(
        "metrics-exception-counted-200",
        "metrics (issue 39)",
        "a request ended by an unhandled exception (answered 500 outside the counter) is "
        "counted as status 200",
        (
            Patch(
                "kvsnap.http.metrics",
                "RequestCounter.__call__",
                "        status = 500  # unless a response starts",
                "        status = 200  # unless a response starts",
            ),
        ),
        (METRICS + "test_an_unhandled_exception_counts_as_a_500",),
    ),
    Breakage(
        "cached-tokens-whole-warm-prompt-above-reuse",
        "7. honest accounting",
        "with keys, a prompt that is exactly a warm prompt reports the whole warm prompt as "
        "cached, its last token (computed) included",
        (
            Patch(
                "kvsnap.runtime.engine.accounting",
                "reported_cached_tokens",
                "return max(min(told_exactly, cached), cached - cached % granularity)",
                "return max(told_exactly, cached - cached % granularity)",
            ),
        ),
        (
            "tests/http/test_cached_tokens.py::"
            "test_with_keys_a_prompt_that_is_exactly_a_warm_prompt_reports_what_was_reused",
        ),
    ),
    Breakage(
        "rewritten-bad-part-stays-bad",
        "4. nothing lost, nothing half-written (persisted conversations)",
        "a bad block the writer rewrote stays marked bad: every later record reaching it "
        "copies and rewrites it again",
        (
            Patch(
                "kvsnap.store.checking",
                "PartHealth.mark_good",
                "                self._bad.discard(part)\n",
                "",
            ),
        ),
        (DAMAGE + "test_a_rewritten_bad_block_is_good_again_and_not_rewritten_by_later_records",),
    ),
    Breakage(
        "persisted-header-namespace-unchecked",
        "3. never foreign (persisted conversations)",
        "the lookup takes a persisted record whose header names another namespace than the "
        "request's, when its key collides with the one looked up",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "Persister._checked_record",
                "            info.prompt_digest != conv_digest\n            or ",
                "            ",
            ),
        ),
        (
            DAMAGE + "test_a_record_whose_header_holds_another_namespace_is_refused_though_"
            "its_key_collides",
        ),
    ),
    Breakage(
        "kv-form-start-exclusive",
        "4. nothing lost (--quantized-kv-start)",
        "a prefix of exactly --quantized-kv-start tokens is taken as unquantized (mlx-lm "
        "quantizes once the offset reaches the start): a build no longer restores there",
        (
            Patch(
                "kvsnap.snapshot.blocks",
                "kv_form_at",
                "if n_tokens >= (identity.quantized_kv_start or 0)",
                "if n_tokens > (identity.quantized_kv_start or 0)",
            ),
        ),
        (
            QUANTIZED_START + "test_a_start_exactly_at_a_warm_prompts_end_restores_there[dense]",
            QUANTIZED_START + "test_a_start_exactly_at_a_warm_prompts_end_restores_there[hybrid]",
        ),
    ),
    Breakage(
        "quantized-checkpoint-at-start-dropped",
        "4. nothing lost (--quantized-kv-start)",
        "a hybrid's quantized chain drops its checkpoint exactly at the quantization start (a "
        "quantized state): a warm prompt ending there has no checkpoint to restore",
        (
            Patch(
                "kvsnap.runtime.persist.writeback",
                "ChainPlan.links",
                "link.checkpoint_key and link.end < start else link",
                "link.checkpoint_key and link.end <= start else link",
            ),
        ),
        (QUANTIZED_START + "test_a_start_exactly_at_a_warm_prompts_end_restores_there[hybrid]",),
    ),
    Breakage(
        "sharded-missing-copy-counted-usable",
        "ranks agree (sharded mlx_lm.server)",
        "a rank whose host has no copy of a snapshot (missing, not damaged) counts the entry "
        "usable: the other ranks pin it, this one does not (a hit on one rank, a miss on another)",
        (
            Patch(
                "kvsnap.integrations.mlx_lm.sharded",
                "ShardedSource.agree",
                "None if reason is None and info is not None else",
                "None if reason is None else",
            ),
        ),
        (
            "tests/integrations/mlx_lm/test_sharded_agreement.py::"
            "test_an_entry_one_rank_lacks_or_cannot_read_is_used_by_no_rank[missing]",
            "tests/integrations/mlx_lm/test_sharded_agreement.py::"
            "test_a_snapshot_missing_on_one_ranks_host_is_pinned_on_no_rank[record]",
        ),
    ),
    Breakage(
        "sharded-every-rank-writes-a-shared-folder",
        "ranks agree (sharded mlx_lm.server)",
        "every rank that can write its store folder writes back what it prefilled, also where "
        "the ranks share one folder (one host, a network share): they race on the same paths",
        (
            Patch(
                "kvsnap.runtime.sharding.agreement",
                "elect_writers",
                "    return made and (not seen or seen[0] == ranks.rank)\n",
                "    return made\n",
            ),
        ),
        (
            "tests/runtime/sharding/test_agreement.py::"
            "test_ranks_sharing_one_folder_elect_rank_0_alone_and_leave_no_probe",
            "tests/runtime/sharding/test_agreement.py::"
            "test_the_lowest_rank_that_can_write_a_shared_folder_writes_it",
        ),
    ),
    Breakage(
        "budget-tenant-per-cache-salt",
        "tenants / bounded disk",
        "the disk budget's unit is the namespace again (API key + cache_salt), not the key: a "
        "key sending many cache_salts holds a share for each and evicts another key's records",
        (
            Patch(
                "kvsnap.store.conversation_space",
                "ConversationRecord.owner",
                "        return self.tenant or self.namespace\n",
                "        return self.namespace\n",
            ),
        ),
        (
            "tests/store/test_conversation_space.py::"
            "test_regression_a_keys_salts_share_its_share_not_one_each",
            "tests/store/test_conversation_space.py::"
            "test_regression_one_key_with_ten_salts_no_longer_evicts_another_keys",
        ),
    ),
    Breakage(
        "vllm-mlx-shared-batch-sampler",
        "hostile requests: one tenant's sampling fails no other's (vllm-mlx.md)",
        "vllm-mlx samples its whole batch with the sampler of the request that made its batch "
        "generator: a greedy request beside another key's sampled one samples too",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.sampling",
                "own_row_samplers._ensure_batch_generator",
                "        ensure(self, shared)\n",
                "        ensure(self, sampling_params)\n",
            ),
            Patch(
                "kvsnap.integrations.vllm_mlx.sampling",
                "own_row_samplers._create_batch_generator.insert_with_sampler",
                '                kwargs["samplers"] = [sampler for _ in prompts]\n',
                "                pass\n",
            ),
        ),
        (
            VLLM_MLX_SAMPLING + "test_a_greedy_request_beside_another_keys_sampling_stays_greedy",
            VLLM_MLX_SAMPLING + "test_a_sampled_request_beside_a_greedy_one_samples",
        ),
    ),
    Breakage(
        "vllm-mlx-greedy-rows-without-sampler",
        "hostile requests: one tenant's sampling fails no other's (vllm-mlx.md)",
        "greedy rows go into vllm-mlx's batch without a sampler: mlx-lm 0.31 leaves an all-None "
        "sampler list untrimmed, and later rows take another request's sampler",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.sampling",
                "own_row_samplers._create_batch_generator.insert_with_sampler",
                '                kwargs["samplers"] = [sampler for _ in prompts]\n',
                '                kwargs["samplers"] = [None if sampler is greedy else sampler]\n',
            ),
        ),
        (
            VLLM_MLX_SAMPLING + "test_a_greedy_request_beside_another_keys_sampling_stays_greedy",
            VLLM_MLX_SAMPLING + "test_a_sampled_request_beside_a_greedy_one_samples",
        ),
    ),
    Breakage(
        "vllm-mlx-sampling-body-unchecked",
        "hostile requests: sampling values at their edges (vllm-mlx.md)",
        "a NaN or infinite sampling number, or a min_p outside [0, 1], reaches vllm-mlx: a 500, "
        "or apply_min_p raising in the batch",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.sampling",
                "guard_sampling",
                "    server.app.add_middleware(SamplingChecks, "
                'api_key=lambda: getattr(server, "_api_key", None))\n',
                "",
            ),
        ),
        (
            VLLM_MLX_SAMPLING
            + "test_a_sampling_value_no_batch_can_take_is_refused_naming_its_field",
        ),
    ),
    Breakage(
        "vllm-mlx-sampler-failure-unreported",
        "hostile requests: one tenant's sampling fails no other's (vllm-mlx.md)",
        "a row whose sampler raised goes on with greedy tokens and answers 200, its failure "
        "never reported",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.sampling",
                "own_row_samplers._process_batch_responses",
                "            if sampler is not None and sampler.error is not None "
                "and rid is not None:",
                "            if False:",
            ),
        ),
        (VLLM_MLX_SAMPLING + "test_a_sampler_that_raises_fails_its_own_request_alone",),
    ),
    Breakage(
        "vllm-mlx-random-state-left-broken",
        "hostile requests: one tenant's sampling fails no other's (vllm-mlx.md)",
        "after a sampler raised inside mlx-lm's compiled filter, mlx's random state stays "
        "unusable: every later draw on it raises",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.sampling",
                "RowSampler.__call__",
                "            mx.random.seed(random.getrandbits(63))\n",
                "            pass\n",
            ),
        ),
        (VLLM_MLX_SAMPLING + "test_a_failed_row_sampler_leaves_mlx_random_state_usable",),
    ),
    Breakage(
        "vllm-mlx-tiny-top-p-samples",
        "hostile requests: sampling values at their edges (vllm-mlx.md)",
        "a top_p of 1e-50 is sampled through mlx-lm 0.31's apply_top_p, which drops every "
        "token (1 - top_p rounds to 1): a random draw",
        (
            Patch(
                "kvsnap.integrations.vllm_mlx.sampling",
                "row_sampler.sample",
                "        if top_p * logprobs.shape[-1] <= 1:",
                "        if False:",
            ),
        ),
        (VLLM_MLX_SAMPLING + "test_values_that_overflow_float32_answer_as_greedy",),
    ),
    Breakage(
        "tier-mac-unchecked",
        "a fleet's tier: never a torn, flipped or planted value (fleet.md)",
        "a tier value's MAC is compared with itself: a payload swapped or planted without the "
        "fleet's secret opens as data",
        (
            Patch(
                "kvsnap.store.tier_values",
                "_check_mac",
                'hmac.compare_digest(header["mac"], computed)',
                'hmac.compare_digest(header["mac"], header["mac"])',
            ),
        ),
        (
            TIER_VALUES + "test_a_payload_swapped_for_another_of_the_same_size_is_a_format_error",
            "tests/store/test_reading.py::"
            "test_a_received_part_flipped_truncated_or_foreign_is_refused",
        ),
    ),
    Breakage(
        "tier-namespaces-merged",
        "a fleet's tier: tenants apart (fleet.md)",
        "the namespace tag ignores the namespace: two API keys' conversations share names",
        (
            Patch(
                "kvsnap.store.tier_values",
                "namespace_tag",
                'b"kvsnap-tier-ns|" + namespace.encode()',
                'b"kvsnap-tier-ns|"',
            ),
        ),
        (
            TIER_VALUES
            + "test_two_namespaces_share_no_name_and_differ_only_in_the_namespace_field",
            TIER_FAULTS + "test_two_keys_on_one_prompt_share_nothing_in_the_tier",
        ),
    ),
    Breakage(
        "tier-fetch-unbounded",
        "a fleet's tier: never stuck (fleet.md)",
        "a request waits for the tier's answer however long it takes, past the budget",
        (
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "SharedTier.fetch",
                "return future.result(timeout=self.options.budget_s)",
                "return future.result()",
            ),
        ),
        (TIER_UNIT + "test_a_fetch_waits_at_most_its_budget_on_a_tier_that_does_not_answer",),
    ),
    Breakage(
        "tier-breaker-never-opens",
        "a fleet's tier: never stuck (fleet.md)",
        "the breaker never opens: a failing tier is asked by every request",
        (
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "Breaker.failure",
                "if self.probing or self.failures >= self.failures_to_open:",
                "if False:",
            ),
        ),
        (
            TIER_UNIT + "test_a_closed_breaker_allows_and_opens_after_that_many_failures_in_a_row",
            TIER_UNIT + "test_a_failing_tier_opens_the_breaker_and_is_not_asked_while_open",
        ),
    ),
    Breakage(
        "tier-queue-unbounded",
        "a fleet's tier: the write-behind queue bounded in bytes (fleet.md)",
        "the write-behind queue never drops: a slow tier grows the server's memory without end",
        (
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "SharedTier.push",
                "while len(self._queue) > 1 and self._queued_bytes > self.options.queue_bytes:",
                "while False:",
            ),
        ),
        (TIER_UNIT + "test_the_write_behind_queue_drops_its_oldest_past_its_byte_bound",),
    ),
    Breakage(
        "tier-nothing-written-behind",
        "a fleet's tier: a conversation continues warm on another replica (fleet.md)",
        "the local writer never hands a written record to the tier",
        (
            Patch(
                "kvsnap.runtime.persist.persister",
                "Persister.open",
                "writer.on_written = persister._write_behind",
                "writer.on_written = None",
            ),
        ),
        (TIER_FAULTS + "test_b_continues_a_conversation_a_served_from_the_tier",),
    ),
    Breakage(
        "tier-lost-secret-not-restored",
        "a fleet's tier: a replica started after a flush shares with the fleet (fleet.md)",
        "a secret the tier lost is never put back: a replica started later uses another one",
        (
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "SharedTier._put",
                "self._secret = self.backend.shared_secret(keep=self._secret)",
                "pass",
            ),
        ),
        (TIER_FAULTS + "test_a_replica_started_after_a_flush_still_shares_with_the_fleet",),
    ),
    Breakage(
        "tier-fresh-any-namespace",
        "a fleet's tier: tenants apart (fleet.md)",
        "a record fetched for one namespace is handed to any request holding its tokens: a "
        "tenant loads another's fetched conversation from memory",
        (
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "SharedTier.take_fresh",
                "fetched.namespace == namespace",
                "True",
            ),
        ),
        (
            TIER_UNIT
            + "test_a_fetched_record_goes_once_to_a_request_of_its_namespace_that_extends_it",
        ),
    ),
    Breakage(
        "memory-part-unchecked",
        "3. never a stale or foreign snapshot",
        "a part held in memory (a tier's fetch) is trusted to be what its own header says: "
        "checked against its header's key, not the chain's, another span's block loads in place",
        (
            Patch(
                "kvsnap.store.reading",
                "part_from_bytes",
                "path = part_path(store, kind, key)",
                'path = part_path(store, kind, header_of_bytes(data).metadata["kvsnap.key"])',
            ),
            Patch(
                "kvsnap.store.reading",
                "part_from_bytes",
                "expect_part(info, kind, model_digest, start, end, prefix_digest)",
                "pass",
            ),
        ),
        (
            "tests/store/test_reading.py::"
            "test_parts_held_in_memory_load_as_read_from_their_files_and_are_checked_the_same",
        ),
    ),
    Breakage(
        "tier-only-newest-indexed",
        "a fleet's tier: a branch continues from its earlier turn on another replica (fleet.md)",
        "each record written behind unindexes the namespace's others: an edited or regenerated "
        "turn on another replica finds nothing",
        (
            Patch(
                "kvsnap.runtime.persist.shared_tier",
                "SharedTier._put",
                "self.backend.index_add(names.index, fields.key, self.options.index_limit)",
                "self.backend.index_add(names.index, fields.key, self.options.index_limit)\n"
                "        others = self.backend.index_members(names.index) - {fields.key}\n"
                "        self.backend.index_remove(names.index, list(others))",
            ),
        ),
        (
            TIER_FAULTS
            + "test_a_branch_of_a_conversation_continues_from_its_earlier_turn_on_another_replica",
        ),
    ),
    Breakage(
        "reply-not-kept",
        "the reply reused on the next turn (issue 41 item 3)",
        "a finished request keeps its prompt only: the next turn prefills the previous reply",
        (
            Patch(
                "kvsnap.runtime.engine.batch_runner",
                "BatchRunner.step",
                "self._keep_reply(gen, r, state, self._heads.pop(r.uid, None))",
                "self._heads.pop(r.uid, None)",
            ),
        ),
        (
            "tests/runtime/engine/test_reply_reuse.py::"
            "test_the_next_turn_reuses_prompt_and_reply_and_answers_as_a_cold_prefill",
            "tests/http/test_reply_reuse_server.py::"
            "test_the_next_turn_gets_the_previous_prompt_and_reply_from_the_cache",
        ),
    ),
    Breakage(
        "reply-not-persisted",
        "the reply reused on the next turn (issue 41 item 3)",
        "--persist-requests writes the prompt's record only: after a restart the next turn "
        "prefills the previous reply",
        (
            Patch(
                "kvsnap.runtime.engine.request_cache",
                "RequestCaches.capture_reply",
                "self.persister.captured(entry, ())",
                "pass",
            ),
        ),
        (
            "tests/runtime/engine/test_reply_reuse.py::"
            "test_persisted_prompt_and_reply_serve_the_next_turn_after_a_restart",
        ),
    ),
    Breakage(
        "reply-kept-one-token-short",
        "the reply reused on the next turn (issue 41 item 3)",
        "the prompt + reply entry is keyed as if the last generated token were never fed: a "
        "key that does not match what the cache holds",
        (
            Patch(
                "kvsnap.runtime.engine.request_cache",
                "RequestCaches.capture_reply",
                "tuple(request.tokens[: state.cached_tokens]) + tuple(held)",
                "tuple(request.tokens[: state.cached_tokens]) + tuple(held)[:-1]",
            ),
        ),
        (
            "tests/runtime/engine/test_reply_reuse.py::"
            "test_the_next_turn_reuses_prompt_and_reply_and_answers_as_a_cold_prefill",
        ),
    ),
)


class PatchError(Exception):
    """A breakage's target is gone, or its pattern matches it zero times or more than once."""

    def __init__(self, message: str, patch: Patch | None = None) -> None:
        super().__init__(message)
        self.patch = patch  # the patch to look for elsewhere in the package, when one failed


def module_path(module: str, root: Path) -> str:
    """A patch's file: the module's .py (or its package's __init__), or a file's path as is."""
    if (root / module).is_file():
        return module
    base = module.replace(".", "/")
    return f"{base}/__init__.py" if (root / base / "__init__.py").is_file() else f"{base}.py"


def definitions(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(qualified name, first line counting decorators, last line) of every def and class."""
    found: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((prefix + child.name, first, child.end_lineno or child.lineno))
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def canonical(texts: dict[str, str]) -> dict[str, str]:
    """Python sources laid out one way whatever their width: ruff at 100 columns with magic
    trailing commas ignored (one ruff run for them all)."""
    if not texts:
        return {}
    with tempfile.TemporaryDirectory(prefix="kvsnap-canonical-") as tmp:
        files = {path: Path(tmp) / f"f{i}.py" for i, path in enumerate(texts)}
        for path, file in files.items():
            file.write_text(texts[path])
        r = subprocess.run(
            [sys.executable, "-m", "ruff", "format", "--isolated", "--no-cache", "--quiet"]
            + ["--line-length", "100", "--target-version", "py310"]
            + ["--config", "format.skip-magic-trailing-comma=true"]
            + ["--config", "lint.isort.split-on-trailing-comma=false", tmp],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise PatchError(f"ruff could not format {', '.join(texts)}: {r.stderr.strip()}")
        return {path: file.read_text() for path, file in files.items()}


TOKEN = re.compile(r"\w+|\S")


def is_word(token: str) -> bool:
    return token[0].isalnum() or token[0] == "_"


def pattern(old: str) -> re.Pattern[str]:
    """`old` as a regex blind to whitespace and to a trailing comma before a closing bracket.
    Leading whitespace anchors it to a line's start, a final newline to a line's end."""
    tokens = TOKEN.findall(old)
    if not tokens:
        raise ValueError("an empty pattern")
    parts = [r"(?<!\w)" if is_word(tokens[0]) else ""]
    for k, token in enumerate(tokens):
        if k:
            parts.append(r"\s+" if is_word(tokens[k - 1]) and is_word(token) else r"\s*")
        if token in ")]}" and (k == 0 or tokens[k - 1] != ","):
            parts.append(r"(?:,\s*)?" + re.escape(token))
        elif token == "," and tokens[k + 1 : k + 2] in ([")"], ["]"], ["}"]):
            parts.append(",?")
        else:
            parts.append(re.escape(token))
    parts.append(r"(?!\w)" if is_word(tokens[-1]) else "")
    start = r"^[ \t]*" if old[:1].isspace() else ""
    end = r"(?=[ \t]*$)" if old.endswith("\n") else ""
    return re.compile(f"{start}(?P<code>{''.join(parts)}){end}", re.M)


def replacement(name: str, patch: Patch) -> str:
    """`new` less the blanks around `old`: the match keeps the line's own indentation."""
    old, new = patch.old, patch.new
    lead, trail = old[: len(old) - len(old.lstrip())], old[len(old.rstrip()) :]
    if not new.strip():
        return ""
    if not (new.startswith(lead) and new.endswith(trail)):
        raise PatchError(f"{name}: new must start and end with the blanks old starts and ends with")
    return new[len(lead) : len(new) - len(trail)]


def where(patch: Patch) -> str:
    return f"{patch.module}, " + (f"in {patch.function}" if patch.function else "module level")


def line_starts(text: str) -> list[int]:
    """The offset of each line's first character, 1-based (index 0 unused), and the end."""
    return [0, 0] + [m.end() for m in re.finditer("\n", text)] + [len(text)]


def patch_text(name: str, patch: Patch, text: str, python: bool) -> str:
    """`text` with the patch applied inside its target: one match, or PatchError."""
    if patch.function is None:
        spans = [(0, len(text))]
    elif not python:
        raise PatchError(f"{name}: {patch.module} is not Python; name no function for it")
    else:
        starts = line_starts(text)
        spans = [
            (starts[first], starts[min(last + 1, len(starts) - 1)])
            for qualname, first, last in definitions(ast.parse(text))
            if qualname == patch.function
        ]
        if not spans:
            raise PatchError(
                f"breakage target is gone: {name}: no def or class {patch.function} in "
                f"{patch.module}; update its Patch in {Path(__file__).name}",
                patch,
            )
    found = [m for a, b in spans for m in pattern(patch.old).finditer(text, a, b)]
    if len(found) != 1:
        raise PatchError(
            f"breakage patch no longer applies: {name}: the pattern {patch.old.strip()[:80]!r} "
            f"matches {len(found)} times in {where(patch)} (once needed); update its Patch "
            f"in {Path(__file__).name}",
            patch,
        )
    m = found[0]
    return text[: m.start("code")] + replacement(name, patch) + text[m.end("code") :]


def splice(original: str, patched: str, targets: set[str]) -> str:
    """The original with only its target definitions replaced by their patched canonical text
    (all of the patched text when a target went or the targets no longer line up)."""
    spans = {}
    for label, text in (("original", original), ("patched", patched)):
        spans[label] = [
            (first, last)
            for qualname, first, last in definitions(ast.parse(text))
            if qualname in targets
            and not any(qualname.startswith(t + ".") for t in targets)  # the outermost only
        ]
    if len(spans["original"]) != len(spans["patched"]):
        return patched
    lines, new_lines = original.splitlines(keepends=True), patched.splitlines(keepends=True)
    pairs = list(zip(spans["original"], spans["patched"]))
    for (first, last), (p_first, p_last) in reversed(pairs):
        lines[first - 1 : last] = new_lines[p_first - 1 : p_last]
    return "".join(lines)


def patched_files(
    breakage: Breakage, root: Path, layout: Callable[[dict[str, str]], dict[str, str]] = canonical
) -> dict[str, str]:
    """The breakage's files (path -> broken text), nothing written: each Python file laid out
    the canonical way, its targets patched there, then spliced back into the file as it is."""
    by_path: dict[str, list[Patch]] = {}
    for patch in breakage.patches:
        path = module_path(patch.module, root)
        if not (root / path).is_file():
            raise PatchError(
                f"breakage target is gone: {breakage.name}: no module {patch.module} ({path}); "
                f"update its Patch in {Path(__file__).name}",
                patch,
            )
        by_path.setdefault(path, []).append(patch)
    originals = {path: (root / path).read_text() for path in by_path}
    laid_out = layout({path: t for path, t in originals.items() if path.endswith(".py")})
    out = {}
    for path, patches in by_path.items():
        text = laid_out.get(path, originals[path])
        try:
            for patch in patches:
                text = patch_text(breakage.name, patch, text, path in laid_out)
            if path in laid_out and all(p.function is not None for p in patches):
                text = splice(originals[path], text, {str(p.function) for p in patches})
            if path.endswith(".py"):
                compile(text, path, "exec")
        except SyntaxError as exc:
            raise PatchError(f"breakage leaves no valid Python: {breakage.name}: {exc}") from exc
        out[path] = text
    return out


def make_copy(dest: Path, root: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def apply(breakage: Breakage, copy: Path) -> None:
    for path, text in patched_files(breakage, copy).items():
        (copy / path).write_text(text)


def module_tests(root: Path) -> dict[str, list[str]]:
    """kvsnap module path -> its tests: the mirrored tests/<folders>/test_<name>.py, then the
    files docs/design.md's module map names in its tests column."""
    doc = (root / "docs" / "design.md").read_text()
    section = doc.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    named: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            for module in re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", cells[0]):
                named[f"kvsnap/{module}"] = re.findall(r"`(tests/[^`]+\.py)`", cells[-1])
    out = {}
    for path in sorted((root / "kvsnap").rglob("*.py")):
        module = str(path.relative_to(root))
        mirrored = Path("tests", *Path(module).parts[1:-1], f"test_{path.name}")
        first = [str(mirrored)] if (root / mirrored).is_file() else []
        out[module] = list(dict.fromkeys(first + named.get(module, [])))
    return out


def guards_of(breakage: Breakage, root: Path) -> tuple[str, ...]:
    """The breakage's own guards (test node ids, the narrowest), else the tests of the modules
    it patches."""
    if breakage.guards:
        return breakage.guards
    tests = module_tests(root)
    return tuple(
        dict.fromkeys(
            t for p in breakage.patches for t in tests.get(module_path(p.module, root), [])
        )
    )


def guard_problem(node_id: str, root: Path, parsed: dict[str, ast.Module]) -> str | None:
    """Why a guard's node id names no test in the tree (its file, class and function), if so."""
    path, *names = node_id.split("::")
    if not (root / path).is_file():
        return f"guard {node_id}: no file {path}"
    if path not in parsed:
        parsed[path] = ast.parse((root / path).read_text())
    scope: list[ast.stmt] = parsed[path].body
    for name in (n.split("[", 1)[0] for n in names):
        node = next((n for n in scope if getattr(n, "name", None) == name), None)
        if node is None:
            return f"guard {node_id}: no {name} in {path}"
        scope = getattr(node, "body", [])
    return None


def check_applies(chosen: list[Breakage], root: Path) -> list[str]:
    """Every breakage's patches apply to the tree at `root` and leave valid Python, and every
    guard names a test there; nothing is copied and no test runs."""
    paths = {module_path(p.module, root) for b in chosen for p in b.patches}
    laid_out = canonical(
        {p: (root / p).read_text() for p in paths if p.endswith(".py") and (root / p).is_file()}
    )
    problems: list[str] = []
    parsed: dict[str, ast.Module] = {}
    package: dict[str, str] = {}  # every module laid out, once a patch has to be looked for
    for b in chosen:
        try:
            patched_files(b, root, lambda texts: {p: laid_out[p] for p in texts})
        except PatchError as exc:
            problems.append(str(exc))
            if exc.patch is not None:
                if not package:
                    files = sorted((root / "kvsnap").rglob("*.py"))
                    package = canonical({str(f.relative_to(root)): f.read_text() for f in files})
                found = found_in(exc.patch, package)
                problems[-1] += (
                    f"\n          its pattern now matches in: {'; '.join(found) or 'none'}"
                )
        for guard in guards_of(b, root):
            problem = guard_problem(guard, root, parsed)
            if problem:
                problems.append(f"{b.name}: {problem}")
    return problems


def found_in(patch: Patch, laid_out: dict[str, str]) -> list[str]:
    """Each place the patch's pattern matches: module and innermost definition (a moved target)."""
    found = []
    for path, text in sorted(laid_out.items()):
        module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        defs = definitions(ast.parse(text))
        for m in pattern(patch.old).finditer(text):
            line = text.count("\n", 0, m.start("code")) + 1
            # definitions come parents first: the last one holding the line is the innermost
            inner = [q for q, first, last in defs if first <= line <= last]
            found.append(f"{module}, " + (f"in {inner[-1]}" if inner else "module level"))
    return found


def copy_env(copy: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    env["PYTHONPATH"] = str(copy)  # before site-packages, so before the editable install's finder
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # pytest keeps each failure's message on its summary line only when it fits
    env["COLUMNS"] = "1000"
    return env


def check_import_location(copy: Path) -> None:
    """Prove the copy is what runs, in pytest's process and in the subprocesses tests start."""
    r = subprocess.run(
        [sys.executable, "-c", "import kvsnap; print(kvsnap.__file__)"],
        cwd=copy / "tests",
        env=copy_env(copy),
        capture_output=True,
        text=True,
        timeout=60,
    )
    where = Path(r.stdout.strip()).resolve()
    if r.returncode != 0 or copy.resolve() not in where.parents:
        raise SystemExit(
            f"mutation_check: kvsnap imports from {where or r.stderr.strip()}, not from the copy "
            f"{copy}; check PYTHONPATH handling"
        )


def run_guards(copy: Path, guards: tuple[str, ...]) -> tuple[int, list[tuple[str, str]], str]:
    """pytest's exit status, the (node id, first message line) of each failure, and the output's
    tail."""
    # -n 0: a breakage runs a few tests; two xdist workers would cost more than they save
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "-rfE",
        *guards,
    ]
    try:
        r = subprocess.run(
            cmd, cwd=copy, env=copy_env(copy), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:  # a guard that hangs notices nothing: bound the test itself
        return 1, [], f"the guards ran past {TIMEOUT_S} s and were stopped; bound their waits"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", r.stdout, re.M)
    return r.returncode, failed, r.stdout[-3000:] + r.stderr[-2000:]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--list", action="store_true", help="print the breakages and their guards, run nothing"
    )
    parser.add_argument(
        "--check-applies",
        action="store_true",
        help="only check that every breakage applies and its guards exist (seconds, no test)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this breakage (repeatable)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the run of every guard on the unbroken copy",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=ROOT,
        help="the tree to break (default: this checkout); it holds kvsnap/, tests/, docs/",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    root = args.root.resolve()
    names = {b.name for b in BREAKAGES}
    unknown = [n for n in args.only if n not in names]
    if unknown:
        print(
            f"mutation_check: unknown breakage {', '.join(unknown)}; choose from "
            f"{', '.join(sorted(names))}",
            file=sys.stderr,
        )
        return 2
    chosen = [b for b in BREAKAGES if not args.only or b.name in args.only]
    if args.list:
        for b in chosen:
            print(f"{b.name}  [{b.contract}]  {b.what}")
            for p in b.patches:
                print(f"    patches {where(p)}")
            for g in guards_of(b, root):
                print(f"    {g}")
        return 0
    if args.check_applies:
        t0 = time.monotonic()
        problems = check_applies(chosen, root)
        for problem in problems:
            print(f"ERROR   {problem}")
        n_patches = sum(len(b.patches) for b in chosen)
        print(
            f"{len(chosen)} breakages ({n_patches} patches) checked against {root}: "
            f"{len(problems) or 'no'} problem(s) ({time.monotonic() - t0:.1f} s)"
        )
        return 1 if problems else 0
    results: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="kvsnap-mutation-") as tmp:
        if not args.no_baseline:
            base = Path(tmp) / "baseline"
            make_copy(base, root)
            check_import_location(base)
            guards = tuple(dict.fromkeys(g for b in chosen for g in guards_of(b, root)))
            t0 = time.monotonic()
            rc, failed, tail = run_guards(base, guards)
            print(
                f"baseline: {len(guards)} guard(s) on the unbroken copy: "
                f"{'pass' if rc == 0 else 'FAIL'} ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
            if rc != 0:
                print(tail)
                print(
                    "mutation_check: the guards fail without any breakage; fix them first",
                    file=sys.stderr,
                )
                return 1
        for b in chosen:
            copy = Path(tmp) / b.name
            make_copy(copy, root)
            try:
                apply(b, copy)
            except PatchError as exc:
                results.append((b.name, "ERROR", str(exc)))
                print(f"ERROR   {b.name}: {exc}", flush=True)
                continue
            check_import_location(copy)
            t0 = time.monotonic()
            rc, failed, tail = run_guards(copy, guards_of(b, root))
            took = f"{time.monotonic() - t0:.0f} s"
            if rc == 1 and failed:
                failures = ", ".join(node.split("::", 1)[-1] for node, _ in failed)
                verdict, detail = (
                    "caught",
                    f"failed: {failures}\n          first: {failed[0][1][:160]}",
                )
            elif rc == 0:
                verdict, detail = "MISSED", f"all {len(guards_of(b, root))} guard(s) passed"
            else:
                verdict, detail = (
                    "ERROR",
                    f"pytest exit {rc} (not a test failure: a broken patch or a stale node "
                    f"id)\n{tail}",
                )
            results.append((b.name, verdict, detail))
            print(f"{verdict:<7} {b.name}  [{b.contract}]  ({took}) {detail}", flush=True)
            shutil.rmtree(copy, ignore_errors=True)

    caught = sum(1 for _, v, _ in results if v == "caught")
    print(f"\n{caught} of {len(results)} breakages caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
