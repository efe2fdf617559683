import sqlite3

import pytest

from fa4tune.db import SCHEMA_VERSION, BestEntry, ResultsDB
from fa4tune.errors import ResultsDBError
from fa4tune.measure import Measurement
from fa4tune.problem import Problem

PROBLEM = Problem(head_dim=128, seqlen_q=4096)


def add(db, run_id, config, time_ms, estimate=True, status="ok"):
    m = (
        Measurement.ok(PROBLEM, time_ms, is_estimate=estimate)
        if status == "ok"
        else Measurement(status=status, reason="test", is_estimate=estimate)
    )
    return db.add_trial(
        run_id=run_id,
        study_name="s",
        optuna_number=None,
        kernel="fa4_fwd_sm90",
        kernel_hash="h",
        target="H200",
        problem=PROBLEM,
        config=config,
        measurement=m,
        source="sampler",
        provenance={"backend": "test"},
    )


def new_run(db):
    return db.start_run(
        job_name="j",
        job_path=None,
        job_text=None,
        kernel="fa4_fwd_sm90",
        kernel_hash="h",
        target="H200",
        backend="model",
        is_estimate=True,
        gpu_name=None,
        sm_count=132,
        cuda_driver=None,
        dsl_version=None,
        torch_version=None,
        fa4tune_version="0",
        storage_url=None,
        study_prefix="p",
    )


