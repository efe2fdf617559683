import itertools

import pytest
from conftest import COLLAPSED_GRID, write_job

from fa4tune.db import ResultsDB, config_key
from fa4tune.errors import JobError
from fa4tune.kernels import get_kernel
from fa4tune.measure.model import CostModelBackend
from fa4tune.problem import Problem
from fa4tune.space import compose
from fa4tune.target import get_target
from fa4tune.tune.job import load_job
from fa4tune.tune.search import run_search
from fa4tune.tune.studies import open_storage

KERNEL = get_kernel()
H200 = get_target("H200")
quiet = lambda *a, **k: None  # noqa: E731


class SpyBackend(CostModelBackend):
    """The cost model, remembering every config it was asked to measure."""

    def __init__(self, kernel, target):
        super().__init__(kernel, target)
        self.seen = []

    def measure(self, problem, config):
        self.seen.append((problem, config))
        return super().measure(problem, config)


def exhaustive_optimum(job):
    """The model's best over the job's whole (small) space, by brute force."""
    space = compose(job.kernel, job.spaces)
    problem = job.problems[0]
    grid = space.grid(problem, H200)
    backend = CostModelBackend(job.kernel, H200)
    best = None
    for values in itertools.product(*grid.values()):
        config = space.full_config(problem, H200, dict(zip(grid, values)))
        if space.check(problem, config, H200):
            continue
        t = backend.measure(problem, KERNEL.config(config)).time_ms
        if best is None or t < best[0]:
            best = (t, config)
    return best, len(list(itertools.product(*grid.values())))


SMALL_SPACE = {
    "tiles": {"tile_m": [128, 192], "tile_n": [64, 96, 128, 160, 192]},
    "pipeline": {
        "num_stages": [1, 2, 3, 4],
        "persistent": [False],
        "wg_epilogue": [False],
        "q_stages": [1],
    },
    "exp2": {"poly_degree": [3], "emu_share": [0.0, 0.125, 0.25]},
    "softmax": {"rescale_threshold": [0.0, 4.0], "rescale_branch": [True], "lazy_max": [False]},
}


def test_search_reaches_the_exhaustive_optimum_of_a_small_space(workdir):
    path = write_job(
        workdir,
        spaces=SMALL_SPACE,
        sampler="tpe",
        budget={"trials": 40},
        problems=[{"head_dim": 64, "seqlen_q": 4096, "batch": 2, "nheads_q": 16}],
    )
    job = load_job(path)
    (best_ms, best_config), size = exhaustive_optimum(job)
    # rescale_threshold: the two listed values plus the default config's 8.0, which a space always
    # keeps; persistent and lazy_max: the listed False plus the default's True.
    assert size == 2 * 5 * 4 * 2 * 2 * 3 * 3 * 2 * 2  # the budget is 40 of 5760 configs
    summary = run_search(job, say=quiet)
    result = summary.results[0]
    assert result.measured <= 40
    assert result.best_ms == pytest.approx(
        best_ms
    )  # ties (equally fast configs) may differ in knobs
    assert CostModelBackend(KERNEL, H200).measure(
        job.problems[0], KERNEL.config(result.best_config)
    ).time_ms == pytest.approx(best_ms)


def test_grid_sampler_exhausts_a_tiny_space(workdir):
    path = write_job(
        workdir,
        spaces={
            "tiles": {"tile_n": [64, 128]},
            "pipeline": {"num_stages": [2, 3], "intra_wg_overlap": [True], "wg_pingpong": [True]},
        },
        sampler="grid",
        budget={"trials": 100},
    )
    job = load_job(path)
    (best_ms, _), size = exhaustive_optimum(job)
    result = run_search(job, say=quiet).results[0]
    assert "exhausted" in result.stopped
    assert result.measured + result.pruned == size
    assert result.best_ms == pytest.approx(best_ms)


def test_a_cost_model_run_flags_its_rejected_configs_as_estimates_too(workdir):
    """Every trial of a cost-model run is flagged as an estimate, the configs rejected before
    compiling included (a flag of False would count them among the GPU's measurements)."""
    path = write_job(
        workdir,
        spaces={
            "tiles": {"tile_n": [128]},
            "pipeline": {
                "num_stages": [2],
                "intra_wg_overlap": [True],
                "wg_pingpong": [True],
                "persistent": [False, True],
                "wg_epilogue": [True],
            },
        },
        sampler="grid",
        budget={"trials": 10},
    )
    result = run_search(load_job(path), say=quiet).results[0]
    assert result.pruned >= 1 and result.measured >= 1  # wg_epilogue needs persistent CTAs
    with ResultsDB.open(str(workdir / "fa4tune-results" / "results.db"), create=False) as db:
        trials = db.trials()
    assert {t["status"] for t in trials} == {"ok", "pruned"} and all(
        t["is_estimate"] for t in trials
    )


