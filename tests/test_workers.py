"""Many workers sharing each problem's study (fa4tune search --workers N), on the cost model:
through the journal file on one host and through a real PostgreSQL server (tests/pgserver.py),
across two "hosts" of which one dies. Exactly once: the measured trials of a study equal its budget,
no config is stored twice, the default is queued once, and what a killed worker was measuring is
handed back."""

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from conftest import (
    COLLAPSED_GRID,
    REPO,
    kill_processes,
    sigint_default,
    still_alive_after,
    write_job,
)

from fa4tune.cli import main
from fa4tune.db import ResultsDB
from fa4tune.tune.problem_search import MAX_CONSECUTIVE_REPEATS
from fa4tune.tune.sharing import SharedStudy
from fa4tune.tune.studies import (
    CLAIM_ATTR,
    DEFAULT_SOURCE,
    GIVEN_BACK_ATTR,
    SOURCE_ATTR,
    WORKER_ATTR,
    open_storage,
    parse_worker,
)

SPACE = ["tiles", "pipeline", "exp2", "softmax"]
PROBLEMS = [{"head_dim": [64, 128], "seqlen_q": 2048, "batch": 2, "nheads_q": 8}]
ONE_PROBLEM = [{"head_dim": 64, "seqlen_q": 2048, "batch": 2, "nheads_q": 8}]
JOURNAL = "fa4tune-results/results.optuna.journal"
DB = "fa4tune-results/results.db"

# Every process of the search (the CLI and the workers it spawns) imports this first: SIGUSR2 prints
# its threads' stacks (finish() sends it to a search that hangs), and the cost model
# takes FA4TUNE_TEST_MEASURE_S per measurement, so that workers overlap, then waits while the file
# FA4TUNE_TEST_HOLD exists (a test kills a worker it has seen measuring, then lets the others go:
# the kill lands mid-trial however loaded the machine is), and appends each finished measurement
# (problem, config) to the file FA4TUNE_TEST_MEASURE_LOG.
SLOW_MODEL = """
import faulthandler, json, os, signal, time
faulthandler.register(signal.SIGUSR2, all_threads=True)  # finish(): where a search hangs
delay = float(os.environ.get("FA4TUNE_TEST_MEASURE_S", "0"))
if delay:
    from fa4tune.measure import model
    measure = model.CostModelBackend.measure
    def slow(self, problem, config):
        time.sleep(delay)
        while os.path.exists(os.environ.get("FA4TUNE_TEST_HOLD", "")):
            time.sleep(0.02)
        result = measure(self, problem, config)
        line = json.dumps([problem.key(), config.to_dict()], sort_keys=True) + "\\n"
        with open(os.environ["FA4TUNE_TEST_MEASURE_LOG"], "a") as log:
            log.write(line)
        return result
    model.CostModelBackend.measure = slow
"""


@pytest.fixture
def slow_env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_MODEL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FA4TUNE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    env["FA4TUNE_TEST_MEASURE_LOG"] = str(tmp_path / "measured.jsonl")
    return env


def measurements(env) -> Counter:
    """How often each (problem, config) was measured to the end, by all processes."""
    return Counter(Path(env["FA4TUNE_TEST_MEASURE_LOG"]).read_text().splitlines())


@pytest.fixture
def hold(tmp_path):
    """A file that holds every measurement of the searches given it while it exists."""
    path = tmp_path / "hold"
    path.touch()
    yield path
    path.unlink(missing_ok=True)


def start_search(workdir, env, *args, delay=0.1, new_session=False, **extra_env):
    env = {**env, "FA4TUNE_TEST_MEASURE_S": str(delay), **extra_env}
    return subprocess.Popen(
        [sys.executable, "-m", "fa4tune.cli", "search", *map(str, args), "--no-progress"],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
        preexec_fn=sigint_default,
    )


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (its workers), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def finish(proc, timeout=120):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Where it hangs: every process of the search prints its threads' stacks (SLOW_MODEL's
        # SIGUSR2) into the output, then the search is killed (its workers follow it).
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        time.sleep(2)
        proc.kill()
        raise AssertionError(
            f"the search did not finish in {timeout} s: {proc.communicate()[0]}"
        ) from None
    assert proc.returncode == 0, out
    return out


