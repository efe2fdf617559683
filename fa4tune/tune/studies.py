"""Optuna's side: where studies live (a journal file beside the results DB by default, any RDB URL
on request), the samplers a job may name, and how studies are named. Optuna's storage is kept apart
from the results DB so that many workers share a study through Optuna, not through our tables.

Many workers: every trial a worker asks for carries the worker's name (`host:pid:identity`,
WORKER_ATTR), and the config it claimed a budget slot for (CLAIM_ATTR, see sharing.py). A worker
that dies leaves its trials RUNNING; they are handed back (failed, and queued again by Optuna's
retry callback) by whoever sees it dead: on its own host, a process that no longer exists; on
another host, Optuna's heartbeat (RDB storages on a server), whose stale trials the same callback
queues again."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import os
import socket
import threading
import time
import warnings
import zlib
from datetime import datetime
from pathlib import Path

from ..db import (
    UNREACHABLE_HINT,
    engine_options,
    engine_url,
    first_line,
    reach,
    shown_location,
    sqlite_path,
)
from ..db.store import SQLITE_HEADER
from ..errors import JobError, StorageError
from ..files import unwritable_ancestor

# Optuna is imported where it is used: what else fa4tune imports from here (the CLI's other
# commands, the report) does not pay for it.

RDB_PREFIXES = ("sqlite:", "postgresql", "mysql", "oracle", "mssql")
WORKER_ATTR = "fa4tune_worker"  # host:pid:identity of the worker that asked the trial
CLAIM_ATTR = "fa4tune_claim"  # the config (key) whose measurement the trial holds a budget slot for
SOURCE_ATTR = "fa4tune_source"  # why a queued trial was queued: default, warm-start or probe
DEFAULT_SOURCE = "default"  # SOURCE_ATTR of the kernel's default config (it keeps a budget slot)
GIVEN_BACK_ATTR = (
    "fa4tune_given_back"  # a queued trial put back unmeasured: the number it was popped as
)
# Heartbeats on server storages (PostgreSQL, MySQL): every FA4TUNE_HEARTBEAT_S seconds (default 10)
# a worker records that each of its trials is alive; one silent for HEARTBEAT_GRACE times that is
# stale and handed back.
HEARTBEAT_S = 10
HEARTBEAT_GRACE = 3
# A trial a dead worker left running is queued again at most this often (a config that kills the
# search worker itself every time must not do so forever).
MAX_HAND_BACKS = 2
UNNAMED_GRACE_S = 10.0  # a worker names the trial it asked for within milliseconds


def quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(logging.WARNING)


def default_storage_location(db_location: str) -> str:
    """The journal file next to the results DB (or under fa4tune-results/ for a non-file DB)."""
    path = sqlite_path(db_location)
    if path is None:
        return "fa4tune-results/optuna.journal"
    return str(path.with_name(path.stem + ".optuna.journal"))


def is_rdb(location: str) -> bool:
    return location.startswith(RDB_PREFIXES) and "://" in location


def is_server_storage(location: str) -> bool:
    """A storage several hosts can share (an RDB on a server, not a file)."""
    return is_rdb(location) and not location.startswith("sqlite:")


def journal_path(location: str) -> Path | None:
    return None if is_rdb(location) else Path(location.removeprefix("journal:")).expanduser()


def resolved_storage_location(location: str) -> str:
    """The location as a run records it, meaning the same from any working directory: a journal
    file's absolute path; a URL as it is."""
    path = journal_path(location)
    return location if path is None else str(path.resolve())


def heartbeat_seconds() -> int:
    value = os.environ.get("FA4TUNE_HEARTBEAT_S", str(HEARTBEAT_S))
    if not value.isdigit() or int(value) < 1:
        raise StorageError(
            f"FA4TUNE_HEARTBEAT_S must be a whole number of seconds, 1 or more; got {value!r}"
        )
    return int(value)


