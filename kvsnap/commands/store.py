"""`kvsnap ls`, `inspect`, `verify` and `gc`: a store's files, read from their headers (no mlx
unless `verify --model`)."""

from __future__ import annotations

import json
from pathlib import Path

from kvsnap.commands import conversations
from kvsnap.commands.common import (
    EXIT_BAD,
    EXIT_OK,
    REVISION_HELP,
    add_kv_options,
    console,
    human_bytes,
    kv_settings,
    print_json,
    table_title,
)
from kvsnap.errors import KvsnapError


def add_ls(sub) -> None:
    p = sub.add_parser("ls", help="list the snapshots in a store (headers only)")
    p.add_argument("store")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_ls)


def cmd_ls(args) -> int:
    from kvsnap.store.local import Store

    store = Store.open(args.store, readonly=True)
    good, bad = store.scan()
    if args.json:
        print(
            json.dumps(
                {
                    "snapshots": [
                        {
                            "key": i.key,
                            "name": i.name,
                            "file": i.relpath,
                            "n_tokens": i.n_tokens,
                            "bytes": i.nbytes,
                            "model_digest": i.model_digest,
                            "model_repo": i.recorded.get("model_repo"),
                            "model_commit": i.recorded.get("model_commit"),
                            "created": i.recorded.get("created"),
                        }
                        for i in good
                    ],
                    "problems": [{"file": str(p.path), "reason": p.reason} for p in bad],
                    "conversations": conversations.summary(store),
                },
                indent=1,
            )
        )
        return EXIT_OK
    from rich.markup import escape
    from rich.table import Table

    # Names and dates come from the files: data, never rich markup ("[/bold]" would raise).
    table = Table(title=table_title(f"{store.root}: {len(good)} snapshot(s)"))
    for col in ("key", "agent", "tokens", "size", "model", "created"):
        table.add_column(col)
    for i in good:
        origin = (
            f" {i.recorded['model_repo']}@{str(i.recorded.get('model_commit', '?'))[:7]}"
            if i.recorded.get("model_repo")
            else ""
        )  # hub builds only
        table.add_row(
            i.key[:12],
            escape(i.name),
            str(i.n_tokens),
            human_bytes(i.nbytes),
            escape(i.model_digest[:12] + origin),
            escape(i.recorded.get("created", "?")),
        )
    out = console()
    out.print(table)
    for p in bad:
        out.print(f"unreadable: {p}", markup=False)
    line = conversations.summary_line(store)  # users' data: a summary, never their contents
    if line:
        out.print(line, markup=False, soft_wrap=True)
    return EXIT_OK


def add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="show one snapshot file's header")
    p.add_argument("file")
    p.set_defaults(run=cmd_inspect)


def cmd_inspect(args) -> int:
    from kvsnap.errors import SnapshotError
    from kvsnap.snapshot.file import FormatError, read_header
    from kvsnap.snapshot.header import inspect_header

    path = Path(args.file)
    if not path.is_file():
        raise KvsnapError(
            f"{path}: no such snapshot file; give a path like STORE/snapshots/<key>.safetensors "
            f"(or blocks/, checkpoints/)"
        )
    try:
        header = read_header(path)
        if "kvsnap.kind" in header.metadata:  # a block or a checkpoint
            from kvsnap.snapshot.chain import inspect_part

            part = inspect_part(path, header)
            print(
                json.dumps(
                    {
                        "file": str(path),
                        **part.__dict__,
                        "bytes": header.file_size,
                        "tensors": {
                            n: {"dtype": t.dtype, "shape": list(t.shape)}
                            for n, t in sorted(header.tensors.items())
                        },
                    },
                    indent=1,
                )
            )
            return EXIT_OK
        info = inspect_header(path, header)
    except FormatError as exc:
        raise SnapshotError(
            str(path),
            str(exc),
            "give a kvsnap snapshot file (STORE/snapshots/<key>.safetensors); `kvsnap verify "
            "STORE` checks them all",
        ) from None
    except OSError as exc:
        raise SnapshotError(
            str(path), f"cannot be read ({exc.strerror or exc})", "check the file's permissions"
        ) from None
    out = {
        "file": str(path),
        "key": info.key,
        "name": info.name,
        "n_tokens": info.n_tokens,
        "bytes": info.nbytes,
        "model_digest": info.model_digest,
        "model": info.model,
        "prompt_digest": info.prompt_digest,
        "recorded": info.recorded,
        "layers": info.layers,
        "chain": info.chain.__dict__ if info.chain is not None else None,
        "tensors": {
            n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in sorted(header.tensors.items())
        },
    }
    print(json.dumps(out, indent=1))
    return EXIT_OK