def studies(storage):
    """Each study's trials (`storage`: a location or an open Optuna storage)."""
    if isinstance(storage, str):
        storage = open_storage(storage, heartbeat=False)
    return {
        s.study_name: optuna.load_study(study_name=s.study_name, storage=storage).get_trials(
            deepcopy=False
        )
        for s in optuna.get_all_study_summaries(storage)
    }


def claimed_trial(location, timeout=60, proc=None, host=None):
    """The first trial a worker claimed and is measuring, (study, trial); with `host`, the first
    one of a worker on that host."""
    storage = open_storage(location, heartbeat=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, proc.stdout.read()
        try:
            for name, trials in studies(storage).items():
                for t in trials:
                    if (
                        t.state == optuna.trial.TrialState.RUNNING
                        and CLAIM_ATTR in t.user_attrs
                        and (host is None or t.user_attrs[WORKER_ATTR].startswith(f"{host}:"))
                    ):
                        return name, t
        except Exception:
            pass  # not created yet
        time.sleep(0.05)
    raise AssertionError(f"no worker{f' of {host}' if host else ''} claimed a trial")


def claiming_workers(location, count: int, timeout=60, proc=None) -> set[int]:
    """The pids of `count` workers of this host that each claimed a trial and are measuring it."""
    storage = open_storage(location, heartbeat=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, proc.stdout.read()
        try:
            claimed = [
                t
                for trials in studies(storage).values()
                for t in trials
                if t.state == optuna.trial.TrialState.RUNNING and CLAIM_ATTR in t.user_attrs
            ]
            pids = {int(parse_worker(t.user_attrs[WORKER_ATTR])[1]) for t in claimed}
        except Exception:
            pids = set()  # not created yet
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"{count} workers never claimed a trial each")


def assert_exactly_once(db_location, storage, budget, n_studies, workers=None):
    """Per study: `budget` measured trials, each config stored once, the default queued once, no
    trial left running, and every claimed trial either stored or handed back (queued again)."""
    with ResultsDB.open(db_location, create=False) as db:
        stored = [t for t in db.trials() if t["source"] != "confirm"]
        runs = db.runs()
    assert len(runs) == 1, runs
    optuna_studies = studies(storage)
    assert len(optuna_studies) == n_studies
    for name, trials in optuna_studies.items():
        mine = [t for t in stored if t["study_name"] == name]
        assert sum(t["status"] != "pruned" for t in mine) == budget, name
        keys = [t["config_key"] for t in mine]
        assert len(keys) == len(set(keys)), f"a config was measured twice in {name}"
        by_number = {t.number: t for t in trials}
        states = Counter(t.state for t in trials)
        assert states[optuna.trial.TrialState.RUNNING] == 0, states
        defaults = [
            t
            for t in trials
            if t.user_attrs.get(SOURCE_ATTR) == DEFAULT_SOURCE
            and "fixed_params" in t.system_attrs
            and not {"failed_trial", GIVEN_BACK_ATTR} & set(t.system_attrs)
        ]
        assert len(defaults) == 1, f"the default was queued {len(defaults)} times in {name}"
        assert sum(t["source"] == DEFAULT_SOURCE for t in mine) == 1, [
            (t.number, t.state, t.user_attrs, t.system_attrs)
            for t in trials
            if "fixed_params" in t.system_attrs
        ]
        for t in mine:  # a stored trial is finished in Optuna with what the DB says
            frozen = by_number[t["optuna_number"]]
            assert frozen.state.is_finished()
            if t["status"] == "ok":
                assert (
                    frozen.state == optuna.trial.TrialState.COMPLETE
                    and frozen.value == t["time_ms"]
                )
        stored_keys = set(keys)
        handed_back = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
        for t in trials:
            if CLAIM_ATTR in t.user_attrs:
                assert t.user_attrs[CLAIM_ATTR] in stored_keys or t.number in handed_back, (
                    f"claimed trial {t.number} of {name} was lost"
                )
        if workers is not None:
            measured_by = {by_number[t["optuna_number"]].user_attrs.get(WORKER_ATTR) for t in mine}
            assert len(measured_by) >= workers, measured_by
    return stored, optuna_studies


# ---- one host, the journal -----------------------------------------------------------------------
def test_four_workers_share_each_study_through_the_journal(workdir, slow_env):
    path = write_job(workdir, spaces=SPACE, problems=PROBLEMS, budget={"trials": 20}, warm_start=1)
    out = finish(start_search(workdir, slow_env, path, "--workers", 4, delay=0.12))
    assert (
        "4 CPU worker processes share run 1" in out and out.count("trial budget (20) reached") == 2
    )
    assert_exactly_once(DB, JOURNAL, budget=20, n_studies=2, workers=4)
    measured = measurements(slow_env)
    assert max(measured.values()) == 1 and sum(measured.values()) == 2 * 20  # on the backend, too


def test_workers_never_measure_one_config_twice_even_in_a_tiny_space(workdir, slow_env):
    """Four workers drawing at random from 12 configs propose the same ones at the same time: the
    claim lets one measure it, the others hear the outcome (or that it is being measured)."""
    space = {"tiles": {"tile_n": [64, 96, 128, 160]}, "softmax": {"rescale_threshold": [0.0, 4.0]}}
    path = write_job(
        workdir,
        spaces=space,
        sampler="random",
        budget={"trials": 9},
        problems=[{"head_dim": 64, "seqlen_q": 2048, "batch": 2, "nheads_q": 8}],
    )
    out = finish(start_search(workdir, slow_env, path, "--workers", 4, delay=0.1))
    assert "trial budget (9) reached" in out
    assert_exactly_once(DB, JOURNAL, budget=9, n_studies=1)
    measured = measurements(slow_env)
    assert sum(measured.values()) == 9 and max(measured.values()) == 1, measured


def test_workers_end_a_grid_search_when_every_point_was_tried(workdir, slow_env):
    """Workers sharing a grid whose points are fewer configs: each config is measured once, and each
    worker ends the study as exhausted (none asks the grid sampler for a point again)."""
    path = write_job(workdir, spaces=COLLAPSED_GRID, sampler="grid", budget={"trials": 100})
    out = finish(start_search(workdir, slow_env, path, "--workers", 3, delay=0.1))
    assert "grid exhausted (all 8 points tried)]" in out, out
    measured = measurements(slow_env)
    assert max(measured.values()) == 1, measured
    [trials] = studies(JOURNAL).values()
    assert {t.system_attrs["grid_id"] for t in trials if "grid_id" in t.system_attrs} == set(
        range(8)
    )
    assert len(trials) < MAX_CONSECUTIVE_REPEATS, len(
        trials
    )  # no worker asked on until "converged"


def test_a_worker_killed_mid_trial_loses_nothing_journal(workdir, slow_env, hold):
    path = write_job(workdir, spaces=SPACE, problems=PROBLEMS, budget={"trials": 16})
    proc = start_search(
        workdir, slow_env, path, "--workers", 4, delay=0.15, FA4TUNE_TEST_HOLD=str(hold)
    )
    name, victim = claimed_trial(JOURNAL, proc=proc)
    pid = int(parse_worker(victim.user_attrs[WORKER_ATTR])[1])
    os.kill(pid, signal.SIGKILL)
    hold.unlink()
    out = finish(proc)
    assert "died (killed by SIGKILL); its trials were handed back; restarting it" in out, out
    stored, optuna_studies = assert_exactly_once(DB, JOURNAL, budget=16, n_studies=2)
    assert max(measurements(slow_env).values()) == 1
    trials = {t.number: t for t in optuna_studies[name]}
    assert trials[victim.number].state == optuna.trial.TrialState.FAIL
    [retry] = [
        t for t in trials.values() if victim.number in t.system_attrs.get("retry_history", [])
    ]
    # The retry measured the killed trial's config, which is stored once, under the retry's number.
    [kept] = [
        t
        for t in stored
        if t["study_name"] == name and t["config_key"] == victim.user_attrs[CLAIM_ATTR]
    ]
    assert kept["optuna_number"] == retry.number and WORKER_ATTR not in retry.system_attrs


def test_ctrl_c_stops_every_worker_and_says_how_to_resume(workdir, slow_env):
    path = write_job(
        workdir, spaces=SPACE, problems=PROBLEMS, budget={"trials": 200}, sampler="random"
    )
    proc = start_search(workdir, slow_env, path, "--workers", 2, delay=0.1)
    claimed_trial(JOURNAL, proc=proc)
    proc.send_signal(signal.SIGINT)  # the search process alone: it stops its workers
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "Continue with: fa4tune search" in out and "--resume --workers 2" in out
    with ResultsDB.open(DB, create=False) as db:
        assert db.runs()[0]["status"] == "interrupted"
    for trials in studies(JOURNAL).values():  # every worker settled its trials before it left
        assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]


