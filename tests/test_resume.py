"""A search killed (SIGKILL) or interrupted (SIGINT) mid-run loses no finished trial, and --resume
continues the same studies up to the budget without measuring anything twice."""

import dataclasses
import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from conftest import COLLAPSED_GRID, sigint_default, study_states, write_job

from fa4tune.db import ResultsDB
from fa4tune.measure.model import CostModelBackend
from fa4tune.tune.job import load_job
from fa4tune.tune.search import run_search
from fa4tune.tune.studies import open_storage

# The CLI with a cost model slowed down to 20 ms a measurement, so that a kill lands mid-search.
SLOW_CLI = """
import sys, time
from fa4tune.measure.model import CostModelBackend
measure = CostModelBackend.measure
def slow(self, problem, config):
    time.sleep(0.02)
    return measure(self, problem, config)
CostModelBackend.measure = slow
from fa4tune.cli import main
sys.exit(main(sys.argv[1:]))
"""

SPACE = ["tiles", "pipeline", "exp2", "softmax"]


def start_search(job_path, workdir, *extra):
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_CLI, "search", str(job_path), "--no-progress", *extra],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=sigint_default,
    )


def wait_for_trials(workdir, count, proc, timeout=60):
    db_path = workdir / "fa4tune-results" / "results.db"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        if db_path.exists():
            try:
                with ResultsDB.open(str(db_path), create=False) as db:
                    if db.counts()["trials"] >= count:
                        return
            except Exception:
                pass  # the schema is being created
        time.sleep(0.05)
    raise AssertionError("the search did not get going")