def add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check every snapshot (exit 1 if any is bad)")
    p.add_argument("store")
    p.add_argument(
        "--model",
        help="also reject snapshots not built for this model: hub id or local folder (imports mlx)",
    )
    p.add_argument("--revision", metavar="REV", help=REVISION_HELP)
    p.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object (counts, then per file status, reason, fix)",
    )
    add_kv_options(p)
    p.set_defaults(run=cmd_verify)


def store_relative(root: Path, path) -> str:
    """A file's path relative to the store root (as ``--json`` gives every file); as it is when
    it lies elsewhere."""
    for base in (root, root.resolve()):
        try:
            return str(Path(path).relative_to(base))
        except ValueError:
            continue
    return str(path)


class Lines:
    """What verify and gc say: printed line by line, or with ``--json`` gathered as the entries
    of one JSON object printed at the end (their files relative to the store)."""

    def __init__(self, as_json: bool, root: Path):
        self.as_json, self.root = as_json, root
        self.entries: list[dict] = []

    def __call__(self, line: str, entry: dict | None = None) -> None:
        if entry is not None:
            self.entries.append({**entry, "file": store_relative(self.root, entry["file"])})
        if not self.as_json:
            print(line)


def cmd_verify(args) -> int:
    from kvsnap.errors import SnapshotError
    from kvsnap.store.foreign import foreign_reason
    from kvsnap.store.local import Store

    store = Store.open(args.store, readonly=True).require_store()
    expected = shapes = None
    if args.revision and not args.model:
        raise KvsnapError(
            f"--revision {args.revision!r} needs --model (a hub id); add --model ORG/NAME or drop "
            f"--revision"
        )
    if args.model:
        from kvsnap.runtime.cache.shapes import ModelShapes
        from kvsnap.runtime.model.loading import default_digest_cache, load_model

        lm = load_model(args.model, kv_settings(args), args.revision)
        expected, shapes = lm.identity(default_digest_cache()), ModelShapes(lm)
    say = Lines(args.json, store.root)
    ok = bad = other = 0
    for path in store.snapshot_files():
        try:
            info = store.verify_file(path)
            # a name from a file must not forge output lines
            name = info.name if info.name.isprintable() else repr(info.name)
            foreign = foreign_reason(expected, info)
            if foreign:  # sound, for another model: a shared store may hold several
                other += 1
                say(
                    f"other {info.relpath}  {name}: {foreign}",
                    {"status": "other", "file": info.relpath, "name": info.name, "reason": foreign},
                )
                continue
            if shapes is not None:
                _check_shapes(store, info, shapes)
            ok += 1
            say(
                f"ok   {info.relpath}  {name}  {info.n_tokens} tokens",
                {
                    "status": "ok",
                    "file": info.relpath,
                    "name": info.name,
                    "n_tokens": info.n_tokens,
                },
            )
        except SnapshotError as exc:
            bad += 1
            say(
                f"BAD  {exc.path}: {exc.reason}; {exc.fix}",
                {"status": "bad", "file": str(exc.path), "reason": exc.reason, "fix": exc.fix},
            )
    check = (lambda info: _check_shapes(store, info, shapes)) if shapes is not None else None
    n_ok, n_bad, n_other = conversations.verify_conversations(store, expected, check, say)
    ok, bad, other = ok + n_ok, bad + n_bad, other + n_other
    bad += _verify_manifest(store, say)
    temp_files = store.temp_files()
    for tmp in temp_files:
        say(
            f"note {tmp}: leftover temp file of an interrupted write (harmless; `kvsnap gc --yes` "
            f"removes it)"
        )
    # a store whose every file is for another model or KV setting was not checked at all
    problem = (
        f"checked nothing: all {other} snapshot(s) are for another model or KV setting; give "
        "the --model and KV flags (--kv-bits, --kv-group-size, --max-kv-size) the server runs with"
        if other and not ok and not bad
        else None
    )
    if args.json:
        print_json(
            {
                "store": str(store.root),
                "ok": ok,
                "bad": bad,
                "other": other,
                "problem": problem,
                "conversations": {"ok": n_ok, "bad": n_bad, "other": n_other},
                "files": say.entries,
                "temp_files": [store_relative(store.root, tmp) for tmp in temp_files],
            }
        )
    else:
        print(f"{ok} ok, {bad} bad" + (f", {other} for another model" if other else ""))
        if problem:
            print(problem)
    return EXIT_BAD if bad or problem else EXIT_OK


def _check_shapes(store, info, shapes) -> None:
    """SnapshotError unless every tensor of the record (its blocks and checkpoints) has the shape
    and dtype of the model's own cache: a block's key does not hash its data, so only the model
    can tell a block rewritten with another head dim."""
    from kvsnap.errors import SnapshotError
    from kvsnap.snapshot.file import read_header
    from kvsnap.store.paths import chain_relpaths

    parts = (
        [store.root / rel for rel in chain_relpaths(info)]
        if info.chain is not None
        else [info.path]
    )
    for path in parts:
        why = shapes.problem_in_header(
            read_header(path).tensors, f"{path.parent.name}/{path.name}: "
        )
        if why:
            raise SnapshotError(
                str(info.path),
                why,
                "it was not built for this model's cache (forged or damaged); rebuild it with "
                "`kvsnap build`",
            )


