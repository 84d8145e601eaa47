"""``kvsnap pull`` and ``serve --kv-snapshots oci://…``: download what the folder lacks, verify it
all, move it in.

Blobs go into a staged install next to the store (checked for size and sha256 while they
stream, then each snapshot's own checks), and only a complete, verified set is moved in;
files already there with the right digest are not downloaded again.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from kvsnap.errors import ManifestError, SnapshotError
from kvsnap.faults import FaultHook
from kvsnap.snapshot.format import BLOCKS, PART_REL_RE
from kvsnap.store.checking import check_part
from kvsnap.store.install import StagedInstall, check_destination, existing_file_is_good
from kvsnap.store.local import MANIFEST, Store
from kvsnap.store.manifest import read_manifest_file
from kvsnap.store.oci.artifact import Layer, parse_artifact
from kvsnap.store.oci.client import RegistryClient
from kvsnap.store.oci.credentials import Credentials
from kvsnap.store.oci.deadlines import Deadlines
from kvsnap.store.oci.errors import RegistryError, RegistryUnreachableError
from kvsnap.store.oci.reference import Reference, as_reference
from kvsnap.store.shipping import ShipError, present_with_digest

log = logging.getLogger("kvsnap")


def fault(point: str) -> None:
    """Crash tests kill a pull here (``KVSNAP_FAULT=pull-staged-blob``); inert otherwise."""
    if os.environ.get("KVSNAP_FAULT"):
        FaultHook.from_env()(point)


@dataclass
class PullReport:
    ref: Reference
    dest: Path
    manifest_digest: str
    downloaded: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    downloaded_bytes: int = 0
    # differ from the store's good file of that name: not installed
    kept: list[str] = field(default_factory=list)
    # staged by a killed pull, digest-checked, not downloaded again
    resumed: list[str] = field(default_factory=list)


def _kept_existing(dest: Path, layers: list[Layer], have: list[Layer]) -> list[str]:
    """Layers whose name the store already holds as a good file with other bytes: never downloaded
    over it (a key names content but does not hash it); the manifest is merged, not kept."""
    if not dest.is_dir():
        return []
    store = Store(root=dest.resolve(), readonly=True)
    return [
        layer.relpath
        for layer in layers
        if layer not in have
        and layer.relpath != MANIFEST
        and (dest / layer.relpath).is_file()
        and existing_file_is_good(store, layer.relpath)
    ]


def _download_missing(
    client: RegistryClient,
    layers: list[Layer],
    have: list[Layer],
    staging: StagedInstall,
    report: PullReport,
    on_bytes: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> None:
    todo = []
    for layer in layers:
        if layer in have:
            report.present.append(layer.relpath)
            continue
        if layer.relpath in report.kept:
            continue
        # staged by a killed pull: sha256 checked
        if staging.reuse(layer.relpath, layer.size, layer.digest):
            report.resumed.append(layer.relpath)
            continue
        todo.append(layer)
    if on_total is not None:
        on_total(sum(layer.size for layer in todo))
    for layer in todo:
        with staging.open(layer.relpath) as out:
            client.download_blob(layer.digest, layer.size, out, layer.relpath, on_bytes)
        report.downloaded.append(layer.relpath)
        report.downloaded_bytes += layer.size
        fault("pull-staged-blob")


def pull(
    ref: Reference | str,
    dest: str | os.PathLike,
    plain_http: bool | None = None,
    credentials: Credentials | None | bool = True,
    transport: httpx.BaseTransport | None = None,
    deadlines: Deadlines | None = None,
    on_bytes: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> PullReport:
    """Fetch the manifest, download what ``dest`` lacks into a temp folder, verify all, move it
    in. ``on_total(n)`` once the bytes to download are known; ``on_bytes(n)`` as they arrive:
    its sum is ``downloaded_bytes``."""
    ref = as_reference(ref)
    dest_path = check_destination(dest)  # before any network call
    with RegistryClient(
        ref, plain_http, credentials, transport=transport, deadlines=deadlines
    ) as client:
        body, digest = client.get_manifest()
        layers = parse_artifact(body, ref)
        report = PullReport(ref, dest_path, digest)
        have = [
            layer
            for layer in layers
            if present_with_digest(dest_path / layer.relpath, layer.size, layer.digest)
        ]
        report.kept = _kept_existing(dest_path, layers, have)
        with StagedInstall(dest_path, resume=True) as staging:
            try:
                _download_missing(client, layers, have, staging, report, on_bytes, on_total)
            except RegistryError as exc:
                raise type(exc)(f"{exc}; nothing was changed in {dest_path}") from None
            staging.verify(str(ref))
            _verify_present(dest_path, [layer.relpath for layer in have], ref)
            staging.commit()
    return report


def _verify_present(root: Path, relpaths: list[str], ref: Reference) -> None:
    """Files already in place matched their blob's sha256; still run their own kvsnap checks."""
    if not relpaths:
        return
    store = Store(root=root.resolve(), readonly=True)
    for relpath in relpaths:
        try:
            if relpath == MANIFEST:
                read_manifest_file(
                    store.root / MANIFEST, f"refusing it (nothing was changed in {root})"
                )
            elif PART_REL_RE.fullmatch(relpath):
                check_part(
                    store,
                    "block" if relpath.startswith(BLOCKS) else "checkpoint",
                    Path(relpath).stem,
                    path=store.root / relpath,
                )
            else:
                # its parts: staged or present, each checked
                store.verify_file(store.root / relpath, parts=False)
        except ManifestError as exc:
            raise ShipError(f"{ref}: {exc}") from None
        except SnapshotError as exc:
            raise ShipError(
                f"{ref}: {relpath}: {exc.reason}; refusing it (nothing was changed in {root})"
            ) from None


def fetch(url: str) -> Path:
    """Pull ``url`` into kvsnap's cache folder and return it (what ``serve --kv-snapshots oci://…``
    starts from).

    The cache folder is ``$KVSNAP_CACHE_DIR/oci/<host>/<repo>/<tag>`` (else
    ``$XDG_CACHE_HOME/kvsnap/oci/…``, else ``~/.cache/kvsnap/oci/…``); files already there are
    reused. If the registry cannot be
    reached and an earlier pull left a store there, that copy is used (a snapshot is keyed
    by model and prompt, so an older copy can only be colder, never wrong).
    """
    ref = Reference.parse(url)
    dest = ref.cache_dir()
    try:
        report = pull(ref, dest)
    except RegistryUnreachableError as exc:
        if dest.is_dir() and Store(root=dest).is_initialized():
            log.warning("[kvsnap] %s; starting from the copy pulled earlier into %s", exc, dest)
            return dest
        raise
    log.info(
        "[kvsnap] pulled %s (%s) into %s: %d file(s) downloaded (%d bytes), %d already there",
        ref,
        report.manifest_digest[:19],
        dest,
        len(report.downloaded),
        report.downloaded_bytes,
        len(report.present),
    )
    return dest