@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_grid_search_asks_for_each_point_once_and_ends_when_all_were_tried(workdir, lookahead):
    """Once every point was asked for, the grid sampler proposes visited ones again; with points
    that are one config the stored configs never reach the space's size, and the repeats went on
    until they read as convergence. Candidates asked ahead (lookahead) must not outrun the grid."""
    import optuna

    job = load_job(
        write_job(workdir, spaces=COLLAPSED_GRID, sampler="grid", budget={"trials": 100})
    )
    (best_ms, _), size = exhaustive_optimum(job)
    spy = SpyBackend(KERNEL, H200)
    spy.lookahead = lookahead
    summary = run_search(job, backend=spy, say=quiet)
    result = summary.results[0]
    assert result.stopped == f"grid exhausted (all {size} points tried)"
    assert result.best_ms == pytest.approx(best_ms)
    assert len(spy.seen) == result.measured == len({config_key(c) for _, c in spy.seen})
    trials = optuna.load_study(
        study_name=result.study_name, storage=open_storage(summary.storage)
    ).trials
    grid_ids = [t.system_attrs["grid_id"] for t in trials if "grid_id" in t.system_attrs]
    assert sorted(grid_ids) == list(range(size)), "a grid point was proposed twice, or never"


def test_infeasible_configs_never_reach_the_backend(workdir):
    problems = [{"head_dim": 256, "seqlen_q": 2048, "batch": 2, "nheads_q": 8}]
    # With the softmax space too: without it every emulated candidate is refused (the default's lazy
    # max needs the MUFU's exponentials), and hdim 256 then has only 18 configs to measure.
    path = write_job(
        workdir,
        spaces=["tiles", "pipeline", "exp2", "softmax"],
        problems=problems,
        budget={"trials": 25},
    )
    job = load_job(path)
    spy = SpyBackend(KERNEL, H200)
    summary = run_search(job, backend=spy, say=quiet)
    space = compose(KERNEL, job.spaces)
    problem = job.problems[0]
    assert len(spy.seen) == 25 == summary.results[0].measured
    for _, config in spy.seen:
        assert space.check(problem, config, H200) == []
        assert KERNEL.infeasible_reasons(problem, config, H200) == []
    with ResultsDB.open(summary.db_location, create=False) as db:
        trials = db.trials()
    pruned = [t for t in trials if t["status"] == "pruned"]
    assert pruned, "hdim 256 with deep pipelines must hit the shared-memory limit"
    assert all(t["reason"] and t["time_ms"] is None for t in pruned)
    assert {t["config_key"] for t in pruned}.isdisjoint(
        {t["config_key"] for t in trials if t["status"] == "ok"}
    )
    # Pruned suggestions do not use up the budget: 25 configs were measured on top of them.
    assert summary.results[0].pruned == len(pruned)


def test_emulation_searched_without_the_softmax_space_is_refused_with_the_lazy_max_named(workdir):
    """The README's warning: the defaults take the lazy max, which refuses emulated exponentials,
    and without the softmax space nothing turns it off, so every emulated candidate is refused, by
    name."""
    problems = [{"head_dim": 128, "seqlen_q": 2048, "batch": 2, "nheads_q": 8}]
    path = write_job(workdir, spaces={"exp2": {}}, problems=problems, budget={"trials": 10})
    summary = run_search(load_job(path), say=quiet)
    with ResultsDB.open(summary.db_location, create=False) as db:
        trials = db.trials()
    emulated = [t for t in trials if t["config"]["emu_share"] > 0]
    assert emulated and all(
        t["status"] == "pruned" and "lazy_max with emu_share" in t["reason"] for t in emulated
    )
    assert {t["config"]["emu_share"] for t in trials if t["status"] == "ok"} == {0.0}


