"""The CLI end to end, and every bad input of issue 2: a one-paragraph error, exit status 2, and
nothing partial written."""

import importlib.util
import sqlite3
from pathlib import Path

import pytest
import yaml
from conftest import REPO, write_job

from fa4tune.cli import main
from fa4tune.db import SCHEMA_VERSION


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad_input(capsys, argv, *fragments):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    message = err.strip()
    assert message.startswith("fa4tune: error: ") and "\n" not in message, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in message, message
    return message


def written(workdir):
    return sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*") if p.suffix != ".yaml")


# ---- the quickstart and the happy paths ----------------------------------------------------------
def test_quickstart_end_to_end_then_show_export_import_doctor(workdir, capsys):
    code, out, _ = run_cli(
        capsys, "search", REPO / "tuning_configs" / "quickstart.yaml", "--no-progress"
    )
    assert code == 0, out
    assert "ESTIMATES" in out and "exported fa4tune-results/quickstart-table.yaml" in out
    assert (workdir / "fa4tune-results" / "results.db").exists()
    assert (workdir / "fa4tune-results" / "results.optuna.journal").exists()
    table = yaml.safe_load((workdir / "fa4tune-results" / "quickstart-table.yaml").read_text())
    assert len(table["entries"]) == 12 and table["estimates"]

    code, out, _ = run_cli(capsys, "show", "--top", "2")
    assert code == 0 and "bf16-d64x64-causal-q16384-k16384-b1-h32x32" in out and "TFLOP/s" in out
    assert "0 stale" in out

    code, out, _ = run_cli(capsys, "export")
    assert code == 0 and "tuning_configs/tables/fa4_fwd_sm90-h200.yaml" in out
    exported = workdir / "tuning_configs" / "tables" / "fa4_fwd_sm90-h200.yaml"
    assert (
        exported.read_text().split("\n", 2)[2]
        == (workdir / "fa4tune-results" / "quickstart-table.yaml").read_text().split("\n", 2)[2]
    )

    code, out, _ = run_cli(capsys, "import", exported, "--db", "copy.db")
    assert code == 0 and "12 added" in out
    code, out, _ = run_cli(capsys, "show", "--table", exported, "--top", "0")
    assert code == 0 and "STALE" not in out

    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0 and f"schema v{SCHEMA_VERSION}" in out and "fa4_fwd_sm90" in out


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="report needs the [report] extra"
)
def test_report_writes_html_and_png(workdir, capsys):
    job = write_job(workdir, spaces=["tiles", "pipeline"], budget={"trials": 12})
    assert run_cli(capsys, "search", job, "--no-progress")[0] == 0
    code, out, err = run_cli(capsys, "report", "--out", "rep")
    assert code == 0, err
    pngs = sorted(p.name for p in (workdir / "rep").glob("*.png"))
    assert "default_vs_tuned.png" in pngs and any("history" in p for p in pngs)
    assert any("importances" in p for p in pngs)
    assert "estimates" in (workdir / "rep" / "index.html").read_text()


needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="report needs the [report] extra"
)
RECORDED = ["as the search records it", "relative, as earlier versions did"]


def search_elsewhere(workdir, capsys, monkeypatch, recorded: str):
    """A search run in its own directory, then the working directory moved to another one: the
    results DB's absolute path. Earlier versions recorded the journal's path relative to where the
    search ran (here the parent of the DB's directory)."""
    searched = workdir / "searched"
    searched.mkdir()
    monkeypatch.chdir(searched)
    job = write_job(searched, spaces=["tiles", "pipeline"], budget={"trials": 8})
    assert run_cli(capsys, "search", job, "--no-progress")[0] == 0
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    db = searched / "fa4tune-results" / "results.db"
    con = sqlite3.connect(db)
    [(stored,)] = con.execute("SELECT storage_url FROM runs").fetchall()
    assert stored == str(db.parent.resolve() / "results.optuna.journal")  # the same from anywhere
    if recorded == RECORDED[1]:
        con.execute("UPDATE runs SET storage_url = 'fa4tune-results/results.optuna.journal'")
        con.commit()
    con.close()
    return db