def check_storage(location: str) -> None:
    """Refuse a storage that cannot work before anything is written anywhere: a journal path that is
    a directory or under no writable directory, an RDB URL without a driver or whose server does not
    answer."""
    shown = shown_location(location)
    path = journal_path(location)
    if path is not None:
        if path.is_dir():
            raise StorageError(
                f"Optuna storage {location!r} is a directory; give a journal file path"
            )
        blocked = None if path.exists() and os.access(path, os.W_OK) else unwritable_ancestor(path)
        if blocked is not None:
            raise StorageError(
                f"cannot write the Optuna journal {location!r}: {blocked} is not a writable "
                "directory"
            )
        if path.is_file() and not _reads_as_journal(path):
            raise StorageError(
                f"Optuna storage {location!r} is not an Optuna journal (its first "
                "line is not one of Optuna's records); move it aside or give "
                "another --storage"
            )
        return
    if is_server_storage(location):
        heartbeat_seconds()
    else:  # SQLite answers SELECT 1 on any file: what the file holds is seen when Optuna opens it
        path = sqlite_path(location)
        if path is not None and path.is_file():
            with open(path, "rb") as f:
                head = f.read(len(SQLITE_HEADER))
            if head and head != SQLITE_HEADER:
                raise StorageError(
                    f"Optuna storage {shown!r}: {path} is not a SQLite database; "
                    "move it aside or give another --storage"
                )
    try:
        reach(location)
    except Exception as exc:  # the driver's and SQLAlchemy's many kinds all mean "cannot use it"
        raise StorageError(
            f"cannot use Optuna storage {shown!r}: {first_line(exc)}. {UNREACHABLE_HINT}"
        ) from exc


def _reads_as_journal(path: Path) -> bool:
    """Whether a file is empty or begins with one of Optuna's journal records (a JSON object with
    an op_code). A first line still being written (no newline yet) gets the benefit of the doubt."""
    try:
        with open(path, "rb") as f:
            line = f.readline(1 << 20)
    except OSError:  # unreadable: opening the storage says so
        return True
    if not line.endswith(b"\n"):
        return True
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


class JournalFlock:
    """The journal's write lock for processes of one host: an exclusive flock(2) on JOURNAL.flock.
    The kernel drops it when its holder dies, so a worker killed in the middle of a write stalls no
    one (Optuna's own file locks are broken only after a grace period of seconds). It serves the
    journal's Optuna backend (acquire / release). flock also locks across NFS clients on Linux, but
    use PostgreSQL for several hosts."""

    def __init__(self, journal: str) -> None:
        self.path = journal + ".flock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        import fcntl

        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


SCHEMA_RACE_ATTEMPTS = 5
# What a process that lost the race to create Optuna's schema sees: concurrent CREATE TABLE (a
# duplicate row type or relation), or a second first row of the version tables.
SCHEMA_RACE_MARKS = (
    "pg_type_typname_nsp_index",
    "already exists",
    "version_info_pkey",
    "alembic_version_pkc",
)


