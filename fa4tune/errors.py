"""The errors fa4tune reports to a person: one paragraph each, caught by the CLI and turned into a
non-zero exit. Errors of the lead's modules (ProblemError, ConfigError, TargetError) are ValueErrors
and are reported the same way."""

from __future__ import annotations


class Fa4tuneError(Exception):
    """Bad input or an unusable environment, explained in the message."""


class KernelError(Fa4tuneError):
    """An unknown kernel, or a problem that no kernel supports."""


class SpaceError(Fa4tuneError):
    """An unknown search space or parameter, a parameter declared twice, an illegal domain."""


class JobError(Fa4tuneError):
    """A malformed search job (YAML); the message names the file and the field."""


class BackendError(Fa4tuneError):
    """A measurement backend that is unknown or cannot run here."""


class BackendUnavailable(BackendError):
    """A backend that cannot measure any more (its worker does not start, or keeps dying): the
    search stops rather than record every remaining candidate as failed."""


class ResultsDBError(Fa4tuneError):
    """A results database that cannot be opened, is corrupt, or has another schema version."""


class TableError(Fa4tuneError):
    """An exported table that is malformed or belongs to another kernel version."""


class StorageError(Fa4tuneError):
    """An Optuna storage that cannot be opened."""


class UnsupportedInput(ValueError):
    """An input fa4tune.attention cannot take; the message names what and what it takes."""


def is_user_error(exc: BaseException) -> bool:
    """Whether an exception is bad input or an unusable environment, to be told to a person in one
    paragraph rather than as a traceback: fa4tune's own errors, and the ValueErrors fa4tune's
    modules raise for bad input (ProblemError, ConfigError, TargetError, UnsupportedInput)."""
    if isinstance(exc, Fa4tuneError):
        return True
    return isinstance(exc, ValueError) and type(exc).__module__.startswith("fa4tune")