@needs_matplotlib
@pytest.mark.parametrize("recorded", RECORDED)
def test_report_from_another_directory_plots_every_study(workdir, capsys, monkeypatch, recorded):
    db = search_elsewhere(workdir, capsys, monkeypatch, recorded)
    code, out, err = run_cli(capsys, "report", "--db", db, "--out", "rep")
    assert code == 0, err
    report = workdir / "elsewhere" / "rep"
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert any("history" in p for p in pngs) and any("importances" in p for p in pngs), pngs
    assert "not found" not in (report / "index.html").read_text()
    assert sorted(p.name for p in report.parent.iterdir()) == ["rep"]  # no journal made here


@needs_matplotlib
@pytest.mark.parametrize("recorded", RECORDED)
def test_report_whose_storage_is_gone_fails_naming_it(workdir, capsys, monkeypatch, recorded):
    db = search_elsewhere(workdir, capsys, monkeypatch, recorded)
    journal = db.parent / "results.optuna.journal"
    journal.unlink()
    message = assert_bad_input(
        capsys, ["report", "--db", db, "--out", "rep"], "cannot read study 'job/", "--storage"
    )
    named = str(journal) if recorded == RECORDED[0] else "'fa4tune-results/results.optuna.journal'"
    assert named in message, message
    assert not journal.exists()
    assert list((workdir / "elsewhere").iterdir()) == []  # neither a journal nor half a report


@needs_matplotlib
def test_report_into_a_file_fails_naming_it_and_leaves_it(workdir, capsys):
    assert run_cli(capsys, "search", write_job(workdir), "--no-progress")[0] == 0
    (workdir / "notes.txt").write_text("mine")
    assert_bad_input(
        capsys,
        ["report", "--out", "notes.txt"],
        "cannot write the report to notes.txt: notes.txt is not a writable directory",
    )
    assert (workdir / "notes.txt").read_text() == "mine"


def test_report_without_matplotlib_says_how_to_get_it(workdir, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a)
    )
    job = write_job(workdir)
    assert run_cli(capsys, "search", job, "--no-progress")[0] == 0
    assert_bad_input(capsys, ["report"], "matplotlib", "fa4tune[report]")


def test_doctor_notes_a_missing_optional_extra_neither_ok_nor_bad(workdir, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a)
    )
    code, out, _ = run_cli(capsys, "doctor")
    [line] = [line for line in out.splitlines() if "[report]" in line]
    assert line.split() == [
        "--",
        "[report]",
        "matplotlib",
        "missing:",
        "pip",
        "install",
        "'fa4tune[report]'",
    ]
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert code == (1 if bad else 0), out  # the note alone does not fail doctor