def lost_schema_race(exc: BaseException) -> bool:
    """Whether opening an RDB storage failed because another process created Optuna's tables at the
    same moment: opening it again finds them made."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(mark in str(exc) for mark in SCHEMA_RACE_MARKS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def open_storage(location: str, heartbeat: bool | None = None, create: bool = True):
    """An Optuna storage: an RDB URL, or a journal file path (optionally written `journal:PATH`). A
    server storage records heartbeats (unless `heartbeat` is False) and hands stale trials back.
    Without `create`, a journal or SQLite file that does not exist is a StorageError (opening it
    would make an empty one)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if not create:
        path = (
            journal_path(location)
            if not is_rdb(location)
            else (sqlite_path(location) if location.startswith("sqlite:") else None)
        )
        if path is not None and not path.exists():
            raise StorageError(
                f"no Optuna storage at {shown_location(location)!r}: the file does not exist"
            )
    try:
        if is_rdb(location):
            url = engine_url(location)
            beats = is_server_storage(location) if heartbeat is None else heartbeat
            options = {}
            if beats:
                seconds = heartbeat_seconds()
                options = {
                    "heartbeat_interval": seconds,
                    "grace_period": HEARTBEAT_GRACE * seconds,
                    "heartbeat_stale_trial_callback": HandBack(),
                }
            for attempt in range(SCHEMA_RACE_ATTEMPTS):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                        return optuna.storages.RDBStorage(
                            url, engine_kwargs=engine_options(url), **options
                        )
                except Exception as exc:  # noqa: BLE001  (only a lost schema race is tried again)
                    if attempt + 1 == SCHEMA_RACE_ATTEMPTS or not lost_schema_race(exc):
                        raise
                    time.sleep(0.2 * (attempt + 1))
        path = journal_path(location)
        if path.is_dir():
            raise StorageError(
                f"Optuna storage {location!r} is a directory; give a journal file path"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        journal = str(path.resolve())
        return JournalStorage(JournalFileBackend(journal, lock_obj=JournalFlock(journal)))
    except StorageError:
        raise
    except Exception as exc:  # Optuna and SQLAlchemy raise many kinds; all mean "cannot use it"
        raise StorageError(
            f"cannot open Optuna storage {shown_location(location)!r}: {type(exc).__name__}: "
            f"{first_line(exc)}"
        ) from exc


# ---- workers sharing a study --------------------------------------------------------------------
def this_host() -> str:
    """The host name in worker names; FA4TUNE_WORKER_HOST overrides it where hosts share a name."""
    return os.environ.get("FA4TUNE_WORKER_HOST") or socket.gethostname()


_BOOT_ID: list = []


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def _identity_of(fields: list[str] | None) -> str | None:
    """The boot and the start time (clock ticks after boot) of a live process, from its stat fields:
    with its pid, what no later process shares. A pid alone does not do: a search restarted in a
    container (a pid namespace) gets the pid of the one that was killed. None where there is no
    /proc."""
    if fields is None or len(fields) < 20:
        return None
    try:
        if not _BOOT_ID:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _BOOT_ID.append(f.read().strip()[:8])
    except OSError:
        return None
    return f"{_BOOT_ID[0]}.{fields[19]}"  # field 22, starttime


def _process_identity(pid: int) -> str | None:
    return _identity_of(_stat_fields(pid))


def worker_name(pid: int | None = None) -> str:
    """host:pid:identity (host:pid where the process's identity cannot be read)."""
    pid = os.getpid() if pid is None else pid
    identity = _process_identity(pid)
    return f"{this_host()}:{pid}:{identity}" if identity else f"{this_host()}:{pid}"


def parse_worker(worker: str) -> tuple[str, str, str | None]:
    """(host, pid, identity or None) of a worker name; earlier versions' names are host:pid."""
    head, _, last = worker.rpartition(":")
    if last.isdigit():
        return head, last, None
    host, _, pid = head.rpartition(":")
    return host, pid, last


def worker_gone(worker: str) -> bool:
    """Whether a worker is known to be dead. A worker of this host is dead when its process is (a
    zombie counts as dead), or when its pid now belongs to another process; of another host nothing
    is known here: its trials are Optuna's heartbeat's to judge."""
    host, pid, identity = parse_worker(worker)
    if host != this_host() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    fields = _stat_fields(int(pid))  # read once: identity and state of one and the same process
    if fields is None:
        return False
    if identity is not None:
        now = _identity_of(fields)
        if now is not None and now != identity:
            return True
    return bool(fields) and fields[0] == "Z"


def trial_orphaned(trial, shared: bool, dead=frozenset()) -> bool:
    """Whether a RUNNING trial's worker is gone (`dead`: workers known dead). A trial without a
    worker's name is from an earlier fa4tune or a search that died between asking for it and naming
    it, unless a live worker asked for it a moment ago and is naming it now: where other workers may
    share the study, such a trial counts as orphaned once it is UNNAMED_GRACE_S old."""
    worker = trial.user_attrs.get(WORKER_ATTR)
    if worker is not None:
        return worker in dead or worker_gone(worker)
    if not shared or trial.datetime_start is None:
        return True
    started = trial.datetime_start
    return (datetime.now(started.tzinfo) - started).total_seconds() > UNNAMED_GRACE_S


def _unmarked(trial):
    """A copy of a frozen trial without its worker's name, for queueing its parameters again. A
    claim stays with it: the queued trial keeps the budget slot for whoever measures it."""
    trial = copy.deepcopy(trial)
    trial.user_attrs = {k: v for k, v in trial.user_attrs.items() if k != WORKER_ATTR}
    return trial


class HandBack:
    """Optuna's retry callback (RetryHeartbeatStaleTrialCallback, formerly RetryFailedTrialCallback)
    over a copy of the failed trial without the dead worker's name: the trial is queued again
    (WAITING) with the same parameters and its claim, at most MAX_HAND_BACKS times."""

    def __init__(self) -> None:
        import optuna

        retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # experimental, or deprecated in favour of the name above
            self.retry = (retry or optuna.storages.RetryFailedTrialCallback)(
                max_retry=MAX_HAND_BACKS
            )

    def __call__(self, study, trial) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.retry(study, _unmarked(trial))


def hand_back(study, trial) -> None:
    """A trial whose worker died: failed, and queued again by the retry callback."""
    import optuna

    study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    HandBack()(study, trial)


def give_back(study, trial) -> None:
    """A trial popped from the queue (default, warm start, handed back) that this worker will not
    measure after all: failed, and its parameters queued again as they were."""
    import optuna

    study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    # What study.enqueue_trial adds, plus where it came from (GIVEN_BACK_ATTR).
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING,
            user_attrs=_unmarked(trial).user_attrs,
            system_attrs={"fixed_params": queued_params(trial), GIVEN_BACK_ATTR: trial.number},
        )
    )