def test_default_is_measured_first_and_neighbours_warm_start_the_next_problem(workdir):
    first = write_job(
        workdir,
        name="first",
        spaces=SMALL_SPACE,
        budget={"trials": 30},
        problems=[{"head_dim": 64, "seqlen_q": 4096, "batch": 2, "nheads_q": 16}],
    )
    summary = run_search(load_job(first), say=quiet)
    with ResultsDB.open(summary.db_location, create=False) as db:
        trials = db.trials()
        best = db.best_configs()[0]
    problem = Problem(head_dim=64, seqlen_q=4096, batch=2, nheads_q=16)
    default = compose(KERNEL, load_job(first).spaces).default_config(problem, H200)
    assert trials[0]["source"] == "default" and trials[0]["config"] == default.to_dict()
    assert summary.results[0].default_ms == trials[0]["time_ms"]

    second = write_job(
        workdir,
        name="second",
        spaces=SMALL_SPACE,
        budget={"trials": 3},
        warm_start=2,
        problems=[{"head_dim": 64, "seqlen_q": 8192, "batch": 1, "nheads_q": 16}],
    )
    run_search(load_job(second), say=quiet)
    with ResultsDB.open(summary.db_location, create=False) as db:
        new = [t for t in db.trials() if t["run_id"] == 2]
    assert [t["source"] for t in new[:2]] == ["default", "warm-start"]
    assert new[1]["config"] == best.config

    # fp16 of the first problem's shape: the bf16 best of that very shape starts it (the sibling
    # dtype).
    third = write_job(
        workdir,
        name="third",
        spaces=SMALL_SPACE,
        budget={"trials": 3},
        warm_start=1,
        problems=[{"dtype": "fp16", "head_dim": 64, "seqlen_q": 4096, "batch": 2, "nheads_q": 16}],
    )
    run_search(load_job(third), say=quiet)
    with ResultsDB.open(summary.db_location, create=False) as db:
        new = [t for t in db.trials() if t["run_id"] == 3]
    assert [t["source"] for t in new[:2]] == ["default", "warm-start"]
    assert new[1]["config"] == best.config and best.problem_key.startswith("bf16-")


def test_search_with_an_entry_point_plugin(workdir, entry_point_plugin):
    from fa4tune_testplugin import REJECTED

    path = write_job(
        workdir, spaces={"tiles": {}, "even_stages": {}}, sampler="random", budget={"trials": 10}
    )
    summary = run_search(load_job(path), say=quiet)
    with ResultsDB.open(summary.db_location, create=False) as db:
        trials = db.trials()
    assert {t["config"]["num_stages"] for t in trials if t["status"] == "ok"} <= {2, 4}
    assert any(REJECTED in (t["reason"] or "") for t in trials)
    assert summary.results[0].measured == 10


def test_time_budget_stops_a_problem(workdir):
    path = write_job(
        workdir,
        spaces=["tiles", "pipeline", "exp2", "softmax"],
        budget={"seconds": 0.5},
        sampler="random",
    )
    result = run_search(load_job(path), say=quiet).results[0]
    assert "time budget" in result.stopped and result.measured >= 1


def test_repeated_suggestions_are_not_measured_twice(workdir):
    path = write_job(workdir, spaces={"tiles": {"tile_n": [128, 144]}}, budget={"trials": 50})
    summary = run_search(load_job(path), say=quiet)
    with ResultsDB.open(summary.db_location, create=False) as db:
        keys = [t["config_key"] for t in db.trials()]
    assert len(keys) == len(set(keys)) <= 8  # tile_m 64, 128, 192, 256 x tile_n 128, 144
    assert summary.results[0].stopped


def test_backend_selection_by_name(workdir):
    from fa4tune.errors import BackendError
    from fa4tune.measure.base import cuda_available, resolve_backend_name

    said = []
    if not cuda_available():
        assert resolve_backend_name("auto", announce=said.append) == "model"
        assert "no CUDA GPU" in said[0] and "estimates" in said[0]
        job = load_job(write_job(workdir, backend="gpu"))
        with pytest.raises(BackendError, match="no CUDA GPU"):
            run_search(job, say=quiet)
        assert not (workdir / "fa4tune-results").exists()
    with pytest.raises(BackendError, match="known backends: auto, model, gpu"):
        resolve_backend_name("fpga")


def test_optuna_storage_can_be_an_rdb_url(workdir):
    import optuna

    url = f"sqlite:///{workdir / 'optuna.sqlite'}"
    summary = run_search(load_job(write_job(workdir, budget={"trials": 4})), storage=url, say=quiet)
    assert summary.storage == url
    [study] = optuna.get_all_study_summaries(url)
    assert study.study_name == summary.results[0].study_name and study.n_trials >= 4
    assert not (workdir / "fa4tune-results" / "results.optuna.journal").exists()