def test_a_broken_family_plugin_stops_neither_doctor_nor_show(
    workdir, capsys, broken_family_plugin
):
    """doctor is where a broken plugin should be found out, with the rest still checked; show of
    a DB or table of the built-in families does not need the plugin."""
    assert run_cli(capsys, "search", write_job(workdir), "--no-progress")[0] == 0
    assert run_cli(capsys, "export", "--out", "t.yaml")[0] == 0
    code, out, err = run_cli(capsys, "doctor")
    assert code == 1, (out, err)
    [bad] = [line for line in out.splitlines() if line.startswith("BAD")]
    assert "'broken' = 'brokenfamily_mod:FAMILY'" in bad and "needs a package" in bad, bad
    assert any(line.split()[:3] == ["ok", "results", "db"] for line in out.splitlines()), out
    for argv in (["show"], ["show", "--table", "t.yaml"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 0 and "bf16-d128x128" in out, (argv, out, err)


def test_show_names_an_unknown_kernel(workdir, capsys):
    """Not "no best configs": that reads as an empty DB."""
    assert run_cli(capsys, "search", write_job(workdir), "--no-progress")[0] == 0
    assert_bad_input(capsys, ["show", "--kernel", "fa4_fwd"], "unknown kernel 'fa4_fwd'")


def test_show_flags_stale_configs(workdir, capsys):
    job = write_job(workdir)
    assert run_cli(capsys, "search", job, "--no-progress")[0] == 0
    con = sqlite3.connect("fa4tune-results/results.db")
    con.execute("UPDATE best_configs SET kernel_hash = 'abc'")
    con.commit()
    con.close()
    code, out, _ = run_cli(capsys, "show")
    assert code == 0 and "STALE" in out and "1 stale" in out


@pytest.mark.parametrize("top", ["-1", "x"])
def test_show_refuses_a_negative_top(workdir, capsys, top):
    """A negative --top would slice the slowest trials off each problem's list without a word."""
    job = write_job(workdir)
    assert run_cli(capsys, "search", job, "--no-progress")[0] == 0
    with pytest.raises(SystemExit) as stop:
        main(["show", "--top", top])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--top" in err and "a whole number of 0 or more" in err and repr(top) in err


# ---- bad input -----------------------------------------------------------------------------------
def test_malformed_yaml_names_the_file_and_line(workdir, capsys):
    bad = workdir / "bad.yaml"
    bad.write_text("kernel: fa4_fwd_sm90\nproblems: [ {head_dim: 128\nbudget: 3\n")
    assert_bad_input(capsys, ["search", bad], "bad.yaml", "malformed YAML", "line")
    assert written(workdir) == []


@pytest.mark.parametrize(
    "fields, fragments",
    [
        ({"budget": {"trials": "many"}}, ["budget.trials", "positive integer"]),
        ({"problems": [{"head_dim": 80}]}, ["problems[0]", "unsupported head_dim 80"]),
        (
            {"problems": [{"head_dim": 128, "nheads_q": 12, "nheads_kv": 5}]},
            ["problems[0]", "multiple of nheads_kv"],
        ),
        ({"problems": [{"seqlen_q": 0}]}, ["problems[0]", "seqlen_q must be positive"]),
        ({"problems": [{"head_dmi": 128}]}, ["problems[0]", "unknown problem field", "head_dim"]),
        (
            {"kernel": "fa5_fwd"},
            ["kernel", "unknown kernel 'fa5_fwd'", "known kernels: fa4_bwd_sm90, fa4_fwd_sm90"],
        ),
        (
            {"spaces": ["tiles", "warp_magic"]},
            ["spaces.warp_magic", "unknown search space", "known spaces", "tiles"],
        ),
        (
            {"spaces": {"tiles": {"tile_k": [1]}}},
            ["spaces", "no parameter 'tile_k'", "tile_m, tile_n"],
        ),
        ({"spaces": {"tiles": {"tile_n": [100]}}}, ["spaces", "outside its domain"]),
        ({"sampler": "annealing"}, ["sampler.name", "unknown sampler", "tpe"]),
        ({"sampler": {"name": "tpe", "n_startup": 3}}, ["sampler", "bad options"]),
        # The right name, a wrong type: TPE first calls gamma after its start-up trials.
        (
            {
                "sampler": {"name": "tpe", "gamma": 5, "n_startup_trials": 2},
                "budget": {"trials": 40},
            },
            ["sampler", "bad options", "gamma"],
        ),
        (
            {"sampler": {"name": "tpe", "gamma": 0.5, "n_startup_trials": 50}},
            ["sampler", "bad options", "gamma"],
        ),
        (
            {"sampler": {"name": "tpe", "gamma": 0.2, "n_startup_trials": 500}},
            ["sampler", "bad options", "gamma"],
        ),
        (
            {"sampler": {"name": "tpe", "n_startup_trials": -3}},
            ["sampler", "n_startup_trials", "0 or more"],
        ),
        ({"backend": "fpga"}, ["backend", "known backends"]),
        ({"target": "A100"}, ["target", "unknown target", "H200"]),
        ({"colour": "blue"}, ["colour", "unknown field", "known fields"]),
        ({"target": "B200"}, ["no kernel supports", "sm_100a"]),
        (
            {"export": "job.yaml/table.yaml"},
            ["export: cannot write", "job.yaml is not a writable directory"],
        ),
    ],
)
def test_bad_job_fields(workdir, capsys, fields, fragments):
    job = write_job(workdir, **fields)
    assert_bad_input(capsys, ["search", job], *fragments)
    assert written(workdir) == [], "nothing may be written for a bad job"


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--trials", "0"], ["--trials", "positive whole number"]),
        (["--trials", "-2"], ["--trials", "positive whole number"]),
        (["--seconds", "-1"], ["--seconds", "positive number"]),
        (["--seconds", "nan"], ["--seconds", "positive number"]),
    ],
)
def test_bad_budget_overrides(workdir, capsys, flags, fragments):
    job = write_job(workdir)
    assert_bad_input(capsys, ["search", job, *flags], *fragments)
    assert written(workdir) == [], "nothing may be written for a bad budget"


