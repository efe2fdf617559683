"""A grid search's points in a study that several workers share. The grid sampler asks for each
point once and counts a point visited once a trial of it is finished, however it finished: the
search must see for itself when every point is measured (GridState), and queue again a point that
failed unmeasured (Grid.requeue), or it would never be proposed again."""

from __future__ import annotations

import math
from enum import Enum

from .studies import queued_params

# Optuna is imported where it is used, as in studies.py.

MAX_GRID_REQUEUES = 3  # a grid point that failed unmeasured this often is not queued again


class GridState(Enum):
    """What is left of a grid search's points."""

    OPEN = "open"  # a point is queued, or was never asked for (a search of another sampler, too)
    BUSY = "busy"  # every point was asked for, and the last ones are being measured
    DONE = "done"  # each measured, pruned, or failed unmeasured past its requeues


class Grid:
    """The points of one problem's grid, as the composed space gives them (`points`: each
    parameter's values), in the study the grid sampler (studies.grid_sampler_class) proposes them
    to. `storage` and `study_id`: the study's Optuna storage, for reads that need no trial list."""

    def __init__(self, study, storage, study_id: int, points: dict[str, list]) -> None:
        self.study, self.storage, self.study_id = study, storage, study_id
        self.names = set(points)
        self.size = math.prod(len(values) for values in points.values())

    def state(self) -> GridState:
        """OPEN while a point is queued or was never asked for, BUSY while the last ones are being
        measured, else DONE. Asked for more then, the grid sampler proposes a point again."""
        import optuna

        trial_state = optuna.trial.TrialState
        if self.storage.get_n_trials(self.study_id) < self.size:
            return GridState.OPEN  # not every point asked for yet (a count, not a read of trials)
        trials = self.study.get_trials(deepcopy=False)
        asked = {
            t.system_attrs["grid_id"]
            for t in trials
            if "grid_id" in t.system_attrs and t.state != trial_state.WAITING
        }
        if len(asked) < self.size or any(t.state == trial_state.WAITING for t in trials):
            return GridState.OPEN
        if any(t.state == trial_state.RUNNING for t in trials):
            return GridState.BUSY
        return GridState.DONE

    def point(self, trial) -> dict | None:
        """The point of a trial: the params it was queued with or suggested, when they are a whole
        point; else the one its grid id names (cut short while suggesting, or a retry's copy: every
        session shuffles the grid alike); None without one."""
        params = queued_params(trial)
        if set(params) == self.names:
            return params
        return self.study.sampler.point(trial.system_attrs.get("grid_id"))

    def requeue(self, number: int) -> None:
        """Queue again the point of trial `number`, which just failed unmeasured, unless it is
        queued already or failed unmeasured more than MAX_GRID_REQUEUES times (then it fails for
        its own reasons). The caller holds the study's lock."""
        import optuna

        trial_state = optuna.trial.TrialState
        params = self.point(
            self.storage.get_trial(
                self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
            )
        )
        if params is None:
            return
        trials = self.study.get_trials(deepcopy=False)
        # Not enqueue_trial's skip_if_exists: the failed trial itself has these params.
        if any(t.state == trial_state.WAITING and self.point(t) == params for t in trials):
            return
        failed = sum(t.state == trial_state.FAIL and self.point(t) == params for t in trials)
        if failed > MAX_GRID_REQUEUES:
            return
        self.study.enqueue_trial(params)