def test_creates_schema_in_wal_mode_and_keeps_the_best(tmp_path):
    path = tmp_path / "sub" / "r.db"
    with ResultsDB.open(str(path)) as db:
        run = new_run(db)
        add(db, run, {"tile_n": 128}, 2.0)
        add(db, run, {"tile_n": 96}, 1.5)
        add(db, run, {"tile_n": 64}, 1.8)
        add(db, run, {"tile_n": 80}, 1.0, status="failed")
        [best] = db.best_configs()
        assert best.config == {"tile_n": 96} and best.time_ms == 1.5
        # A measurement beats an estimate, even a slower one; an estimate never beats a measurement.
        add(db, run, {"tile_n": 112}, 1.7, estimate=False)
        add(db, run, {"tile_n": 144}, 0.5, estimate=True)
        [best] = db.best_configs()
        assert best.config == {"tile_n": 112} and not best.is_estimate
        assert db.counts() == {"runs": 1, "trials": 6, "best_configs": 1}
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_another_schema_version_is_refused(tmp_path):
    path = tmp_path / "r.db"
    ResultsDB.open(str(path)).close()
    con = sqlite3.connect(path)
    con.execute(
        "UPDATE fa4tune_schema SET value = ? WHERE key = 'schema_version'",
        (str(SCHEMA_VERSION + 1),),
    )
    con.commit()
    con.close()
    with pytest.raises(
        ResultsDBError, match=f"schema version {SCHEMA_VERSION + 1}.*reads version {SCHEMA_VERSION}"
    ):
        ResultsDB.open(str(path))


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(ResultsDBError, match="not a SQLite database"):
        ResultsDB.open(str(junk))
    assert junk.read_bytes().startswith(b"this is not")  # untouched

    damaged = tmp_path / "damaged.db"
    ResultsDB.open(str(damaged)).close()
    data = bytearray(damaged.read_bytes())
    data[100:4096] = b"\xff" * (4096 - 100)
    damaged.write_bytes(bytes(data))
    with pytest.raises(ResultsDBError, match="cannot be read|corrupt"):
        ResultsDB.open(str(damaged))

    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE users (id INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(ResultsDBError, match="not an fa4tune results DB"):
        ResultsDB.open(str(foreign))


def test_unwritable_and_missing_paths(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ResultsDBError, match="not a writable directory"):
        ResultsDB.open(str(blocker / "sub" / "r.db"))
    assert not (tmp_path / "a_file" / "sub").exists()
    with pytest.raises(ResultsDBError, match="is a directory"):
        ResultsDB.open(str(tmp_path))
    with pytest.raises(ResultsDBError, match="no results DB"):
        ResultsDB.open(str(tmp_path / "missing.db"), create=False)
    assert not (tmp_path / "missing.db").exists()


def test_urls_and_environment(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'u.db'}"
    ResultsDB.open(url).close()
    assert (tmp_path / "u.db").exists()
    monkeypatch.setenv("FA4TUNE_DB", str(tmp_path / "env.db"))
    with ResultsDB.open(None) as db:
        assert db.location == str(tmp_path / "env.db")
    with pytest.raises(ResultsDBError, match="cannot use results DB"):
        ResultsDB.open("nosuchdialect://x/y")


def test_merge_reports_conflicts_and_the_better_entry_wins(tmp_path):
    def entry(config, time_ms, estimate=True):
        return BestEntry(
            kernel="k",
            kernel_hash="h",
            target="H200",
            problem=PROBLEM.to_dict(),
            problem_key=PROBLEM.key(),
            bucket_key=PROBLEM.bucket().key(),
            config=config,
            time_ms=time_ms,
            tflops=1.0,
            is_estimate=estimate,
            provenance={},
            source="t",
        )

    with ResultsDB.open(str(tmp_path / "m.db")) as db:
        first = db.merge_best([entry({"a": 1}, 2.0)])
        assert first.added == [PROBLEM.key()]
        slower = db.merge_best([entry({"a": 2}, 3.0)])
        assert slower.kept and "database wins" in slower.conflicts[0]
        faster = db.merge_best([entry({"a": 3}, 1.0)])
        assert faster.replaced and "table wins" in faster.conflicts[0]
        same = db.merge_best([entry({"a": 3}, 1.0)])
        assert same.kept and not same.conflicts
        assert db.best_configs()[0].config == {"a": 3}


def test_a_study_stores_each_search_config_once(tmp_path):
    from fa4tune.db import DuplicateTrial

    with ResultsDB.open(str(tmp_path / "r.db")) as db:
        run = new_run(db)
        add(db, run, {"tile_n": 128}, 2.0)
        with pytest.raises(DuplicateTrial):
            add(db, run, {"tile_n": 128}, 1.0)
        # Re-timings of a stored config (source confirm) are not search trials.
        [trial] = db.trials()
        db.confirm_best(
            run_id=run,
            study_name="s",
            kernel="fa4_fwd_sm90",
            kernel_hash="h",
            target="H200",
            problem=PROBLEM,
            provenance={},
            confirmed=[(trial, Measurement.ok(PROBLEM, 1.9))],
        )
        assert len(db.trials()) == 2 and db.best_configs()[0].time_ms == 1.9


def test_schema_2_is_upgraded_to_3(tmp_path):
    from fa4tune.db import DuplicateTrial

    path = tmp_path / "old.db"
    with ResultsDB.open(str(path)) as db:
        add(db, new_run(db), {"tile_n": 128}, 2.0)
    con = sqlite3.connect(path)  # what fa4tune with schema 2 made: no locks table, no unique index
    con.execute("DROP TABLE locks")
    con.execute("DROP INDEX uq_trials_study_config")
    con.execute("UPDATE fa4tune_schema SET value = '2' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    with ResultsDB.open(str(path)) as db:
        with db.locked("s") as lock:
            assert lock.measured() == 1
        with pytest.raises(DuplicateTrial):
            add(db, 1, {"tile_n": 128}, 1.0)
    con = sqlite3.connect(path)
    assert (
        con.execute("SELECT value FROM fa4tune_schema").fetchone()[0] == str(SCHEMA_VERSION) == "3"
    )


def hammer(path: str, worker: int, rounds: int) -> None:
    """One of several processes writing one SQLite results DB as hard as they can."""
    with ResultsDB.open(path, create=False) as db:
        for i in range(rounds):
            with db.locked("s") as lock:  # a read, then a write, in one transaction
                lock.add_trial(
                    run_id=1,
                    optuna_number=None,
                    kernel="fa4_fwd_sm90",
                    kernel_hash="h",
                    target="H200",
                    problem=PROBLEM,
                    config={"worker": worker, "i": i, "locked": True},
                    measurement=Measurement.ok(
                        PROBLEM, 1.0 + lock.measured() / 1000, is_estimate=True
                    ),
                    source="sampler",
                    provenance={},
                )
            add(db, 1, {"worker": worker, "i": i}, 1.0 + i / 100)  # also offers the best config
            db.add_clocks(1, {"worker": worker, "i": i})
            db.top_trials("s", 3)


def test_many_processes_write_one_sqlite_db_without_database_is_locked(tmp_path):
    import multiprocessing

    path = str(tmp_path / "shared.db")
    with ResultsDB.open(path) as db:
        new_run(db)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=hammer, args=(path, worker, 25)) for worker in range(4)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
    assert [p.exitcode for p in processes] == [0, 0, 0, 0], "a writer failed (database is locked?)"
    with ResultsDB.open(path, create=False) as db:
        assert db.counts()["trials"] == 4 * 25 * 2 and len(db.runs()[0]["clocks"]["seen"]) == 4 * 25
        assert db.best_configs()[0].time_ms == 1.0


def test_a_config_that_was_ever_wrong_does_not_stand_in_for_the_fastest_in_the_min_gain_test(
    tmp_path,
):
    """W (3% faster than the default) gave a wrong result once, in another study: it is out. Then X,
    0.5% faster, must still beat the default by the 1% min gain, and does not: the default stays."""
    from fa4tune.kernels import get_kernel

    kernel, problem = get_kernel(), Problem(head_dim=128, seqlen_q=2048, batch=2, nheads_q=8)
    db = ResultsDB.open(str(tmp_path / "r.db"))
    run = db.start_run(
        job_name="j",
        kernel=kernel.name,
        kernel_hash="h",
        target="H200",
        backend="gpu",
        is_estimate=False,
        fa4tune_version="0",
        study_prefix="p",
    )
    common = dict(
        run_id=run,
        kernel=kernel.name,
        kernel_hash="h",
        target="H200",
        problem=problem,
        provenance={},
    )
    db.add_trial(
        study_name="old",
        optuna_number=0,
        config={"tile_n": 64},
        source="sampler",
        measurement=Measurement(status="wrong", reason="output error 0.3"),
        offer_best=False,
        **common,
    )
    ids = {}
    for number, (name, tile_n, ms) in enumerate(
        (("D", 128, 1.0), ("X", 96, 0.995), ("W", 64, 0.97))
    ):
        ids[name] = db.add_trial(
            study_name="s",
            optuna_number=number,
            config={"tile_n": tile_n},
            source="default" if name == "D" else "sampler",
            measurement=Measurement.ok(problem, ms),
            offer_best=False,
            **common,
        )
    db.confirm_best(
        study_name="s",
        prefer=ids["D"],
        min_gain=0.01,
        confirmed=[
            ({"id": ids[n]}, Measurement.ok(problem, ms))
            for n, ms in (("W", 0.97), ("X", 0.995), ("D", 1.0))
        ],
        **common,
    )
    [best] = db.best_configs()
    assert best.config == {"tile_n": 128} and best.provenance.get("kept_default")
    db.close()


def test_a_new_db_is_switched_to_wal_while_a_reader_looks_at_it(tmp_path):
    """A search creating its DB while `fa4tune show` (or a test) reads it failed with "database is
    locked": switching a file to WAL needs it alone, and SQLite refused at once."""
    import threading
    import time

    from fa4tune.db.store import _sqlite_connect

    path = str(tmp_path / "new.db")
    first = sqlite3.connect(path, isolation_level=None)
    first.execute("create table t(x)")
    first.close()
    held = threading.Event()

    def reader():
        connection = sqlite3.connect(path, isolation_level=None)
        connection.execute("begin")
        connection.execute("select * from t").fetchall()  # a shared lock, in rollback-journal mode
        held.set()
        time.sleep(0.5)
        connection.execute("commit")
        connection.close()

    thread = threading.Thread(target=reader)
    thread.start()
    held.wait()
    writer = sqlite3.connect(path, timeout=0.05)  # SQLite's own wait alone would give up at once
    _sqlite_connect(writer, None)
    thread.join()
    assert writer.execute("pragma journal_mode").fetchone() == ("wal",)
    writer.close()