def test_opening_an_rdb_storage_retries_a_lost_schema_race_and_nothing_else(workdir, monkeypatch):
    """Two hosts that open one PostgreSQL storage at once may both create Optuna's tables; the loser
    gets a duplicate-key error from the catalog and must open it again, not fail the join. Any
    other error still fails at once, and a race lost every time fails after the retries."""
    import optuna
    from sqlalchemy.exc import IntegrityError

    from fa4tune.errors import StorageError
    from fa4tune.tune import studies

    monkeypatch.setattr(studies.time, "sleep", lambda s: None)
    real = optuna.storages.RDBStorage
    race = IntegrityError(
        "CREATE TABLE studies",
        {},
        Exception('duplicate key value violates unique constraint "pg_type_typname_nsp_index"'),
    )
    calls = []

    def flaky(url, *args, fails=1, error=race, **kwargs):
        calls.append(url)
        if len(calls) <= fails:
            raise error
        return real(url, *args, **kwargs)

    url = f"sqlite:///{workdir / 'optuna.sqlite'}"
    monkeypatch.setattr(optuna.storages, "RDBStorage", flaky)
    assert isinstance(studies.open_storage(url), real) and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(
        optuna.storages, "RDBStorage", lambda url, *a, **k: flaky(url, *a, fails=99, **k)
    )
    with pytest.raises(StorageError, match="pg_type_typname_nsp_index"):
        studies.open_storage(url)
    assert len(calls) == studies.SCHEMA_RACE_ATTEMPTS
    calls.clear()
    other = IntegrityError(
        "INSERT", {}, Exception("null value in column violates not-null constraint")
    )
    monkeypatch.setattr(
        optuna.storages,
        "RDBStorage",
        lambda url, *a, **k: flaky(url, *a, fails=99, error=other, **k),
    )
    with pytest.raises(StorageError, match="not-null"):
        studies.open_storage(url)
    assert len(calls) == 1


def test_probes_follow_the_default_and_a_bad_count_is_refused(workdir):
    job = write_job(
        workdir,
        name="probed",
        spaces=SMALL_SPACE,
        budget={"trials": 5},
        probes=3,
        problems=[{"head_dim": 64, "seqlen_q": 4096, "batch": 2, "nheads_q": 16}],
    )
    summary = run_search(load_job(job), say=quiet)
    with ResultsDB.open(summary.db_location, create=False) as db:
        trials = db.trials()
    problem = Problem(head_dim=64, seqlen_q=4096, batch=2, nheads_q=16)
    space = compose(KERNEL, load_job(job).spaces)
    expected = [
        space.full_config(problem, H200, p).to_dict() for p in space.probes(problem, H200, 3)
    ]
    assert [t["source"] for t in trials[:4]] == ["default", "probe", "probe", "probe"]
    assert [t["config"] for t in trials[1:4]] == expected
    bad = write_job(workdir, name="bad", probes=-1)
    with pytest.raises(JobError, match="probes"):
        load_job(bad)


def test_results_db_and_storage_must_be_two_databases(tmp_path):
    from fa4tune.errors import StorageError
    from fa4tune.tune.search import _check_apart

    db = str(tmp_path / "r.db")
    with pytest.raises(StorageError, match="the same database"):
        _check_apart(db, f"sqlite:///{db}")
    _check_apart(db, f"sqlite:///{tmp_path / 'optuna.db'}")
    _check_apart(db, "sqlite:///:memory:")  # no file: apart (it raised AttributeError)


def test_the_pruner_waits_for_distinct_configs_not_repeats():
    """A repeat of a measured config is told COMPLETE with its stored value: three of one config are
    not three opinions on how fast the space can be."""
    import optuna

    from fa4tune.measure.pruner import make_pruner

    pruner = make_pruner(0.1, min_completed=3)
    study = optuna.create_study(pruner=pruner)
    for value in (1.0, 1.0, 1.0):
        study.enqueue_trial({"x": 1})
        trial = study.ask()
        trial.suggest_int("x", 0, 9)
        study.tell(trial, value)
    assert pruner.best(study) is None
    for x, value in ((2, 1.5), (3, 0.9)):
        study.enqueue_trial({"x": x})
        trial = study.ask()
        trial.suggest_int("x", 0, 9)
        study.tell(trial, value)
    assert pruner.best(study) == 0.9
