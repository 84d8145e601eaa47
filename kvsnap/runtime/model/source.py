"""Where a model's files are: a local folder, or a Hugging Face hub id resolved as mlx-lm resolves
it.

No mlx here (huggingface_hub only, imported on use), so a bad ``--model`` fails before
anything heavy loads. The user's Hugging Face cache is searched first; a download (with
huggingface_hub's progress bar) happens only when the snapshot is not cached and
``HF_HUB_OFFLINE`` is not set.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvsnap.errors import ModelError, UsageError

# mlx_lm.utils.DEFAULT_ALLOW_PATTERNS (0.31-0.32): the files `mlx_lm.load(ID)` fetches.
# Copied, not imported, because importing mlx_lm.utils imports mlx; a test keeps them equal.
HUB_ALLOW_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
REVISION_RE = re.compile(r"[\w.\-/]{1,200}")


@dataclass(frozen=True)
class ResolvedModel:
    """A model folder and, when it is a hub snapshot, the repo id and commit it came from."""

    path: Path
    repo_id: str | None = None
    commit: str | None = None

    def recorded_fields(self) -> dict:
        """What a snapshot header records about the origin (for people, never keyed)."""
        return {"model_repo": self.repo_id, "model_commit": self.commit} if self.repo_id else {}


def check_model_dir(path: str | os.PathLike) -> Path:
    """A local model directory; mlx-lm would take a missing path for a hub repo id and download
    it."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(
            f"model directory {str(path)!r} does not exist; give a local mlx-lm model directory or "
            f"a hub id like org/name (make a local one with `kvsnap demo-model DIR`)"
        )
    if not p.is_dir():
        raise ModelError(
            f"model {str(path)!r} is a file, not a directory; give the folder holding config.json "
            f"and *.safetensors"
        )
    if not (p / "config.json").is_file():
        raise ModelError(
            f"{p}: no config.json; give an mlx-lm model directory (make one with `kvsnap "
            f"demo-model DIR`)"
        )
    return p.resolve()


def hub_snapshot_origin(folder: Path) -> tuple[str | None, str | None]:
    """(repo id, commit) when ``folder`` is ``…/models--ORG--NAME/snapshots/<commit>`` of a Hugging
    Face cache."""
    snapshots = folder.parent
    repo_folder = snapshots.parent
    if (
        snapshots.name != "snapshots"
        or not repo_folder.name.startswith("models--")
        or not COMMIT_RE.fullmatch(folder.name)
    ):
        return None, None
    # Hub ids never contain "--" (huggingface_hub refuses them), so every "--" was a "/".
    return repo_folder.name[len("models--") :].replace("--", "/"), folder.name


def looks_like_repo_id(name: str) -> bool:
    """What huggingface_hub accepts as a repo id; './x', '/x', '~/x' and 'a/b/c' are paths."""
    if name.startswith((".", "/", "~")) or "\\" in name:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(
    name: str | os.PathLike,
    revision: str | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
) -> ResolvedModel:
    """The folder ``name`` names: an existing local folder, else a hub id from the Hugging Face
    cache (or the hub).

    ``cache_dir``: the hub cache to use (default: huggingface_hub's, i.e. $HF_HUB_CACHE or
    $HF_HOME/hub).
    """
    text = os.fspath(name)
    if not text.strip():
        # Path("") is the current folder: an empty value would load whatever is there.
        raise UsageError(
            f"model {text!r} is empty; give a local mlx-lm model directory or a hub id like "
            "org/name"
        )
    local = Path(text).expanduser()
    if local.exists() or not looks_like_repo_id(text):
        if revision is not None:
            raise UsageError(
                f"--revision {revision!r} applies to hub ids, but {text!r} is a local path; drop "
                f"--revision or give a hub id like org/name"
            )
        folder = check_model_dir(text)
        return ResolvedModel(folder, *hub_snapshot_origin(folder))
    if revision is not None and (
        not REVISION_RE.fullmatch(revision) or ".." in revision.split("/")
    ):
        raise UsageError(
            f"--revision {revision!r} is not a branch, tag or commit name; give e.g. main or a "
            f"40-hex commit"
        )
    folder = _hub_snapshot(text, revision, cache_dir)
    repo_id, commit = hub_snapshot_origin(folder)
    return ResolvedModel(folder, repo_id or text, commit)


def fetch_command(repo_id: str, revision: str | None) -> str:
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's own error base (httpx2, httpx or requests by huggingface_hub version): not
    all are OSErrors."""
    found: list[type[BaseException]] = []
    for module, name in (
        ("httpx2", "HTTPError"),
        ("httpx", "HTTPError"),
        ("requests", "RequestException"),
    ):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None) -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision``; downloaded first when online and
    not cached."""
    from huggingface_hub import constants, is_offline_mode, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    where = (
        f"the Hugging Face cache {cache} has no complete snapshot of it (revision "
        f"{revision or 'main'})"
    )
    fix = f"fetch it with `{fetch_command(repo_id, revision)}`, or give a local mlx-lm model folder"
    patterns = list(HUB_ALLOW_PATTERNS)
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=patterns,
                cache_dir=cache,
                local_files_only=True,
            )
        )
        if _is_complete(folder):
            return check_model_dir(folder)
    except OSError:
        # not cached, incomplete (LocalEntryNotFoundError) or unreadable: download below when
        # allowed
        pass
    if is_offline_mode():
        raise ModelError(
            f"model {repo_id!r} is not a local folder, and {where}; HF_HUB_OFFLINE is set, so "
            f"nothing is downloaded; {fix}"
        )
    # LocalEntryNotFoundError is an OSError
    download_errors: tuple[type[BaseException], ...] = (
        HfHubHTTPError,
        OSError,
        *_transport_errors(),
    )
    try:
        folder = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=patterns, cache_dir=cache)
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelError(
            f"model {repo_id!r} is not a local folder and the hub has no such repo or revision "
            f"({_first_line(exc)}); {where}; check the id (`hf auth login` for a private or gated "
            f"repo), or {fix}"
        ) from None
    except download_errors as exc:
        raise ModelError(
            f"model {repo_id!r} is not a local folder, {where}, and the download failed "
            f"({_first_line(exc)}); {fix}"
        ) from None
    if not _is_complete(folder):
        raise ModelError(
            f"model {repo_id!r}: the hub snapshot {folder} has no config.json or no *.safetensors "
            f"weights, so it is not an mlx-lm model; pick an MLX conversion (e.g. an "
            f"mlx-community/… repo) or convert it with mlx_lm.convert"
        )
    return check_model_dir(folder)


def _is_complete(folder: Path) -> bool:
    """A snapshot mlx-lm can load: config.json and at least one weight file (links that resolve)."""
    return (folder / "config.json").is_file() and any(
        p.is_file() for p in folder.glob("*.safetensors")
    )
