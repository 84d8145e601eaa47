"""contrib/: the upstream patches, applied to scratch copies of the pinned releases and run.

Each patch adds ``--kv-snapshots`` (and kvsnap's ``--warm-prompts``) to a server by calling
one public kvsnap function. The tests copy the installed upstream package (mlx-lm 0.32 from
this environment; vllm-mlx 0.6.0 from the cached vllm-mlx environment of
tests/integrations/vllm_mlx/test_route.py) into a temporary folder, apply the patch there with
``git apply``
(no fuzz), put that folder first on PYTHONPATH and run the literal commands on a tiny model
with a real store, beside the unpatched server: the first request of each agent finds the
agent's prefix cached, and the greedy answers are the unpatched server's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from helpers import mlx_lm_route as mlx_lm_tests
from helpers import vllm_mlx_route as vllm_tests
from helpers.cli import run_kvsnap

ROOT = Path(__file__).resolve().parents[2]
MLX_LM_PATCH = ROOT / "contrib" / "mlx-lm" / "0001-server-kv-snapshots.patch"
VLLM_MLX_PATCH = ROOT / "contrib" / "vllm-mlx" / "0001-serve-kv-snapshots.patch"
# The kvsnap names each patch may use: one function (and, for vllm-mlx, the error it raises).
PATCH_CALLS = {
    MLX_LM_PATCH: {"kvsnap.integrations.mlx_lm.warm.warm_prompt_cache"},
    VLLM_MLX_PATCH: {
        "kvsnap.integrations.vllm_mlx.launcher.use_kv_snapshots",
        "kvsnap.errors.KvsnapError",
    },
}


def apply_patch(patch: Path, package: Path, dest: Path) -> Path:
    """A copy of ``package`` (an installed upstream package folder) in ``dest``, patched."""
    shutil.copytree(package, dest / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    # Inside another git work tree, git apply takes paths from that tree's root, skips ours
    # and still exits 0: stop its search at dest, and check the target really changed.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.parent)}
    r = subprocess.run(
        ["git", "apply", "--verbose", str(patch)],
        cwd=dest,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, f"{patch.name} does not apply to {package}:\n{r.stderr}"
    targets = re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), re.M)
    assert targets, f"{patch.name} names no file"
    for target in targets:
        text = (dest / target).read_text()
        assert "--kv-snapshots" in text, f"git apply left {dest / target} unpatched:\n{r.stderr}"
    return dest


def _added_lines(patch: Path) -> list[str]:
    return [
        line[1:]
        for line in patch.read_text().splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


def _blas_env() -> dict:
    """One BLAS for patched and unpatched servers (kvsnap's launchers preload it themselves)."""
    from kvsnap.blas import find_openblas

    blas = find_openblas()
    return {"LD_PRELOAD": blas} if blas else {}


# --- the patches themselves -----------------------------------------------------------------


def test_each_patch_applies_cleanly_to_the_pinned_release_and_calls_one_kvsnap_function(
    tmp_path, vllm_mlx_python
):
    mlx_lm_version = metadata.version("mlx-lm")
    assert mlx_lm_version.startswith("0.32."), (
        f"contrib/mlx-lm is tested against mlx-lm 0.32.x, not {mlx_lm_version}"
    )
    import mlx_lm

    apply_patch(MLX_LM_PATCH, Path(mlx_lm.__file__).parent, tmp_path / "mlx-lm")
    vllm_pkg = _vllm_mlx_package(vllm_mlx_python)
    assert (vllm_pkg.parent / "vllm_mlx-0.6.0.dist-info").is_dir(), sorted(
        p.name for p in vllm_pkg.parent.glob("vllm_mlx*")
    )
    apply_patch(VLLM_MLX_PATCH, vllm_pkg, tmp_path / "vllm-mlx")
    for patch, allowed in PATCH_CALLS.items():
        added = "\n".join(_added_lines(patch))
        used = {
            f"{m}.{n}"
            for m, names in re.findall(r"from (kvsnap[\w.]*) import ([\w, ]+)", added)
            for n in names.replace(" ", "").split(",")
        }
        assert used == allowed, (patch.name, used)
        assert "import kvsnap" not in added and added.count("kvsnap.") == len(allowed), patch.name
        # The flags are the patch's; without --kv-snapshots nothing of kvsnap is imported.
        assert '"--kv-snapshots"' in added and "kv_snapshots" in added
        assert (patch.parent / "PULL_REQUEST.md").is_file()


def _vllm_mlx_package(python: Path) -> Path:
    r = subprocess.run(
        [str(python), "-c", "import vllm_mlx, os; print(os.path.dirname(vllm_mlx.__file__))"],
        capture_output=True,
        text=True,
        env=vllm_tests._venv_env(Path("/nonexistent")),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


# --- mlx-lm: python -m mlx_lm.server --model MODEL --kv-snapshots DIR -------------------------


def _mlx_lm_server(cmd: list[str], log: Path, pythonpath: str | None):
    """mlx_lm.server as this environment runs it; only PYTHONPATH differs between the two."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **_blas_env())
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return mlx_lm_tests._launch(cmd, log, env)


def _mlx_lm_answers(
    cmd: list[str], log: Path, pythonpath: str | None, asks
) -> tuple[list[dict], str]:
    server = _mlx_lm_server(cmd, log, pythonpath)
    try:
        server.wait_ready(180)
        answers = [mlx_lm_tests._ask(server, agent, user) for agent, user in asks]
    finally:
        server.stop()
    return answers, server.log()


def test_patched_mlx_lm_server_kv_snapshots_first_request_hits_and_answers_like_unpatched(
    demo_models, tmp_path
):
    import mlx_lm

    patched = apply_patch(MLX_LM_PATCH, Path(mlx_lm.__file__).parent, tmp_path / "mlx-lm")
    model = str(demo_models.path("hybrid"))
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(mlx_lm_tests.AGENTS))
    r = run_kvsnap(
        "build", agents, "--model", model, "--out", tmp_path / "snaps", "--for", "mlx-lm", "--json"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    n_tokens = {e["name"]: e["n_tokens"] for e in json.loads(r.stdout)["entries"]}
    asks = [("reviewer", mlx_lm_tests.USERS[0]), ("planner", mlx_lm_tests.USERS[1])]
    # The literal command; kvsnap is importable from this checkout, after the patched mlx_lm.
    command = [sys.executable, "-m", "mlx_lm.server", "--model", model]
    warm, log = _mlx_lm_answers(
        [*command, "--kv-snapshots", str(tmp_path / "snaps")],
        tmp_path / "patched.log",
        f"{patched}{os.pathsep}{ROOT}",
        asks,
    )
    assert mlx_lm_tests._warmup(log) == (2, 0), log[-3000:]
    assert [a["cached"] for a in warm] == [n_tokens["reviewer"], n_tokens["planner"]], log[-3000:]
    assert "protected from eviction" in log
    cold, cold_log = _mlx_lm_answers(command, tmp_path / "unpatched.log", None, asks)
    assert cold[0]["cached"] == 0, cold_log[-2000:]
    mlx_lm_tests._same_answers(warm, cold)
    # The flag is the patch's: the installed mlx-lm does not know it.
    r = subprocess.run(
        [*command, "--kv-snapshots", str(tmp_path / "snaps")],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert r.returncode == 2 and "unrecognized arguments: --kv-snapshots" in r.stderr, r.stderr[
        -2000:
    ]


def test_patched_mlx_lm_server_refuses_a_bad_option_in_one_line(demo_models, tmp_path):
    """A refused option ends the patched server as argparse would: one line, no traceback."""
    import mlx_lm

    patched = apply_patch(MLX_LM_PATCH, Path(mlx_lm.__file__).parent, tmp_path / "mlx-lm")
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(mlx_lm_tests.AGENTS))
    command = [sys.executable, "-m", "mlx_lm.server", "--model", str(demo_models.path("dense"))]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{patched}{os.pathsep}{ROOT}", HF_HUB_OFFLINE="1")
    cases = [
        (["--warm-prompts", str(agents)], 2, "needs --kv-snapshots"),
        (["--kv-snapshots", str(tmp_path / "missing")], 1, str(tmp_path / "missing")),
    ]
    for extra, code, said in cases:
        r = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == code and "mlx_lm.server: error: " in r.stderr, r.stderr[-2000:]
        assert said in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_patched_mlx_lm_server_without_kvsnap_refuses_in_one_line(demo_models, tmp_path):
    """--kv-snapshots where kvsnap cannot be imported: argparse's one line and exit 2."""
    import mlx_lm

    patched = apply_patch(MLX_LM_PATCH, Path(mlx_lm.__file__).parent, tmp_path / "mlx-lm")
    # A kvsnap first on the path that fails to import, as a missing one does (the real one is
    # installed in this environment).
    shadow = tmp_path / "no-kvsnap" / "kvsnap"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'kvsnap'\")\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{shadow.parent}{os.pathsep}{patched}", HF_HUB_OFFLINE="1")
    model = str(demo_models.path("dense"))
    for extra in (["--kv-snapshots", str(tmp_path)], ["--warm-prompts", str(tmp_path / "a.json")]):
        r = subprocess.run(
            [sys.executable, "-m", "mlx_lm.server", "--model", model, *extra],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,  # python -m puts the cwd first on the path: not this checkout
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
        assert lines[0].startswith(
            "mlx_lm.server: error: --kv-snapshots needs kvsnap installed (No module named"
        ), lines
        assert "pip install -e PATH" in lines[0] and "pip install kvsnap" not in lines[0]


def test_patched_mlx_lm_server_warm_prompts_prefill_once_and_write_back(demo_models, tmp_path):
    import mlx_lm

    patched = apply_patch(MLX_LM_PATCH, Path(mlx_lm.__file__).parent, tmp_path / "mlx-lm")
    model, store = str(demo_models.path("dense")), tmp_path / "fresh"
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(mlx_lm_tests.AGENTS))
    cmd = [
        sys.executable,
        "-m",
        "mlx_lm.server",
        "--model",
        model,
        "--kv-snapshots",
        str(store),
        "--warm-prompts",
        str(agents),
    ]
    path = f"{patched}{os.pathsep}{ROOT}"
    first, log1 = _mlx_lm_answers(
        cmd, tmp_path / "first.log", path, [("planner", mlx_lm_tests.USERS[0])]
    )
    assert mlx_lm_tests._warmup(log1) == (0, 2), log1[-3000:]
    assert len(list((store / "snapshots").glob("*.safetensors"))) == 2
    second, log2 = _mlx_lm_answers(
        cmd, tmp_path / "second.log", path, [("planner", mlx_lm_tests.USERS[0])]
    )
    assert mlx_lm_tests._warmup(log2) == (2, 0), log2[-3000:]
    assert first[0]["cached"] == second[0]["cached"] > 0
    mlx_lm_tests._same_answers(second, first)


# --- vllm-mlx: vllm-mlx serve MODEL --continuous-batching --kv-snapshots DIR ------------------


def _vllm(python: Path, args: list[str], home: Path, log: Path, patched: Path | None):
    """The venv's own ``vllm-mlx`` command; the patched package, then kvsnap, on PYTHONPATH."""
    env = {"PYTHONPATH": f"{patched}{os.pathsep}{ROOT}" if patched else str(ROOT), **_blas_env()}
    return vllm_tests._launch([str(python.parent / "vllm-mlx"), "serve", *args], home, log, env)


def _vllm_answers(python, args, tmp_path: Path, name: str, patched, asks) -> tuple[list[dict], str]:
    home = tmp_path / f"home-{name}"
    home.mkdir()
    server = _vllm(python, args, home, tmp_path / f"{name}.log", patched)
    try:
        server.wait_ready(180)
        answers = [vllm_tests._ask(server, args[0], user, 24, system) for system, user in asks]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    return answers, server.log()


@pytest.mark.slow
def test_patched_vllm_mlx_serve_kv_snapshots_and_warm_prompts_hit_and_answer_like_unpatched(
    vllm_mlx_python, tmp_path
):
    patched = apply_patch(VLLM_MLX_PATCH, _vllm_mlx_package(vllm_mlx_python), tmp_path / "vllm-mlx")
    home = tmp_path / "build-home"
    home.mkdir()
    model = tmp_path / "dense"
    vllm_tests._venv_kvsnap(vllm_mlx_python, home, "demo-model", model)
    reviewer, planner = vllm_tests.AGENTS[0]["messages"][0], vllm_tests.PLANNER["messages"][0]
    first, both = tmp_path / "first.json", tmp_path / "agents.json"
    first.write_text(json.dumps(vllm_tests.AGENTS))
    both.write_text(json.dumps([*vllm_tests.AGENTS, vllm_tests.PLANNER]))
    store = tmp_path / "snaps"
    built = json.loads(
        vllm_tests._venv_kvsnap(
            vllm_mlx_python,
            home,
            "build",
            first,
            "--model",
            model,
            "--out",
            store,
            "--for",
            "vllm-mlx",
            "--json",
        ).stdout
    )
    n_reviewer = built["entries"][0]["n_tokens"]
    asks = [(reviewer, "Please review the server code."), (planner, "Plan the database migration.")]
    serve = [str(model), "--continuous-batching", "--kv-snapshots", str(store)]

    # --warm-prompts: the reviewer from its snapshot, the planner prefilled once and written back.
    with_prompts, log = _vllm_answers(
        vllm_mlx_python, [*serve, "--warm-prompts", str(both)], tmp_path, "prompts", patched, asks
    )
    assert "Warming prefix cache" not in log  # vllm-mlx's own warm-up never ran
    assert re.search(r"Warm-up done .*\(1 from snapshots, 1 prefilled\)", log), log[-3000:]
    assert len(list((store / "snapshots").glob("*.safetensors"))) == 2
    n_planner = with_prompts[1]["cached_tokens"]
    assert with_prompts[0]["cached_tokens"] == n_reviewer and n_planner > 128, with_prompts

    # --kv-snapshots alone, the seed's literal command: both agents from the store.
    warm, log = _vllm_answers(vllm_mlx_python, serve, tmp_path, "warm", patched, asks)
    assert [(a["cached_tokens"], a["hit"]) for a in warm] == [
        (n_reviewer, "prefix"),
        (n_planner, "prefix"),
    ], log[-3000:]
    assert "not saved to ~/.cache/vllm-mlx/prefix_cache" in log

    cold, _ = _vllm_answers(
        vllm_mlx_python, [str(model), "--continuous-batching"], tmp_path, "cold", None, asks
    )
    assert [a["cached_tokens"] for a in cold] == [0, 0]
    assert (
        [(a["text"], a["prompt_tokens"]) for a in warm]
        == [(a["text"], a["prompt_tokens"]) for a in cold]
        == [(a["text"], a["prompt_tokens"]) for a in with_prompts]
    )


def test_patched_vllm_mlx_serve_refuses_kv_snapshots_without_continuous_batching(
    vllm_mlx_python, tmp_path
):
    patched = apply_patch(VLLM_MLX_PATCH, _vllm_mlx_package(vllm_mlx_python), tmp_path / "vllm-mlx")
    (tmp_path / "snaps").mkdir()
    env = {**vllm_tests._venv_env(tmp_path), "PYTHONPATH": f"{patched}{os.pathsep}{ROOT}"}
    r = subprocess.run(
        [
            str(vllm_mlx_python.parent / "vllm-mlx"),
            "serve",
            str(tmp_path / "no-model"),
            "--kv-snapshots",
            str(tmp_path / "snaps"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert (
        "Error: --kv-snapshots cannot work with these vllm-mlx options: add --continuous-batching"
        in r.stdout
    ), r.stdout[-2000:]
    # The same check, the same words, from kvsnap's own launcher (the one function both call).
    r = subprocess.run(
        [
            str(vllm_mlx_python),
            "-m",
            "kvsnap",
            "vllm-mlx",
            "serve",
            str(tmp_path / "no-model"),
            "--kv-snapshots",
            str(tmp_path / "snaps"),
        ],
        capture_output=True,
        text=True,
        env=vllm_tests._venv_env(tmp_path),
        timeout=120,
    )
    assert r.returncode == 2 and "add --continuous-batching" in r.stderr, r.stderr[-2000:]


def test_the_path_an_earlier_vllm_mlx_patch_imported_still_gives_use_kv_snapshots():
    """vllm-mlx servers patched before the route became a package import
    ``kvsnap.integrations.vllm_mlx.use_kv_snapshots``; it stays that function."""
    from kvsnap.integrations import vllm_mlx
    from kvsnap.integrations.vllm_mlx.launcher import use_kv_snapshots

    assert vllm_mlx.use_kv_snapshots is use_kv_snapshots
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        vllm_mlx.nothing  # noqa: B018