def _verify_manifest(store, say: Lines) -> int:
    """Say and count what is wrong with the manifest: unreadable, or listing files that are
    gone."""
    from kvsnap.errors import StoreError
    from kvsnap.store.local import MANIFEST

    bad = 0
    try:
        referenced = store.referenced()
    except StoreError as exc:
        bad += 1
        referenced = set()
        say(f"BAD  {exc}", {"status": "bad", "file": MANIFEST, "reason": str(exc)})
    for ref in store.missing_files(referenced):
        bad += 1
        reason, fix = "listed in the manifest but missing", "run `kvsnap build` again"
        say(
            f"BAD  {store.root / ref}: {reason}; {fix}",
            {"status": "bad", "file": str(ref), "reason": reason, "fix": fix},
        )
    return bad


def add_gc(sub) -> None:
    p = sub.add_parser(
        "gc", help="remove temp files and snapshots no manifest record uses (dry run unless --yes)"
    )
    p.add_argument("store")
    p.add_argument("--yes", action="store_true", help="really delete")
    p.add_argument(
        "--conversations-unused-for",
        type=conversations.duration,
        metavar="AGE",
        help="also remove persisted conversations not used for AGE (90s, 30m, 12h, 7d, 2w)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object (the files, their count and bytes)",
    )
    p.set_defaults(run=cmd_gc)


def cmd_gc(args) -> int:
    from kvsnap.store.local import MANIFEST, Store

    store = Store.open(args.store)
    say = Lines(args.json, store.root)
    n_conv = conv_bytes = 0
    if args.conversations_unused_for is not None:
        n_conv, conv_bytes = conversations.gc_conversations(
            store, args.conversations_unused_for, args.yes, say
        )
    conv_entries = list(say.entries)
    doomed, freed = store.gc(apply=args.yes)
    doomed_count, freed = len(doomed) + n_conv, freed + conv_bytes
    verb = "removed" if args.yes else "would remove"
    has_manifest = (store.root / MANIFEST).exists()
    if not has_manifest and store.snapshot_files():
        say(
            f"note {store.root} has no manifest.json, so no snapshot is known to be unused; every "
            f"snapshot is kept (temp files and blocks no record reaches go)"
        )
    for p in doomed:
        say(f"{verb} {p}")
    if args.json:
        print_json(
            {
                "store": str(store.root),
                "deleted": args.yes,
                "manifest": has_manifest,
                "files": [store_relative(store.root, p) for p in doomed],
                "conversations": [e["file"] for e in conv_entries],
                "count": doomed_count,
                "bytes": freed,
            }
        )
        return EXIT_OK
    print(
        f"{verb} {doomed_count} file(s), {human_bytes(freed)}"
        + ("" if args.yes else "; run again with --yes to delete")
    )
    return EXIT_OK


def add_migrate(sub) -> None:
    p = sub.add_parser(
        "migrate",
        help="turn a store's v2 whole-file snapshots into v3 records and shared blocks (no model "
        "needed)",
    )
    p.add_argument("store")
    p.add_argument(
        "--block-tokens", type=int, default=256, metavar="B", help="tokens per block (default 256)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list the files that would be migrated, change nothing",
    )
    p.set_defaults(run=cmd_migrate)


def cmd_migrate(args) -> int:
    from kvsnap.errors import UsageError
    from kvsnap.snapshot.blocks import MAX_BLOCK_TOKENS, BlockSettings
    from kvsnap.store.migrate import migrate_store

    if not 1 <= args.block_tokens <= MAX_BLOCK_TOKENS:
        raise UsageError(
            f"--block-tokens {args.block_tokens}: give a number of tokens from 1 to "
            f"{MAX_BLOCK_TOKENS}"
        )
    report = migrate_store(
        args.store, BlockSettings(block_tokens=args.block_tokens), dry_run=args.dry_run
    )
    verb = "would migrate" if args.dry_run else "migrated"
    for path in report.migrated:
        print(f"{verb} {path}")
    for problem in report.problems:
        print(f"left as it is: {problem}")
    sizes = (
        ""
        if args.dry_run
        else f"; {human_bytes(report.bytes_before)} of whole files became "
        f"{human_bytes(report.bytes_after)} of records and new blocks"
    )
    print(
        f"{verb} {len(report.migrated)} file(s), {report.already} already v3, "
        f"{len(report.problems)} unreadable{sizes}"
    )
    return EXIT_BAD if report.problems else EXIT_OK
