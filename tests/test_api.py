"""The Python API (kvsnap/api.py, listed in kvsnap/__init__.py): a store's snapshot as an mlx-lm
prompt cache, export to mlx-lm's prompt-cache file, import of one made by mlx_lm.cache_prompt,
and the README's example run as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.models import LONG_SYSTEM
from helpers.stores import AGENTS, build_store

import kvsnap
from kvsnap.errors import MessageError, SnapshotError, UsageError
from kvsnap.store.local import Store
from kvsnap.tools.serverproc import serving

ROOT = Path(__file__).resolve().parent.parent
QUESTION = {"role": "user", "content": "Is this function correct? Check the tests first."}
CACHE_PROMPT = "You review code. " + LONG_SYSTEM


@pytest.fixture(scope="module")
def dense(demo_models):
    """(folder, LoadedModel, the (model, tokenizer) mlx_lm.load would return)."""
    lm = demo_models.load("dense")
    return demo_models.path("dense"), lm, (lm.model, lm.tokenizer)


def _greedy(lm, prompt: list[int], cache=None, n: int = 12) -> list[int]:
    from mlx_lm import stream_generate

    out = stream_generate(lm.model, lm.tokenizer, prompt, max_tokens=n, prompt_cache=cache)
    return [r.token for r in out]


def _request(lm, messages: list[dict]) -> list[int]:
    return list(lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _snapshot(store: Path, name: str):
    (info,) = [i for i in Store.open(store).scan()[0] if i.name == name]
    return info


def _snapshot_tokens(store: Path, name: str) -> tuple[int, ...]:
    return tuple(Store.open(store).read_tokens(_snapshot(store, name)))


def test_the_public_names_are_few_and_import_kvsnap_stays_light():
    assert sorted(kvsnap.__all__) == sorted(
        [
            "PromptCache",
            "__version__",
            "export_prompt_cache",
            "import_prompt_cache",
            "load_prompt_cache",
        ]
    )
    code = (
        "import sys, kvsnap; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]; "
        "assert not heavy and 'kvsnap.api' not in sys.modules, heavy; "
        "assert callable(kvsnap.load_prompt_cache) and 'kvsnap.api' in sys.modules; "
        "print(sorted(n for n in dir(kvsnap) if not n.startswith('_')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    with pytest.raises(AttributeError, match="no attribute 'capture'"):
        kvsnap.capture  # noqa: B018


def test_generation_from_the_loaded_cache_equals_generation_without_it(dense, built):
    """Greedy tokens from the snapshot's cache (fed the request's remaining tokens) equal a cold
    run's; the cache holds the snapshot's tokens, and it is the caller's own: using it leaves the
    next load as it was."""
    path, lm, loaded = dense
    agent = AGENTS[0]
    cache, cached = kvsnap.load_prompt_cache(built, path, agent["messages"], loaded=loaded)
    assert cached == _snapshot_tokens(built, agent["name"]) and len(cached) > 100
    assert all(c.offset == len(cached) for c in cache)
    prompt = _request(lm, agent["messages"] + [QUESTION])
    assert prompt[: len(cached)] == list(cached)
    warm = _greedy(lm, prompt[len(cached) :], cache)
    assert warm == _greedy(lm, prompt) and len(warm) == 12
    assert all(c.offset > len(cached) for c in cache)  # generation grew the caller's copy

    # A warm-prompt entry finds the same snapshot; a fresh load is untouched by the run above.
    again, same = kvsnap.load_prompt_cache(built, path, agent, loaded=loaded)
    assert same == cached and all(c.offset == len(cached) for c in again)
    assert _greedy(lm, prompt[len(cached) :], again) == warm


def test_without_loaded_the_model_is_loaded_from_its_folder(dense, built):
    path, _, _ = dense
    cache, cached = kvsnap.load_prompt_cache(built, path, AGENTS[1]["messages"])
    assert cached == _snapshot_tokens(built, AGENTS[1]["name"])


def test_a_snapshot_built_for_mlx_lm_serve_is_found_too(dense, tmp_path):
    """`kvsnap build --for mlx-lm` keys with mlx_lm.server's profile; the API finds it as
    `kvsnap mlx-lm serve` would."""
    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.profiles import mlx_lm_tokenization
    from kvsnap.prompts import parse_warm_prompts

    path, lm, loaded = dense
    store = Store.open(tmp_path / "snaps", create=True)
    report = build_snapshots(
        lm, parse_warm_prompts(AGENTS[:1]), store, "agents.json", tokenization=mlx_lm_tokenization()
    )
    assert report.ok
    _, cached = kvsnap.load_prompt_cache(store.root, path, AGENTS[0]["messages"], loaded=loaded)
    assert cached == _snapshot_tokens(store.root, AGENTS[0]["name"])


def test_no_snapshot_stale_and_foreign_are_refused_by_name(dense, built, demo_models, tmp_path):
    path, _, loaded = dense
    other = [{"role": "system", "content": "You answer in haiku only. " * 5}]
    with pytest.raises(SnapshotError, match="holds no snapshot of .* for these messages"):
        kvsnap.load_prompt_cache(built, path, other, loaded=loaded)
    with pytest.raises(SnapshotError, match="is stale: built for warm prompt 'reviewer'"):
        renamed = {"name": "reviewer", "messages": other}
        kvsnap.load_prompt_cache(built, path, renamed, loaded=loaded)
    # The same tokenizer and template, other weights: the same tokens, another model's KV.
    foreign = build_store(demo_models.load("dense-q4"), tmp_path / "q4", AGENTS[:1])
    with pytest.raises(SnapshotError, match=r"built for another model .*differs in: .*weights"):
        kvsnap.load_prompt_cache(foreign, path, AGENTS[0]["messages"], loaded=loaded)
    with pytest.raises(MessageError, match="ends with a 'user' message"):
        kvsnap.load_prompt_cache(built, path, AGENTS[0]["messages"] + [QUESTION], loaded=loaded)


def test_export_round_trips_through_mlx_lm_and_imports_back_under_the_same_key(
    dense, built, tmp_path
):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import load_prompt_cache

    path, lm, loaded = dense
    messages = AGENTS[0]["messages"]
    file = tmp_path / "reviewer.safetensors"
    exported = kvsnap.export_prompt_cache(built, path, messages, file, loaded=loaded)
    cache, metadata = load_prompt_cache(str(file), return_metadata=True)
    mine, cached = kvsnap.load_prompt_cache(built, path, messages, loaded=loaded)
    assert exported.tokens == cached and len(cache) == len(mine)
    assert [type(c) for c in cache] == [type(c) for c in mine]
    assert all(c.offset == len(cached) for c in cache)
    theirs, ours = (tree_flatten([c.state for c in layers]) for layers in (cache, mine))
    assert [name for name, _ in theirs] == [name for name, _ in ours] and theirs
    arrays = 0
    for (name, a), (_, b) in zip(theirs, ours):
        if isinstance(a, mx.array):
            assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b), name
            arrays += 1
        else:  # a scalar mlx-lm keeps in a layer's state (its offset)
            assert a == b, name
    assert arrays >= 2 * len(cache)
    assert metadata["model"] == str(path)
    assert metadata["chat_template"] == lm.tokenizer.chat_template
    assert json.loads(metadata["tokenizer_config"]) == {"trust_remote_code": False}
    assert json.loads(metadata["kvsnap_tokens"]) == list(cached)

    # Imported back, it is keyed exactly as the build keyed it.
    key = kvsnap.import_prompt_cache(file, tmp_path / "back", path, loaded=loaded)
    assert key == _snapshot(built, AGENTS[0]["name"]).key
    _, again = kvsnap.load_prompt_cache(tmp_path / "back", path, messages, loaded=loaded)
    assert again == cached


@pytest.fixture(scope="module")
def cache_prompt_file(dense, tmp_path_factory) -> Path:
    """A prompt cache made by `python -m mlx_lm cache_prompt` for the dense demo model."""
    path, _, _ = dense
    file = tmp_path_factory.mktemp("cache-prompt") / "prompt.safetensors"
    cmd = [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(path)]
    cmd += ["--prompt", CACHE_PROMPT, "--prompt-cache-file", str(file)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and file.is_file(), r.stderr[-2000:]
    return file


def test_a_cache_prompt_file_imports_and_kvsnap_serve_hits_it(dense, cache_prompt_file, tmp_path):
    path, lm, loaded = dense
    store = tmp_path / "snaps"
    key = kvsnap.import_prompt_cache(cache_prompt_file, store, path, prompt=CACHE_PROMPT)
    (info,) = Store.open(store).scan()[0]
    assert info.key == key and info.name == "prompt"
    assert kvsnap.import_prompt_cache(cache_prompt_file, store, path, prompt=CACHE_PROMPT) == key

    body = {
        "model": "dense",
        "messages": [{"role": "user", "content": CACHE_PROMPT}],
        "max_tokens": 2,
        "temperature": 0,
    }
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    with serving(path, ["--kv-snapshots", str(store)], tmp_path / "serve.log", env, 300) as server:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == info.n_tokens > 100


def test_an_import_with_other_tokens_or_another_model_is_refused_naming_both(
    dense, cache_prompt_file, demo_models, tmp_path
):
    path, _, loaded = dense
    store = tmp_path / "snaps"
    with pytest.raises(SnapshotError, match=r"does not hold the \d+ tokens given"):
        kvsnap.import_prompt_cache(
            cache_prompt_file, store, path, prompt=CACHE_PROMPT + " More.", loaded=loaded
        )
    with pytest.raises(UsageError, match="does not record its tokens; pass prompt="):
        kvsnap.import_prompt_cache(cache_prompt_file, store, path, loaded=loaded)
    hybrid = demo_models.path("hybrid")
    with pytest.raises(UsageError) as caught:
        kvsnap.import_prompt_cache(cache_prompt_file, store, hybrid, prompt=CACHE_PROMPT)
    assert str(path) in str(caught.value) and str(hybrid) in str(caught.value)
    assert not (store / "snapshots").exists() or not list((store / "snapshots").iterdir())


def _readme_blocks() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    shell = re.search(r"```bash\n(.*?)```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert shell and python, "README's Python API section needs a bash and a python block"
    return shell.group(1), python.group(1)


def test_the_readme_python_api_example_runs(tmp_path):
    shell, python = _readme_blocks()
    bindir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        "HF_HUB_OFFLINE": "1",
        "KVSNAP_CACHE_DIR": str(tmp_path / "cache"),
    }
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shell],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (tmp_path / "example.py").write_text(python)
    r = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (tmp_path / "reviewer.safetensors").is_file()
