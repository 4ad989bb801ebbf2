"""One exception hierarchy. Each error says what went wrong, where, and what to do."""

from __future__ import annotations

import difflib


class BuildkitError(Exception):
    """Base of every error buildkit raises on purpose. ``exit_code`` is what the CLI returns."""

    exit_code = 1


class UsageError(BuildkitError):
    """Bad command-line usage or a bad manifest: the user's input is wrong (exit 2)."""

    exit_code = 2


class ManifestError(UsageError):
    def __init__(self, file: str, where: str, message: str):
        self.file, self.where = file, where
        loc = f"{file}: {where}: " if where else f"{file}: "
        super().__init__(loc + message)


class SourceError(BuildkitError):
    """The source checkpoint is missing, malformed or inconsistent."""


class StepError(BuildkitError):
    """A step failed while running."""


class VerifyError(StepError):
    """One or more verification checks failed; ``report`` is the full report (JSON bytes),
    which the scheduler keeps in the store's ``reports/`` for the user to read."""

    def __init__(self, message: str, report: bytes | None = None):
        super().__init__(message)
        self.report = report


class StoreError(BuildkitError):
    """The store is unusable (permissions, corruption that cannot be repaired)."""


class StoreMiss(StoreError):
    """A store entry is missing, or was corrupt and has been removed: rebuilding restores it."""


def did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
