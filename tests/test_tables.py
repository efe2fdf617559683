import pytest
import yaml
from conftest import write_job

from fa4tune.db import ResultsDB
from fa4tune.errors import TableError
from fa4tune.kernels import get_kernel
from fa4tune.runtime.tables import export_table, import_table, read_table
from fa4tune.tune.job import load_job
from fa4tune.tune.search import run_search

KERNEL = get_kernel()


@pytest.fixture
def searched(workdir):
    path = write_job(
        workdir,
        spaces=["tiles", "pipeline"],
        budget={"trials": 6},
        problems=[
            {
                "head_dim": [64, 128],
                "causal": [False, True],
                "seqlen_q": 2048,
                "batch": 2,
                "nheads_q": 8,
            }
        ],
    )
    summary = run_search(load_job(path), say=lambda *a: None)
    return summary.db_location


def test_export_is_sorted_deterministic_and_round_trips_exactly(searched, workdir):
    with ResultsDB.open(searched, create=False) as db:
        first = export_table(db, "t1.yaml", kernel=KERNEL, target="H200")
        export_table(db, "t2.yaml", kernel=KERNEL, target="H200")
    assert first == ["t1.yaml", "t1.json"]
    assert (workdir / "t1.yaml").read_text() == (workdir / "t2.yaml").read_text()
    assert (workdir / "t1.json").read_text() == (workdir / "t2.json").read_text()
    document = read_table("t1.yaml")
    keys = [e["problem_key"] for e in document["entries"]]
    assert keys == sorted(keys) and len(keys) == 4
    assert document["kernel_hash"] == KERNEL.source_hash() and document["estimates"] is True
    assert all(e["provenance"]["backend"] == "model" for e in document["entries"])

    with ResultsDB.open("fresh.db") as fresh:
        report = import_table(fresh, "t1.yaml")
        assert len(report.added) == 4 and not report.conflicts
        export_table(fresh, "t3.yaml", kernel=KERNEL, target="H200")
    assert (workdir / "t3.yaml").read_text() == (workdir / "t1.yaml").read_text()
    # JSON reads back the same table.
    assert read_table("t1.json") == document


def test_import_merges_faster_entries_and_reports_conflicts(searched, workdir):
    with ResultsDB.open(searched, create=False) as db:
        export_table(db, "t.yaml", kernel=KERNEL, target="H200")
    document = yaml.safe_load((workdir / "t.yaml").read_text())
    slower, faster = document["entries"][0], document["entries"][1]
    slower["time_ms"] *= 2
    slower["config"]["tile_n"] = 64 if slower["config"]["tile_n"] != 64 else 80
    faster["time_ms"] /= 2
    faster["config"]["tile_n"] = 64 if faster["config"]["tile_n"] != 64 else 80
    (workdir / "edited.yaml").write_text(yaml.safe_dump(document))
    with ResultsDB.open(searched) as db:
        report = import_table(db, "edited.yaml")
        best = {e.problem_key: e for e in db.best_configs()}
    assert report.kept and report.replaced and len(report.conflicts) == 2
    assert best[faster["problem_key"]].config == faster["config"]
    assert best[slower["problem_key"]].config != slower["config"]


