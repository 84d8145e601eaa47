"""How much a tarball may expand to: checked entry by entry, from declared sizes, before writing.

A 1 MB ``.tar.gz`` of zeros expands to 1 GiB; ``unpack`` once staged all of it before any
check. Every entry's declared size is held to ``max_file_bytes``, the running total to
``max_total_bytes`` and, past ``ratio_floor``, to ``max_ratio`` times the archive's own size
(kvsnap's tensors hardly compress: a real store packs at about 1:1). The entry count is
bounded, and so are tar's own metadata entries (pax headers, GNU long names), which
``tarfile`` would read whole into memory.
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass, fields
from typing import Mapping

from kvsnap.errors import UsageError

MAX_META_BYTES = 1 << 20  # one pax header or long name; kvsnap's are under 200 bytes
META_TYPES = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)
ENV = {
    "max_total_bytes": "KVSNAP_UNPACK_MAX_BYTES",
    "max_files": "KVSNAP_UNPACK_MAX_FILES",
    "max_file_bytes": "KVSNAP_UNPACK_MAX_FILE_BYTES",
    "max_ratio": "KVSNAP_UNPACK_MAX_RATIO",
}


@dataclass(frozen=True)
class UnpackLimits:
    max_total_bytes: int = 1 << 40
    max_files: int = 100_000
    max_file_bytes: int = 64 << 30
    max_ratio: float = 50.0  # expanded bytes per archive byte
    ratio_floor: int = 64 << 20  # below this much expansion the ratio is not checked

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "UnpackLimits":
        """The defaults, each replaced by its ``KVSNAP_UNPACK_*`` variable when set."""
        values: dict = {}
        for f in fields(cls):
            name = ENV.get(f.name)
            text = environ.get(name, "").strip() if name else ""
            if not text:
                continue
            try:
                value = float(text) if f.name == "max_ratio" else int(text)
            except ValueError:
                value = 0
            if not value > 0:
                raise UsageError(f"${name} is {text!r}; give a positive number")
            values[f.name] = value
        return cls(**values)


class ExpansionGuard:
    """Counts entries and declared bytes; ``admit`` says why an entry would break a limit."""

    def __init__(self, limits: UnpackLimits, archive_bytes: int):
        self.limits = limits
        self.archive_bytes = max(1, archive_bytes)
        self.files = 0
        self.total = 0

    def admit(self, size: int) -> str | None:
        """None if an entry of ``size`` bytes fits; else the limit it breaks (then nothing is
        written)."""
        lim = self.limits
        self.files += 1
        if self.files > lim.max_files:
            return f"holds more than {lim.max_files} entries (${ENV['max_files']} raises it)"
        if size > lim.max_file_bytes:
            return (
                f"declares {size} bytes, over the {lim.max_file_bytes}-byte limit for one file "
                f"(${ENV['max_file_bytes']} raises it)"
            )
        self.total += size
        if self.total > lim.max_total_bytes:
            return (
                f"expands past {lim.max_total_bytes} bytes in all (${ENV['max_total_bytes']} "
                f"raises it)"
            )
        if self.total > lim.ratio_floor and self.total > lim.max_ratio * self.archive_bytes:
            return (
                f"expands to {self.total} bytes from a {self.archive_bytes}-byte archive, over "
                f"{lim.max_ratio:g} times "
                f"its size (a compression bomb? ${ENV['max_ratio']} raises it)"
            )
        return None


class BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses a pax header or long name over MAX_META_BYTES before tarfile reads
    it."""

    def _proc_member(self, tarfile_obj):
        if self.type in META_TYPES and self.size > MAX_META_BYTES:
            raise tarfile.ReadError(
                f"a tar metadata entry of {self.size} bytes, over the {MAX_META_BYTES}-byte limit"
            )
        # A private TarInfo hook (typeshed omits it): the one place a member's metadata is read.
        return super()._proc_member(tarfile_obj)  # type: ignore[misc]
