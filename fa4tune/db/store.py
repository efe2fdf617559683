"""The results database: opening (path or SQLAlchemy URL, schema check), and every read and write of
runs, trials and best configs. The only module in fa4tune that talks SQL."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import create_engine, event, func, inspect, select, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from ..best import BestEntry, MergeReport
from ..errors import ResultsDBError
from .models import SCHEMA_VERSION, UPGRADES, Base, BestConfig, Run, SchemaInfo, Trial

CONFIRM_SOURCE = "confirm"  # trials of the re-timing before a best is stored; not search trials

DEFAULT_DB_PATH = "fa4tune-results/results.db"
SQLITE_HEADER = b"SQLite format 3\x00"


def now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def config_key(config: dict) -> str:
    """A canonical text form of a config: equal configs, equal keys."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def resolve_location(location: str | os.PathLike | None = None, job_location: str | None = None) -> str:
    """Where the results DB is: the explicit location (--db), else FA4TUNE_DB, else the job's, else
    the default path under the working directory."""
    for candidate in (location, os.environ.get("FA4TUNE_DB") or None, job_location):
        if candidate:
            return str(candidate)
    return DEFAULT_DB_PATH


def is_url(location: str) -> bool:
    return "://" in location


def sqlite_path(location: str) -> Path | None:
    """The file behind a location, or None for a non-file database."""
    if not is_url(location):
        return Path(location).expanduser()
    url = make_url(location)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return Path(url.database).expanduser()
    return None


