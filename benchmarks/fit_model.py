"""Fit the cost model's assumptions to a GPU search's measurements, and say how well it then ranks.

    python benchmarks/fit_model.py --samples tuning_configs/calibration/h200-run10.json \
        --holdout tuning_configs/calibration/h200-run11.json [--trials 300] [--refine 250]
    python benchmarks/fit_model.py --db fa4tune-results/h200-bf16.db --run 8 \
        --save-samples run8.json

Samples come from a results DB (one run's measured candidates, `--run`) or a samples file
(`fa4tune.measure.calibrate.save_samples`). Prints, per problem, the rank correlation and the regret
(how much slower the candidate the model ranks first measured than the best measured; both over the
fully timed candidates, not the pruner's cheap timings) before and after
the fit, the same on the held-out samples, and the fitted assumptions as `ModelAssumptions` fields.
With `--trials 0` it only evaluates the installed assumptions. Fitting is CPU work: about 0.6 s per
evaluation of 750 candidates, so about 5 minutes with the defaults."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def table(before, after) -> list[str]:
    lines = [
        "| problem | candidates (fully timed) | rank corr. before | after | "
        "regret before | after | scale after |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, a in zip(before, after):
        lines.append(
            f"| {b.problem_key} | {b.candidates} ({b.timed}) | "
            f"{b.rank_correlation:+.2f} | {a.rank_correlation:+.2f} | "
            f"{b.regret:.1%} | {a.regret:.1%} | {a.scale:.2f} |"
        )
    return lines


def summary_line(name, s) -> str:
    return (
        f"{name}: {s['problems']} problems, {s['candidates']} candidates; "
        f"RMS log error {s['rms_log_error']:.3f}; "
        f"over the {s['timed']} fully timed: "
        f"mean rank correlation {s['mean_rank_correlation']:+.3f}, "
        f"regret mean {s['mean_regret']:.1%} max {s['max_regret']:.1%}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--samples", help="a samples file (JSON)")
    source.add_argument("--db", help="a results DB of a GPU search")
    ap.add_argument(
        "--run", type=int, help="with --db: the run whose candidates to fit (default: every run)"
    )
    ap.add_argument("--kernel", default="fa4_fwd_sm90")
    ap.add_argument("--target", default="H200")
    ap.add_argument("--holdout", help="a samples file to check the fit on, not fitted")
    ap.add_argument("--save-samples", help="write the samples read from --db to this file")
    ap.add_argument("--trials", type=int, default=300, help="TPE evaluations (0: only evaluate)")
    ap.add_argument("--refine", type=int, default=250, help="pattern-search evaluations after TPE")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.samples and (args.run is not None or args.save_samples):
        ap.error("--run and --save-samples go with --db")

    from fa4tune.errors import Fa4tuneError
    from fa4tune.kernels.fa4_fwd_sm90.calibrate import (
        CalibrationError,
        evaluate,
        fit,
        load_samples,
        samples_from_db,
        save_samples,
        summary,
    )
    from fa4tune.kernels.fa4_fwd_sm90.cost_model import ModelAssumptions
    from fa4tune.target import get_target

    try:
        target = get_target(args.target)
        if args.samples:
            samples = load_samples(args.samples, args.kernel)
        else:
            from fa4tune.db import ResultsDB

            with ResultsDB.open(args.db, create=False) as db:
                samples = samples_from_db(
                    db, kernel=args.kernel, target=target.name, run_id=args.run
                )
            if args.save_samples:
                save_samples(
                    args.save_samples,
                    samples,
                    f"{args.db}, " + (f"run {args.run}" if args.run is not None else "every run"),
                )
        if not samples:
            raise CalibrationError(
                f"no measured candidates of {args.kernel} on {target.name} in "
                f"{args.samples or args.db}" + (f", run {args.run}" if args.run is not None else "")
            )
        holdout = load_samples(args.holdout, args.kernel) if args.holdout else []
        installed = ModelAssumptions()
        if args.trials > 0:
            fitted, _ = fit(
                samples,
                target,
                trials=args.trials,
                seed=args.seed,
                refine=args.refine,
                start=installed,
            )
        else:
            fitted = installed
    except (CalibrationError, Fa4tuneError, KeyError, ValueError) as exc:
        print(f"fit_model: error: {exc}", file=sys.stderr)
        return 2

    before, after = evaluate(installed, samples, target), evaluate(fitted, samples, target)
    print("\n".join(table(before, after)))
    print()
    print(summary_line("fitted samples, installed assumptions", summary(before)))
    print(summary_line("fitted samples, fitted assumptions   ", summary(after)))
    if holdout:
        print(
            summary_line(
                "held-out samples, installed          ",
                summary(evaluate(installed, holdout, target)),
            )
        )
        print(
            summary_line(
                "held-out samples, fitted             ", summary(evaluate(fitted, holdout, target))
            )
        )
    changed = {
        f.name: getattr(fitted, f.name)
        for f in dataclasses.fields(fitted)
        if getattr(fitted, f.name) != getattr(installed, f.name)
    }
    print(
        "\nfitted assumptions (ModelAssumptions fields):" if changed else "\nno assumption changed"
    )
    for name, value in changed.items():
        print(f"    {name}: float = {value:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
