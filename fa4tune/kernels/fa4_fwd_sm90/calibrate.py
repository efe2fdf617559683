"""Fit the cost model's assumptions to measurements: the trials a GPU search stored.

    samples = samples_from_db(db, kernel="fa4_fwd_sm90", target="H200", run_id=8)
    fitted, report = fit(samples, get_target("H200"), trials=300)

A sample is one measured candidate (problem, config, median ms, and whether that is the full
timing or the pruner's cheap one, 10 runs, which a stopped candidate has alone). The fit minimises
the mean over problems of the mean squared log error of the model's times over all samples, so that
every problem weighs the same however many candidates its search measured; it moves only the
assumptions in FITTED (the softmax side's three stay at the design notes' microbenchmark).
`evaluate` says how well a set of assumptions ranks each problem's fully timed candidates (cheap
timings can be several percent off): the rank correlation, and the regret of trusting the model,
i.e. how much slower the candidate the model ranks first measured than the best one measured
(averaged over the candidates the model ties for first).

Samples travel as JSON (`save_samples` / `load_samples`): one problem per entry, its candidates as
knob-value rows under a shared list of knob names, then the time and 1 for a full timing, 0 for a
cheap one."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ...problem import Problem
from .. import get_kernel
from .cost_model import CostModel, ModelAssumptions

# The assumptions a fit moves, with the range it searches (log-uniform where marked).
FITTED = {
    "tensor_efficiency_scale": (
        0.9,
        1.32,
        False,
    ),  # 1.32: the H200's measured rate times it is the peak
    "overlap_norm_both": (1.0, 6.0, False),
    "overlap_norm_one": (1.0, 4.0, False),
    "overlap_norm_none": (1.0, 2.5, False),
    "overlap_norm_per_extra_warpgroup": (0.0, 2.0, False),
    "load_latency_clk": (200.0, 4000.0, True),
    "l2_bytes_per_clk_per_sm": (16.0, 256.0, True),
    "step_overhead_clk": (1.0, 3000.0, True),
    "cta_overhead_clk": (10.0, 20000.0, True),
    "emulation_kernel_extra_ops": (0.0, 16.0, False),
    "single_stage_exposed_fetch": (0.0, 1.0, False),
}
MEASURED_STATUSES = ("ok", "stopped")  # stopped: the pruner's cheap timing, still a measurement


class CalibrationError(ValueError):
    pass


@dataclass(frozen=True)
class Sample:
    problem: object  # Problem
    config: object  # the kernel's config
    time_ms: float
    full: bool = True  # False: the pruner's cheap timing (a stopped candidate)


# ---- where samples come from --------------------------------------------------------------------
def samples_from_db(
    db, *, kernel: str, target: str, run_id: int | None = None, kernel_hash: str | None = None
) -> list[Sample]:
    """The measured candidates of `kernel` on `target` stored in a results DB (one run, or every run
    of one kernel hash, or all), confirmation re-timings left out (they repeat a candidate)."""
    spec = get_kernel(kernel)
    samples = []
    for row in db.trials(kernel=kernel, target=target, run_id=run_id, confirmations=False):
        if row["status"] not in MEASURED_STATUSES or row["is_estimate"]:
            continue
        if kernel_hash is not None and row["kernel_hash"] != kernel_hash:
            continue
        if not row["time_ms"] or row["time_ms"] <= 0:
            continue
        try:
            config = spec.config(row["config"]).canonical()
        except spec.config_error:
            continue  # a knob this kernel no longer has
        samples.append(
            Sample(
                Problem.from_dict(row["problem"]),
                config,
                float(row["time_ms"]),
                row["status"] == "ok",
            )
        )
    return samples


def _by_problem(samples: list[Sample]) -> dict[str, list[Sample]]:
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.problem.key()].append(s)
    return groups


def save_samples(path: str | Path, samples: list[Sample], note: str = "") -> None:
    by_problem = _by_problem(samples)
    knobs = sorted({k for s in samples for k in s.config.to_dict()})
    document = {
        "note": note,
        "knobs": knobs,
        "problems": [
            {
                "problem": group[0].problem.to_dict(),
                "trials": [
                    [s.config.to_dict().get(k) for k in knobs] + [round(s.time_ms, 6), int(s.full)]
                    for s in group
                ],
            }
            for _, group in sorted(by_problem.items())
        ],
    }
    text = json.dumps(document, separators=(",", ":"))
    # One candidate per line: readable in a diff.
    Path(path).write_text(text.replace("],[", "],\n[") + "\n")


def load_samples(path: str | Path, kernel: str = "fa4_fwd_sm90") -> list[Sample]:
    spec = get_kernel(kernel)
    try:
        document = json.loads(Path(path).read_text())
        knobs = document["knobs"]
        samples = []
        for entry in document["problems"]:
            problem = Problem.from_dict(entry["problem"])
            for row in entry["trials"]:
                if len(row) != len(knobs) + 2:
                    raise ValueError(
                        f"a row of {len(row)} values for {len(knobs)} knobs, the time and the flag"
                    )
                values = dict(zip(knobs, row[: len(knobs)]))
                samples.append(
                    Sample(problem, spec.config(values).canonical(), float(row[-2]), bool(row[-1]))
                )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CalibrationError(f"cannot read samples from {path}: {exc}") from None
    return samples


# ---- how well a model fits ----------------------------------------------------------------------
def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 0.0


@dataclass(frozen=True)
class ProblemFit:
    problem_key: str
    candidates: int  # all samples of the problem
    timed: int  # of them fully timed: what the rank correlation and the regret are over
    rank_correlation: float  # Spearman, model times against measured times
    regret: (
        float  # measured time of the model's first choice / best measured - 1 (ties: their mean)
    )
    log_error: float  # root mean squared log(model / measured), all samples
    scale: float  # geometric mean of measured / model, all samples


def evaluate(assumptions: ModelAssumptions, samples: list[Sample], target) -> list[ProblemFit]:
    model = CostModel(target, assumptions)
    fits = []
    for key, group in sorted(_by_problem(samples).items()):
        predicted = [model.time_s(s.config, s.problem)[0] * 1e3 for s in group]
        logs = [math.log(p / s.time_ms) for p, s in zip(predicted, group)]
        timed = [(p, s.time_ms) for p, s in zip(predicted, group) if s.full] or [
            (p, s.time_ms) for p, s in zip(predicted, group)
        ]  # no full timing: the cheap ones
        first = min(p for p, _ in timed)
        chosen = [m for p, m in timed if p == first]  # the model cannot tell these apart
        best = min(m for _, m in timed)
        fits.append(
            ProblemFit(
                key,
                len(group),
                sum(s.full for s in group),
                spearman([p for p, _ in timed], [m for _, m in timed]) if len(timed) > 1 else 1.0,
                sum(chosen) / len(chosen) / best - 1.0,
                math.sqrt(sum(x * x for x in logs) / len(logs)),
                math.exp(-sum(logs) / len(logs)),
            )
        )
    return fits


def loss(fits: list[ProblemFit]) -> float:
    """Mean over problems of the mean squared log error: what `fit` minimises."""
    return sum(f.log_error**2 for f in fits) / len(fits)


def summary(fits: list[ProblemFit]) -> dict:
    n = len(fits)
    if not n:
        raise CalibrationError("no samples to evaluate")
    mean_loss = loss(fits)
    return {
        "problems": n,
        "candidates": sum(f.candidates for f in fits),
        "timed": sum(f.timed for f in fits),
        "loss": mean_loss,
        "mean_rank_correlation": sum(f.rank_correlation for f in fits) / n,
        "mean_regret": sum(f.regret for f in fits) / n,
        "max_regret": max(f.regret for f in fits),
        "rms_log_error": math.sqrt(mean_loss),
    }


# ---- the fit ------------------------------------------------------------------------------------
def _refine(values: dict, best: float, params: dict, objective, budget: int) -> tuple[dict, float]:
    """Pattern search from TPE's best: each assumption in turn a step up and down (a factor in log
    space, a share of the range otherwise), kept where the loss falls; the step halves after a pass
    that kept nothing. At most `budget` evaluations."""
    step = 0.25  # a share of each range (of its log for log-scale ones)
    spent = 0
    while spent < budget and step > 0.01:
        improved = False
        for name, (low, high, log) in params.items():
            for sign in (1, -1):
                if spent >= budget:
                    break
                current = values[name]
                moved = (
                    current * math.exp(sign * step * math.log(high / low))
                    if log
                    else current + sign * step * (high - low)
                )
                moved = min(high, max(low, moved))
                if moved == current:
                    continue
                trial = dict(values, **{name: moved})
                value = objective(trial)
                spent += 1
                if value < best:
                    values, best, improved = trial, value, True
                    break
        if not improved:
            step /= 2
    return values, best


def fit(
    samples: list[Sample],
    target,
    *,
    trials: int = 300,
    seed: int = 0,
    refine: int = 150,
    start: ModelAssumptions | None = None,
    params: dict | None = None,
) -> tuple[ModelAssumptions, dict]:
    """Fit the assumptions in `params` (default FITTED) to the samples: Optuna's TPE for `trials`
    evaluations from `start`, then a pattern search of at most `refine` more. Returns the best
    assumptions and {"before": summary, "after": summary}."""
    import optuna

    if not samples:
        raise CalibrationError("no measured samples to fit")
    if trials < 1:
        raise CalibrationError("trials must be at least 1")
    start = start or ModelAssumptions()
    params = FITTED if params is None else params
    unknown = set(params) - {f.name for f in dataclasses.fields(ModelAssumptions)}
    if unknown:
        raise CalibrationError(f"not model assumptions: {', '.join(sorted(unknown))}")

    def clip(name):
        low, high, _ = params[name]
        return min(high, max(low, getattr(start, name)))

    def loss_of(values: dict) -> float:
        return loss(evaluate(dataclasses.replace(start, **values), samples, target))

    def objective(trial):
        return loss_of(
            {
                name: trial.suggest_float(name, low, high, log=log)
                for name, (low, high, log) in params.items()
            }
        )

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed, multivariate=True)
    )
    study.enqueue_trial({name: clip(name) for name in params})
    study.optimize(objective, n_trials=trials)
    values, best = _refine(dict(study.best_params), study.best_value, params, loss_of, refine)
    fitted = dataclasses.replace(start, **values)
    before = summary(evaluate(start, samples, target))
    after = summary(evaluate(fitted, samples, target))
    if after["loss"] > before["loss"]:  # the start lay outside the ranges: keep it
        fitted, after = start, before
    return fitted, {"before": before, "after": after}
