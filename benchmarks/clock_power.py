"""Clock, power and throttle reasons while a backward runs as the report times it: fa4tune's
backward (the config fa4tune.attention looks up) and flash-attn-4's, per shape, in windows of
`fa4tune.measure.timing.time_cuda` (L2 flushed before every run), with nvidia-smi sampling the SM
clock, the board's power, the temperature and the active clock-event (throttle) reasons every 50
ms.

    python benchmarks/clock_power.py [--shapes 128:16384:causal,128:16384,128:4096:causal]
                                     [--windows 400,2500] [--reps 2] [--json out.json]

Shapes are 'head_dim:seqlen[:causal][:gN]' at 16k tokens and hidden 2048 (benchmarks/attention.py).
Each side's gradients are checked against the fp32 reference first (fa4tune's on the family's
measurement case with poisoned outputs; flash-attn-4's against the same reference). Then, per
repetition, each side runs one window of each length: a short one (the clock the report's rounds
start at) and a long one (where power sets it). A window's first samples, taken before its runs
start, are dropped (SKIP_SAMPLES). cycles = median time x mean clock: two kernels that run the same
cycles at different clocks differ in power, not in work. The table, last: per shape, side and
window the median time over the repetitions, the mean clock, power and their cycles, the largest
temperature and every reason seen; then fa4tune / flash-attn-4 in time and in cycles."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention import parse_shape  # noqa: E402
from benchmarks.tuning_report import gpu_target  # noqa: E402

PROG = "benchmarks/clock_power.py"
FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,{reasons}"
# The reasons' field: named clocks_event_reasons by newer drivers, clocks_throttle_reasons before.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
SAMPLE_MS = 50
SKIP_SAMPLES = 3  # the window's start: nvidia-smi's first line and the runs not yet begun
# NVML's clock-event reason bits (nvmlClocksEventReason*), as nvidia-smi prints the active mask.
REASONS = (
    (0x1, "idle"),
    (0x2, "applications clocks"),
    (0x4, "sw power cap"),
    (0x8, "hw slowdown"),
    (0x10, "sync boost"),
    (0x20, "sw thermal"),
    (0x40, "hw thermal"),
    (0x80, "hw power brake"),
    (0x100, "display clocks"),
)
SIDES = ("fa4tune", "flash-attn-4")
PEER_TOLERANCE = 0.05  # flash-attn-4's largest relative gradient error before it is timed


class Sample(NamedTuple):
    mhz: float
    watts: float
    celsius: float
    reasons: int  # the active mask


def parse_samples(text: str) -> list[Sample]:
    """nvidia-smi's lines (--format=csv,noheader,nounits, FIELDS' order); a line with a field it
    could not read ('[N/A]', a cut-off last line) is left out."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            samples.append(
                Sample(float(parts[1]), float(parts[2]), float(parts[3]), int(parts[4], 16))
            )
        except ValueError:
            continue
    return samples


def reason_names(mask: int) -> list[str]:
    names = [name for bit, name in REASONS if mask & bit]
    rest = mask & ~sum(bit for bit, _ in REASONS)
    return names + ([f"0x{rest:x}"] if rest else [])


def summarise(samples: list[Sample]) -> dict:
    """One window's samples (SKIP_SAMPLES already dropped): mean clock and power, the lowest
    clock, the highest temperature and the reasons active in any sample."""
    if not samples:
        raise ValueError("no clock samples in the window (nvidia-smi printed none it could read)")
    mask = 0
    for s in samples:
        mask |= s.reasons
    return {
        "mhz": statistics.fmean(s.mhz for s in samples),
        "mhz_min": min(s.mhz for s in samples),
        "watts": statistics.fmean(s.watts for s in samples),
        "celsius": max(s.celsius for s in samples),
        "reasons": reason_names(mask),
        "samples": len(samples),
    }