def test_missing_optional_sampler_dependency_is_explained(workdir, capsys):
    if importlib.util.find_spec("cmaes") is not None:
        pytest.skip("cmaes is installed here")
    job = write_job(workdir, sampler="cmaes")
    assert_bad_input(capsys, ["search", job], "cmaes sampler needs cmaes", "pip install cmaes")
    assert written(workdir) == []


def test_unwritable_db_path(workdir, capsys):
    (workdir / "a_file").write_text("x")
    job = write_job(workdir)
    assert_bad_input(
        capsys,
        ["search", job, "--db", "a_file/results.db"],
        "cannot create results DB",
        "not a writable directory",
    )
    assert written(workdir) == ["a_file"]


def unwritable_directory(tmp_path):
    """A directory where no file can be made: one without write permission, or where that does not
    bind (root) /proc, which refuses new files; the test is skipped where neither holds."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    for directory in (locked, Path("/proc")):
        try:
            (directory / "probe").open("x").close()
        except OSError:
            return directory
        (directory / "probe").unlink()
    pytest.skip("no unwritable directory here (root, and no /proc)")


def test_a_db_in_an_unwritable_directory_is_named_as_such(workdir, capsys, tmp_path):
    location = unwritable_directory(tmp_path) / "x.db"
    message = assert_bad_input(
        capsys,
        ["search", write_job(workdir), "--db", location, "--no-progress"],
        f"cannot create results DB '{location}'",
        "is not a writable directory",
    )
    assert "corrupt" not in message
    code, out, _ = run_cli(capsys, "doctor", "--db", location)
    [line] = [line for line in out.splitlines() if "results db" in line]
    assert line.startswith("BAD") and "is not a writable directory" in line, line
    assert code == 1
    assert not location.exists()


def test_db_of_another_schema_version(workdir, capsys):
    job = write_job(workdir)
    assert run_cli(capsys, "search", job, "--no-progress", "--db", "old.db")[0] == 0
    con = sqlite3.connect("old.db")
    con.execute("UPDATE fa4tune_schema SET value = '0'")
    con.commit()
    con.close()
    before = (workdir / "old.db").read_bytes()
    for argv in (
        ["search", job, "--db", "old.db"],
        ["show", "--db", "old.db"],
        ["export", "--db", "old.db"],
    ):
        assert_bad_input(capsys, argv, "schema version 0", f"reads version {SCHEMA_VERSION}")
    assert (workdir / "old.db").read_bytes() == before


def test_corrupt_db_file(workdir, capsys):
    (workdir / "broken.db").write_bytes(b"\x00garbage" * 512)
    job = write_job(workdir)
    assert_bad_input(capsys, ["search", job, "--db", "broken.db"], "not a SQLite database")
    assert_bad_input(capsys, ["show", "--db", "broken.db"], "not a SQLite database")
    assert written(workdir) == ["broken.db"]


def zero_byte_db(workdir):
    """An empty file to give as --db, and a check that it is still one (no -wal, -shm beside it)."""
    empty = workdir / "empty.db"
    empty.touch()

    def untouched():
        assert empty.stat().st_size == 0
        beside = sorted(p.name for p in workdir.iterdir() if p.name.startswith("empty.db"))
        assert beside == ["empty.db"], beside

    return empty, untouched


def test_commands_that_read_leave_a_zero_byte_db_as_it_is(workdir, capsys):
    """An empty file given as --db is no results DB yet: opened, it would be made a SQLite file."""
    from fa4tune.problem import Problem
    from fa4tune.runtime.lookup import lookup

    empty, untouched = zero_byte_db(workdir)
    for command in (["show"], ["export"], ["report", "--out", "rep"]):
        message = assert_bad_input(capsys, [*command, "--db", empty])
        assert "empty" in message and "empty.db" in message, message
        untouched()
    code, out, _ = run_cli(capsys, "doctor", "--db", empty)
    [line] = [line for line in out.splitlines() if "results db" in line]
    assert line.startswith("ok") and "an empty file, no results yet" in line, line
    untouched()
    with pytest.warns(RuntimeWarning, match="empty file"):
        found = lookup(
            Problem(head_dim=128, seqlen_q=2048, batch=2, nheads_q=8), "H200", source=str(empty)
        )
    assert found.source == "default"
    untouched()


def test_a_search_refused_leaves_a_zero_byte_db_as_it_is(workdir, capsys):
    """What the storage holds is checked before the results DB is touched, too."""
    empty, untouched = zero_byte_db(workdir)
    (workdir / "notes.txt").write_text("not a database\n")
    job = write_job(workdir)
    for flags, fragment in (
        (["--trials", "0"], "--trials"),
        (["--storage", empty], "is the results DB's file"),
        (["--storage", "notes.txt"], "is not an Optuna journal"),
        (["--storage", "sqlite:///notes.txt"], "is not a SQLite database"),
    ):
        assert_bad_input(capsys, ["search", job, "--db", empty, "--no-progress", *flags], fragment)
        untouched()
    assert not (workdir / "empty.optuna.journal").exists()


def test_table_for_another_kernel_hash(workdir, capsys):
    job = write_job(workdir)
    assert run_cli(capsys, "search", job, "--no-progress")[0] == 0
    assert run_cli(capsys, "export", "--out", "t.yaml")[0] == 0
    document = yaml.safe_load((workdir / "t.yaml").read_text())
    document["kernel_hash"] = "0" * 64
    (workdir / "t.yaml").write_text(yaml.safe_dump(document))
    assert_bad_input(
        capsys, ["import", "t.yaml", "--db", "new.db"], "kernel_hash 000000000000", "stale"
    )
    code, out, _ = run_cli(capsys, "show", "--table", "t.yaml")
    assert code == 0 and "STALE" in out


def test_export_replaces_a_table_only_with_force(workdir, capsys):
    """A measured table with its carry records is not lost to an estimate export; a job's own export
    is rewritten by each run of the job."""
    job = write_job(workdir, export="job-table.yaml")
    for _ in range(2):
        assert run_cli(capsys, "search", job, "--no-progress")[0] == 0
    shipped = REPO / "tuning_configs" / "tables" / "h200-bf16.yaml"
    (workdir / "tables").mkdir()
    (workdir / "tables" / "h200-bf16.json").write_bytes(shipped.with_suffix(".json").read_bytes())
    # The shipped table as it was after a carry over a refactor: with its carry record.
    table = yaml.safe_load(shipped.read_text())
    table["carried"] = [
        {
            "checked": "ir, ptx and launch arguments of all entries identical",
            "date": "2026-11-29T20:03:02Z",
            "from_hash": "9" * 64,
            "from_revision": "a" * 40,
            "to_hash": table["kernel_hash"],
        }
    ]
    (workdir / "tables" / "h200-bf16.yaml").write_text(yaml.safe_dump(table, sort_keys=False))
    before = {p: p.read_bytes() for p in (workdir / "tables").iterdir()}
    assert_bad_input(
        capsys,
        ["export", "--out", "tables/h200-bf16.yaml"],
        "tables/h200-bf16.yaml exists",
        f"{len(table['entries'])} entries "
        f"({len(table['entries'])} measured, 0 cost-model estimates)",
        f"hash {table['kernel_hash'][:12]}",
        "on H200, with 1 carry record;",
        "--force",
    )
    assert {p: p.read_bytes() for p in (workdir / "tables").iterdir()} == before
    (workdir / "tables" / "h200-bf16.yaml").unlink()  # the JSON half alone is refused too
    assert_bad_input(
        capsys, ["export", "--out", "tables/h200-bf16.yaml"], "tables/h200-bf16.json exists"
    )
    assert run_cli(capsys, "export")[0] == 0
    assert_bad_input(
        capsys,
        ["export"],
        "tuning_configs/tables/fa4_fwd_sm90-h200.yaml exists",
        "1 entries (0 measured, 1 cost-model estimates)",
    )
    assert run_cli(capsys, "export", "--out", "tables/h200-bf16.yaml", "--force")[0] == 0
    assert yaml.safe_load((workdir / "tables" / "h200-bf16.yaml").read_text())["estimates"] is True


def test_a_cost_model_search_does_not_export_over_measurements(workdir, capsys):
    """The shipped job run with --backend model used to replace the shipped table's measurements
    with estimates; now it stops before anything is written, and --export sends the table
    elsewhere."""
    shipped = REPO / "tuning_configs" / "tables" / "h200-bf16.yaml"
    (workdir / "tables").mkdir()
    for path in (shipped, shipped.with_suffix(".json")):
        (workdir / "tables" / path.name).write_bytes(path.read_bytes())
    before = {p: p.read_bytes() for p in (workdir / "tables").iterdir()}
    measured = sum(not e["is_estimate"] for e in yaml.safe_load(shipped.read_text())["entries"])
    job = write_job(workdir, export="tables/h200-bf16.yaml")
    assert_bad_input(
        capsys,
        ["search", job, "--no-progress"],
        f"cannot export to tables/h200-bf16.yaml: it holds {measured} measured entries",
        "cost-model estimates",
        "--export PATH",
    )
    assert {p: p.read_bytes() for p in (workdir / "tables").iterdir()} == before
    assert not (workdir / "fa4tune-results").exists()  # refused before the DB was made
    code, out, _ = run_cli(capsys, "search", job, "--no-progress", "--export", "mine.yaml")
    assert code == 0 and "exported mine.yaml" in out, out
    assert yaml.safe_load((workdir / "mine.yaml").read_text())["estimates"] is True
    assert {p: p.read_bytes() for p in (workdir / "tables").iterdir()} == before
    # A table of estimates is the model's to replace, as before.
    assert (
        run_cli(
            capsys, "search", write_job(workdir, name="again", export="mine.yaml"), "--no-progress"
        )[0]
        == 0
    )
    assert_bad_input(
        capsys, ["search", job, "--no-progress", "--export", " "], "--export: a table path"
    )


def test_export_and_show_take_a_target_in_any_case(workdir, capsys):
    assert run_cli(capsys, "search", write_job(workdir), "--no-progress")[0] == 0
    code, out, _ = run_cli(capsys, "export", "--target", "h200", "--out", "t.yaml")
    assert code == 0 and "exported t.yaml" in out
    code, out, _ = run_cli(capsys, "show", "--target", "h200")
    assert code == 0 and "bf16-d128x128-full-q2048-k2048-b2-h8x8" in out
    for command in ("export", "show"):
        assert_bad_input(capsys, [command, "--target", "Z9"], "unknown target 'Z9'", "H200")


def test_a_table_half_written_is_taken_back(workdir, capsys):
    assert run_cli(capsys, "search", write_job(workdir), "--no-progress")[0] == 0
    (workdir / "out" / "t.json").mkdir(parents=True)
    assert_bad_input(capsys, ["export", "--out", "out/t.yaml"], "cannot write table out/t.json")
    assert not (workdir / "out" / "t.yaml").exists()


@pytest.mark.parametrize(
    "argv, what",
    [
        (["search", "binary.yaml"], "job file"),
        (["show", "--table", "binary.yaml"], "table"),
        (["import", "binary.yaml", "--db", "new.db"], "table"),
        (["carry", "binary.yaml", "--from", "HEAD"], "table"),
    ],
)
def test_a_binary_file_given_as_a_job_or_table_is_named(workdir, capsys, argv, what):
    """A results DB (or any binary file) passed where a YAML file goes: one paragraph naming the
    file, not a UnicodeDecodeError's traceback."""
    (workdir / "binary.yaml").write_bytes(b"SQLite format 3\x00\xff\xfe" + bytes(range(256)))
    assert_bad_input(capsys, argv, f"cannot read {what} binary.yaml", "text (byte 16 is 0xff)")
    assert written(workdir) == []


