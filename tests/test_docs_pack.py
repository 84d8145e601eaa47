"""The docs say what the code does: what `pack` writes and `unpack` takes (from a real archive),
the OCI client's size, the mlx_lm.server command mlx-lm does not call deprecated, and how
`--kv-snapshots` sits beside vllm-mlx's own disk cache and metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from helpers.cli import run_kvsnap
from helpers.models import LONG_SYSTEM

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def section(doc: str, heading: str) -> str:
    """The text of the ``## heading...`` section of ``docs/doc``, up to the next ``## ``."""
    text = (DOCS / doc).read_text()
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def top_level(names: list[str]) -> set[str]:
    """Top-level entries as the docs write them: ``manifest.json``, ``blocks/``, ..."""
    return {n.split("/", 1)[0] + ("/" if "/" in n else "") for n in names}


def test_docs_name_everything_pack_writes_and_unpack_takes_and_what_it_leaves_out(
    demo_models, tmp_path
):
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps([{"name": "a", "messages": [{"role": "system", "content": LONG_SYSTEM}]}])
    )
    store, archive = tmp_path / "snaps", tmp_path / "snaps.tar"
    # A hybrid model: its records reach checkpoints as well as blocks.
    r = run_kvsnap("build", agents, "--model", demo_models.path("hybrid"), "--out", store)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_kvsnap("pack", store, "-o", archive)
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(archive) as tar:
        packed = top_level(tar.getnames())
    assert packed == {"manifest.json", "snapshots/", "blocks/", "checkpoints/"}, packed
    r = run_kvsnap("unpack", archive, tmp_path / "copy")
    assert r.returncode == 0, r.stdout + r.stderr
    unpacked = {p.name + ("/" if p.is_dir() else "") for p in (tmp_path / "copy").iterdir()}
    assert packed <= unpacked, unpacked  # unpack takes every kind pack writes
    left_out = {p.name + ("/" if p.is_dir() else "") for p in store.iterdir()} - packed
    assert ".lock" in left_out, left_out
    for doc, heading in (("cli.md", "`kvsnap pack"), ("deploy.md", "Plain tarballs")):
        said = section(doc, heading)
        assert [n for n in sorted(packed) if f"`{n}" not in said] == [], (doc, said)
        assert [n for n in sorted(left_out) if f"`{n.rstrip('/')}" not in said] == [], (doc, said)
        # What a store of served conversations holds beside those, which pack never ships.
        assert "`conversations/`" in said and "`.secret`" in said, (doc, said)


def test_deploy_md_states_the_oci_clients_size_truly_or_not_at_all():
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "kvsnap/store/oci").glob("*.py"))
    claims = [
        int(n.replace(",", ""))
        for n in re.findall(r"about ([\d,]+) lines", (DOCS / "deploy.md").read_text())
    ]
    assert [n for n in claims if abs(n - lines) > lines // 4] == [], (claims, lines)


def test_mlx_lm_docs_never_run_the_server_the_way_mlx_lm_calls_deprecated():
    r = subprocess.run(
        [sys.executable, "-m", "mlx_lm.server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    (notice,) = [line for line in (r.stdout + r.stderr).splitlines() if "deprecated" in line]
    assert "`python -m mlx_lm.server...`" in notice and "`mlx_lm.server...`" in notice, notice
    commands = []
    for doc in DOCS.glob("*.md"):
        fenced, inside = [], False
        for line in doc.read_text().splitlines():
            if line.lstrip().startswith("```"):
                inside = not inside
            elif inside or line.startswith("|"):
                fenced.append(line)  # a code block's line, or a table row (commands compared)
        commands += [f"{doc.name}: {line}" for line in fenced if "python -m mlx_lm.server" in line]
    assert commands == [], commands


def test_vllm_mlx_md_says_how_kv_snapshots_sits_beside_its_ssd_cache_and_metrics():
    from kvsnap.integrations.vllm_mlx.session import STATUS_PATH

    said = section("vllm-mlx.md", "Beside vllm-mlx's own `--ssd-cache-dir`")
    for words in ("--ssd-cache-dir", "--enable-metrics", "Both can be on at once", STATUS_PATH):
        assert words in said, words