def queued_params(trial) -> dict:
    """The parameters a trial was queued with (enqueued or handed back), else those it suggested."""
    return trial.system_attrs.get("fixed_params") or trial.params


def tell_outcome(study, number: int, status: str, time_ms: float | None) -> None:
    """Tell Optuna a trial's outcome by its status in the results DB (ok, pruned, stopped, ...)."""
    import optuna

    state = optuna.trial.TrialState
    if status == "ok":
        study.tell(number, time_ms, skip_if_finished=True)
    elif status in ("pruned", "stopped"):  # a stopped trial's cheap value was reported to Optuna
        study.tell(number, state=state.PRUNED, skip_if_finished=True)
    else:  # failed or wrong: samplers must not learn a time from it
        study.tell(number, state=state.FAIL, skip_if_finished=True)


def tell_stored(study, number: int, stored: dict) -> None:
    """Tell Optuna the outcome the results DB stored for a trial (a row of ResultsDB's trials)."""
    tell_outcome(study, number, stored["status"], stored["time_ms"])


def heartbeat_interval(storage) -> int | None:
    """Seconds between a trial's heartbeats on this storage; None where it records none (journal
    storages, and RDB storages opened without)."""
    interval = getattr(storage, "get_heartbeat_interval", None)
    return interval() if interval is not None else None


class Heartbeat:
    """A trial's heartbeat, as Optuna's optimize loop keeps one: a thread that records it at once
    and then every heartbeat_interval seconds until `join()`. On a storage without heartbeats it
    does nothing. Built on the storage's public record_heartbeat; the search loop asks and tells
    trials itself, where Optuna starts none."""

    def __init__(self, storage, study_id: int, number: int) -> None:
        self.storage = storage
        self.interval = heartbeat_interval(storage)
        self.trial_id = (
            storage.get_trial_id_from_study_id_trial_number(study_id, number)
            if self.interval is not None
            else None
        )
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        if self.interval is not None:
            self.thread = threading.Thread(
                target=self.beat, name=f"fa4tune-heartbeat-{self.trial_id}"
            )
            self.thread.start()
        return self

    def beat(self) -> None:
        while True:
            self.storage.record_heartbeat(self.trial_id)
            if self.stopped.wait(timeout=self.interval):
                return

    def join(self) -> None:
        if self.thread is not None:
            self.stopped.set()
            self.thread.join()


def fail_stale(study) -> None:
    """Optuna's check for trials whose heartbeat stopped (server storages): they are failed and
    handed back through the storage's callback."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def check_sampler_available(name: str, where: str) -> None:
    needs = {"cmaes": ["cmaes"], "gp": ["scipy", "torch"]}.get(name, [])
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise JobError(
            f"{where}: the {name} sampler needs {', '.join(missing)}; install it (pip install "
            f"{' '.join(missing)}) or choose tpe, random or grid"
        )


# ---- the grid sampler ---------------------------------------------------------------------------
# Written against Optuna 5.0.0 (optuna/samplers/_grid.py); the one place that uses what Optuna's
# GridSampler keeps private, for want of a public way:
#   _all_grids    the grid's points as tuples, shuffled by the sampler's seed; a trial's "grid_id"
#                 system attribute is an index into it;
#   _param_names  the names of a point's values, sorted;
#   _rng.rng      the numpy RandomState of its choices among the points not yet visited.
# tests/test_optuna_adapter.py fails, naming what changed, when these no longer work as used here.
@functools.cache
def grid_sampler_class():
    """AskTellGridSampler (a class made on first use: Optuna is imported only then)."""
    from optuna.samplers import GridSampler

    class AskTellGridSampler(GridSampler):
        """Optuna's grid sampler stops the study from inside `tell` once the grid is done, which
        only works under study.optimize; the search loop notices an exhausted space itself.

        Its seed also shuffles the grid, and a trial's grid id indexes the shuffled grid: every
        worker and every session of a study must shuffle alike (`grid_seed`), or the ids that one
        marked visited name other points for the next, which are then never measured. The seed of
        its choices among unvisited points (`seed`) may differ."""

        def __init__(self, search_space, seed=None, grid_seed: int = 0) -> None:
            super().__init__(search_space, seed=grid_seed)  # shuffles the grid with grid_seed
            self._rng.rng.seed(seed)  # then chooses with this worker's seed

        def after_trial(self, study, trial, state, values) -> None:
            pass

        def point(self, grid_id) -> dict | None:
            """The params of the point a trial's "grid_id" names; None for no point."""
            if grid_id is None or not 0 <= grid_id < len(self._all_grids):
                return None
            return dict(zip(self._param_names, self._all_grids[grid_id]))

    return AskTellGridSampler