@pytest.mark.parametrize(
    "moment, wait_s",
    [
        ("workers starting", 0.0),
        ("workers starting", 0.2),
        ("workers starting", 0.6),
        ("a worker measuring", 0.0),
    ],
)
def test_ctrl_c_to_the_process_group_prints_no_traceback(workdir, slow_env, moment, wait_s):
    """Ctrl-C from a terminal reaches the search and its workers at once, and the search's SIGTERM
    follows: whether a worker's interpreter is still starting, its handlers being installed, or a
    trial being measured, the search stops quietly with status 130 and settles every trial."""
    path = write_job(
        workdir, spaces=SPACE, problems=PROBLEMS, budget={"trials": 200}, sampler="random"
    )
    for attempt in range(3):
        db, journal = f"a{attempt}.db", str(workdir / f"a{attempt}.optuna.journal")
        proc = start_search(
            workdir, slow_env, path, "--workers", 2, "--db", db, delay=0.1, new_session=True
        )
        lines = []
        if moment == "a worker measuring":
            claimed_trial(journal, proc=proc)
        else:  # said just before the workers are started
            while not lines or "CPU worker processes share run" not in lines[-1]:
                lines.append(proc.stdout.readline())
                assert lines[-1], "".join(lines)
        time.sleep(wait_s)
        os.killpg(proc.pid, signal.SIGINT)
        out = "".join(lines) + proc.communicate(timeout=120)[0]
        assert proc.returncode == 130, out
        assert "Traceback" not in out and "Exception ignored" not in out, out
        assert "Continue with: fa4tune search" in out and "--resume" in out, out
        with ResultsDB.open(db, create=False) as results:
            assert results.runs()[0]["status"] == "interrupted"
            stored = {t["optuna_number"] for t in results.trials() if t["source"] != "confirm"}
        for trials in studies(journal).values():
            assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING], out
            complete = [t.number for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
            assert set(complete) <= stored, out


# ---- PostgreSQL ----------------------------------------------------------------------------------
def test_four_workers_share_each_study_through_postgresql_and_survive_a_kill(
    workdir, slow_env, postgres, hold
):
    db_url, storage_url = postgres
    path = write_job(workdir, spaces=SPACE, problems=ONE_PROBLEM, budget={"trials": 12})
    proc = start_search(
        workdir,
        slow_env,
        path,
        "--workers",
        4,
        "--db",
        db_url,
        "--storage",
        storage_url,
        delay=0.2,
        FA4TUNE_TEST_HOLD=str(hold),
    )
    name, victim = claimed_trial(storage_url, proc=proc)
    os.kill(int(parse_worker(victim.user_attrs[WORKER_ATTR])[1]), signal.SIGKILL)
    hold.unlink()
    out = finish(proc)
    assert "its trials were handed back; restarting it" in out, out
    stored, optuna_studies = assert_exactly_once(
        db_url, storage_url, budget=12, n_studies=1, workers=3
    )
    assert max(measurements(slow_env).values()) == 1
    trials = {t.number: t for t in optuna_studies[name]}
    assert trials[victim.number].state == optuna.trial.TrialState.FAIL
    assert any(victim.number in t.system_attrs.get("retry_history", []) for t in trials.values())
    assert not (
        workdir / "fa4tune-results"
    ).exists()  # nothing local: both databases are on the server


def test_two_hosts_join_one_run_and_the_survivor_finishes_after_the_other_dies(
    workdir, slow_env, postgres, hold
):
    """Two hosts (host names set apart) start together with --resume and join one run; host A is
    killed whole (coordinator and workers) mid-run. Host B cannot see A's processes: Optuna's
    heartbeat finds A's trials stale, they are handed back, and B completes every budget."""
    db_url, storage_url = postgres
    path = write_job(workdir, spaces=SPACE, problems=ONE_PROBLEM, budget={"trials": 12})
    args = (path, "--workers", 2, "--db", db_url, "--storage", storage_url, "--resume")
    # Each host's measurements wait on its own hold file: the trial seen running is running when A
    # is killed, and B cannot use up the budget before A has claimed a trial, however slowly A
    # starts.
    hold_b = hold.with_name("hold-b")
    hold_b.touch()
    host_a = start_search(
        workdir,
        slow_env,
        *args,
        delay=0.3,
        new_session=True,
        FA4TUNE_WORKER_HOST="host-a",
        FA4TUNE_HEARTBEAT_S="1",
        FA4TUNE_TEST_HOLD=str(hold),
    )
    host_b = start_search(
        workdir,
        slow_env,
        *args,
        delay=0.3,
        FA4TUNE_WORKER_HOST="host-b",
        FA4TUNE_HEARTBEAT_S="1",
        FA4TUNE_TEST_HOLD=str(hold_b),
    )
    # Host B's held trials stay running, so look for host A's among them.
    name, victim = claimed_trial(storage_url, proc=host_a, host="host-a")
    assert host_b.poll() is None, host_b.stdout.read()
    os.killpg(host_a.pid, signal.SIGKILL)
    host_a.wait()
    hold_b.unlink()
    out = finish(host_b)
    assert "resuming run 1" in out or "starting a new one" in out
    stored, optuna_studies = assert_exactly_once(db_url, storage_url, budget=12, n_studies=1)
    assert max(measurements(slow_env).values()) == 1
    trials = {t.number: t for t in optuna_studies[name]}
    assert trials[victim.number].state == optuna.trial.TrialState.FAIL
    assert any(victim.number in t.system_attrs.get("retry_history", []) for t in trials.values())
    hosts = {
        t.user_attrs.get(WORKER_ATTR, "").partition(":")[0]
        for ts in optuna_studies.values()
        for t in ts
    }
    assert {"host-a", "host-b"} <= hosts


def test_a_queued_default_keeps_a_budget_slot_without_a_claim():
    """The queued default holds a budget slot, claimed or not: a worker that dies after asking for
    it and before claiming it leaves a copy without a claim, and fresh trials must not take the
    budget's last slot from it (session 62's failure of the survivor test: the budget filled and
    the default was never measured). A queued probe holds none; a claimed queued copy does, and
    a trial being measured does until it is stored."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    study.enqueue_trial({"x": 1}, user_attrs={SOURCE_ATTR: DEFAULT_SOURCE})
    study.enqueue_trial({"x": 2}, user_attrs={SOURCE_ATTR: "probe"})
    study.enqueue_trial({"x": 3}, user_attrs={SOURCE_ATTR: "warm-start", CLAIM_ATTR: "k3"})
    running = study.ask()  # takes the oldest queued trial: the default
    running.suggest_int("x", 0, 9)
    running.set_user_attr(CLAIM_ATTR, "k1")
    shared = SharedStudy(run=None, db=None, name="s", study=study, worker="w")

    def numbers(**kw):
        return sorted(t.number for t in shared.in_flight(lambda found: set(), **kw))

    assert numbers() == [0, 2]  # the default being measured, the claimed copy
    assert numbers(reserved=False) == [0]
    study.tell(running, state=optuna.trial.TrialState.FAIL)  # its worker died before measuring
    # Queued again, without a claim.
    study.enqueue_trial({"x": 1}, user_attrs={SOURCE_ATTR: DEFAULT_SOURCE})
    assert numbers() == [2, 3]
    assert numbers(reserved=False) == []
    assert numbers(exclude=3) == [2]


def test_workers_leave_when_their_coordinator_is_sigkilled(workdir, slow_env, hold):
    """Both workers are held in a measurement (the hold file) when the coordinator is SIGKILLed:
    they must see it go and exit, not search on by themselves."""
    path = write_job(workdir, spaces=SPACE, problems=ONE_PROBLEM, budget={"trials": 12})
    coordinator = start_search(workdir, slow_env, path, "--workers", 2, FA4TUNE_TEST_HOLD=str(hold))
    workers: set[int] = set()
    try:
        workers = claiming_workers(JOURNAL, count=2, proc=coordinator)
        coordinator.kill()
        coordinator.wait()
        assert not still_alive_after(workers, 10), "a worker outlived its killed coordinator"
    finally:
        coordinator.kill()
        kill_processes(workers)


# ---- bad input -----------------------------------------------------------------------------------
def assert_refused(capsys, argv, *fragments):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("fa4tune: error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_bad_worker_options_are_refused_before_anything_is_written(workdir, capsys):
    path = write_job(workdir)
    assert_refused(capsys, ["search", path, "--workers", 0], "--workers must be at least 1")
    assert_refused(
        capsys, ["search", path, "--workers", 2, "--gpus", "0,1"], "either --workers N or --gpus"
    )
    assert_refused(capsys, ["search", path, "--gpus", "0"], "--gpus 0", "model backend")
    with pytest.raises(SystemExit) as exit_:
        main(["search", str(path), "--gpus", "zero"])
    assert (
        exit_.value.code == 2 and "comma-separated list of GPU indices" in capsys.readouterr().err
    )
    assert not (workdir / "fa4tune-results").exists()


def test_a_gpu_that_does_not_exist_is_named(monkeypatch):
    from fa4tune.errors import Fa4tuneError
    from fa4tune.tune import workers

    monkeypatch.setattr(workers, "visible_gpus", lambda: ["0", "1"])
    assert workers.plan_workers(None, [1, 0], "gpu") == ["1", "0"]
    assert workers.plan_workers(2, None, "gpu") == ["0", "1"]
    with pytest.raises(Fa4tuneError, match="GPU 3 does not exist; this host has GPUs 0..1"):
        workers.plan_workers(None, [0, 3], "gpu")
    with pytest.raises(Fa4tuneError, match="GPU 2 does not exist"):
        workers.plan_workers(3, None, "gpu")
    with pytest.raises(Fa4tuneError, match="names a GPU twice"):
        workers.plan_workers(None, [1, 1], "gpu")


def test_unreachable_postgresql_is_one_paragraph_and_nothing_is_written(workdir, capsys):
    import importlib.util

    from pgserver import free_port, unavailable

    if importlib.util.find_spec("psycopg") is None:
        unavailable(
            "the PostgreSQL driver psycopg is not installed (pip install 'fa4tune[postgres]')"
        )
    path = write_job(workdir)
    nowhere = f"postgresql://fa4tune@127.0.0.1:{free_port()}/fa4tune"
    assert_refused(
        capsys,
        ["search", path, "--storage", nowhere, "--workers", 2],
        "cannot use Optuna storage",
        "127.0.0.1",
        "server runs",
    )
    assert_refused(
        capsys, ["search", path, "--db", nowhere], "cannot use results DB", "server runs"
    )
    assert not (workdir / "fa4tune-results").exists()
    secret = nowhere.replace("fa4tune@", "fa4tune:hunter2@")
    assert_refused(capsys, ["search", path, "--db", secret], "cannot use results DB")
    capsys.readouterr()
    code = main(["search", str(path), "--db", secret])
    assert code == 2 and "hunter2" not in capsys.readouterr().err


def test_the_results_db_and_the_storage_must_be_two_databases(workdir, capsys):
    path = write_job(workdir)
    assert_refused(
        capsys,
        ["search", path, "--db", "r.db", "--storage", f"sqlite:///{workdir / 'r.db'}"],
        "the results DB and the Optuna storage are the same database",
    )
    url = "postgresql://u@db.example:5432/tuning"
    assert_refused(capsys, ["search", path, "--db", url, "--storage", url], "two databases")
    assert not (workdir / "r.db").exists()


def test_the_multi_gpu_benchmark_runs_on_cpu_workers(workdir):
    """benchmarks/multi_gpu.py on the cost model (its GPU run is the lead's): both runs, one
    table."""
    job = write_job(
        workdir,
        spaces=SPACE,
        problems=PROBLEMS,
        budget={"trials": 30, "seconds": 600},
        export="t.yaml",
    )
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "multi_gpu.py"),
            "--job",
            str(job),
            "--workers",
            "2",
            "--trials",
            "5",
            "--out",
            str(workdir / "bench"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| bf16-")]
    assert len(rows) == 2 and all(
        "| 5 " in row for row in rows
    )  # both problems, 5 trials in each run
    assert any(
        line.startswith("wall time: 1 = ") and "2 workers = " in line and "speedup" in line
        for line in lines
    )
    timed = (workdir / "bench" / "job.yaml").read_text()
    assert "seconds" not in timed and "export" not in timed and not (workdir / "t.yaml").exists()


def test_the_multi_gpu_benchmark_simulates_gpus_on_a_cpu(workdir):
    """--simulate: the gpu backend's real worker processes, pool and confirmation, with sleeps for
    the GPU (benchmarks/simulated_gpu_worker.py); each run's workers report their time with a trial
    in flight. The run and the best configs its workers store record its L2 flush."""
    job = write_job(workdir, spaces=SPACE, problems=ONE_PROBLEM, budget={"trials": 30})
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    sleeps = {
        "FA4TUNE_SIM_COMPILE_S": "0.05",
        "FA4TUNE_SIM_CHEAP_S": "0.01",
        "FA4TUNE_SIM_FULL_S": "0.02",
    }
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "multi_gpu.py"),
            "--job",
            str(job),
            "--simulate",
            "--gpus",
            "0,1",
            "--trials",
            "4",
            "--compile-workers",
            "2",
            "--out",
            str(workdir / "bench"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path, "FA4TUNE_L2_FLUSH": "dirty", **sleeps},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len([line for line in lines if line.startswith("| bf16-")]) == 1
    assert any(line.startswith("wall time: 1 = ") and "2 GPUs = " in line for line in lines)
    assert len([line for line in lines if line.startswith("one: worker ")]) == 1
    assert 1 <= len([line for line in lines if line.startswith("many: worker ")]) <= 2
    with ResultsDB.open(str(workdir / "bench" / "many.db"), create=False) as db:
        [run] = db.runs()
        assert run["gpu_name"].startswith("simulated") and run["backend"] == "gpu"
        assert run["details"]["l2_flush"] == "dirty"
        best = db.best_configs()
        assert best and all(b.provenance["l2_flush"] == "dirty" for b in best)
    timed = (workdir / "bench" / "job.yaml").read_text()
    assert "simulated_gpu_worker" in timed


def test_one_worker_confirms_a_study_unless_it_died(workdir):
    """The re-timing of a study's best few (gpu backend) is claimed under the study's lock: by one
    worker while it lives, by another once it is dead."""
    import multiprocessing

    from fa4tune.tune.job import load_job
    from fa4tune.tune.run import RunRef
    from fa4tune.tune.sharing import SharedStudy
    from fa4tune.tune.studies import worker_name

    job = load_job(write_job(workdir))
    with ResultsDB.open("r.db") as db:
        run = RunRef(
            job=job,
            run_id=1,
            prefix="p",
            kernel_hash="h",
            target=job.target,
            budget_trials=4,
            budget_seconds=None,
            shared=True,
            l2_flush="none",
        )

        def worker(name):
            return SharedStudy(run, db, "s", None, name)

        dead = multiprocessing.get_context("spawn").Process(target=int)
        dead.start()
        dead.join()
        first, second = worker(worker_name(dead.pid)), worker(worker_name(os.getpid()))
        third = worker(worker_name(os.getppid()))
        assert second.claim_confirmation() and second.claim_confirmation()  # its own claim, again
        assert not third.claim_confirmation()  # the holder lives
        with db.locked("s") as lock:
            lock.set_confirming(first.worker)  # a worker that died holding it
        assert third.claim_confirmation() and not second.claim_confirmation()


def test_compile_workers_are_shared_by_the_search_workers_of_a_host(monkeypatch):
    from fa4tune.measure.gpu import GpuOptions

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert [GpuOptions.auto_compile_workers(n) for n in (1, 2, 4, 8)] == [8, 6, 2, 0]
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert GpuOptions.auto_compile_workers(1) == 0 and GpuOptions().workers() == 0


def test_a_pid_taken_over_by_a_later_process_is_a_dead_worker(monkeypatch):
    """A search killed and started again in a container gets the same pid (1, say): its own old
    trials must still count as a dead worker's, or a resume waits for them for ever."""
    from fa4tune.tune import studies

    me = studies.worker_name()
    host, pid, identity = studies.parse_worker(me)
    assert (host, int(pid)) == (studies.this_host(), os.getpid())
    if identity is None:
        pytest.skip("no /proc: workers are named by host and pid only")
    assert not studies.worker_gone(me)
    boot, _, start = identity.partition(".")
    assert studies.worker_gone(
        f"{host}:{pid}:{boot}.{int(start) - 1}"
    )  # this pid, an earlier process
    assert not studies.worker_gone(f"{host}:{pid}")  # a name of an earlier fa4tune: the pid lives
    assert studies.parse_worker(f"{host}:{pid}") == (host, pid, None)
    assert not studies.worker_gone(f"elsewhere:{pid}:{identity}")  # another host's: not judged here
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    named = studies.worker_name(child.pid)  # while it may still run
    deadline = time.monotonic() + 30
    while studies._stat_fields(child.pid)[0] != "Z":  # exited, not yet reaped: a zombie
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    assert studies.worker_gone(named) and studies.worker_gone(f"{host}:{child.pid}")
    child.wait()
    assert studies.worker_gone(named)  # reaped: no such process


def test_trials_measured_after_a_confirmation_by_another_host_are_confirmed_too(
    workdir, monkeypatch
):
    """Host A searched and confirmed; host B resumes the study with a larger budget. A's claim on
    the confirmation must not outlive it (another host's worker is never known dead here), or B's
    trials are never re-timed and, where only confirmations store a best, never become best."""
    from fa4tune.measure.model import CostModelBackend
    from fa4tune.target import get_target
    from fa4tune.tune.job import load_job
    from fa4tune.tune.search import run_search

    class Confirming(CostModelBackend):  # like the gpu backend: a best only through a confirmation
        confirms_best = True
        confirm_count = 3
        calls = 0

        def confirm(self, problem, configs):
            Confirming.calls += 1
            return [self.measure(problem, self.kernel.config(c)) for c in configs]

    job = load_job(
        write_job(
            workdir,
            spaces={"tiles": {}, "pipeline": {}, "exp2": {}, "softmax": {}},
            budget={"trials": 4},
            warm_start=0,
        )
    )
    for host, trials, resume in (("host-a", 4, False), ("host-b", 40, True)):
        monkeypatch.setenv("FA4TUNE_WORKER_HOST", host)
        before = Confirming.calls
        run_search(
            job,
            backend=Confirming(job.kernel, get_target("H200")),
            trials=trials,
            resume=resume,
            say=lambda *a: None,
        )
        assert Confirming.calls == before + 1, f"{host} did not confirm"
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        name = db.trials()[0]["study_name"]
        assert db.confirmed(name)
        fastest = db.top_trials(name, 1)[0]["time_ms"]
        assert db.best_configs()[0].time_ms <= fastest * 1.0001