def test_an_import_never_weighs_times_of_two_l2_flushes(searched, workdir, monkeypatch, capsys):
    """Where the table and the DB measured a problem under different L2 flushes, the entry of the
    flush this process times with (FA4TUNE_L2_FLUSH) wins whatever the times, and the conflict says
    why; an entry that records no flush was timed with the dirty one."""
    from fa4tune.cli import main
    from fa4tune.measure.timing import FLUSH_ENV

    with ResultsDB.open(searched, create=False) as db:
        export_table(db, "t.yaml", kernel=KERNEL, target="H200")
    document = yaml.safe_load((workdir / "t.yaml").read_text())
    document["estimates"] = False
    for row in document["entries"]:
        row["is_estimate"] = False
        row["provenance"]["l2_flush"] = "clean"
    (workdir / "clean.yaml").write_text(yaml.safe_dump(document))
    for row in document["entries"]:  # faster, another config, and no record of its flush
        row["time_ms"] /= 2
        row["config"]["tile_n"] = 64 if row["config"]["tile_n"] != 64 else 80
        del row["provenance"]["l2_flush"]
    (workdir / "unrecorded.yaml").write_text(yaml.safe_dump(document))
    count = len(document["entries"])

    monkeypatch.delenv(FLUSH_ENV, raising=False)
    with ResultsDB.open("measured.db") as db:
        assert len(import_table(db, "clean.yaml").added) == count
    assert main(["import", "unrecorded.yaml", "--db", "measured.db"]) == 0
    said = capsys.readouterr().out
    assert f"0 added, 0 replaced by better entries, {count} kept" in said
    assert (
        said.count(
            "the database wins (times of the clean and the dirty L2 flush do not compare: an "
            "entry of the clean one wins)"
        )
        == count
    )
    monkeypatch.setenv(FLUSH_ENV, "dirty")
    assert main(["import", "unrecorded.yaml", "--db", "measured.db"]) == 0
    assert f"{count} replaced by better entries" in capsys.readouterr().out
    with ResultsDB.open("measured.db", create=False) as db:
        assert all("l2_flush" not in e.provenance for e in db.best_configs())
    # Back under the clean flush, the clean table wins again, slower as it is.
    monkeypatch.setenv(FLUSH_ENV, "clean")
    with ResultsDB.open("measured.db") as db:
        assert len(import_table(db, "clean.yaml").replaced) == count
        assert all(e.provenance["l2_flush"] == "clean" for e in db.best_configs())


def test_a_table_for_another_kernel_hash_is_refused_and_nothing_is_written(searched, workdir):
    with ResultsDB.open(searched, create=False) as db:
        export_table(db, "t.yaml", kernel=KERNEL, target="H200")
    document = yaml.safe_load((workdir / "t.yaml").read_text())
    document["kernel_hash"] = "f" * 64
    (workdir / "old.yaml").write_text(yaml.safe_dump(document))
    with ResultsDB.open("other.db") as db:
        with pytest.raises(TableError, match="stale"):
            import_table(db, "old.yaml")
        assert db.counts()["best_configs"] == 0


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.pop("kernel_hash"), "kernel_hash: missing"),
        (lambda d: d.update(format="other/9"), "format"),
        (lambda d: d["entries"][0].pop("config"), r"entries\[0\]: missing field\(s\) config"),
        (
            lambda d: d["entries"][0]["problem"].update(head_dim=80),
            r"entries\[0\].problem: unsupported head_dim",
        ),
        (lambda d: d["entries"][0].update(problem_key="x"), "does not match"),
        (
            lambda d: d["entries"][0].update(bucket_key="x"),
            r"entries\[0\].bucket_key: 'x' does not match",
        ),
        (lambda d: d["entries"][0]["config"].update(tile_n=100), r"entries\[0\].config"),
        (lambda d: d.update(target="Z9"), "target: unknown target"),
        (lambda d: d.update(carried={"from_hash": "x"}), "carried: a list of records"),
        (
            lambda d: d.update(carried=[{"from_hash": "x", "to_hash": "y"}]),
            "carried: a list of records with from_hash",
        ),
        # `carry --write` renders the label: a table without it must fail here, not with a KeyError
        # there.
        (lambda d: d.pop("estimates"), "estimates: missing or not true"),
        (lambda d: d.update(estimates=False), "estimates: missing or not true"),
        (
            lambda d: d["entries"][0].update(is_estimate="no"),
            r"entries\[0\].is_estimate: true or false",
        ),
        (
            lambda d: d["entries"][0]["provenance"].update(l2_flush="dirty"),
            r"entries\[0\].provenance.l2_flush: 'dirty', want none for an estimate",
        ),
        (
            lambda d: (
                d["entries"][0].update(is_estimate=False)
                or d["entries"][0]["provenance"].update(l2_flush="warm")
            ),
            r"entries\[0\].provenance.l2_flush: 'warm', want dirty or clean for a measurement",
        ),
        # The DB would take these only with a SQLAlchemy traceback, or keep a time that no
        # comparison can rank.
        (
            lambda d: d["entries"][0].update(time_ms=float("nan")),
            r"entries\[0\].time_ms: a positive finite number, got nan",
        ),
        (lambda d: d["entries"][0].update(time_ms=float("inf")), r"entries\[0\].time_ms"),
        (lambda d: d["entries"][0].update(time_ms=True), r"entries\[0\].time_ms"),
        (
            lambda d: d["entries"][0].update(tflops="fast"),
            r"entries\[0\].tflops: a non-negative finite number, got 'fast'",
        ),
        (lambda d: d["entries"][0].update(tflops=None), r"entries\[0\].tflops"),
        (
            lambda d: d["entries"][0].update(provenance="gpu"),
            r"entries\[0\].provenance: a mapping",
        ),
        (lambda d: d["entries"][0].update(source=5), r"entries\[0\].source: a string"),
    ],
)
def test_malformed_tables_name_the_field(searched, workdir, edit, message):
    with ResultsDB.open(searched, create=False) as db:
        export_table(db, "t.yaml", kernel=KERNEL, target="H200")
    document = yaml.safe_load((workdir / "t.yaml").read_text())
    edit(document)
    (workdir / "bad.yaml").write_text(yaml.safe_dump(document))
    with ResultsDB.open("other.db") as db:
        with pytest.raises(TableError, match=message):
            import_table(db, "bad.yaml")
        assert db.counts()["best_configs"] == 0


