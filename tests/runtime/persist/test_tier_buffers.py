"""A shared tier's fetch makes its mlx buffers on its own threads while the engine steps.
mlx-lm's prompt processing calls ``mx.clear_cache``, which waits for every mlx stream while
holding the GIL; a buffer made through a Python reader (``fileio.unfilled_buffer``) needs the
GIL on its stream's worker, so the two together hung the whole process. The fetch's buffers
are made by mlx alone. Each case runs in a child process with a deadline: a hang is a
failure, not a stuck suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, threading, time
    import mlx.core as mx
    from kvsnap.snapshot.file import parse_header
    from kvsnap.runtime.persist.shared_tier import _mlx_buffer

    path = {path!r}
    import numpy as np
    from safetensors.numpy import save_file
    save_file({{"k": np.arange(4096, dtype=np.float32).reshape(64, 64)}}, path)
    with open(path, "rb") as f:
        header = parse_header(f, os.fstat(f.fileno()).st_size)
    stop = False

    def engine():  # the engine's prompt steps: a matmul, then mlx-lm's clear_cache
        with mx.stream(mx.new_stream(mx.cpu)):
            a = mx.ones((128, 128))
            while not stop:
                mx.eval(a @ a)
                mx.clear_cache()

    made = []

    def fetch():  # a fetch thread making part buffers beside it
        with mx.stream(mx.new_stream(mx.cpu)):
            end = time.monotonic() + 3
            while time.monotonic() < end:
                view, tensors = _mlx_buffer(header)
                made.append(tensors["k"].shape)

    threading.Thread(target=engine, daemon=True).start()
    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    t.join(30)
    print("made", len(made), made[:1], flush=True)
    os._exit(0 if made and not t.is_alive() else 1)
    """
)


def test_a_fetch_making_buffers_beside_the_engines_steps_never_hangs(tmp_path):
    script = SCRIPT.format(path=str(tmp_path / "part.safetensors"))
    try:
        r = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            "making tier buffers beside mx.clear_cache hung the process (60 s)"
        ) from None
    assert r.returncode == 0, r.stdout + r.stderr
    assert "made" in r.stdout and "(64, 64)" in r.stdout, r.stdout