class ResultsDB:
    def __init__(self, engine: Engine, location: str) -> None:
        self.engine = engine
        self.location = location
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    # ---- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, location: str | os.PathLike | None = None, *, create: bool = True) -> "ResultsDB":
        """Open (and with `create`, make) a results DB. A clear ResultsDBError for an unwritable path,
        a file that is not SQLite or not ours, and a schema of another version."""
        location = resolve_location(location)
        path = sqlite_path(location)
        if path is not None:
            _check_sqlite_file(path, location, create)
            url = f"sqlite:///{path.resolve()}"
        else:
            url = location
        try:
            engine = create_engine(url, future=True)
        except (ArgumentError, ImportError, ValueError) as exc:
            raise ResultsDBError(f"cannot use results DB {location!r}: {exc}") from exc
        if engine.dialect.name == "sqlite":
            event.listen(engine, "connect", _sqlite_pragmas)
        db = cls(engine, location)
        try:
            db._check_schema(create)
        except SQLAlchemyError as exc:
            engine.dispose()
            raise ResultsDBError(
                f"results DB {location!r} cannot be read: {_first_line(exc)}. If it is a file, it may be "
                "corrupt or not a database; move it aside or point --db / FA4TUNE_DB elsewhere."
            ) from exc
        except ResultsDBError:
            engine.dispose()
            raise
        return db

    def _check_schema(self, create: bool) -> None:
        tables = set(inspect(self.engine).get_table_names())
        if "fa4tune_schema" not in tables:
            if tables:
                raise ResultsDBError(
                    f"{self.location!r} holds a database that is not an fa4tune results DB (tables: "
                    f"{', '.join(sorted(tables))}); give another path with --db or FA4TUNE_DB"
                )
            if not create:
                raise ResultsDBError(f"results DB {self.location!r} is empty: run `fa4tune search` first")
            with self._sessions.begin() as session:
                Base.metadata.create_all(session.connection())
                session.add(SchemaInfo(key="schema_version", value=str(SCHEMA_VERSION)))
            return
        with self._sessions() as session:
            row = session.get(SchemaInfo, "schema_version")
        found = row.value if row else "none"
        if found.isdigit() and int(found) in UPGRADES:
            found = self._upgrade(int(found))
        if found != str(SCHEMA_VERSION):
            raise ResultsDBError(
                f"results DB {self.location!r} has schema version {found}, but this fa4tune "
                f"({_fa4tune_version()}) reads version {SCHEMA_VERSION}. Use the fa4tune version that wrote "
                "it, or export its tables with that version and import them into a new DB."
            )

    def _upgrade(self, version: int) -> str:
        """Add the columns later versions added (all nullable), one version at a time, in one
        transaction; the version they reach."""
        tables = Base.metadata.tables
        try:
            with self._sessions.begin() as session:
                while version in UPGRADES:
                    for table, columns in UPGRADES[version].items():
                        present = {c["name"] for c in inspect(session.connection()).get_columns(table)}
                        for name in columns:
                            if name not in present:
                                kind = tables[table].c[name].type.compile(dialect=self.engine.dialect)
                                session.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {kind}"))
                    version += 1
                session.get(SchemaInfo, "schema_version").value = str(version)
        except SQLAlchemyError as exc:
            raise ResultsDBError(
                f"results DB {self.location!r} has schema version {version} and could not be upgraded to "
                f"{SCHEMA_VERSION} ({_first_line(exc)}); make it writable, or export its tables and import "
                "them into a new DB"
            ) from exc
        return str(version)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- runs ---------------------------------------------------------------------------------
    def start_run(self, **fields) -> int:
        with self._sessions.begin() as session:
            run = Run(status="running", started_at=now(), details={}, **fields)
            session.add(run)
            session.flush()
            return run.id

    def resume_run(self, run_id: int) -> None:
        with self._sessions.begin() as session:
            run = session.get(Run, run_id)
            run.status, run.ended_at = "running", None

    def set_study_prefix(self, run_id: int, prefix: str) -> None:
        with self._sessions.begin() as session:
            session.get(Run, run_id).study_prefix = prefix

    def finish_run(self, run_id: int, status: str) -> None:
        with self._sessions.begin() as session:
            run = session.get(Run, run_id)
            run.status, run.ended_at = status, now()

    def add_clocks(self, run_id: int, sample: dict) -> None:
        """Record clocks the GPU was seen running at during the run."""
        with self._sessions.begin() as session:
            run = session.get(Run, run_id)
            clocks = dict(run.clocks or {})
            clocks["seen"] = list(clocks.get("seen", [])) + [sample]
            run.clocks = clocks

    def latest_run(self, job_name: str, kernel: str, kernel_hash: str, target: str) -> dict | None:
        with self._sessions() as session:
            run = session.scalars(
                select(Run)
                .where(Run.job_name == job_name, Run.kernel == kernel, Run.kernel_hash == kernel_hash,
                       Run.target == target)
                .order_by(Run.id.desc())
                .limit(1)
            ).first()
            return _columns(run) if run else None

    def runs(self) -> list[dict]:
        with self._sessions() as session:
            return [_columns(r) for r in session.scalars(select(Run).order_by(Run.id))]

    # ---- trials -------------------------------------------------------------------------------
    def add_trial(self, *, run_id: int, study_name: str, optuna_number: int | None, kernel: str,
                  kernel_hash: str, target: str, problem, config: dict, measurement, source: str,
                  provenance: dict, offer_best: bool = True) -> int:
        """Store one trial and, when it is the best ok measurement of its problem (and `offer_best`),
        the best config, in one transaction: a kill between the two cannot leave them disagreeing."""
        with self._sessions.begin() as session:
            trial = self._new_trial(session, run_id, study_name, optuna_number, kernel, kernel_hash, target,
                                    problem, config, measurement, source)
            if measurement.status == "ok" and offer_best:
                _offer_best(session, _trial_entry(trial, measurement, provenance), trial_id=trial.id)
            return trial.id

    def confirm_best(self, *, run_id: int, study_name: str, kernel: str, kernel_hash: str, target: str,
                     problem, confirmed: list[tuple[dict, object]], provenance: dict) -> int | None:
        """Store the re-timing of the best few trials of a study (`confirmed`: (trial, measurement)
        pairs) as trials of source `confirm`, and offer the fastest ok one as the best config, in
        one transaction. Only a trial that is ok can be confirmed. Returns the stored best's trial id,
        or None when nothing became best."""
        with self._sessions.begin() as session:
            stored = []
            for trial, measurement in confirmed:
                original = session.get(Trial, trial["id"])
                if original is None or original.status != "ok" or original.study_name != study_name:
                    raise ResultsDBError(f"trial {trial['id']} is not an ok trial of {study_name}: it cannot be "
                                         "confirmed as best")
                row = self._new_trial(session, run_id, study_name, None, kernel, kernel_hash, target, problem,
                                      original.config, measurement, CONFIRM_SOURCE)
                row.details = {**row.details, "confirms_trial": original.id}
                stored.append((row, measurement))
            session.flush()
            ok = sorted(((m.time_ms, row.id, row, m) for row, m in stored if m.status == "ok"))
            for _, _, row, measurement in ok:  # the fastest that may become best
                if _offer_best(session, _trial_entry(row, measurement, provenance), trial_id=row.id):
                    return row.id
                if not _was_wrong(session, _trial_entry(row, measurement, provenance)):
                    return None  # a faster best is already stored
            return None

    def confirmed(self, study_name: str) -> bool:
        """Whether the study's latest search trial is followed by a confirmation."""
        with self._sessions() as session:
            last_search = session.scalar(select(func.max(Trial.id)).where(
                Trial.study_name == study_name, Trial.source != CONFIRM_SOURCE))
            last_confirm = session.scalar(select(func.max(Trial.id)).where(
                Trial.study_name == study_name, Trial.source == CONFIRM_SOURCE))
        return last_confirm is not None and (last_search is None or last_confirm > last_search)

    def top_trials(self, study_name: str, limit: int) -> list[dict]:
        """The fastest ok search trials of a study, one per config."""
        with self._sessions() as session:
            rows = session.scalars(
                select(Trial)
                .where(Trial.study_name == study_name, Trial.status == "ok", Trial.source != CONFIRM_SOURCE)
                .order_by(Trial.time_ms, Trial.id)
            )
            picked, seen = [], set()
            for row in rows:
                if row.config_key not in seen:
                    seen.add(row.config_key)
                    picked.append(_columns(row))
                if len(picked) >= limit:
                    break
            return picked

    @staticmethod
    def _new_trial(session: Session, run_id, study_name, optuna_number, kernel, kernel_hash, target, problem,
                   config, measurement, source) -> Trial:
        trial = Trial(
            run_id=run_id, study_name=study_name, optuna_number=optuna_number, kernel=kernel,
            kernel_hash=kernel_hash, target=target, problem_key=problem.key(),
            bucket_key=problem.bucket().key(), problem=problem.to_dict(), config=dict(config),
            config_key=config_key(config), source=source, status=measurement.status,
            reason=measurement.reason, time_ms=measurement.time_ms, spread_ms=measurement.spread_ms,
            tflops=measurement.tflops, max_error=measurement.max_error,
            compile_s=measurement.compile_s, is_estimate=measurement.is_estimate,
            details=dict(measurement.details), created_at=now(),
        )
        session.add(trial)
        session.flush()
        return trial

    def trial_by_number(self, study_name: str, optuna_number: int) -> dict | None:
        with self._sessions() as session:
            row = session.scalars(
                select(Trial).where(Trial.study_name == study_name, Trial.optuna_number == optuna_number)
            ).first()
            return _columns(row) if row else None

    def trial_by_config(self, study_name: str, config: dict) -> dict | None:
        """The earlier trial of this study with the same config (the search never measures twice)."""
        with self._sessions() as session:
            row = session.scalars(
                select(Trial)
                .where(Trial.study_name == study_name, Trial.config_key == config_key(config))
                .order_by(Trial.id)
            ).first()
            return _columns(row) if row else None

    def count_trials(self, study_name: str, measured_only: bool = True, status: str | None = None) -> int:
        """Search trials of a study (confirmations not counted): all, those measured (not pruned as
        infeasible), or those of one status."""
        query = select(func.count()).select_from(Trial).where(Trial.study_name == study_name,
                                                                 Trial.source != CONFIRM_SOURCE)
        if measured_only:
            query = query.where(Trial.status != "pruned")
        if status is not None:
            query = query.where(Trial.status == status)
        with self._sessions() as session:
            return int(session.scalar(query))

    def trials(self, *, study_name: str | None = None, problem_key: str | None = None,
               kernel: str | None = None, target: str | None = None, run_id: int | None = None) -> list[dict]:
        query = select(Trial).order_by(Trial.id)
        for column, value in ((Trial.study_name, study_name), (Trial.problem_key, problem_key),
                              (Trial.kernel, kernel), (Trial.target, target), (Trial.run_id, run_id)):
            if value is not None:
                query = query.where(column == value)
        with self._sessions() as session:
            return [_columns(t) for t in session.scalars(query)]

    # ---- best configs -------------------------------------------------------------------------
    def best_configs(self, *, kernel: str | None = None, kernel_hash: str | None = None,
                     target: str | None = None) -> list[BestEntry]:
        query = select(BestConfig).order_by(BestConfig.kernel, BestConfig.target, BestConfig.problem_key,
                                             BestConfig.kernel_hash)
        for column, value in ((BestConfig.kernel, kernel), (BestConfig.kernel_hash, kernel_hash),
                              (BestConfig.target, target)):
            if value is not None:
                query = query.where(column == value)
        with self._sessions() as session:
            return [_best_entry(b) for b in session.scalars(query)]

    def merge_best(self, entries: list[BestEntry]) -> MergeReport:
        """Merge entries (an imported table) in one transaction; the better of two wins."""
        added, replaced, kept, conflicts = [], [], [], []
        with self._sessions.begin() as session:
            for entry in entries:
                row = _find_best(session, entry)
                existing = _best_entry(row) if row is not None else None  # before the row changes
                if _was_wrong(session, entry):
                    conflicts.append(f"{entry.problem_key} on {entry.target}: the table's config {entry.config} "
                                     "gave wrong results here; not imported")
                    kept.append(entry.problem_key)
                    continue
                outcome = _offer_best(session, entry, trial_id=None)
                if existing is None:
                    added.append(entry.problem_key)
                    continue
                (replaced if outcome else kept).append(entry.problem_key)
                if existing.config != entry.config:
                    winner = "table" if outcome else "database"
                    conflicts.append(
                        f"{entry.problem_key} on {entry.target}: database {existing.time_ms:.4g} ms "
                        f"{existing.config} vs table {entry.time_ms:.4g} ms {entry.config}; the {winner} wins"
                    )
        return MergeReport(added, replaced, kept, conflicts)

    # ---- state --------------------------------------------------------------------------------
    def counts(self) -> dict:
        with self._sessions() as session:
            return {
                name: int(session.scalar(select(func.count()).select_from(model)))
                for name, model in (("runs", Run), ("trials", Trial), ("best_configs", BestConfig))
            }


