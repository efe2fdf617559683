"""The results DB (SQLAlchemy 2.0 ORM): runs, trials, best configs. The only SQL in fa4tune."""

from ..best import BestEntry, MergeReport
from .models import SCHEMA_VERSION
from .store import (
    DEFAULT_DB_PATH,
    UNREACHABLE_HINT,
    DuplicateTrial,
    LockedStudy,
    ResultsDB,
    config_key,
    engine_options,
    engine_url,
    first_line,
    reach,
    resolve_location,
    shown_location,
    sqlite_path,
)

__all__ = [
    "DEFAULT_DB_PATH",
    "SCHEMA_VERSION",
    "BestEntry",
    "DuplicateTrial",
    "LockedStudy",
    "MergeReport",
    "ResultsDB",
    "UNREACHABLE_HINT",
    "config_key",
    "engine_options",
    "engine_url",
    "first_line",
    "reach",
    "resolve_location",
    "shown_location",
    "sqlite_path",
]
