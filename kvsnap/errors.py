"""The exception tree. Every error names the thing, the bad value and the fix."""

from __future__ import annotations


class KvsnapError(Exception):
    """Base of every error kvsnap raises on purpose; the CLI prints it as one line."""


class UsageError(KvsnapError):
    """A command-line argument or option that cannot work."""


class ModelError(KvsnapError):
    """A model directory that is missing, unreadable or not an mlx-lm model."""


class WarmPromptError(KvsnapError):
    """A warm-prompt file that cannot be read or has no valid entry."""


class MessageError(KvsnapError):
    """One chat message or message list that is not valid.

    ``where`` is a path such as ``entries[2].messages[0].role`` so that the
    same error reads well in a warm-prompt report and in an HTTP 400 body.
    """

    def __init__(self, where: str, problem: str, fix: str):
        self.where = where
        self.problem = problem
        self.fix = fix
        super().__init__(f"{where}: {problem}; {fix}")


class TemplateError(KvsnapError):
    """A chat template that fails to render the messages it was given."""


class SnapshotError(KvsnapError):
    """A snapshot file that is corrupt, foreign, stale or of an unknown format."""

    def __init__(self, path: str, reason: str, fix: str = "rebuild it with `kvsnap build`"):
        self.path = path
        self.reason = reason
        self.fix = fix
        super().__init__(f"{path}: {reason}; {fix}")


class StoreError(KvsnapError):
    """A snapshot store that cannot be read, written or locked."""


class ManifestError(StoreError):
    """A ``manifest.json`` that is too big, not JSON, or not the shape kvsnap writes.

    ``where`` is the file (or the archive / registry entry it came from), ``reason`` names
    the field and quotes its value, ``fix`` says what to do.
    """

    def __init__(self, where: str, reason: str, fix: str):
        self.where = where
        self.reason = reason
        self.fix = fix
        super().__init__(f"{where} {reason}; {fix}")