# ---- helpers ------------------------------------------------------------------------------------
def _check_sqlite_file(path: Path, location: str, create: bool) -> None:
    if path.is_dir():
        raise ResultsDBError(f"results DB path {location!r} is a directory; give a file path")
    if path.exists():
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
        if head and head != SQLITE_HEADER:
            raise ResultsDBError(
                f"results DB {location!r} is not a SQLite database (corrupt or another kind of file); "
                "move it aside or give another path with --db or FA4TUNE_DB"
            )
        if create and not os.access(path, os.W_OK):
            raise ResultsDBError(f"results DB {location!r} is not writable")
        return
    if not create:
        raise ResultsDBError(f"no results DB at {location!r}: run `fa4tune search` first, or give --db")
    parent = path.parent if str(path.parent) else Path(".")
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ResultsDBError(
            f"cannot create results DB {location!r}: {existing} is not a writable directory; give "
            "another path with --db or FA4TUNE_DB"
        )
    parent.mkdir(parents=True, exist_ok=True)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers (show, lookup) run while a search writes; the busy timeout rides out the short
    # write locks of concurrent workers instead of failing with "database is locked".
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=60000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _find_best(session: Session, entry: BestEntry) -> BestConfig | None:
    return session.scalars(
        select(BestConfig).where(
            BestConfig.kernel == entry.kernel, BestConfig.kernel_hash == entry.kernel_hash,
            BestConfig.target == entry.target, BestConfig.problem_key == entry.problem_key,
        )
    ).first()