def test_export_of_nothing_is_an_error(workdir):
    with ResultsDB.open("empty.db") as db:
        with pytest.raises(TableError, match="no best configs"):
            export_table(db, "t.yaml", kernel=KERNEL, target="H200")
    assert not (workdir / "t.yaml").exists()


def test_a_stale_table_is_refused_before_any_db_is_created(searched, workdir, capsys):
    from fa4tune.cli import main

    with ResultsDB.open(searched, create=False) as db:
        export_table(db, "t.yaml", kernel=KERNEL, target="H200")
    document = yaml.safe_load((workdir / "t.yaml").read_text())
    document["kernel_hash"] = "f" * 64
    (workdir / "old.yaml").write_text(yaml.safe_dump(document))
    assert main(["import", "old.yaml", "--db", "new.db"]) == 2
    assert "stale" in capsys.readouterr().err and not (workdir / "new.db").exists()


def test_a_target_name_in_any_case_is_read_as_the_target(searched, workdir):
    from fa4tune.problem import Problem
    from fa4tune.runtime.lookup import lookup

    with ResultsDB.open(searched, create=False) as db:
        export_table(db, "t.yaml", kernel=KERNEL, target="H200")
        problem = Problem.from_dict(db.best_configs()[0].problem)
    document = yaml.safe_load((workdir / "t.yaml").read_text())
    document["target"] = "h200"
    (workdir / "lower.yaml").write_text(yaml.safe_dump(document))
    assert read_table("lower.yaml")["target"] == "H200"
    assert lookup(problem, "H200", source=str(workdir / "lower.yaml")).source == "exact"


def test_export_takes_a_kernel_hash_as_short_as_show_prints_it(searched, workdir):
    installed = KERNEL.source_hash()
    with ResultsDB.open(searched, create=False) as db:
        assert export_table(db, "t.yaml", kernel=KERNEL, target="H200", kernel_hash=installed[:12])
        with pytest.raises(TableError, match="no best configs"):
            export_table(db, "u.yaml", kernel=KERNEL, target="H200", kernel_hash="0123456789ab")
    assert read_table("t.yaml")["kernel_hash"] == installed


def test_a_table_pair_that_cannot_be_written_is_put_back(tmp_path):
    from fa4tune.runtime.tables import write_table

    (tmp_path / "t.yaml").write_text("old yaml\n")
    (tmp_path / "t.json").mkdir()  # the JSON cannot be written
    with pytest.raises(TableError, match="cannot write table .*t.json"):
        write_table({"format": "x", "estimates": False}, tmp_path / "t")
    assert (tmp_path / "t.yaml").read_text() == "old yaml\n"
    (tmp_path / "new.json").mkdir()  # and a YAML file that was not there is not left behind
    with pytest.raises(TableError, match="cannot write table .*new.json"):
        write_table({"format": "x", "estimates": False}, tmp_path / "new.yaml")
    assert not (tmp_path / "new.yaml").exists()
