"""What fa4tune uses of Optuna beyond its public API, in studies.grid_sampler_class (written against
Optuna 5.0.0), and the heartbeat it keeps through the storages' public methods. A failure here means
the installed Optuna changed under that adapter: fix the adapter, not the search."""

import itertools
import time
import warnings

import optuna
import pytest

from fa4tune.tune.studies import Heartbeat, grid_sampler_class, heartbeat_interval, open_storage

GRID = {"tile_n": [64, 96, 128, 160], "tile_m": [128, 192], "stages": [1, 2, 3]}
WRITTEN_AGAINST = "5.0.0"


def changed(what: str) -> str:
    return (
        f"Optuna {optuna.__version__}'s GridSampler changed ({what}); "
        f"fa4tune.tune.studies.grid_sampler_class was written against Optuna {WRITTEN_AGAINST}"
    )


def grid_sampler(seed: int, grid_seed: int):
    return grid_sampler_class()(GRID, seed=seed, grid_seed=grid_seed)


def ask_all(sampler) -> list:
    """Every point of the grid asked for and told, in the sampler's order (the frozen trials)."""
    study = optuna.create_study(sampler=sampler)
    for _ in range(len(list(itertools.product(*GRID.values())))):
        trial = study.ask()
        for name in GRID:
            trial.suggest_categorical(name, GRID[name])
        study.tell(trial, 1.0)  # the last point too: Optuna's own after_trial would stop the study
    return study.get_trials(deepcopy=False)


def test_the_grid_samplers_private_parts_are_where_the_adapter_reads_them():
    sampler = grid_sampler(seed=1, grid_seed=2)
    points = list(itertools.product(*(GRID[k] for k in sorted(GRID))))
    assert isinstance(getattr(sampler, "_param_names", None), list), changed("no _param_names")
    assert sampler._param_names == sorted(GRID), changed("_param_names is not the sorted names")
    assert isinstance(getattr(sampler, "_all_grids", None), list), changed("no _all_grids")
    assert sorted(sampler._all_grids) == sorted(points), changed("_all_grids is not the points")
    rng = getattr(getattr(sampler, "_rng", None), "rng", None)
    assert hasattr(rng, "seed") and hasattr(rng, "choice"), changed("no _rng.rng random state")
    assert sampler.point(None) is None and sampler.point(len(points)) is None


def test_a_trials_grid_id_names_the_point_it_suggested():
    trials = ask_all(grid_sampler(seed=1, grid_seed=2))
    assert all("grid_id" in t.system_attrs for t in trials), changed("no grid_id system attribute")
    sampler = grid_sampler(seed=7, grid_seed=2)  # another worker's sampler of the same study
    for trial in trials:
        assert sampler.point(trial.system_attrs["grid_id"]) == trial.params, changed(
            "a grid id no longer indexes the shuffled points"
        )
    assert len({tuple(sorted(t.params.items())) for t in trials}) == len(trials)


def test_the_grid_seed_shuffles_the_grid_and_the_seed_chooses_among_its_points():
    size = len(list(itertools.product(*GRID.values())))
    shared = [grid_sampler(seed=seed, grid_seed=2) for seed in (1, 7)]
    assert [shared[0].point(i) for i in range(size)] == [shared[1].point(i) for i in range(size)], (
        changed("the seed of its choices shuffles the grid too")
    )
    other = grid_sampler(seed=1, grid_seed=3)
    assert [other.point(i) for i in range(size)] != [shared[0].point(i) for i in range(size)], (
        changed("its seed no longer shuffles the grid")
    )

    def order(seed):
        """The grid ids it picks once the first trial numbers, which name their grid ids
        themselves, went to queued trials (as the default, the warm start and the probes do)."""
        study = optuna.create_study(sampler=grid_sampler(seed=seed, grid_seed=2))
        for _ in range(size):
            study.enqueue_trial({name: values[0] for name, values in GRID.items()})
        picked = []
        for n in range(size + 6):
            trial = study.ask()
            for name in GRID:
                trial.suggest_categorical(name, GRID[name])
            study.tell(trial, 1.0)
            if n >= size:
                picked.append(study.trials[-1].system_attrs["grid_id"])
        return picked

    assert order(1) == order(1), changed("a seeded sampler's choices are not repeatable")
    assert order(1) != order(7), changed("the seed no longer chooses among the unvisited points")


def test_a_heartbeat_is_recorded_through_the_storages_public_methods(tmp_path, monkeypatch):
    """A trial whose heartbeat stopped goes stale after the grace period; one that never had a
    heartbeat does not (Optuna judges only trials with one)."""
    assert heartbeat_interval(open_storage(str(tmp_path / "s.journal"))) is None
    monkeypatch.setenv("FA4TUNE_HEARTBEAT_S", "1")  # a grace of 3 s (studies.HEARTBEAT_GRACE)
    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat=True)
    assert heartbeat_interval(storage) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(study_name="s", storage=storage)
        beating, silent = study.ask(), study.ask()
    study_id = storage.get_study_id_from_name("s")
    heartbeat = Heartbeat(storage, study_id, beating.number).start()
    heartbeat.join()
    assert heartbeat.trial_id == storage.get_trial_id_from_study_id_trial_number(study_id, 0)
    time.sleep(4.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert (states[beating.number], states[silent.number]) == (
        optuna.trial.TrialState.FAIL,
        optuna.trial.TrialState.RUNNING,
    ), states


@pytest.mark.parametrize("location", ["journal", "sqlite"])
def test_a_heartbeat_on_a_storage_without_heartbeats_does_nothing(tmp_path, location):
    storage = open_storage(
        str(tmp_path / "s.journal")
        if location == "journal"
        else f"sqlite:///{tmp_path / 'optuna.db'}"
    )
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    heartbeat = Heartbeat(storage, storage.get_study_id_from_name("s"), trial.number).start()
    assert heartbeat.thread is None and heartbeat.trial_id is None
    heartbeat.join()
