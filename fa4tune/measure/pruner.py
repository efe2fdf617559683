"""The pruner of a multi-fidelity backend: Optuna's verdict on a candidate's cheap first timing."""

from __future__ import annotations


def make_pruner(margin: float, min_completed: int = 3):
    """An Optuna pruner for cheap first measurements: it stops a candidate whose first (cheap) value
    is more than `margin` above the best completed value so far, once `min_completed` candidates
    have completed. The cheap timing is noisy (few runs), so only a clearly slower one is
    stopped."""
    from optuna.pruners import BasePruner
    from optuna.trial import TrialState

    class SlowerThanBestPruner(BasePruner):
        def __init__(self) -> None:
            self.margin = margin
            self.min_completed = min_completed

        def best(self, study) -> float | None:
            completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            # Distinct configs: a repeat of a measured config is told COMPLETE with its stored
            # value, and is no second opinion on how fast the space can be.
            distinct = {
                tuple(sorted(t.params.items(), key=lambda item: item[0])) for t in completed
            }
            return min(t.value for t in completed) if len(distinct) >= self.min_completed else None

        def prune(self, study, trial) -> bool:
            step = trial.last_step
            best = self.best(study)
            if step is None or best is None:
                return False
            return trial.intermediate_values[step] > best * (1.0 + self.margin)

        def explain(self, study, value: float) -> str:
            return (
                f"stopped after the cheap timing: {value:.4g} ms is more than {self.margin:.0%} "
                f"above the best so far ({self.best(study):.4g} ms)"
            )

    return SlowerThanBestPruner()
