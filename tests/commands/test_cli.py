"""The `kvsnap` command across the process boundary: exit codes, one-line errors, output, no mlx.

Stores are built in-process (fast); only what the process boundary decides runs as a
subprocess: exit codes, stdout/stderr, and which modules a command imports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_kvsnap
from helpers.local_store import FAULTS, agents, build, stamps, tree, write_agents

from kvsnap.store.local import MANIFEST, TMP_PREFIX, Store

# Runs the CLI and fails (exit 99) if mlx, mlx-lm or transformers got imported.
LIGHT = """
import atexit, os, sys
def _check():
    heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'transformers'))
    if heavy:
        sys.stderr.write('HEAVY IMPORTS: ' + ' '.join(heavy[:8]) + '\\n')
        sys.stderr.flush()
        os._exit(99)
atexit.register(_check)
sys.argv = ['kvsnap'] + sys.argv[1:]
from kvsnap.commands.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    # An empty Hugging Face cache: a hub id must never find the user's own downloads here.
    return {
        "KVSNAP_CACHE_DIR": str(tmp_path_factory.mktemp("digest-cache")),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path_factory.mktemp("hf-home")),
        "COLUMNS": "200",
    }


@pytest.fixture(scope="module")
def light(env):
    def run(*args, cwd=None):
        full = {**os.environ, **env}
        proc = subprocess.run(
            [sys.executable, "-c", LIGHT, *map(str, args)],
            capture_output=True,
            text=True,
            env=full,
            cwd=cwd,
            timeout=120,
        )
        assert "HEAVY IMPORTS" not in proc.stderr, (
            f"kvsnap {' '.join(map(str, args))} imported mlx: {proc.stderr}"
        )
        return proc

    return run


@pytest.fixture(scope="module")
def dense(demo_models):
    return demo_models.load("dense")


@pytest.fixture(scope="module")
def model_dir(demo_models) -> Path:
    return demo_models.path("dense")


