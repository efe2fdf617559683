"""The results database (SQLAlchemy 2.0 ORM): runs, trials, best configs. The only SQL in fa4tune."""

from .models import SCHEMA_VERSION
from ..best import BestEntry, MergeReport
from .store import DEFAULT_DB_PATH, ResultsDB, config_key, resolve_location, sqlite_path

__all__ = [
    "DEFAULT_DB_PATH", "SCHEMA_VERSION", "BestEntry", "MergeReport", "ResultsDB", "config_key",
    "resolve_location", "sqlite_path",
]