def render(rows: list[dict]) -> str:
    """The markdown table of the rows (one per shape, side, window and repetition)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["shape"], r["window_ms"], r["side"]), []).append(r)
    lines = [
        "| shape | window ms | side | time us | MHz (lowest) | W | Mcycles | max °C | reasons |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for window in sorted({r["window_ms"] for r in rows if r["shape"] == shape}):
            got = {}
            for side in SIDES:
                rs = groups.get((shape, window, side))
                if not rs:
                    continue
                us = statistics.median(r["us"] for r in rs)
                mhz = statistics.median(r["mhz"] for r in rs)
                cycles = us * mhz / 1e6
                got[side] = (us, cycles)
                reasons = sorted({n for r in rs for n in r["reasons"]}) or ["none"]
                lines.append(
                    f"| {shape} | {window:g} | {side} | {us:.0f} | {mhz:.0f} "
                    f"({min(r['mhz_min'] for r in rs):.0f}) | "
                    f"{statistics.median(r['watts'] for r in rs):.0f} | {cycles:.2f} | "
                    f"{max(r['celsius'] for r in rs):.0f} | {', '.join(reasons)} |"
                )
            if len(got) == 2:
                (ut, ct), (uf, cf) = got[SIDES[0]], got[SIDES[1]]
                ratios.append(f"| {shape} | {window:g} | {ut / uf:.3f} | {ct / cf:.3f} |")
    if ratios:
        lines += [
            "",
            "| shape | window ms | fa4tune / flash-attn-4, time | in cycles |",
            "|---|---|---|---|",
            *ratios,
        ]
    return "\n".join(lines)


def reasons_field(smi: str = "nvidia-smi") -> str:
    """The name this driver's nvidia-smi gives the active reasons."""
    for name in REASON_FIELDS:
        probe = subprocess.run(
            [smi, f"--query-gpu={name}", "--format=csv,noheader"], capture_output=True, text=True
        )
        if probe.returncode == 0:
            return name
    raise RuntimeError(f"{smi} takes neither of {', '.join(REASON_FIELDS)}")


def sampled_window(fn, flusher, window_ms: float, field: str) -> dict:
    """time_cuda of `fn` for about `window_ms` of runs while nvidia-smi samples."""
    from fa4tune.measure.timing import time_cuda

    smi = subprocess.Popen(
        [
            "nvidia-smi",
            f"--query-gpu={FIELDS.format(reasons=field)}",
            "--format=csv,noheader,nounits",
            "-lms",
            str(SAMPLE_MS),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(SKIP_SAMPLES * SAMPLE_MS / 1e3)
        timing = time_cuda(
            fn, flusher=flusher, warmup_ms=0.0, target_ms=window_ms, max_runs=1_000_000
        )
    finally:
        smi.terminate()
        text = smi.communicate()[0]
    return {
        "us": timing.median_ms * 1e3,
        "runs": timing.runs,
        **summarise(parse_samples(text)[SKIP_SAMPLES:]),
    }


def sides(problem, target):
    """{side: backward fn} for the problem, each checked against the fp32 reference first (the
    checks and fa4tune's call are benchmarks/backward.py's)."""
    import backward as report  # benchmarks/, on the path as the script's own folder
    import torch

    from fa4tune.kernels import get_kernel
    from fa4tune.kernels.fa4_bwd_sm90.peers import fa4_backward
    from fa4tune.runtime.lookup import lookup

    family = get_kernel("fa4_bwd_sm90")
    config = lookup(problem, target, kernel=family.name).config
    case = family.measurement_case(problem, "cuda")
    family.randomize(case, 0)
    refs = family.reference(case)
    wrong, _ = report.check_fa4tune(family, problem, config, target, case, refs)
    if wrong:
        raise RuntimeError(f"fa4tune's backward is wrong on {problem.key()}: {wrong}")
    ours = report.fa4tune_columns(problem, config, target, case)[0]
    peer = fa4_backward(problem, case.q, case.k, case.v, case.dout)
    grads = peer()
    torch.cuda.synchronize()
    error = report.peer_error(family, case, grads, refs)
    if not error <= PEER_TOLERANCE:
        raise RuntimeError(f"flash-attn-4's backward is off on {problem.key()}: error {error:.3g}")
    return {SIDES[0]: ours, SIDES[1]: peer}, config.short()


def measure(target, shapes, windows, reps) -> list[dict]:
    from fa4tune.measure.timing import L2Flusher, time_cuda

    flusher, field = L2Flusher(), reasons_field()
    rows = []
    for spec in shapes:
        fns, config = sides(parse_shape(spec), target)
        for fn in fns.values():  # compiled, and the clocks up
            time_cuda(fn, flusher=flusher, target_ms=200)
        for rep in range(reps):
            for side, fn in fns.items():
                for window in windows:
                    row = {"shape": spec, "side": side, "rep": rep, "window_ms": window}
                    row.update(sampled_window(fn, flusher, window, field), config=config)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="128:16384:causal,128:16384,128:4096:causal")
    parser.add_argument(
        "--windows", default="400,2500", help="ms of runs a window, comma-separated"
    )
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        shapes = [s for s in args.shapes.split(",") if s]
        for spec in shapes:
            parse_shape(spec)
        windows = [float(w) for w in args.windows.split(",") if w]
        if not shapes or not windows or min(windows) <= 0 or args.reps < 1:
            raise ValueError("want at least one shape, windows above 0 ms and --reps 1 or more")
    except ValueError as exc:
        parser.error(str(exc))
    target = gpu_target(PROG)
    if target is None:
        return 2
    if importlib.util.find_spec("flash_attn") is None:
        print(f"{PROG} compares with flash-attn-4, which is not installed", file=sys.stderr)
        return 2
    rows = measure(target, shapes, windows, args.reps)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
