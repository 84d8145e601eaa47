"""OpenBLAS must be in place before mlx loads, whichever kvsnap module imports mlx first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsnap.blas import find_openblas

# the modules that import mlx at load time
MODULES = ["kvsnap.snapshot.codec", "kvsnap.runtime.warmup.run", "kvsnap.runtime.engine.sampling"]


@pytest.mark.skipif(
    find_openblas() is None or not sys.platform.startswith("linux"),
    reason="Debian's libopenblas0-pthread is not installed",
)
@pytest.mark.parametrize("module", MODULES)
def test_regression_server_warmup_ran_on_reference_blas(module):
    """The engine imported mlx (via warmup -> snapshot) before load_model preloaded OpenBLAS: 6x
    slower warm-ups."""
    code = (
        f"import {module}, mlx.core as mx; mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4))); "
        f"print('libopenblas' in open('/proc/self/maps').read())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


@pytest.mark.skipif(
    find_openblas() is None or not sys.platform.startswith("linux"),
    reason="Debian's libopenblas0-pthread is not installed",
)
def test_regression_snapshot_prefetch_imported_mlx_before_openblas(demo_models, tmp_path):
    """The engine thread's prefetch (started before the model loads) imported mlx first: every
    server started with --kv-snapshots decoded on reference BLAS (TPOT 0.8 s against 0.3 s)."""
    (tmp_path / "snaps" / "snapshots").mkdir(parents=True)
    code = (
        "from kvsnap.runtime.engine.engine import Engine, EngineConfig; "
        f"e = Engine(EngineConfig(model={str(demo_models.path('dense'))!r}, "
        f"snapshots={str(tmp_path / 'snaps')!r})); "
        "e.start(); e.wait_warm(120); print('libopenblas' in open('/proc/self/maps').read()); "
        "e.shutdown()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env={**__import__("os").environ, "KVSNAP_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


def openblas_warning_in_a_process(env: dict) -> str:
    """``openblas_warning()`` once mlx is loaded, as serve calls it, in a fresh process."""
    code = (
        "import kvsnap.runtime.engine.sampling; from kvsnap.blas import openblas_warning; "
        "print(openblas_warning())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, **env},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is Linux's concern")
def test_without_openblas_the_warning_names_the_package_and_why():
    warning = openblas_warning_in_a_process({"KVSNAP_NO_OPENBLAS": "1"})
    assert "KVSNAP_NO_OPENBLAS is set" in warning and "several times slower" in warning
    assert "apt-get install libopenblas0-pthread" in warning
    if find_openblas() is not None:
        assert openblas_warning_in_a_process({"KVSNAP_NO_OPENBLAS": ""}) == "None"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is Linux's concern")
def test_serve_warns_at_start_when_openblas_is_not_loaded(demo_models, tmp_path):
    from kvsnap.tools.serverproc import serving

    env = {"KVSNAP_NO_OPENBLAS": "1", "KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    with serving(demo_models.path("dense"), [], tmp_path / "serve.log", env=env) as server:
        lines = [line for line in server.log().splitlines() if "OpenBLAS is not loaded" in line]
    assert len(lines) == 1 and "apt-get install libopenblas0-pthread" in lines[0], server.log()


@pytest.mark.skipif(
    find_openblas() is None or not sys.platform.startswith("linux"),
    reason="Debian's libopenblas0-pthread is not installed",
)
@pytest.mark.parametrize(("given", "loaded_with"), [(None, "16"), ("20", "20")])
def test_openblas_loads_with_a_short_idle_spin_unless_the_user_set_one(given, loaded_with):
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it loads; its default (2^28 cycles) kept the
    worker spinning between a server's matmuls, ~3-5 ms of CPU per generated token (issue 41).
    kvsnap loads it with 16 unless the user gave a value."""
    import os

    env = {
        k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "LD_PRELOAD")
    }
    if given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    code = (
        "import os; from kvsnap.blas import preload_openblas, openblas_loaded; "
        "preload_openblas(); print(openblas_loaded(), os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.stdout.split() == ["True", loaded_with], out.stderr