def test_kill_and_resume_loses_no_finished_trial(workdir):
    job_path = write_job(workdir, spaces=SPACE, budget={"trials": 30}, sampler="tpe")
    proc = start_search(job_path, workdir)
    wait_for_trials(workdir, 8, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        before = db.trials()
        assert db.runs()[0]["status"] == "running"  # killed: nobody marked it
    assert 8 <= len(before) and sum(t["status"] != "pruned" for t in before) < 30

    summary = run_search(load_job(job_path), resume=True, say=lambda *a: None)
    assert summary.resumed and summary.run_id == before[0]["run_id"]
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        after = db.trials()
        assert db.runs()[0]["status"] == "finished" and len(db.runs()) == 1
    kept = {t["id"]: t for t in after}
    assert all(kept[t["id"]] == t for t in before), "a finished trial changed or vanished"
    assert sum(t["status"] != "pruned" for t in after) == 30
    keys = [t["config_key"] for t in after]
    assert len(keys) == len(set(keys)), "a config was measured twice"
    assert {t["study_name"] for t in after} == {before[0]["study_name"]}
    name, states = study_states(load_job(job_path))
    assert optuna.trial.TrialState.RUNNING not in states
    assert states.count(optuna.trial.TrialState.COMPLETE) >= sum(t["status"] == "ok" for t in after)


def test_ctrl_c_stores_everything_and_says_how_to_resume(workdir):
    job_path = write_job(workdir, spaces=SPACE, budget={"trials": 200}, sampler="random")
    proc = start_search(job_path, workdir)
    wait_for_trials(workdir, 5, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "--resume" in out and "every finished trial is stored" in out
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        assert db.runs()[0]["status"] == "interrupted"
        stored = db.count_trials(db.trials()[0]["study_name"], measured_only=False)
    _, states = study_states(load_job(job_path))
    assert optuna.trial.TrialState.RUNNING not in states
    finished = [
        s for s in states if s in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    ]
    assert len(finished) >= stored


def test_the_resume_hint_repeats_the_options_that_pick_the_run(workdir):
    """A resume continues only a run of the same kind and target: the hint must repeat --backend and
    --target (and the budgets) as given, or following it starts another run."""
    job_path = write_job(
        workdir, spaces=SPACE, budget={"trials": 300}, sampler="random", backend="auto"
    )
    proc = start_search(
        job_path,
        workdir,
        "--backend",
        "model",
        "--target",
        "h100-sxm",
        "--trials",
        "250",
        "--export",
        "elsewhere.yaml",
    )
    wait_for_trials(workdir, 3, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert (
        "--resume --export elsewhere.yaml --backend model --target h100-sxm --trials 250" in out
    ), out


def test_sigterm_is_an_interrupt_too(workdir):
    job_path = write_job(workdir, spaces=SPACE, budget={"trials": 200}, sampler="random")
    proc = start_search(job_path, workdir)
    wait_for_trials(workdir, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "--resume" in out and "every finished trial is stored" in out
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        assert db.runs()[0]["status"] == "interrupted"
    _, states = study_states(load_job(job_path))
    assert optuna.trial.TrialState.RUNNING not in states


def test_a_resumed_random_search_proposes_new_configs(workdir):
    """With the first session's seed the random sampler replayed the configs measured then, and the
    run of repeats stopped the problem as converged long before its budget."""
    from fa4tune.measure.model import CostModelBackend
    from fa4tune.target import get_target
    from fa4tune.tune.search import SearchInterrupted

    job = load_job(
        write_job(workdir, spaces=SPACE, budget={"trials": 120}, sampler="random", warm_start=0)
    )

    class Interrupting(CostModelBackend):
        calls = 0

        def measure(self, problem, config):
            Interrupting.calls += 1
            if Interrupting.calls == 60:
                raise KeyboardInterrupt
            return super().measure(problem, config)

    target = get_target("H200")
    with pytest.raises(SearchInterrupted):
        run_search(job, backend=Interrupting(job.kernel, target), say=lambda *a: None)
    summary = run_search(
        job, backend=CostModelBackend(job.kernel, target), resume=True, say=lambda *a: None
    )
    result = summary.results[0]
    assert result.measured == 120 and "budget" in result.stopped, (
        result.stopped,
        result.measured,
        result.repeats,
    )
    assert result.repeats < 5


def test_an_interrupted_grid_search_measures_every_point_when_resumed(workdir):
    """The grid sampler counts a failed trial's point as visited: the point that an interrupt cut
    short is queued again. And a resumed session shuffles the grid as the first did: a trial's grid
    id indexes the shuffled grid, so another seed would take the visited ids for other points."""
    from fa4tune.db import config_key
    from fa4tune.measure.model import CostModelBackend
    from fa4tune.space import compose
    from fa4tune.target import get_target
    from fa4tune.tune.search import SearchInterrupted

    # A grid large enough for four interrupts. A lost point that were not queued again would never
    # be measured: the search ends once the sampler has asked for every point.
    job = load_job(
        write_job(
            workdir,
            spaces={"tiles": {}, "pipeline": {"num_stages": [2, 3]}},
            budget={"trials": 1000},
            sampler="grid",
            warm_start=0,
            probes=0,
        )
    )

    class Interrupting(CostModelBackend):
        calls = 0

        def measure(self, problem, config):
            Interrupting.calls += 1
            if Interrupting.calls in (20, 50, 80, 110):
                raise KeyboardInterrupt
            return super().measure(problem, config)

    target = get_target("H200")
    for session in range(6):  # interrupted four times, resumed each time
        try:
            summary = run_search(
                job,
                backend=Interrupting(job.kernel, target),
                resume=session > 0,
                say=lambda *a: None,
            )
            break
        except SearchInterrupted:
            continue
    assert session == 4 and "exhausted" in summary.results[0].stopped, summary.results[0].stopped
    space, problem = compose(job.kernel, job.spaces), job.problems[0]
    grid = space.grid(problem, target)
    wanted = {
        config_key(space.full_config(problem, target, dict(zip(grid, values))))
        for values in itertools.product(*grid.values())
    }
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        stored = {t["config_key"] for t in db.trials()}
    assert wanted <= stored, f"{len(wanted - stored)} grid points never measured"


def test_a_grid_search_cut_short_while_suggesting_resumes(workdir, monkeypatch):
    """An interrupt in the middle of a trial's suggestions leaves it with part of a grid point: the
    whole point (named by its grid id) is queued again, not the part, which the grid sampler refuses
    (every resume then crashed)."""
    from fa4tune.measure.model import CostModelBackend
    from fa4tune.target import get_target
    from fa4tune.tune.search import SearchInterrupted

    job = load_job(
        write_job(
            workdir,
            spaces={"tiles": {}, "pipeline": {"num_stages": [2, 3]}},
            budget={"trials": 1000},
            sampler="grid",
            warm_start=0,
            probes=0,
        )
    )
    suggest, calls = optuna.trial.Trial.suggest_categorical, []

    def interrupted_once(self, name, choices):
        calls.append(name)
        if len(calls) == 40:  # in the middle of one trial's suggestions
            raise KeyboardInterrupt
        return suggest(self, name, choices)

    monkeypatch.setattr(optuna.trial.Trial, "suggest_categorical", interrupted_once)
    target = get_target("H200")
    with pytest.raises(SearchInterrupted):
        run_search(job, backend=CostModelBackend(job.kernel, target), say=lambda *a: None)
    summary = run_search(
        job, backend=CostModelBackend(job.kernel, target), resume=True, say=lambda *a: None
    )
    assert "exhausted" in summary.results[0].stopped, summary.results[0].stopped


@pytest.mark.parametrize("cut", ["claim", "lookahead"])
def test_a_grid_point_failed_unmeasured_is_queued_again_under_the_studys_lock(
    workdir, monkeypatch, cut
):
    """Between a point's failure and its copy in the queue, another worker would see every point
    asked for and none queued or running, and end the grid as exhausted with that point never
    measured: both happen under the study's lock, where that worker checks again before it stops.
    Cut short while claiming (the trial is settled) or while waiting in the lookahead queue."""
    import contextlib

    from fa4tune.measure.model import CostModelBackend
    from fa4tune.target import get_target
    from fa4tune.tune.search import SearchInterrupted
    from fa4tune.tune.sharing import SharedStudy

    job = load_job(
        write_job(
            workdir,
            spaces={"tiles": {"tile_m": [128], "tile_n": [64, 96, 128, 160]}},
            sampler="grid",
            budget={"trials": 100},
            warm_start=0,
            probes=0,
        )
    )
    backend = CostModelBackend(job.kernel, get_target("H200"))
    backend.lookahead = 1 if cut == "lookahead" else 0
    events, held = [], []
    locked, tell, enqueue = (
        ResultsDB.locked,
        optuna.study.Study.tell,
        optuna.study.Study.enqueue_trial,
    )
    claim = SharedStudy.claim

    @contextlib.contextmanager
    def spy_locked(self, name):
        with locked(self, name) as lock:
            held.append(name)
            try:
                yield lock
            finally:
                held.pop()

    def spy_tell(self, trial, *args, state=None, **kwargs):
        if state == optuna.trial.TrialState.FAIL:
            events.append(("fail", bool(held)))
        return tell(self, trial, *args, state=state, **kwargs)

    def spy_enqueue(self, params, *args, **kwargs):
        events.append(("queued", bool(held)))
        return enqueue(self, params, *args, **kwargs)

    def interrupted_claim(self, candidate):
        if len(self.db.trials()) == 2:  # the third point's claim
            raise KeyboardInterrupt
        return claim(self, candidate)

    monkeypatch.setattr(ResultsDB, "locked", spy_locked)
    monkeypatch.setattr(optuna.study.Study, "tell", spy_tell)
    monkeypatch.setattr(optuna.study.Study, "enqueue_trial", spy_enqueue)
    monkeypatch.setattr(SharedStudy, "claim", interrupted_claim)
    with pytest.raises(SearchInterrupted):
        run_search(job, backend=backend, say=lambda *a: None)
    failed = [e for e in events if e[0] == "fail"]
    assert failed and ("queued", True) in events, events
    assert all(under for _, under in events), f"failed or queued outside the study's lock: {events}"
    monkeypatch.setattr(SharedStudy, "claim", claim)
    summary = run_search(job, backend=backend, resume=True, say=lambda *a: None)
    assert "exhausted" in summary.results[0].stopped and summary.results[0].measured == 4


def test_a_resumed_grid_search_whose_every_point_was_tried_asks_for_none(workdir):
    """Resumed with a larger budget, a study whose grid is exhausted ends at once, its best config
    kept: asked again, the grid sampler would only propose points tried already."""
    job = load_job(
        write_job(workdir, spaces=COLLAPSED_GRID, sampler="grid", budget={"trials": 100})
    )
    first = run_search(job, say=lambda *a: None)
    storage = open_storage(first.storage)
    asked = len(optuna.load_study(study_name=first.results[0].study_name, storage=storage).trials)
    again = run_search(job, resume=True, trials=200, say=lambda *a: None).results[0]
    assert again.stopped == first.results[0].stopped and "grid exhausted" in again.stopped
    assert len(optuna.load_study(study_name=again.study_name, storage=storage).trials) == asked
    assert (again.measured, again.best_config) == (
        first.results[0].measured,
        first.results[0].best_config,
    )
    with ResultsDB.open(first.db_location, create=False) as db:
        assert [b.config for b in db.best_configs()] == [again.best_config]


def test_a_grid_point_that_always_fails_unmeasured_is_not_queued_for_ever(workdir):
    """A point queued again after each failure would be the first thing every resume does, though it
    fails for its own reasons (here a plugin's check raises on it): it is queued again at most
    MAX_GRID_REQUEUES times, and then counts as tried (the grid sampler must not propose it
    again)."""
    from fa4tune.errors import SpaceError
    from fa4tune.space import Choice, SearchSpace, _registered, register_space
    from fa4tune.tune.grid import MAX_GRID_REQUEUES

    class Boom(SearchSpace):
        name, knobs = "boom_on_96", ("num_stages",)

        def params(self):
            return {"num_stages": Choice([2])}

        def check(self, problem, config, target):
            if config.tile_n == 96:
                raise RuntimeError("planted plugin bug")
            return []

    register_space(Boom)
    try:
        job = load_job(
            write_job(
                workdir,
                spaces={"tiles": {"tile_m": [128], "tile_n": [64, 96, 128]}, "boom_on_96": {}},
                budget={"trials": 20},
                sampler="grid",
                warm_start=0,
                probes=0,
            )
        )
        for session in range(MAX_GRID_REQUEUES + 1):
            with pytest.raises(
                SpaceError, match="planted plugin bug"
            ):  # a plugin's bug stops the search
                run_search(job, resume=session > 0, say=lambda *a: None)
        assert (
            "grid exhausted" in run_search(job, resume=True, say=lambda *a: None).results[0].stopped
        )
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend("fa4tune-results/results.optuna.journal")
        )
        study = optuna.load_study(
            study_name=optuna.get_all_study_summaries(storage)[0].study_name, storage=storage
        )
        requeued = [
            t
            for t in study.get_trials(deepcopy=False)
            if "fixed_params" in t.system_attrs
            and t.system_attrs["fixed_params"].get("tile_n") == 96
        ]
        assert len(requeued) == MAX_GRID_REQUEUES, len(requeued)
    finally:
        _registered.pop(Boom.name, None)


class _MeasuringModel(CostModelBackend):
    """Stands in for the GPU backend: the cost model's times, stored as measurements."""

    name = "gpu"
    is_estimate = False

    def measure(self, problem, config):
        return dataclasses.replace(super().measure(problem, config), is_estimate=False)


def test_a_cost_model_resume_does_not_join_a_measured_run(workdir):
    """Estimates in a measured run's studies would use up their trial budgets (a measured resume
    would then measure nothing more) and teach their samplers model times."""
    job_path = write_job(workdir, spaces=SPACE, budget={"trials": 6}, sampler="random")
    job = load_job(job_path)
    measured = run_search(job, backend=_MeasuringModel(job.kernel, job.target), say=lambda *a: None)
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        before = db.trials()
    assert (
        not measured.is_estimate and len(before) >= 6 and not any(t["is_estimate"] for t in before)
    )

    said = []
    estimated = run_search(load_job(job_path), resume=True, trials=10, say=said.append)
    assert not estimated.resumed and estimated.run_id != measured.run_id
    assert any(
        "no earlier cost-model run of job 'job'" in line
        and f"run {measured.run_id} was measured on a GPU" in line
        for line in said
    ), said
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        after = db.trials()
    assert [
        t for t in after if t["run_id"] == measured.run_id
    ] == before  # the measured run untouched
    new = [t for t in after if t["run_id"] == estimated.run_id]
    assert new and all(t["is_estimate"] for t in new)
    assert {t["study_name"] for t in new}.isdisjoint({t["study_name"] for t in before})

    # A measured resume still continues the measured run, and its budget counts only measurements.
    again = run_search(
        load_job(job_path),
        resume=True,
        trials=8,
        backend=_MeasuringModel(job.kernel, job.target),
        say=lambda *a: None,
    )
    assert again.resumed and again.run_id == measured.run_id
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        joined = [t for t in db.trials() if t["run_id"] == measured.run_id]
    assert sum(t["status"] != "pruned" for t in joined) == 8


def test_a_resume_charges_the_earlier_sessions_to_the_time_budget(workdir):
    """A problem that used up its time budget before the search stopped stays done when the run is
    resumed (it used to get the whole budget again); a longer budget on the resume continues it for
    the difference."""
    path = write_job(
        workdir,
        spaces=["tiles", "pipeline", "exp2", "softmax"],
        sampler="random",
        budget={"seconds": 0.5, "trials": 100000},
        problems=[
            {"head_dim": 64, "seqlen_q": 4096, "batch": 2, "nheads_q": 16},
            {"head_dim": 128, "seqlen_q": 4096, "batch": 2, "nheads_q": 16},
        ],
    )
    job = load_job(path)
    first = run_search(job, say=lambda *a: None)
    assert all("time budget" in r.stopped and r.measured >= 1 for r in first.results)
    counted = [r.measured + r.pruned for r in first.results]
    with ResultsDB.open(first.db_location, create=False) as db:
        spent = [db.study_seconds(first.run_id, r.study_name) for r in first.results]
    assert all(s >= 0.5 for s in spent), spent
    again = run_search(job, resume=True, say=lambda *a: None)
    assert again.run_id == first.run_id
    assert [r.measured + r.pruned for r in again.results] == counted
    assert all("time budget" in r.stopped for r in again.results)
    longer = run_search(job, resume=True, seconds=max(spent) + 0.5, say=lambda *a: None)
    assert all(r.measured + r.pruned > c for r, c in zip(longer.results, counted))


def _stored(db_path="fa4tune-results/results.db"):
    """Everything the results DB holds of runs, trials and best configs."""
    with ResultsDB.open(db_path, create=False) as db:
        return db.runs(), db.trials(), db.best_configs()


def _forget_flush(db_path="fa4tune-results/results.db"):
    """Make every run and best config look as one stored before they recorded their L2 flush."""
    import sqlite3

    with sqlite3.connect(db_path) as connection:
        connection.execute("UPDATE runs SET details = json_remove(details, '$.l2_flush')")
        connection.execute(
            "UPDATE best_configs SET provenance = json_remove(provenance, '$.l2_flush')"
        )


def _measured_search(job_path):
    """A search of the job at job_path, measured (by _MeasuringModel) on each call, with the
    call's run_search options."""
    job = load_job(job_path)

    def measured(**options):
        return run_search(
            load_job(job_path),
            backend=_MeasuringModel(job.kernel, job.target),
            say=lambda *a: None,
            **options,
        )

    return measured


def test_a_run_records_its_l2_flush_and_is_continued_only_under_it(workdir, monkeypatch):
    """Times of the clean and the dirty flush do not compare: a resume under the other mode is
    refused before anything is measured, naming both modes and the setting that continues the run,
    and leaves the DB as it was; under the run's own mode it continues."""
    from fa4tune.errors import Fa4tuneError
    from fa4tune.measure.timing import FLUSH_ENV

    measured = _measured_search(
        write_job(workdir, spaces=SPACE, budget={"trials": 6}, sampler="random")
    )

    monkeypatch.setenv(FLUSH_ENV, "warm")
    with pytest.raises(ValueError, match="FA4TUNE_L2_FLUSH='warm'"):
        measured()
    assert not (workdir / "fa4tune-results").exists()  # refused before anything was written

    monkeypatch.delenv(FLUSH_ENV)
    first = measured()
    runs, trials, best = _stored()
    assert runs[0]["details"]["l2_flush"] == "clean"
    assert best and all(b.provenance["l2_flush"] == "clean" for b in best)
    journal = (workdir / "fa4tune-results" / "results.optuna.journal").read_bytes()

    monkeypatch.setenv(FLUSH_ENV, "dirty")
    with pytest.raises(Fa4tuneError) as refused:
        measured(resume=True, trials=10)
    message = str(refused.value)
    assert f"run {first.run_id} of job 'job'" in message
    assert "timed with the clean L2 flush" in message and "times with the dirty one" in message
    assert "Set FA4TUNE_L2_FLUSH=clean to continue it" in message
    assert _stored() == (runs, trials, best)  # nothing changed, the run's status included
    assert (workdir / "fa4tune-results" / "results.optuna.journal").read_bytes() == journal

    # Without --resume the dirty search is a run of its own, which says so.
    other = measured()
    assert other.run_id != first.run_id and not other.resumed
    assert _stored()[0][-1]["details"]["l2_flush"] == "dirty"

    # A resume joins the job's latest run, now the dirty one: refused under the clean flush.
    monkeypatch.setenv(FLUSH_ENV, "clean")
    with pytest.raises(Fa4tuneError, match="Set FA4TUNE_L2_FLUSH=dirty to continue it"):
        measured(resume=True)
    monkeypatch.setenv(FLUSH_ENV, "dirty")
    again = measured(resume=True, trials=10)
    assert again.resumed and again.run_id == other.run_id
    runs, trials, _ = _stored()
    assert sum(t["status"] != "pruned" for t in trials if t["run_id"] == other.run_id) == 10
    assert runs[-1]["details"]["l2_flush"] == "dirty"


def test_a_run_that_does_not_record_its_flush_was_timed_dirty(workdir, monkeypatch):
    """Every measured run stored before runs recorded their L2 flush was timed with the dirty one:
    a clean search does not continue it, a dirty one does."""
    from fa4tune.errors import Fa4tuneError
    from fa4tune.measure.timing import FLUSH_ENV

    measured = _measured_search(
        write_job(workdir, spaces=SPACE, budget={"trials": 6}, sampler="random")
    )

    monkeypatch.setenv(FLUSH_ENV, "dirty")
    old = measured()
    _forget_flush()
    stored = _stored()
    assert "l2_flush" not in stored[0][0]["details"]

    monkeypatch.delenv(FLUSH_ENV)
    with pytest.raises(Fa4tuneError, match="timed with the dirty L2 flush") as refused:
        measured(resume=True, trials=8)
    assert "Set FA4TUNE_L2_FLUSH=dirty to continue it" in str(refused.value)
    assert _stored() == stored

    monkeypatch.setenv(FLUSH_ENV, "dirty")
    again = measured(resume=True, trials=8)
    assert again.resumed and again.run_id == old.run_id


def test_show_ranks_a_best_configs_trials_under_its_own_flush(workdir, monkeypatch, capsys):
    """`fa4tune show` says which L2 flush each measured best config was timed under, and --top
    ranks only the trials of that flush (the other flush's times do not compare), counting the
    others."""
    from fa4tune.cli import main as cli
    from fa4tune.measure.timing import FLUSH_ENV

    measured = _measured_search(
        write_job(workdir, spaces=SPACE, budget={"trials": 5}, sampler="random")
    )
    measured()  # clean
    monkeypatch.setenv(FLUSH_ENV, "dirty")
    second = measured()  # a run of its own: its best replaces the clean one (policy.better)
    runs, trials, best = _stored()
    assert [b.provenance["l2_flush"] for b in best] == ["dirty"]
    dirty = [t for t in trials if t["run_id"] == second.run_id]
    clean = [t for t in trials if t["run_id"] != second.run_id]
    assert dirty and clean
    capsys.readouterr()
    assert cli(["show", "--top", "50"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "L2 flush" in lines[1] and lines[3].split()[5] == "dirty"  # the best config's row
    header = next(line for line in lines if "(L2 flush dirty)" in line)
    assert f"{len(clean)} under another L2 flush, not ranked with these" in header
    ranked = lines[lines.index(header) + 3 :]
    assert len(ranked) == sum(t["status"] == "ok" for t in dirty)
    dirty_ms = sorted(t["time_ms"] for t in dirty if t["status"] == "ok")
    assert [float(line.split()[1]) for line in ranked] == pytest.approx(dirty_ms, rel=1e-3)


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="report needs the [report] extra"
)
def test_the_report_compares_default_and_tuned_under_one_flush_at_a_time(workdir, monkeypatch):
    """`fa4tune report`'s default-against-tuned table: a problem searched under both L2 flushes
    gets a row per flush, each from its own runs' trials, not the fastest time of either."""
    import re

    from fa4tune.measure.timing import FLUSH_ENV
    from fa4tune.report import write_report

    job_path = write_job(workdir, spaces=SPACE, budget={"trials": 5}, sampler="random")
    job = load_job(job_path)
    run_search(job, backend=_MeasuringModel(job.kernel, job.target), say=lambda *a: None)
    monkeypatch.setenv(FLUSH_ENV, "dirty")
    run_search(job, backend=_SlowerMeasuringModel(job.kernel, job.target), say=lambda *a: None)
    runs, trials, _ = _stored()
    mode = {r["id"]: r["details"]["l2_flush"] for r in runs}
    written = write_report(None, str(workdir / "rep"))
    text = Path(written["html"]).read_text()
    for flush in ("clean", "dirty"):
        ok = [t for t in trials if mode[t["run_id"]] == flush and t["status"] == "ok"]
        default = min(t["time_ms"] for t in ok if t["source"] == "default")
        best = min(t["time_ms"] for t in ok)
        row = re.search(rf"\[{flush} flush\]</td><td>([^<]+)</td><td>([^<]+)</td>", text)
        assert row, text
        assert float(row.group(1)) == pytest.approx(default, rel=1e-3)
        assert float(row.group(2)) == pytest.approx(best, rel=1e-3)


def test_a_cost_model_search_flushes_nothing_and_resumes_under_any_setting(workdir, monkeypatch):
    """Estimates time nothing: the run and its best configs record the flush "none", whatever
    FA4TUNE_L2_FLUSH says (it is not read, so not even a bad value stops the search), and a resume
    of a cost-model run, one stored before runs recorded their flush included, is never refused."""
    from fa4tune.measure.timing import FLUSH_ENV

    job_path = write_job(workdir, spaces=SPACE, budget={"trials": 4}, sampler="random")
    monkeypatch.setenv(FLUSH_ENV, "dirty")
    first = run_search(load_job(job_path), say=lambda *a: None)
    assert first.is_estimate
    runs, _, best = _stored()
    assert runs[0]["details"]["l2_flush"] == "none"
    assert best and all(b.provenance["l2_flush"] == "none" for b in best)

    _forget_flush()
    for setting, trials in (("clean", 6), ("warm", 8)):
        monkeypatch.setenv(FLUSH_ENV, setting)
        again = run_search(load_job(job_path), resume=True, trials=trials, say=lambda *a: None)
        assert again.resumed and again.run_id == first.run_id
    _, trials, _ = _stored()
    assert sum(t["status"] != "pruned" for t in trials) == 8


class _SlowerMeasuringModel(_MeasuringModel):
    """_MeasuringModel, `factor` times slower."""

    factor = 2.0

    def measure(self, problem, config):
        m = super().measure(problem, config)
        return dataclasses.replace(
            m, time_ms=m.time_ms * self.factor, tflops=m.tflops / self.factor
        )


class _SlowestMeasuringModel(_SlowerMeasuringModel):
    factor = 3.0


def test_a_search_under_another_flush_replaces_the_best_whatever_its_time(workdir, monkeypatch):
    """A best config measured under the other L2 flush (here one that records none: dirty) is no
    yardstick for this search's times: its own fastest replaces it, slower as it is, and the
    exported table then holds this flush's times only. Under one flush the faster stays."""
    from fa4tune.measure.timing import FLUSH_ENV
    from fa4tune.runtime.tables import read_table

    job_path = write_job(
        workdir, spaces=SPACE, budget={"trials": 6}, sampler="random", export="t.yaml"
    )
    job = load_job(job_path)

    def search(backend):
        return run_search(job, backend=backend(job.kernel, job.target), say=lambda *a: None)

    monkeypatch.setenv(FLUSH_ENV, "dirty")
    search(_MeasuringModel)
    _forget_flush()
    [dirty] = _stored()[2]
    assert "l2_flush" not in dirty.provenance

    monkeypatch.setenv(FLUSH_ENV, "clean")
    second = search(_SlowerMeasuringModel)
    [best] = _stored()[2]
    assert best.provenance["l2_flush"] == "clean" and best.provenance["run"] == second.run_id
    assert best.time_ms > dirty.time_ms
    table = read_table(workdir / "t.yaml")
    assert [e["provenance"]["l2_flush"] for e in table["entries"]] == ["clean"]

    third = search(_SlowestMeasuringModel)
    assert third.run_id != second.run_id and _stored()[2] == [best]