@pytest.fixture(scope="module")
def base(dense, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli-base")
    build(dense, write_agents(d / "agents.json", agents(["alpha", "beta", "gamma"])), d / "store")
    return d / "store"


@pytest.fixture()
def store_copy(base, tmp_path) -> Path:
    shutil.copytree(base, tmp_path / "store", symlinks=True)
    return tmp_path / "store"


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# --- no mlx for the admin commands -------------------------------------------------------


def test_help_ls_verify_inspect_gc_do_not_import_mlx(light, base):
    snap = Store.open(base).snapshot_files()[0]
    for args in (
        ["--help"],
        ["build", "--help"],
        ["ls", base],
        ["ls", base, "--json"],
        ["verify", base],
        ["inspect", snap],
        ["gc", base],
    ):
        proc = light(*args)
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    assert "verify" in light("--help").stdout
    listed = json.loads(light("ls", base, "--json").stdout)
    assert (
        sorted(s["name"] for s in listed["snapshots"]) == ["alpha", "beta", "gamma"]
        and listed["problems"] == []
    )
    shown = json.loads(light("inspect", snap).stdout)
    assert shown["file"] == str(snap) and snap.name == shown["key"] + ".safetensors"


def test_cli_docstring_documents_exit_code_1_for_invalid_or_failed_entries():
    import kvsnap.commands.cli

    doc = " ".join(kvsnap.commands.cli.__doc__.split())
    assert re.search(
        r"1 a check found bad files \(verify\), or some warm-prompt entries were invalid or failed "
        r"to build",
        doc,
    )
    assert "2 a usage or input error" in doc


# --- errors: exit 2, one line naming the problem and the fix -------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, base) -> dict:
    d = tmp_path_factory.mktemp("inputs")
    (d / "bad.json").write_text('[{"name": "x", ')
    (d / "afile").write_text("not a folder")
    (d / "empty").mkdir()
    write_agents(d / "agents.json", agents(["alpha"]))
    write_agents(d / "none-valid.json", [[{"role": "user", "content": "hi"}]])
    return {"dir": d, "agents": d / "agents.json", "store": base}


ERRORS = {
    # name: (argv with placeholders, what the one line must say)
    "missing-model-dir": (
        ["build", "{agents}", "--model", "{dir}/no-model", "--out", "{dir}/out1"],
        r"model directory '.*/no-model' does not exist; give a local mlx-lm model directory",
    ),
    "hub-id-is-not-downloaded": (
        ["build", "{agents}", "--model", "Qwen/Qwen3-0.6B", "--out", "{dir}/out2"],
        r"model 'Qwen/Qwen3-0.6B' is not a local folder, and the Hugging Face cache .* has no "
        r"complete snapshot .*HF_HUB_OFFLINE is set.*`hf download Qwen/Qwen3-0.6B`",
    ),
    "missing-agents-file": (
        ["build", "{dir}/nope.json", "--model", "{model}", "--out", "{dir}/out3"],
        r"nope.json: no such warm-prompt file; check the path",
    ),
    "invalid-json-agents": (
        ["build", "{dir}/bad.json", "--model", "{model}", "--out", "{dir}/out4"],
        r"bad.json: not valid JSON at line 1 column \d+ .*; fix the JSON",
    ),
    "no-valid-entry": (
        ["build", "{dir}/none-valid.json", "--model", "{model}", "--out", "{dir}/out5"],
        r"none-valid.json: no valid warm-prompt entry \(entry 0: .*\)",
    ),
    "build-store-is-a-file": (
        ["build", "{agents}", "--model", "{model}", "--out", "{dir}/afile"],
        r"snapshot store '.*/afile' is a file, not a directory; give a folder",
    ),
    "ls-store-is-a-file": (["ls", "{dir}/afile"], r"is a file, not a directory; give a folder"),
    "verify-store-is-a-file": (
        ["verify", "{dir}/afile"],
        r"is a file, not a directory; give a folder",
    ),
    "gc-store-is-a-file": (["gc", "{dir}/afile"], r"is a file, not a directory; give a folder"),
    "ls-missing-store": (["ls", "{dir}/no-store"], r"does not exist; build one with `kvsnap build"),
    "verify-not-a-store": (
        ["verify", "{dir}/empty"],
        r"is not a kvsnap store \(no manifest.json, no snapshots/\); give the folder passed to "
        r"`kvsnap build --out`",
    ),
    "verify-missing-model": (
        ["verify", "{store}", "--model", "{dir}/no-model"],
        r"model directory '.*/no-model' does not exist",
    ),
    "inspect-not-a-snapshot": (
        ["inspect", "{agents}"],
        r"agents.json: declared header size \d+ exceeds .*not a safetensors file.*; give a kvsnap "
        r"snapshot file",
    ),
    "inspect-empty-file": (
        ["inspect", "{dir}/afile"],
        r"afile: declared header size \d+ exceeds|afile: .*not a safetensors file",
    ),
    "inspect-missing-file": (
        ["inspect", "{dir}/nope.safetensors"],
        r"no such snapshot file; give a path like STORE/snapshots/<key>.safetensors",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_exit_2_with_one_line_naming_problem_and_fix(light, inputs, model_dir, case):
    argv, expected = ERRORS[case]
    args = [a.format(model=model_dir, **inputs) for a in argv]
    proc = light(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = lines(proc.stderr)
    assert len(err) == 1, proc.stderr
    assert err[0].startswith(f"kvsnap {args[0]}: error: ")
    assert re.search(expected, err[0]), err[0]
    assert "Traceback" not in proc.stderr and "HFValidationError" not in proc.stderr
    if args[0] == "build":
        out = Path(args[args.index("--out") + 1])
        assert not out.exists() or out.is_file()  # nothing created for a build that cannot start


# --- build: table, counts, invalid entries, incremental ------------------------------------


@pytest.fixture(scope="module")
def cli_build(model_dir, env, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-build")
    entries = agents(["alpha", "beta"])
    entries.insert(
        1,
        [{"role": "system", "content": "ok"}, {"role": "user", "content": "a trailing user turn"}],
    )
    agents_file = write_agents(d / "agents.json", entries)
    proc = run_kvsnap(
        "build", agents_file, "--model", model_dir, "--out", d / "store", env=env, timeout=120
    )
    return proc, agents_file, d / "store"


def test_build_prints_a_table_and_counts_and_builds_the_valid_entries(cli_build):
    proc, _, store_dir = cli_build
    assert proc.returncode == 1, proc.stderr  # one entry was invalid
    out = proc.stdout
    assert re.search(r"agent\s*┃\s*status\s*┃\s*tokens", out), out
    for name in ("alpha", "beta"):
        assert re.search(rf"{name}\s*│\s*built\s*│\s*\d+", out), out
    assert re.search(
        r"entry 1: entries\[1\]\[1\]\.role: the entry ends with a 'user' message",
        " ".join(out.split()),
    ), out
    assert "2 built, 0 reused, 0 failed, 1 invalid" in out
    store = Store.open(store_dir)
    good, bad = store.scan()
    assert sorted(i.name for i in good) == ["alpha", "beta"] and bad == []
    for p in store.snapshot_files():
        store.verify_file(p)


def test_a_second_build_reuses_everything_and_exits_0_once_the_file_is_valid(
    cli_build, model_dir, env
):
    _, agents_file, store_dir = cli_build
    store = Store.open(store_dir)
    before, manifest = stamps(store), (store_dir / MANIFEST).read_bytes()
    write_agents(agents_file, agents(["alpha", "beta"]))
    proc = run_kvsnap(
        "build", agents_file, "--model", model_dir, "--out", store_dir, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 built, 2 reused, 0 failed, 0 invalid" in proc.stdout
    assert re.search(r"alpha\s*│\s*reused", proc.stdout)
    assert stamps(store) == before and (store_dir / MANIFEST).read_bytes() == manifest


# --- verify: every kind of bad file, by name and reason -------------------------------------


@pytest.fixture(scope="module")
def damaged(dense, tmp_path_factory) -> tuple[Path, dict[str, Path], dict[Path, bytes]]:
    """One store holding one file per fault, plus two good ones."""
    d = tmp_path_factory.mktemp("damaged")
    names = [f"agent{i:02d}" for i in range(len(FAULTS) + 2)]
    build(dense, write_agents(d / "agents.json", agents(names)), d / "store")
    files = Store.open(d / "store").snapshot_files()
    donor, spare = files[-2], files[-1]
    victims = dict(zip(FAULTS, files))
    for fault, path in victims.items():
        FAULTS[fault][0](path, donor=donor, outside=d / "outside")
    return d / "store", victims, {donor: donor.read_bytes(), spare: spare.read_bytes()}


def test_verify_names_every_bad_file_with_its_reason_and_passes_the_good_ones(light, damaged):
    root, victims, good = damaged
    before = tree(root)
    proc = light("verify", root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = lines(proc.stdout)
    for fault, path in victims.items():
        [line] = [ln for ln in out if ln.startswith(f"BAD  {path}: ")]
        assert re.search(FAULTS[fault][1], line), (fault, line)
    for path in good:
        assert any(ln.startswith(f"ok   snapshots/{path.name}") for ln in out)
    assert out[-1] == f"2 ok, {len(FAULTS)} bad"
    assert tree(root) == before and all(p.read_bytes() == b for p, b in good.items())
    # the rest survive a damaged store
    for args in (["ls", root], ["ls", root, "--json"], ["gc", root]):
        assert light(*args).returncode == 0
    assert tree(root) == before


def test_verify_with_model_rejects_a_snapshot_of_another_seed(
    light, dense, demo_models, store_copy, model_dir, env, tmp_path
):
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    other = load_model(make_demo_model(demo_models.root / "dense-seed1", DemoSpec(seed=1)))
    report = build(other, write_agents(tmp_path / "a.json", agents(["alpha"])), store_copy)
    foreign = Store.open(store_copy).path_for(report.entries[0].key)
    assert light("verify", store_copy).stdout.splitlines()[-1] == "4 ok, 0 bad"  # fine on its own
    proc = run_kvsnap("verify", store_copy, "--model", model_dir, env=env, timeout=120)
    # Sound but another model's: named as such, not a failure.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("other")]
    assert (
        line.startswith(
            f"other snapshots/{foreign.name}  alpha: built for another model or KV setting "
            f"(differs in: "
        )
        and "weights" in line
    )
    assert proc.stdout.splitlines()[-1] == "3 ok, 0 bad, 1 for another model"


def test_verify_reports_a_missing_snapshot_and_a_damaged_manifest(light, store_copy):
    store = Store.open(store_copy)
    gone = store.snapshot_files()[0]
    gone.unlink()
    proc = light("verify", store_copy)
    assert proc.returncode == 1
    assert (
        f"BAD  {gone}: listed in the manifest but missing; run `kvsnap build` again" in proc.stdout
    )
    assert lines(proc.stdout)[-1] == "2 ok, 1 bad"

    (store_copy / MANIFEST).write_text("{oops")
    proc = light("verify", store_copy)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert re.search(r"BAD  .*manifest.json cannot be read", proc.stdout)
    assert lines(proc.stdout)[-1] == "2 ok, 1 bad"


# --- gc ---------------------------------------------------------------------------------------


def test_gc_dry_run_lists_then_yes_removes_a_dropped_entry_and_temp_files(light, dense, tmp_path):
    agents_file = write_agents(tmp_path / "agents.json", agents(["alpha", "beta", "gamma"]))
    first = build(dense, agents_file, tmp_path / "store")
    write_agents(agents_file, agents(["alpha", "beta"]))
    build(dense, agents_file, tmp_path / "store")
    store = Store.open(tmp_path / "store")
    from kvsnap.store.paths import chain_relpaths

    gamma = store.path_for(next(e.key for e in first.entries if e.name == "gamma"))
    shared = {
        rel
        for p in store.snapshot_files()
        if p != gamma
        for rel in chain_relpaths(store.inspect(p))
    }
    # its tail's blocks
    own = [store.root / rel for rel in chain_relpaths(store.inspect(gamma)) if rel not in shared]
    tmp = store.snapshots_dir / f"{TMP_PREFIX}{gamma.name}.abc"
    tmp.write_bytes(b"interrupted")
    before = tree(store.root)
    n = 2 + len(own)

    proc = light("gc", store.root)
    assert proc.returncode == 0
    assert (
        f"would remove {gamma}" in proc.stdout
        and f"would remove {tmp}" in proc.stdout
        and all(f"would remove {p}" in proc.stdout for p in own)
    )
    assert (
        f"would remove {n} file(s)" in proc.stdout
        and "run again with --yes to delete" in proc.stdout
    )
    assert tree(store.root) == before

    proc = light("gc", store.root, "--yes")
    assert (
        proc.returncode == 0
        and f"removed {gamma}" in proc.stdout
        and f"removed {n} file(s)" in proc.stdout
    )
    assert not gamma.exists() and not tmp.exists() and not any(p.exists() for p in own)
    after = tree(store.root)
    assert (
        after == {k: v for k, v in before.items() if k in after} and len(after) == len(before) - n
    )
    proc = light("verify", store.root)
    assert proc.returncode == 0 and lines(proc.stdout)[-1] == "2 ok, 0 bad"


def test_gc_without_a_manifest_says_so_and_keeps_the_snapshots(light, store_copy):
    (store_copy / MANIFEST).unlink()
    proc = light("gc", store_copy, "--yes")
    assert (
        proc.returncode == 0
        and "has no manifest.json" in proc.stdout
        and "removed 0 file(s)" in proc.stdout
    )
    assert len(Store.open(store_copy).snapshot_files()) == 3


# --- a moved store ------------------------------------------------------------------------------


def test_a_moved_store_still_verifies_and_lists_relative_files(light, store_copy, tmp_path):
    moved = tmp_path / "image" / "opt" / "snaps"
    moved.parent.mkdir(parents=True)
    os.rename(store_copy, moved)
    proc = light("verify", moved)
    assert proc.returncode == 0 and lines(proc.stdout)[-1] == "3 ok, 0 bad", proc.stdout
    listed = json.loads(light("ls", moved, "--json").stdout)
    assert all(
        s["file"].startswith("snapshots/") and not os.path.isabs(s["file"])
        for s in listed["snapshots"]
    )
    proc = light("verify", "snaps", cwd=moved.parent)  # a relative store path works too
    assert proc.returncode == 0
