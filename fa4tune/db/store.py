"""The results database: opening (path or SQLAlchemy URL, schema check), and every read and write of
runs, trials and best configs. The only module in fa4tune that talks SQL."""

from __future__ import annotations

import importlib.util
import os
import random
import sqlite3
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import create_engine, event, func, inspect, select, text, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from .. import __version__, interrupts, policy
from ..best import BestEntry, MergeReport, config_key, config_values
from ..errors import Fa4tuneError, ResultsDBError
from ..files import unwritable_ancestor
from .models import (
    CONFIRM_SOURCE,
    SCHEMA_VERSION,
    UPGRADES,
    Base,
    BestConfig,
    Lock,
    Run,
    SchemaInfo,
    Trial,
)

# Write transactions carry this execution option: on SQLite they begin IMMEDIATE (below).
WRITE_OPTION = "fa4tune_write"
SQLITE_BUSY_TIMEOUT_S = 60  # how long a SQLite connection waits for another's lock

# A write transaction that meets a transient conflict (SQLite busy past its timeout, a PostgreSQL
# serialization failure or deadlock, two workers inserting the same best config) is run again.
WRITE_ATTEMPTS = 8
POSTGRES_TRANSIENT = {"40001", "40P01"}  # serialization_failure, deadlock_detected
POSTGRES_CONNECT_TIMEOUT_S = 10

DEFAULT_DB_PATH = "fa4tune-results/results.db"
SQLITE_HEADER = b"SQLite format 3\x00"


def now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def resolve_location(
    location: str | os.PathLike | None = None, job_location: str | None = None
) -> str:
    """Where the results DB is: the explicit location (--db), else FA4TUNE_DB, else the job's, else
    the default path under the working directory."""
    for candidate in (location, os.environ.get("FA4TUNE_DB") or None, job_location):
        if candidate:
            return str(candidate)
    return DEFAULT_DB_PATH


def is_url(location: str) -> bool:
    return "://" in location


class DuplicateTrial(Exception):
    """The study already stores a search trial of this config (another worker measured it too)."""


def shown_location(location: str) -> str:
    """A location fit to print or store: a URL's password is masked."""
    if not is_url(location):
        return location
    try:
        return make_url(location).render_as_string(hide_password=True)
    except ArgumentError:
        return location


def engine_url(location: str) -> str:
    """The SQLAlchemy URL for a database URL: `postgresql://` without a driver uses psycopg (3) when
    it is installed (SQLAlchemy's default would be psycopg2)."""
    url = make_url(location)
    if url.drivername in ("postgresql", "postgres"):
        for module, driver in (
            ("psycopg", "postgresql+psycopg"),
            ("psycopg2", "postgresql+psycopg2"),
        ):
            if importlib.util.find_spec(module) is not None:
                return url.set(drivername=driver).render_as_string(hide_password=False)
        raise Fa4tuneError(
            f"{shown_location(location)}: PostgreSQL needs a driver; install it with "
            "pip install 'fa4tune[postgres]' (psycopg)"
        )
    return location


UNREACHABLE_HINT = (
    "Check the URL, that the server runs and accepts connections from this host, and that the "
    "database exists."
)


def reach(location: str) -> None:
    """Connect to a DB URL once and let go; the driver's (or SQLAlchemy's) error when it cannot."""
    url = engine_url(location)
    engine = create_engine(url, **engine_options(url))
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    finally:
        engine.dispose()