def _trial_entry(trial: Trial, measurement, provenance: dict) -> BestEntry:
    return BestEntry(
        kernel=trial.kernel, kernel_hash=trial.kernel_hash, target=trial.target, problem=dict(trial.problem),
        problem_key=trial.problem_key, bucket_key=trial.bucket_key, config=dict(trial.config),
        time_ms=measurement.time_ms, tflops=measurement.tflops, is_estimate=measurement.is_estimate,
        provenance=provenance, source=f"run {trial.run_id}",
    )


def _was_wrong(session: Session, entry: BestEntry) -> bool:
    """Whether this config ever gave a wrong result on this problem with this kernel code."""
    return session.scalar(
        select(func.count()).select_from(Trial).where(
            Trial.kernel == entry.kernel, Trial.kernel_hash == entry.kernel_hash, Trial.target == entry.target,
            Trial.problem_key == entry.problem_key, Trial.config_key == config_key(entry.config),
            Trial.status == "wrong",
        )
    ) > 0


def _offer_best(session: Session, entry: BestEntry, trial_id: int | None) -> bool:
    """Store `entry` as best unless the stored one is at least as good, or the config ever gave a
    wrong result for this problem and kernel code (then never); True when stored."""
    if _was_wrong(session, entry):
        return False
    row = _find_best(session, entry)
    if row is not None and not entry.beats(_best_entry(row)):
        return False
    if row is None:
        row = BestConfig(kernel=entry.kernel, kernel_hash=entry.kernel_hash, target=entry.target,
                         problem_key=entry.problem_key)
        session.add(row)
    row.bucket_key, row.problem, row.config = entry.bucket_key, dict(entry.problem), dict(entry.config)
    row.time_ms, row.tflops, row.is_estimate = entry.time_ms, entry.tflops, entry.is_estimate
    row.provenance, row.source, row.trial_id, row.updated_at = dict(entry.provenance), entry.source, trial_id, now()
    return True


def _best_entry(row: BestConfig) -> BestEntry:
    return BestEntry(
        kernel=row.kernel, kernel_hash=row.kernel_hash, target=row.target, problem=dict(row.problem),
        problem_key=row.problem_key, bucket_key=row.bucket_key, config=dict(row.config),
        time_ms=row.time_ms, tflops=row.tflops, is_estimate=row.is_estimate,
        provenance=dict(row.provenance or {}), source=row.source,
    )


def _columns(row) -> dict:
    return {c.key: getattr(row, c.key) for c in inspect(row).mapper.column_attrs}


def _first_line(exc: Exception) -> str:
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        return str(exc.orig).splitlines()[0]
    return str(exc).splitlines()[0]


def _fa4tune_version() -> str:
    from .. import __version__

    return f"fa4tune {__version__}"
