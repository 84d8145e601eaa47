"""`kvsnap push`, `pull`, `pack` and `unpack`: a store to and from an OCI registry or a tarball,
verified."""

from __future__ import annotations

from kvsnap.commands.common import EXIT_OK, byte_progress, human_bytes, print_json

JSON_HELP = "print the report as one JSON object (no progress bar); docs/cli.md lists its fields"
PLAIN_HTTP_HELP = (
    "plain HTTP instead of HTTPS (the default for localhost and 127.0.0.1; or set "
    "KVSNAP_REGISTRY_PLAIN_HTTP=1)"
)


def add_deadline_flags(p) -> None:
    """Per-request registry deadlines (docs/deploy.md#deadlines-and-limits); unset: env, then
    defaults."""
    p.add_argument(
        "--registry-timeout",
        type=float,
        metavar="S",
        help="seconds one registry request may take, plus its bytes at --registry-min-rate "
        "(default 120; env KVSNAP_REGISTRY_TIMEOUT)",
    )
    p.add_argument(
        "--registry-idle-timeout",
        type=float,
        metavar="S",
        help="seconds a registry may send nothing (default 30; env KVSNAP_REGISTRY_IDLE_TIMEOUT)",
    )
    p.add_argument(
        "--registry-min-rate",
        type=float,
        metavar="BYTES_PER_S",
        help="slowest transfer a blob's deadline allows (default 262144; env "
        "KVSNAP_REGISTRY_MIN_RATE)",
    )


def deadlines_of(args):
    """The flags over the environment's deadlines; None without flags (the backend reads the
    environment itself). Imported lazily: --help loads no HTTP client."""
    given = {
        "total_s": args.registry_timeout,
        "idle_s": args.registry_idle_timeout,
        "min_rate": args.registry_min_rate,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    from dataclasses import replace

    from kvsnap.store.oci.deadlines import Deadlines

    return replace(Deadlines.from_env(), **given)


def add_push(sub) -> None:
    p = sub.add_parser(
        "push",
        help="verify a store and upload it to an OCI registry (blobs the registry has are not sent "
        "again)",
    )
    p.add_argument("store", help="snapshot store directory")
    p.add_argument("ref", help="oci://HOST[:PORT]/REPO:TAG")
    p.add_argument("--plain-http", action="store_true", default=None, help=PLAIN_HTTP_HELP)
    add_deadline_flags(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(run=cmd_push)


def cmd_push(args) -> int:
    from kvsnap.store.remote import push

    with byte_progress("push", quiet=args.json) as progress:
        report = push(
            args.store,
            args.ref,
            plain_http=args.plain_http,
            deadlines=deadlines_of(args),
            **progress,
        )
    if args.json:
        print_json(
            {
                "store": args.store,
                "ref": str(report.ref),
                "manifest_digest": report.manifest_digest,
                "uploaded": report.uploaded,
                "uploaded_bytes": report.uploaded_bytes,
                "skipped": report.skipped,
            }
        )
        return EXIT_OK
    print(f"pushed {args.store} to {report.ref} ({report.manifest_digest})")
    print(
        f"{len(report.uploaded)} blob(s) uploaded ({human_bytes(report.uploaded_bytes)}), "
        f"{len(report.skipped)} already in the registry"
    )
    return EXIT_OK


def add_pull(sub) -> None:
    p = sub.add_parser(
        "pull",
        help="download a store from an OCI registry (only missing files), verify it, install it "
        "atomically",
    )
    p.add_argument("ref", help="oci://HOST[:PORT]/REPO:TAG or oci://HOST/REPO@sha256:…")
    p.add_argument(
        "store", help="snapshot store directory (created if absent; files already there are reused)"
    )
    p.add_argument("--plain-http", action="store_true", default=None, help=PLAIN_HTTP_HELP)
    add_deadline_flags(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(run=cmd_pull)


def cmd_pull(args) -> int:
    from kvsnap.store.remote import pull

    with byte_progress("pull", quiet=args.json) as progress:
        report = pull(
            args.ref,
            args.store,
            plain_http=args.plain_http,
            deadlines=deadlines_of(args),
            **progress,
        )
    if args.json:
        print_json(
            {
                "ref": str(report.ref),
                "store": str(report.dest),
                "manifest_digest": report.manifest_digest,
                "downloaded": report.downloaded,
                "downloaded_bytes": report.downloaded_bytes,
                "present": report.present,
                "resumed": list(getattr(report, "resumed", [])),
                "kept": list(getattr(report, "kept", [])),
            }
        )
        return EXIT_OK
    print(f"pulled {report.ref} ({report.manifest_digest}) into {report.dest}")
    print(
        f"{len(report.downloaded)} file(s) downloaded ({human_bytes(report.downloaded_bytes)}), "
        f"{len(report.present)} already there; all verified"
    )
    if getattr(report, "resumed", None):
        print(
            f"{len(report.resumed)} file(s) taken from an interrupted pull's stage (sha256 "
            f"checked), not downloaded again"
        )
    print_kept(getattr(report, "kept", []))
    return EXIT_OK


def add_pack(sub) -> None:
    p = sub.add_parser(
        "pack", help="verify a store and write it to a tarball (.tar, .tar.gz, .tar.xz)"
    )
    p.add_argument("store", help="snapshot store directory")
    p.add_argument("-o", "--output", required=True, help="archive file to write")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(run=cmd_pack)


def cmd_pack(args) -> int:
    from kvsnap.store.archive import pack

    with byte_progress("pack", quiet=args.json) as progress:
        report = pack(args.store, args.output, **progress)
    if args.json:
        print_json(
            {
                "store": args.store,
                "archive": str(report.archive),
                "files": report.files,
                "bytes": report.nbytes,
            }
        )
        return EXIT_OK
    print(
        f"packed {len(report.files)} file(s), {human_bytes(report.nbytes)}, from {args.store} into "
        f"{report.archive}"
    )
    return EXIT_OK


def add_unpack(sub) -> None:
    p = sub.add_parser(
        "unpack", help="unpack a tarball made by `kvsnap pack`, verify it, install it atomically"
    )
    p.add_argument("archive", help="archive file")
    p.add_argument("store", help="snapshot store directory (created if absent)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(run=cmd_unpack)


def cmd_unpack(args) -> int:
    from kvsnap.store.archive import unpack

    with byte_progress("unpack", quiet=args.json) as progress:
        report = unpack(args.archive, args.store, **progress)
    if args.json:
        print_json(
            {
                "archive": args.archive,
                "store": str(report.dest),
                "files": report.files,
                "bytes": report.nbytes,
                "kept": report.kept,
            }
        )
        return EXIT_OK
    print(
        f"unpacked {len(report.files)} file(s), {human_bytes(report.nbytes)}, from {args.archive} "
        f"into {report.dest}; all verified"
    )
    print_kept(report.kept)
    return EXIT_OK


def print_kept(kept: list[str]) -> None:
    """Shipped files that differ from the store's good file of the same name: reported, never
    installed."""
    if kept:
        shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        print(
            f"{len(kept)} shipped file(s) differ from the store's good file of the same name and "
            f"were not installed: {shown}"
        )