def engine_options(url: str) -> dict:
    """create_engine options: a PostgreSQL server that does not answer fails within seconds, and a
    connection the server dropped while a long measurement ran is replaced, not reused."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return {}
    options: dict = {"pool_pre_ping": True}
    if "connect_timeout" not in parsed.query:
        options["connect_args"] = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S}
    return options


def sqlite_path(location: str) -> Path | None:
    """The file behind a location, or None for a non-file database."""
    if not is_url(location):
        return Path(location).expanduser()
    url = make_url(location)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return Path(url.database).expanduser()
    return None


def _new_run(session: Session, **fields) -> Run:
    """A new run row, running from now, flushed so that it has its id."""
    run = Run(status="running", started_at=now(), **{"details": {}, **fields})
    session.add(run)
    session.flush()
    return run


class ResultsDB:
    def __init__(self, engine: Engine, location: str) -> None:
        self.engine = engine
        self.location = location
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(
            engine.execution_options(**{WRITE_OPTION: True}), expire_on_commit=False
        )
        self._lock_rows: set[str] = set()  # lock names known to have their row

    # ---- opening ------------------------------------------------------------------------------
    @staticmethod
    def check(location: str) -> None:
        """Refuse a results DB that cannot be used, writing nothing: a path where no DB can be made,
        a URL without a driver or whose server does not answer (a ResultsDBError)."""
        path = sqlite_path(location)
        if path is not None:
            _check_sqlite_file(path, location, create=True, make_parent=False)
            return
        try:
            reach(location)
        except (SQLAlchemyError, ImportError, ValueError, Fa4tuneError) as exc:
            raise ResultsDBError(
                f"cannot use results DB {shown_location(location)!r}: {first_line(exc)}. "
                f"{UNREACHABLE_HINT}"
            ) from exc

    @classmethod
    def open(cls, location: str | os.PathLike | None = None, *, create: bool = True) -> ResultsDB:
        """Open (and with `create`, make) a results DB. A clear ResultsDBError for an unwritable
        path, a file that is not SQLite or not ours, and a schema of another version."""
        location = resolve_location(location)
        path = sqlite_path(location)
        shown = shown_location(location)
        if path is not None:
            _check_sqlite_file(path, location, create)  # its own ResultsDBError
        try:
            url = f"sqlite:///{path.resolve()}" if path is not None else engine_url(location)
            engine = create_engine(url, future=True, **engine_options(url))
        except (ArgumentError, ImportError, ValueError, Fa4tuneError) as exc:
            raise ResultsDBError(f"cannot use results DB {shown!r}: {exc}") from exc
        if engine.dialect.name == "sqlite":
            event.listen(engine, "connect", _sqlite_connect)
            event.listen(engine, "begin", _sqlite_begin)
        db = cls(engine, location)
        try:
            db._check_schema(create)
        except SQLAlchemyError as exc:
            engine.dispose()
            if path is None:
                raise ResultsDBError(
                    f"cannot use results DB {shown!r}: {first_line(exc)}. {UNREACHABLE_HINT}"
                ) from exc
            raise ResultsDBError(
                f"results DB {location!r} cannot be read: {first_line(exc)}. If it is a "
                "file, it may be corrupt or not a database; move it aside or point "
                "--db / FA4TUNE_DB elsewhere."
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
                    f"{shown_location(self.location)!r} holds a database that is not an "
                    f"fa4tune results DB (tables: {', '.join(sorted(tables))}); give "
                    "another path with --db or FA4TUNE_DB"
                )
            if not create:
                raise ResultsDBError(
                    f"results DB {shown_location(self.location)!r} is empty: run `fa4tune search` "
                    "first"
                )
            try:
                self._transact(_create_schema)
            except DBAPIError:
                # Another process created it at the same moment (PostgreSQL refuses the second
                # CREATE TABLE); what it made is checked below like any existing schema.
                if "fa4tune_schema" not in inspect(self.engine).get_table_names():
                    raise
        with self._sessions() as session:
            row = session.get(SchemaInfo, "schema_version")
        found = row.value if row else "none"
        if found.isdigit() and int(found) in UPGRADES:
            found = self._upgrade(int(found))
        if found != str(SCHEMA_VERSION):
            raise ResultsDBError(
                f"results DB {self.location!r} has schema version {found}, but this fa4tune "
                f"({_fa4tune_version()}) reads version {SCHEMA_VERSION}. Use the "
                "fa4tune version that wrote it, or export its tables with that version "
                "and import them into a new DB."
            )

    def _upgrade(self, version: int) -> str:
        """Add the columns later versions added (all nullable), one version at a time, and the
        tables and indexes they added, in one transaction; the version they reach."""
        tables = Base.metadata.tables

        def upgrade(session: Session) -> int:
            reached = int(
                session.get(SchemaInfo, "schema_version").value
            )  # another worker may have upgraded it
            while reached in UPGRADES:
                for table, columns in UPGRADES[reached].items():
                    present = {c["name"] for c in inspect(session.connection()).get_columns(table)}
                    for name in columns:
                        if name not in present:
                            kind = tables[table].c[name].type.compile(dialect=self.engine.dialect)
                            session.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {kind}"))
                reached += 1
            connection = session.connection()
            Base.metadata.create_all(connection)  # tables added since (existing ones are kept)
            for table in Base.metadata.sorted_tables:
                for index in table.indexes:
                    index.create(connection, checkfirst=True)
            session.get(SchemaInfo, "schema_version").value = str(reached)
            return reached

        try:
            version = self._transact(upgrade)
        except SQLAlchemyError as exc:
            raise ResultsDBError(
                f"results DB {self.location!r} has schema version {version} and could not be "
                f"upgraded to {SCHEMA_VERSION} ({first_line(exc)}); make it writable, or export "
                "its tables and import them into a new DB"
            ) from exc
        return str(version)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- transactions -------------------------------------------------------------------------
    @staticmethod
    def _retrying(attempt_once):
        """What `attempt_once()` returns, calling it again after a short, growing pause while the
        database reports a transient conflict (at most WRITE_ATTEMPTS calls)."""
        for attempt in range(WRITE_ATTEMPTS):
            try:
                return attempt_once()
            except DBAPIError as exc:
                if attempt == WRITE_ATTEMPTS - 1 or not _transient(exc):
                    raise
            time.sleep(random.uniform(0.01, 0.03) * 2**attempt)
        raise AssertionError("unreachable")

    def _transact(self, work):
        """`work(session)` in one write transaction, run again (from the start) when the database
        reports a transient conflict; what `work` returns."""

        def once():
            # Ctrl-C waits for the end of the transaction: interrupted inside it, the session could
            # be left holding the write lock (see fa4tune.interrupts).
            with interrupts.critical(), self._write_sessions.begin() as session:
                return work(session)

        return self._retrying(once)

    @contextmanager
    def locked(self, name: str):
        """Hold the lock named `name` (a study, or a job's runs) for the body, which gets a
        LockedStudy: reads and writes inside one transaction that no other holder of the lock can
        interleave with, on one host or many. The lock is the transaction's: a worker that dies
        holding it releases it with its connection."""
        self._ensure_lock_row(name)
        with (
            interrupts.critical()
        ):  # the whole hold: never interrupted while the lock is taken or held
            yield from self._hold(name)

    def _hold(self, name: str):
        def take():
            session = self._write_sessions()
            try:
                session.begin()
                session.execute(update(Lock).where(Lock.name == name).values(updated_at=now()))
            except BaseException:
                session.close()
                raise
            return session

        session = self._retrying(take)
        try:
            yield LockedStudy(session, name)
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def _ensure_lock_row(self, name: str) -> None:
        # Lock rows are never deleted: once seen, a name needs no second look from this connection.
        if name in self._lock_rows:
            return
        with self._sessions() as session:
            exists = session.get(Lock, name) is not None
        if not exists:
            try:
                self._transact(lambda session: session.add(Lock(name=name, updated_at=now())))
            except IntegrityError:
                pass  # another worker made it first
        self._lock_rows.add(name)

    # ---- runs ---------------------------------------------------------------------------------
    def start_run(self, **fields) -> int:
        return self._transact(lambda session: _new_run(session, **fields).id)

    def open_run(
        self, *, resume: bool, study_prefix, check_resume=None, **fields
    ) -> tuple[int, str, bool]:
        """Start a run of a job, or with `resume` continue (join) its latest run of the same kernel
        code and target that measures the same way (a cost-model search never continues a measured
        run: its estimates would count toward the measured studies' budgets and teach their
        samplers): (run id, study prefix, whether an earlier run was continued). Serialised per job,
        so that hosts starting together with --resume join one run. `study_prefix(run_id)` names the
        run's studies. `check_resume(run)` is shown the run to be continued (its columns) before
        anything changes: an error it raises refuses the resume, and the DB stays as it was."""
        key = (fields["job_name"], fields["kernel"], fields["kernel_hash"], fields["target"])
        with self.locked("job:" + "/".join(key)) as lock:
            session = lock.session
            previous = (
                _latest_run(session, *key, is_estimate=fields["is_estimate"]) if resume else None
            )
            if previous is not None:
                if check_resume is not None:
                    check_resume(_columns(previous))
                previous.status, previous.ended_at = "running", None
                return previous.id, previous.study_prefix, True
            run = _new_run(session, study_prefix="pending", **fields)
            run.study_prefix = study_prefix(run.id)
            return run.id, run.study_prefix, False

    def finish_run(self, run_id: int, status: str) -> None:
        def work(session: Session) -> None:
            run = session.get(Run, run_id)
            run.status, run.ended_at = status, now()

        self._transact(work)

    def fill_run(self, run_id: int, fields: dict) -> None:
        """Set the run's fields still empty (a worker telling what GPU the run measures on)."""

        def work(session: Session) -> None:
            run = session.get(Run, run_id, with_for_update=True)
            for key, value in fields.items():
                if getattr(run, key) is None and value is not None:
                    setattr(run, key, value)

        self._transact(work)

    def add_clocks(self, run_id: int, sample: dict) -> None:
        """Record clocks the GPU was seen running at during the run (workers of several GPUs add to
        the same run: the row is locked while it is changed)."""

        def work(session: Session) -> None:
            run = session.get(Run, run_id, with_for_update=True)
            clocks = dict(run.clocks or {})
            clocks["seen"] = list(clocks.get("seen", [])) + [sample]
            run.clocks = clocks

        self._transact(work)

    def study_seconds(self, run_id: int, study_name: str) -> float:
        """Seconds the run has searched the study so far, in all its earlier sessions (the longest
        any one worker searched it), as record_study_seconds left them."""
        with self._sessions() as session:
            run = session.get(Run, run_id)
            return float(((run.details or {}).get("study_seconds") or {}).get(study_name, 0.0))

    def record_study_seconds(self, run_id: int, study_name: str, seconds: float) -> None:
        """Note that a worker has searched the study for `seconds` in this run (counting the earlier
        sessions it started from): a resumed run charges them to the problem's time budget. Workers
        search a study side by side, so the longest of them counts, not their sum."""

        def work(session: Session) -> None:
            run = session.get(Run, run_id, with_for_update=True)
            details = dict(run.details or {})
            spent = dict(details.get("study_seconds") or {})
            spent[study_name] = max(float(spent.get(study_name, 0.0)), float(seconds))
            details["study_seconds"] = spent
            run.details = details

        self._transact(work)

    def latest_run(
        self,
        job_name: str,
        kernel: str,
        kernel_hash: str,
        target: str,
        is_estimate: bool | None = None,
    ) -> dict | None:
        """The job's latest run of this kernel code on `target` (of estimates or of measurements
        only, when `is_estimate` says which)."""
        with self._sessions() as session:
            run = _latest_run(session, job_name, kernel, kernel_hash, target, is_estimate)
            return _columns(run) if run else None

    def run(self, run_id: int) -> dict | None:
        with self._sessions() as session:
            run = session.get(Run, run_id)
            return _columns(run) if run else None

    def runs(self) -> list[dict]:
        with self._sessions() as session:
            return [_columns(r) for r in session.scalars(select(Run).order_by(Run.id))]

    # ---- trials -------------------------------------------------------------------------------
    def add_trial(
        self,
        *,
        run_id: int,
        study_name: str,
        optuna_number: int | None,
        kernel: str,
        kernel_hash: str,
        target: str,
        problem,
        config: dict,
        measurement,
        source: str,
        provenance: dict,
        offer_best: bool = True,
    ) -> int:
        """Store one trial and, when it is the best ok measurement of its problem (and
        `offer_best`), the best config, in one transaction: a kill between the two cannot leave them
        disagreeing. DuplicateTrial when the study already stores a search trial of this config."""

        def work(session: Session) -> int:
            return _add_trial(
                session,
                run_id,
                study_name,
                optuna_number,
                kernel,
                kernel_hash,
                target,
                problem,
                config,
                measurement,
                source,
                provenance,
                offer_best,
            )

        try:
            return self._transact(work)
        except IntegrityError as exc:
            if _is_duplicate_trial(exc):
                raise DuplicateTrial(
                    f"{study_name} already stores a trial of {config_key(config)}"
                ) from exc
            raise

    def confirm_best(
        self,
        *,
        run_id: int,
        study_name: str,
        kernel: str,
        kernel_hash: str,
        target: str,
        problem,
        confirmed: list[tuple[dict, object]],
        provenance: dict,
        prefer: int | None = None,
        min_gain: float = 0.0,
    ) -> int | None:
        """Store the re-timing of the best few trials of a study (`confirmed`: (trial, measurement)
        pairs) as trials of source `confirm`, and offer the fastest ok one as the best config, in
        one transaction. Only a trial that is ok can be confirmed. `prefer` (the id of one of the
        confirmed trials, the default config's) is offered first unless another beats it
        (`beats_default`: faster by more than `min_gain` (0.003 = 0.3%, the gpu backend's default),
        and in every round timed beside it); the fastest that does goes before it. Returns the
        stored best's trial id, or None when nothing became best."""

        def work(session: Session) -> int | None:
            stored = []
            for trial, measurement in confirmed:
                original = session.get(Trial, trial["id"])
                if original is None or original.status != "ok" or original.study_name != study_name:
                    raise ResultsDBError(
                        f"trial {trial['id']} is not an ok trial of {study_name}: it cannot be "
                        "confirmed as best"
                    )
                row = _new_trial(
                    session,
                    run_id,
                    study_name,
                    None,
                    kernel,
                    kernel_hash,
                    target,
                    problem,
                    original.config,
                    measurement,
                    CONFIRM_SOURCE,
                )
                row.details = {**row.details, "confirms_trial": original.id}
                stored.append((row, measurement))
            session.flush()
            # A config that ever gave a wrong result never becomes best: out before the default is
            # weighed against the fastest, or the next one would win without that test.
            ok = sorted(
                (
                    (m, row)
                    for row, m in stored
                    if m.status == "ok"
                    and not _was_wrong(session, _trial_entry(row, m, provenance))
                ),
                key=lambda pair: (pair[0].time_ms, pair[1].id),
            )
            default = next(
                (i for i, (_, row) in enumerate(ok) if row.details.get("confirms_trial") == prefer),
                None,
            )
            ok, kept = policy.confirmation_order(ok, default, min_gain)
            # A stored best whose config was re-timed here is judged by these side-by-side rounds,
            # not by its time from another session (clocks, temperature); otherwise the lower time
            # stands.
            retimed = {row.config_key for _, row in ok}
            for measurement, row in ok:  # the fastest that may become best
                label = (
                    dict(provenance, kept_default=kept) if kept and row is ok[0][1] else provenance
                )
                entry = _trial_entry(row, measurement, label)
                if _offer_best(session, entry, trial_id=row.id, retimed=retimed):
                    return row.id
                if not _was_wrong(session, entry):
                    return None  # a faster best is already stored
            return None

        return self._transact(work)

    def confirmed(self, study_name: str) -> bool:
        """Whether the study's latest search trial is followed by a confirmation."""
        with self._sessions() as session:
            last_search = session.scalar(
                select(func.max(Trial.id)).where(
                    Trial.study_name == study_name, Trial.source != CONFIRM_SOURCE
                )
            )
            last_confirm = session.scalar(
                select(func.max(Trial.id)).where(
                    Trial.study_name == study_name, Trial.source == CONFIRM_SOURCE
                )
            )
        return last_confirm is not None and (last_search is None or last_confirm > last_search)

    def top_trials(self, study_name: str, limit: int) -> list[dict]:
        """The fastest ok search trials of a study, one per config."""
        with self._sessions() as session:
            rows = session.scalars(
                select(Trial)
                .where(
                    Trial.study_name == study_name,
                    Trial.status == "ok",
                    Trial.source != CONFIRM_SOURCE,
                )
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

    def trial_by_number(self, study_name: str, optuna_number: int) -> dict | None:
        with self._sessions() as session:
            return _trial_by_number(session, study_name, optuna_number)

    def trial_by_config(self, study_name: str, config: dict) -> dict | None:
        """The study's earlier trial with the same config (the search never measures twice)."""
        with self._sessions() as session:
            return _trial_by_config(session, study_name, config)

    def count_trials(
        self, study_name: str, measured_only: bool = True, status: str | None = None
    ) -> int:
        """Search trials of a study (confirmations not counted): all, those measured (not pruned as
        infeasible), or those of one status."""
        with self._sessions() as session:
            return _count_trials(session, study_name, measured_only, status)

    def study_counts(self, study_name: str) -> dict:
        """A study's search trials by status in one query: {"ok": n, "pruned": n, ...}."""
        with self._sessions() as session:
            rows = session.execute(
                select(Trial.status, func.count())
                .where(Trial.study_name == study_name, Trial.source != CONFIRM_SOURCE)
                .group_by(Trial.status)
            )
            return {status: int(count) for status, count in rows}

    def stored_among(self, study_name: str, numbers) -> set[int]:
        """Which of these Optuna trial numbers the study has stored."""
        with self._sessions() as session:
            return _stored_among(session, study_name, numbers)

    def trials(
        self,
        *,
        study_name: str | None = None,
        problem_key: str | None = None,
        kernel: str | None = None,
        target: str | None = None,
        run_id: int | None = None,
        confirmations: bool = True,
    ) -> list[dict]:
        """Stored trials, oldest first; without `confirmations`, the search's own (not the
        re-timings of the best few before one is stored best)."""
        query = select(Trial).order_by(Trial.id)
        if not confirmations:
            query = query.where(Trial.source != CONFIRM_SOURCE)
        for column, value in (
            (Trial.study_name, study_name),
            (Trial.problem_key, problem_key),
            (Trial.kernel, kernel),
            (Trial.target, target),
            (Trial.run_id, run_id),
        ):
            if value is not None:
                query = query.where(column == value)
        with self._sessions() as session:
            return [_columns(t) for t in session.scalars(query)]

    def known_good_config(
        self, *, kernel: str, kernel_hash: str, target: str, problem_key: str
    ) -> dict | None:
        """A config of the problem measured ok (not estimated) with this kernel code on this target,
        and never wrong there: its best config's trial, else its fastest ok trial, else a measured
        best config without a trial here (imported from a table: measured where the table was made);
        None when there is none. Evidence that the problem runs at all, for the gpu backend's health
        check."""
        same = (
            Trial.kernel == kernel,
            Trial.kernel_hash == kernel_hash,
            Trial.target == target,
            Trial.problem_key == problem_key,
        )
        wrong = select(Trial.config_key).where(*same, Trial.status == "wrong")
        ok = select(Trial).where(
            *same,
            Trial.status == "ok",
            Trial.is_estimate.is_(False),
            Trial.config_key.not_in(wrong),
        )
        this_best = (
            BestConfig.kernel == kernel,
            BestConfig.kernel_hash == kernel_hash,
            BestConfig.target == target,
            BestConfig.problem_key == problem_key,
        )
        best = select(BestConfig.trial_id).where(*this_best)
        with self._sessions() as session:
            row = (
                session.scalars(ok.where(Trial.id == best.scalar_subquery())).first()
                or session.scalars(ok.order_by(Trial.time_ms, Trial.id)).first()
            )
            if row is not None:
                return dict(row.config)
            imported = session.scalars(
                select(BestConfig).where(*this_best, BestConfig.is_estimate.is_(False))
            ).first()
            if imported is not None and config_key(imported.config) not in set(
                session.scalars(wrong)
            ):
                return dict(imported.config)
            return None

    # ---- best configs -------------------------------------------------------------------------
    def best_configs(
        self,
        *,
        kernel: str | None = None,
        kernel_hash: str | None = None,
        target: str | None = None,
    ) -> list[BestEntry]:
        query = select(BestConfig).order_by(
            BestConfig.kernel, BestConfig.target, BestConfig.problem_key, BestConfig.kernel_hash
        )
        for column, value in (
            (BestConfig.kernel, kernel),
            (BestConfig.kernel_hash, kernel_hash),
            (BestConfig.target, target),
        ):
            if value is not None:
                query = query.where(column == value)
        with self._sessions() as session:
            return [_best_entry(b) for b in session.scalars(query)]

    def merge_best(self, entries: list[BestEntry], flush: str | None = None) -> MergeReport:
        """Merge entries (an imported table) in one transaction; the better of two wins
        (policy.better; `flush`: the L2 flush whose measurements win over another's, None: the
        table's)."""

        def work(session: Session) -> MergeReport:
            added, replaced, kept, conflicts = [], [], [], []
            for entry in entries:
                row = _find_best(session, entry)
                existing = _best_entry(row) if row is not None else None  # before the row changes
                if _was_wrong(session, entry):
                    conflicts.append(
                        f"{entry.problem_key} on {entry.target}: the table's config {entry.config} "
                        "gave wrong results here; not imported"
                    )
                    kept.append(entry.problem_key)
                    continue
                outcome = _offer_best(session, entry, trial_id=None, flush=flush)
                if existing is None:
                    added.append(entry.problem_key)
                    continue
                (replaced if outcome else kept).append(entry.problem_key)
                if existing.config != entry.config:
                    winner = "table" if outcome else "database"
                    apart = (
                        f" (times of the {policy.flush_of(existing)} and the "
                        f"{policy.flush_of(entry)} L2 flush do not compare: an entry of the "
                        f"{flush or policy.flush_of(entry)} one wins)"
                        if policy.flushes_differ(entry, existing)
                        else ""
                    )
                    conflicts.append(
                        f"{entry.problem_key} on {entry.target}: database "
                        f"{existing.time_ms:.4g} ms {existing.config} vs table "
                        f"{entry.time_ms:.4g} ms {entry.config}; the {winner} wins{apart}"
                    )
            return MergeReport(added, replaced, kept, conflicts)

        return self._transact(work)

    # ---- state --------------------------------------------------------------------------------
    def counts(self) -> dict:
        with self._sessions() as session:
            return {
                name: int(session.scalar(select(func.count()).select_from(model)))
                for name, model in (("runs", Run), ("trials", Trial), ("best_configs", BestConfig))
            }


# ---- helpers ------------------------------------------------------------------------------------
def _check_sqlite_file(path: Path, location: str, create: bool, make_parent: bool = True) -> None:
    if path.is_dir():
        raise ResultsDBError(f"results DB path {location!r} is a directory; give a file path")
    if path.exists():
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
        if head and head != SQLITE_HEADER:
            raise ResultsDBError(
                f"results DB {location!r} is not a SQLite database (corrupt or another kind of "
                "file); move it aside or give another path with --db or FA4TUNE_DB"
            )
        if not head and not create:
            # Opening it would make it a SQLite file (WAL mode is written to its header): a command
            # that only reads leaves it as it is.
            raise ResultsDBError(
                f"results DB {location!r} is an empty file (0 bytes), with no "
                "results yet: run `fa4tune search` with it first, or give "
                "another --db"
            )
        if create and not os.access(path, os.W_OK):
            raise ResultsDBError(f"results DB {location!r} is not writable")
        return
    if not create:
        raise ResultsDBError(
            f"no results DB at {location!r}: run `fa4tune search` first, or give --db"
        )
    blocked = unwritable_ancestor(path)
    if blocked is not None:
        raise ResultsDBError(
            f"cannot create results DB {location!r}: {blocked} is not a writable directory; give "
            "another path with --db or FA4TUNE_DB"
        )
    if make_parent:
        path.parent.mkdir(parents=True, exist_ok=True)


def _sqlite_connect(dbapi_connection, _record) -> None:
    # fa4tune begins its transactions itself (_sqlite_begin), not the sqlite3 module.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # The busy timeout rides out the short write locks of concurrent workers instead of failing with
    # "database is locked". It comes first: switching a new file to WAL needs it alone, while a
    # reader (`fa4tune show`, a test polling it) may hold it.
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000:.0f}")
    # WAL lets readers (show, lookup, other workers) run while a search writes. SQLite refuses the
    # switch at once, without waiting, where waiting could deadlock (two connections both
    # switching): so it is tried again, for as long as the busy timeout.
    deadline, pause = time.monotonic() + SQLITE_BUSY_TIMEOUT_S, 0.01
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(connection) -> None:
    """A write transaction takes SQLite's write lock when it begins (IMMEDIATE), waiting for it
    under the busy timeout. A deferred one that read first and then wrote could not wait: SQLite
    fails it at once with "database is locked" when another worker committed in between."""
    write = connection.get_execution_options().get(WRITE_OPTION)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _transient(exc: DBAPIError) -> bool:
    """A conflict that running the transaction again resolves."""
    message = str(exc.orig)
    if isinstance(exc, IntegrityError):  # two workers inserted the same problem's first best config
        return "uq_best_problem" in message or "UNIQUE constraint failed: best_configs." in message
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    return (
        code in POSTGRES_TRANSIENT
        or "database is locked" in message
        or "database is busy" in message
    )


def _is_duplicate_trial(exc: IntegrityError) -> bool:
    message = str(exc.orig)  # PostgreSQL names the index, SQLite its columns
    return (
        "uq_trials_study_config" in message
        or "UNIQUE constraint failed: trials.study_name, trials.config_key" in message
    )


def _create_schema(session: Session) -> None:
    connection = session.connection()
    if inspect(connection).has_table("fa4tune_schema"):
        return  # another process made it while this one waited for the write lock
    Base.metadata.create_all(connection)
    session.add(SchemaInfo(key="schema_version", value=str(SCHEMA_VERSION)))


def _latest_run(
    session: Session,
    job_name: str,
    kernel: str,
    kernel_hash: str,
    target: str,
    is_estimate: bool | None = None,
) -> Run | None:
    same = [
        Run.job_name == job_name,
        Run.kernel == kernel,
        Run.kernel_hash == kernel_hash,
        Run.target == target,
    ]
    if is_estimate is not None:
        same.append(Run.is_estimate.is_(is_estimate))
    return session.scalars(select(Run).where(*same).order_by(Run.id.desc()).limit(1)).first()


def _trial_by_number(session: Session, study_name: str, optuna_number: int) -> dict | None:
    row = session.scalars(
        select(Trial).where(Trial.study_name == study_name, Trial.optuna_number == optuna_number)
    ).first()
    return _columns(row) if row else None


def _trial_by_config(session: Session, study_name: str, config: dict) -> dict | None:
    row = session.scalars(
        select(Trial)
        .where(Trial.study_name == study_name, Trial.config_key == config_key(config))
        .order_by(Trial.id)
    ).first()
    return _columns(row) if row else None


def _count_trials(
    session: Session, study_name: str, measured_only: bool, status: str | None
) -> int:
    query = (
        select(func.count())
        .select_from(Trial)
        .where(Trial.study_name == study_name, Trial.source != CONFIRM_SOURCE)
    )
    if measured_only:
        query = query.where(Trial.status != "pruned")
    if status is not None:
        query = query.where(Trial.status == status)
    return int(session.scalar(query))


def _stored_among(session: Session, study_name: str, numbers) -> set[int]:
    numbers = list(numbers)
    if not numbers:
        return set()
    return set(
        session.scalars(
            select(Trial.optuna_number).where(
                Trial.study_name == study_name,
                Trial.source != CONFIRM_SOURCE,
                Trial.optuna_number.in_(numbers),
            )
        )
    )


def _new_trial(
    session: Session,
    run_id,
    study_name,
    optuna_number,
    kernel,
    kernel_hash,
    target,
    problem,
    config,
    measurement,
    source,
) -> Trial:
    trial = Trial(
        run_id=run_id,
        study_name=study_name,
        optuna_number=optuna_number,
        kernel=kernel,
        kernel_hash=kernel_hash,
        target=target,
        problem_key=problem.key(),
        bucket_key=problem.bucket().key(),
        problem=problem.to_dict(),
        config=config_values(config),
        config_key=config_key(config),
        source=source,
        status=measurement.status,
        reason=measurement.reason,
        time_ms=measurement.time_ms,
        spread_ms=measurement.spread_ms,
        tflops=measurement.tflops,
        max_error=measurement.max_error,
        compile_s=measurement.compile_s,
        is_estimate=measurement.is_estimate,
        details=dict(measurement.details),
        created_at=now(),
    )
    session.add(trial)
    session.flush()
    return trial


def _add_trial(
    session: Session,
    run_id,
    study_name,
    optuna_number,
    kernel,
    kernel_hash,
    target,
    problem,
    config,
    measurement,
    source,
    provenance,
    offer_best,
) -> int:
    trial = _new_trial(
        session,
        run_id,
        study_name,
        optuna_number,
        kernel,
        kernel_hash,
        target,
        problem,
        config,
        measurement,
        source,
    )
    if measurement.status == "ok" and offer_best:
        _offer_best(session, _trial_entry(trial, measurement, provenance), trial_id=trial.id)
    return trial.id


class LockedStudy:
    """In ResultsDB.locked: the study's stored trials read and written in the lock's transaction."""

    def __init__(self, session: Session, name: str) -> None:
        self.session = session
        self.name = name

    def stored(self, config: dict) -> dict | None:
        return _trial_by_config(self.session, self.name, config)

    def stored_number(self, optuna_number: int) -> dict | None:
        return _trial_by_number(self.session, self.name, optuna_number)

    def stored_among(self, numbers) -> set[int]:
        return _stored_among(self.session, self.name, numbers)

    def measured(self) -> int:
        return _count_trials(self.session, self.name, True, None)

    def add_trial(
        self,
        *,
        run_id,
        optuna_number,
        kernel,
        kernel_hash,
        target,
        problem,
        config,
        measurement,
        source,
        provenance,
        offer_best=True,
    ) -> int:
        return _add_trial(
            self.session,
            run_id,
            self.name,
            optuna_number,
            kernel,
            kernel_hash,
            target,
            problem,
            config,
            measurement,
            source,
            provenance,
            offer_best,
        )

    def confirming(self) -> str | None:
        """The worker that claimed the study's confirmation, if any."""
        return self.session.get(Lock, self.name).confirming

    def set_confirming(self, worker: str | None) -> None:
        self.session.get(Lock, self.name).confirming = worker


def _find_best(session: Session, entry: BestEntry) -> BestConfig | None:
    """The stored best of the entry's problem, locked until the transaction ends (PostgreSQL:
    another worker's offer waits, then compares with what this one stored)."""
    return session.scalars(
        select(BestConfig)
        .where(
            BestConfig.kernel == entry.kernel,
            BestConfig.kernel_hash == entry.kernel_hash,
            BestConfig.target == entry.target,
            BestConfig.problem_key == entry.problem_key,
        )
        .with_for_update()
    ).first()


def _trial_entry(trial: Trial, measurement, provenance: dict) -> BestEntry:
    return BestEntry(
        kernel=trial.kernel,
        kernel_hash=trial.kernel_hash,
        target=trial.target,
        problem=dict(trial.problem),
        problem_key=trial.problem_key,
        bucket_key=trial.bucket_key,
        config=dict(trial.config),
        time_ms=measurement.time_ms,
        tflops=measurement.tflops,
        is_estimate=measurement.is_estimate,
        provenance=provenance,
        source=f"run {trial.run_id}",
    )


def _was_wrong(session: Session, entry: BestEntry) -> bool:
    """Whether this config ever gave a wrong result on this problem with this kernel code."""
    return (
        session.scalar(
            select(func.count())
            .select_from(Trial)
            .where(
                Trial.kernel == entry.kernel,
                Trial.kernel_hash == entry.kernel_hash,
                Trial.target == entry.target,
                Trial.problem_key == entry.problem_key,
                Trial.config_key == config_key(entry.config),
                Trial.status == "wrong",
            )
        )
        > 0
    )


def _offer_best(
    session: Session,
    entry: BestEntry,
    trial_id: int | None,
    retimed=frozenset(),
    flush: str | None = None,
) -> bool:
    """Store `entry` as best unless the stored one is at least as good, or the config ever gave a
    wrong result for this problem and kernel code (then never); True when stored. A stored best
    whose config key is in `retimed` was timed again in the same rounds as `entry`, which the caller
    offers as their winner: it is replaced, whatever its time from another session. `flush`: which
    L2 flush wins where the two were measured under different ones (policy.better)."""
    row = _find_best(session, entry)
    stored = _best_entry(row) if row is not None else None
    if not policy.stores_best(
        entry,
        stored,
        ever_wrong=_was_wrong(session, entry),
        stored_retimed=row is not None and config_key(row.config) in retimed,
        flush=flush,
    ):
        return False
    if row is None:
        row = BestConfig(
            kernel=entry.kernel,
            kernel_hash=entry.kernel_hash,
            target=entry.target,
            problem_key=entry.problem_key,
        )
        session.add(row)
    row.bucket_key, row.problem, row.config = (
        entry.bucket_key,
        dict(entry.problem),
        dict(entry.config),
    )
    row.time_ms, row.tflops, row.is_estimate = entry.time_ms, entry.tflops, entry.is_estimate
    row.provenance, row.source, row.trial_id, row.updated_at = (
        dict(entry.provenance),
        entry.source,
        trial_id,
        now(),
    )
    return True


def _best_entry(row: BestConfig) -> BestEntry:
    return BestEntry(
        kernel=row.kernel,
        kernel_hash=row.kernel_hash,
        target=row.target,
        problem=dict(row.problem),
        problem_key=row.problem_key,
        bucket_key=row.bucket_key,
        config=dict(row.config),
        time_ms=row.time_ms,
        tflops=row.tflops,
        is_estimate=row.is_estimate,
        provenance=dict(row.provenance or {}),
        source=row.source,
    )


def _columns(row) -> dict:
    return {c.key: getattr(row, c.key) for c in inspect(row).mapper.column_attrs}


def first_line(exc: Exception) -> str:
    """The first line of an error's message (a driver's own, under SQLAlchemy's wrapping)."""
    text = str(exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _fa4tune_version() -> str:

    return f"fa4tune {__version__}"