def test_malformed_table_and_missing_files(workdir, capsys):
    (workdir / "t.yaml").write_text("format: [")
    assert_bad_input(capsys, ["import", "t.yaml", "--db", "new.db"], "t.yaml", "malformed YAML")
    assert not (workdir / "new.db").exists()
    assert_bad_input(capsys, ["import", "none.yaml"], "cannot read table none.yaml")
    assert_bad_input(capsys, ["search", "none.yaml"], "cannot read job file none.yaml")
    assert_bad_input(capsys, ["show", "--db", "none.db"], "no results DB")
    assert not (workdir / "none.db").exists()


def test_doctor_says_which_gpu_each_shipped_table_serves_and_whether_it_is_fresh(tmp_path):
    """A line per table: its family, GPU and entries, fresh or stale (a note: it still serves);
    an unreadable one is bad. With a GPU, which families look up tuned configs there."""
    from fa4tune.doctor import NOTE, table_lines
    from fa4tune.runtime.lookup import PACKAGE_TABLES
    from fa4tune.target import get_target

    shipped = yaml.safe_load((PACKAGE_TABLES / "h100-bf16-train.yaml").read_text())
    (tmp_path / "fresh.yaml").write_text(yaml.safe_dump(shipped))
    (tmp_path / "stale.yaml").write_text(yaml.safe_dump({**shipped, "kernel_hash": "0" * 64}))
    (tmp_path / "broken.yaml").write_text("format: nothing\n")
    broken, fresh, stale = table_lines(directory=tmp_path)
    assert broken[:2] == ("table", False) and broken[2].startswith("broken.yaml: TableError")
    entries = len(shipped["entries"])
    assert fresh == (
        "table", True,
        f"fresh.yaml: fa4_bwd_sm90 on H100-SXM, {entries} entries, tuned for the installed code",
    )  # fmt: skip
    assert stale[:2] == ("table", NOTE) and "STALE: tuned for 000000000000" in stale[2]
    *_, here = table_lines(get_target("H100-SXM"), directory=tmp_path)
    assert here == (
        "tables here", True,
        "H100-SXM: tuned configs for fa4_bwd_sm90; the default configs for fa4_fwd_sm90",
    )  # fmt: skip
    *_, here = table_lines(get_target("H200"))  # the shipped tables
    assert here[2] == "H200: tuned configs for fa4_bwd_sm90, fa4_fwd_sm90"
