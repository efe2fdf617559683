"""Where a kernel's time goes, from the hardware counters: Nsight Compute (ncu) around one launch of
a shape's default config and of that config with a knob change, side by side.

    python benchmarks/ncu_profile.py [--shape 64:16384] [--set emu_share=0.125 ...] [--ncu PATH]
                                     [--csv out.csv] [--json out.json]

A shape is 'head_dim:seqlen[:causal]' at 16k tokens and hidden 2048 (benchmarks/attention.py). The
script runs itself under ncu (`--profile-from-start off`, `--clock-control none`: the clocks are left
as they are); the profiled child compiles and runs each config once outside the profiled range, then
once between cudaProfilerStart and cudaProfilerStop, so each profile is one launch of the kernel. It
collects the sections SchedulerStats, WarpStateStats, ComputeWorkloadAnalysis and InstructionStats and
prints a markdown table of what they say about a latency- or pipe-bound kernel: issue slots, pipe
utilisation (XU is the MUFU), eligible warps, the largest stall reasons, executed instructions.
ncu replays the launch once per pass of counters, so a kernel's outputs are written several times;
nothing is checked against the reference here (the other benchmarks do that). ncu needs a machine
whose GPU counters are readable (on a gVisor host they are not: ncu says so and this script stops)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SECTIONS = ("SchedulerStats", "WarpStateStats", "ComputeWorkloadAnalysis", "InstructionStats")
# (row label, ncu section, ncu body item label or None for any, metric name)
ROWS = (
    ("issue slots busy (%)", "Compute Workload Analysis", "", "Issue Slots Busy"),
    ("XU (MUFU) pipe, % of peak", "Compute Workload Analysis", "Pipe Utilization (% of peak instructions executed over elapsed cycles)", "XU"),
    ("FMA pipe, % of peak", "Compute Workload Analysis", "Pipe Utilization (% of peak instructions executed over elapsed cycles)", "FMA"),
    ("ALU pipe, % of peak", "Compute Workload Analysis", "Pipe Utilization (% of peak instructions executed over elapsed cycles)", "ALU"),
    ("no eligible warp (% of cycles)", "Scheduler Statistics", "", "No Eligible"),
    ("eligible warps per scheduler", "Scheduler Statistics", "", "Eligible Warps Per Scheduler"),
    ("cycles per issued instruction", "Warp State Statistics", "", "Warp Cycles Per Issued Instruction"),
    ("executed instructions", "Instruction Statistics", "", "Executed Instructions"),
)
STALLS_SHOWN = 5  # the largest stall reasons of each launch, in cycles per issued instruction


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu's `--csv --page details` output -> one dict per profiled launch, in launch order:
    {(section, body item label, metric name): value text}. Lines before the header (the profiled
    program's own output, ncu's ==PROF== lines) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise ValueError("no ncu CSV header (\"ID\",...) in the output")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    launches: dict[str, dict] = {}
    for row in reader:
        if row.get("ID") is None or row.get("Metric Name") is None:
            continue
        metrics = launches.setdefault(row["ID"], {})
        metrics[(row["Section Name"], row["Body Item Label"], row["Metric Name"])] = row["Metric Value"]
    return [launches[key] for key in sorted(launches, key=int)]


def number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(metrics: dict) -> dict:
    """The rows of the table, and the stall reasons (name -> cycles per issued instruction)."""
    out = {}
    for label, section, item, name in ROWS:
        out[label] = number(metrics.get((section, item, name)))
    stalls = {name[len("Stall "):]: number(value) for (section, _, name), value in metrics.items()
              if section == "Warp State Statistics" and name.startswith("Stall ") and number(value)}
    out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    return out


def _child(args) -> int:
    import torch

    from benchmarks.attention import parse_shape
    from benchmarks.tuning_report import gpu_target
    from fa4tune.kernels.interface import attention_forward

    target = gpu_target("benchmarks/ncu_profile.py")
    if target is None:
        return 2
    problem = parse_shape(args.shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(problem.batch, problem.seqlen_q, problem.nheads_q, problem.head_dim, device="cuda",
                           dtype=torch.bfloat16, generator=gen) for _ in range(3))
    try:
        configs = _configs(args, target)
    except ValueError as exc:  # an infeasible variant: said before anything runs
        print(f"ncu_profile: {exc}", file=sys.stderr)
        return 2
    for config in configs:
        attention_forward(q, k, v, config, causal=problem.causal)  # compile and warm, not profiled
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        attention_forward(q, k, v, config, causal=problem.causal)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


def _configs(args, target) -> list:
    from dataclasses import replace

    from benchmarks.ab import parse_changes
    from benchmarks.attention import parse_shape
    from fa4tune.kernels.config import default_config, infeasible_reasons

    problem = parse_shape(args.shape)
    default = default_config(problem, target)
    configs = [default]
    changes = parse_changes(args.set)
    if changes:
        variant = replace(default, **changes)
        reasons = infeasible_reasons(problem, variant, target)
        if reasons:
            raise ValueError(f"{variant.short()} is infeasible for {problem.key()}: {'; '.join(reasons)}")
        configs.append(variant)
    return configs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="64:16384", help="head_dim:seqlen[:causal] (16k tokens, hidden 2048)")
    ap.add_argument("--set", action="append", default=[], help="knob=value: the variant profiled beside the default")
    ap.add_argument("--ncu", default=None, help="the ncu binary (default: ncu on PATH, else /usr/local/cuda/bin/ncu)")
    ap.add_argument("--csv", default=None, help="keep ncu's CSV here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole ncu run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        from benchmarks.ab import parse_changes
        from benchmarks.attention import parse_shape

        parse_changes(args.set)
    except ValueError as exc:
        print(f"ncu_profile: {exc}", file=sys.stderr)
        return 2
    try:
        parse_shape(args.shape)
    except (ValueError, IndexError):
        print(f"ncu_profile: --shape wants head_dim:seqlen[:causal] (got {args.shape!r})", file=sys.stderr)
        return 2
    if args.child:
        return _child(args)

    ncu = args.ncu or shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(ncu).exists() and not shutil.which(ncu):
        print(f"ncu_profile: no Nsight Compute at {ncu} (pass --ncu PATH)", file=sys.stderr)
        return 2
    command = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--target-processes", "all",
               *[part for section in SECTIONS for part in ("--section", section)],
               "--print-details", "all", "--csv", "--page", "details",
               sys.executable, str(Path(__file__).resolve()), "--child", "--shape", args.shape,
               *[part for item in args.set for part in ("--set", item)]]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"ncu_profile: ncu did not finish in {args.timeout:.0f} s (--timeout)", file=sys.stderr)
        return 1
    if args.csv:
        Path(args.csv).write_text(done.stdout)
    try:
        launches = parse_ncu_csv(done.stdout)
    except ValueError as exc:
        print(f"ncu_profile: {exc}; ncu exit status {done.returncode}; its stderr ends:\n{done.stderr[-2000:]}",
              file=sys.stderr)
        return 1
    labels = ["default"] + (["default + " + " ".join(args.set)] if args.set else [])
    if len(launches) != len(labels):
        print(f"ncu_profile: {len(launches)} profiled launches, expected {len(labels)}; stderr ends:\n"
              f"{done.stderr[-2000:]}", file=sys.stderr)
        return 1
    summaries = [summarize(m) for m in launches]
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "set": args.set,
                                               "columns": dict(zip(labels, summaries))}, indent=1))
    print(table(args.shape, labels, summaries))
    return 0


def table(shape: str, labels: list[str], summaries: list[dict]) -> str:
    """A markdown table: one row per metric of ROWS, then the largest stall reasons."""
    def cell(value):
        if value is None:
            return "-"
        return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"

    out = [f"ncu, one launch per column, shape {shape} (clocks not controlled)\n",
           "| metric | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for label, *_ in ROWS:
        out.append(f"| {label} | " + " | ".join(cell(s[label]) for s in summaries) + " |")
    reasons = []
    for s in summaries:
        for name in list(s["stalls"])[:STALLS_SHOWN]:
            if name not in reasons:
                reasons.append(name)
    for name in reasons:
        out.append(f"| stall: {name} (cycles per issued instruction) | "
                   + " | ".join(cell(s["stalls"].get(name)) for s in summaries) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
