import sqlite3

import pytest

from fa4tune.db import SCHEMA_VERSION, BestEntry, ResultsDB
from fa4tune.errors import ResultsDBError
from fa4tune.measure import Measurement
from fa4tune.problem import Problem

PROBLEM = Problem(head_dim=128, seqlen_q=4096)


def add(db, run_id, config, time_ms, estimate=True, status="ok"):
    m = (Measurement.ok(PROBLEM, time_ms, is_estimate=estimate) if status == "ok"
         else Measurement(status=status, reason="test", is_estimate=estimate))
    return db.add_trial(run_id=run_id, study_name="s", optuna_number=None, kernel="fa4_fwd_sm90",
                        kernel_hash="h", target="H200", problem=PROBLEM, config=config, measurement=m,
                        source="sampler", provenance={"backend": "test"})


def new_run(db):
    return db.start_run(job_name="j", job_path=None, job_text=None, kernel="fa4_fwd_sm90", kernel_hash="h",
                        target="H200", backend="model", is_estimate=True, gpu_name=None, sm_count=132,
                        cuda_driver=None, dsl_version=None, torch_version=None, fa4tune_version="0",
                        storage_url=None, study_prefix="p")


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
    con.execute("UPDATE fa4tune_schema SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    con.commit()
    con.close()
    with pytest.raises(ResultsDBError, match=f"schema version {SCHEMA_VERSION + 1}.*reads version {SCHEMA_VERSION}"):
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
        return BestEntry(kernel="k", kernel_hash="h", target="H200", problem=PROBLEM.to_dict(),
                         problem_key=PROBLEM.key(), bucket_key=PROBLEM.bucket().key(), config=config,
                         time_ms=time_ms, tflops=1.0, is_estimate=estimate, provenance={}, source="t")

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