def make_sampler(
    spec,
    seed: int,
    grid: dict | None = None,
    where: str = "sampler",
    shared: bool = False,
    grid_seed: int = 0,
):
    """An Optuna sampler from a job's sampler spec; bad options are a JobError naming the field. A
    `shared` study (several workers) gets TPE's constant liar unless the job says otherwise, so that
    workers do not all propose the same configs around the best so far."""
    import optuna.samplers as s

    check_sampler_available(spec.name, where)
    options = dict(spec.options)
    if shared and spec.name == "tpe":
        options.setdefault("constant_liar", True)
    factories = {
        "tpe": lambda **o: s.TPESampler(seed=seed, **o),
        "random": lambda **o: s.RandomSampler(seed=seed, **o),
        "cmaes": lambda **o: s.CmaEsSampler(seed=seed, **o),
        "gp": lambda **o: s.GPSampler(seed=seed, **o),
        "grid": lambda **o: grid_sampler_class()(grid, seed=seed, grid_seed=grid_seed, **o),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # constant_liar is experimental
            return factories[spec.name](**options)
    except (TypeError, ValueError) as exc:
        raise JobError(
            f"{where}: bad options {spec.options} for the {spec.name} sampler: {exc}"
        ) from exc


def try_sampler_options(spec, where: str = "sampler") -> None:
    """Run a sampler built with the job's options on a toy study past its start-up trials: an option
    of the right name but a wrong type (TPE's gamma as a number, say) fails only when the sampler
    first uses it, which in a search is after several measured trials. JobError naming the field."""
    # Not the grid's, nor CMA-ES's (its options, x0 say, name the job's own parameters).
    if not spec.options or spec.name in ("grid", "cmaes"):
        return
    import optuna

    startup = spec.options.get("n_startup_trials")
    if startup is not None and (
        isinstance(startup, bool) or not isinstance(startup, int) or startup < 0
    ):
        raise JobError(
            f"{where}: n_startup_trials must be a whole number of 0 or more, got {startup!r}"
        )
    # The start-up cut short, so that the options the sampler uses after it are used here too.
    tried = (
        type(spec)(name=spec.name, options={**spec.options, "n_startup_trials": min(startup, 3)})
        if startup is not None
        else spec
    )
    sampler = make_sampler(tried, 0, where=where)
    trials = 13
    study = optuna.create_study(sampler=sampler, storage=optuna.storages.InMemoryStorage())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(trials):
                trial = study.ask()
                x, k = trial.suggest_float("x", 0.0, 1.0), trial.suggest_categorical("k", [1, 2, 3])
                study.tell(trial, (x - 0.3) ** 2 + k)
    except Exception as exc:  # noqa: BLE001 - any failure here is the options'
        raise JobError(
            f"{where}: bad options {spec.options} for the {spec.name} sampler: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def problem_seed(seed: int, problem_key: str, worker: int = 0, earlier_trials: int = 0) -> int:
    """A per-problem seed, stable across runs and processes. Workers sharing a study (`worker` > 0)
    each get their own, or they would all propose the same configs; so does each session of a study
    (by the number of trials it found), or a resume would propose the configs of the first again."""
    return (
        seed * 1_000_003
        + zlib.crc32(problem_key.encode())
        + worker * 7919
        + earlier_trials * 104_729
    ) % (2**31)


def worker_seed(index: int) -> int:
    """The seed offset of a worker: its index on this host, and the host (hosts share a study)."""
    return 1 + index + zlib.crc32(this_host().encode()) % 100_003


def study_name(prefix: str, space_signature: str, problem_key: str) -> str:
    return f"{prefix}/{space_signature}/{problem_key}"
