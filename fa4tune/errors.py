"""The errors fa4tune reports to a person: one paragraph each, caught by the CLI and turned into a
non-zero exit. Errors of the lead's modules (ProblemError, ConfigError, TargetError) are ValueErrors and
are reported the same way."""

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
    """A backend that cannot measure any more (its worker does not start, or keeps dying): the search
    stops rather than record every remaining candidate as failed."""


class ResultsDBError(Fa4tuneError):
    """A results database that cannot be opened, is corrupt, or has another schema version."""


class TableError(Fa4tuneError):
    """An exported table that is malformed or belongs to another kernel version."""


class StorageError(Fa4tuneError):
    """An Optuna storage that cannot be opened."""
