"""Where a kernel's time goes, from the hardware counters: Nsight Compute (ncu) around one launch of
a shape's default config and of that config with a knob change, side by side.

    python benchmarks/ncu_profile.py [--shape 64:16384] [--set emu_share=0.125 ...] [--source]
                                     [--backward [--peer]] [--ncu PATH] [--csv out.csv]
                                     [--json out.json]

A shape is 'head_dim:seqlen[:causal][:gN]' at 16k tokens and hidden 2048 (gN: N query heads per K/V
head; benchmarks/attention.py). The script runs itself under ncu (`--profile-from-start off`,
`--clock-control none`: the clocks are left as they are); the profiled child compiles and runs each
config once outside the profiled range, then once between cudaProfilerStart and cudaProfilerStop, so
each profile is one launch of the kernel. It collects the sections SchedulerStats, WarpStateStats,
ComputeWorkloadAnalysis and InstructionStats and prints a markdown table of what they say about a
latency- or pipe-bound kernel: issue slots, pipe utilisation (XU is the MUFU), eligible warps, the
largest stall reasons, executed instructions, and (raw counters) shared memory's wavefronts and
bank conflicts. With --source it also collects the source counters (warp-state samples per SASS
instruction) and prints a second table: the opcodes the warps were sampled on most, each with its
share of all samples and its largest stall reasons (where in the code the stalls of the first table
are); --csv then keeps each launch's source page too (one row per SASS instruction: its samples by
stall reason, executions and shared-memory wavefronts, the HGMMAs' operand reads among them). With
--backward the kernel is the backward's main kernel (fa4_bwd_sm90, its knobs for --set; the
preprocessing kernel and the dQ cast around it are not profiled), run on the family's measurement
case; --peer adds flash-attn-4's backward main kernel on the same tensors, as a last column. ncu
replays the launch once per pass of counters, so a kernel's outputs are written several times;
nothing is checked against the reference here (the other benchmarks do that). ncu needs a machine
whose GPU counters are readable (on a gVisor host they are not: ncu says so and this script
stops)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BACKWARD = "fa4_bwd_sm90"
# The backward's main kernel in ncu's kernel names (the DSL names a kernel after its class).
BACKWARD_KERNEL = "FlashBackwardSm90"
# flash-attn-4's SM90 backward main kernel (--peer), named after its class the same way.
PEER_BACKWARD_KERNEL = "FlashAttentionBackwardSm90"
SECTIONS = ("SchedulerStats", "WarpStateStats", "ComputeWorkloadAnalysis", "InstructionStats")
# (row label, ncu section, ncu body item label or None for any, metric name)
ROWS = (
    ("issue slots busy (%)", "Compute Workload Analysis", "", "Issue Slots Busy"),
    (
        "XU (MUFU) pipe, % of peak",
        "Compute Workload Analysis",
        "Pipe Utilization (% of peak instructions executed over elapsed cycles)",
        "XU",
    ),
    (
        "FMA pipe, % of peak",
        "Compute Workload Analysis",
        "Pipe Utilization (% of peak instructions executed over elapsed cycles)",
        "FMA",
    ),
    (
        "ALU pipe, % of peak",
        "Compute Workload Analysis",
        "Pipe Utilization (% of peak instructions executed over elapsed cycles)",
        "ALU",
    ),
    ("no eligible warp (% of cycles)", "Scheduler Statistics", "", "No Eligible"),
    ("eligible warps per scheduler", "Scheduler Statistics", "", "Eligible Warps Per Scheduler"),
    (
        "cycles per issued instruction",
        "Warp State Statistics",
        "",
        "Warp Cycles Per Issued Instruction",
    ),
    ("executed instructions", "Instruction Statistics", "", "Executed Instructions"),
    # Raw counters (--metrics; matched by name in whatever section ncu files them under): shared
    # memory's wavefronts and its bank conflicts, the wavefronts above an access's minimum.
    ("shared store wavefronts", None, None, "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"),
    (
        "shared store bank conflicts",
        None,
        None,
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    ),
    ("shared load wavefronts", None, None, "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"),
    (
        "shared load bank conflicts",
        None,
        None,
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    ),
)
METRICS = tuple(name for _, section, _, name in ROWS if section is None)
STALLS_SHOWN = 5  # the largest stall reasons of each launch, in cycles per issued instruction


def _csv_rows(text: str, first_column: str, what: str) -> csv.DictReader:
    """The rows of the CSV in ncu's output whose header starts with `first_column`; the lines before
    the header (the profiled program's own output, ncu's ==PROF== lines, a kernel's name)
    skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f'"{first_column}",')), None)
    if start is None:
        raise ValueError(f'no {what} header ("{first_column}",...) in the output')
    return csv.DictReader(io.StringIO("\n".join(lines[start:])))


def _first_of_each(rankings, count: int) -> list:
    """The first `count` names of each ranking, each name once, in order of appearance."""
    names = []
    for ranking in rankings:
        for name in list(ranking)[:count]:
            if name not in names:
                names.append(name)
    return names


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu's `--csv --page details` output -> one dict per profiled launch, in launch order:
    {(section, body item label, metric name): value text}."""
    launches: dict[str, dict] = {}
    for row in _csv_rows(text, "ID", "ncu CSV"):
        if row.get("ID") is None or row.get("Metric Name") is None:
            continue
        metrics = launches.setdefault(row["ID"], {})
        metrics[(row["Section Name"], row["Body Item Label"], row["Metric Name"])] = row[
            "Metric Value"
        ]
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
        if section is None:
            value = next((v for (_, _, n), v in metrics.items() if n == name), None)
        else:
            value = metrics.get((section, item, name))
        out[label] = number(value)
    stalls = {
        name[len("Stall ") :]: number(value)
        for (section, _, name), value in metrics.items()
        if section == "Warp State Statistics" and name.startswith("Stall ") and number(value)
    }
    out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    return out


SOURCE_OPCODES_SHOWN = 8  # the opcodes with the most samples, per launch
SAMPLES = "Warp Stall Sampling (All Samples)"


def parse_source_csv(text: str) -> list[dict]:
    """`ncu --page source --csv --print-source sass` of one launch -> one dict per SASS instruction
    (its columns by name). The line before the header names the kernel."""
    return [
        row for row in _csv_rows(text, "Address", "ncu source CSV") if row.get("Source") is not None
    ]


def opcode(source: str) -> str:
    """The opcode and its first modifier, the guard dropped: '@!P0  BRA 0x7f..' -> 'BRA',
    'HGMMA.64x96x16.F32.BF16 R24, ...' -> 'HGMMA.64x96x16' (the S GEMM apart from the PV GEMM where
    their shapes differ), 'WARPGROUP.DEPBAR.LE gsb0, 0x0' -> 'WARPGROUP.DEPBAR'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return ".".join(words[0].split(".")[:2]) if words else "?"


def summarize_source(rows: list[dict]) -> dict:
    """{opcode: {"share": % of all samples, "stalls": {reason: % of the opcode's samples}}}, the
    opcodes with the most samples first. Stall columns are ncu's stall_* (all samples, issued or
    not)."""
    reasons = [
        name for name in (rows[0] if rows else {}) if name.startswith("stall_") and "(" not in name
    ]
    total = 0.0
    per_op: dict[str, dict] = {}
    for r in rows:
        samples = number(r.get(SAMPLES)) or 0.0
        total += samples
        entry = per_op.setdefault(opcode(r.get("Source", "")), {"samples": 0.0, "stalls": {}})
        entry["samples"] += samples
        for name in reasons:
            value = number(r.get(name)) or 0.0
            if value:
                reason = name[len("stall_") :]
                entry["stalls"][reason] = entry["stalls"].get(reason, 0.0) + value
    out = {}
    for op, entry in sorted(per_op.items(), key=lambda kv: -kv[1]["samples"]):
        if not entry["samples"]:
            continue
        stalls = {
            k: 100.0 * v / entry["samples"]
            for k, v in sorted(entry["stalls"].items(), key=lambda kv: -kv[1])
        }
        out[op] = {"share": 100.0 * entry["samples"] / total, "stalls": stalls}
    return out


def source_table(labels: list[str], summaries: list[dict]) -> str:
    """Markdown: the opcodes most sampled in any launch, each cell 'share (largest stalls)'."""
    ops = _first_of_each(summaries, SOURCE_OPCODES_SHOWN)

    def cell(s, op):
        if op not in s:
            return "-"
        stalls = ", ".join(f"{k} {v:.0f}%" for k, v in list(s[op]["stalls"].items())[:3])
        return f"{s[op]['share']:.1f}% ({stalls})"

    out = [
        "warp-state samples per SASS opcode: share of all samples (the opcode's largest "
        "warp states: stall reasons, or 'selected' when it issued; a BRA with long_sb is most "
        "often the spin of an mbarrier wait)\n",
        "| opcode | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    out += [f"| {op} | " + " | ".join(cell(s, op) for s in summaries) + " |" for op in ops]
    return "\n".join(out)


def _child(args) -> int:
    import torch

    from benchmarks.attention import parse_shape
    from benchmarks.tuning_report import gpu_target
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    target = gpu_target("benchmarks/ncu_profile.py")
    if target is None:
        return 2
    problem = parse_shape(args.shape)
    try:
        configs = _configs(args, target)
    except ValueError as exc:  # an infeasible variant: said before anything runs
        print(f"ncu_profile: {exc}", file=sys.stderr)
        return 2
    if args.backward:  # the family's measurement case (ncu keeps the main kernel: BACKWARD_KERNEL)
        from fa4tune.kernels import get_kernel

        family = get_kernel(BACKWARD)
        case = family.measurement_case(problem, "cuda")
        family.randomize(case, 0)
        runs = [family.launcher(case, config, target) for config in configs]
        if args.peer:
            # Its forward runs here, outside the profiled range; ncu keeps its main kernel only.
            from fa4tune.kernels.fa4_bwd_sm90.peers import fa4_backward

            runs.append(fa4_backward(problem, case.q, case.k, case.v, case.dout))
    else:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(
                problem.batch,
                problem.seqlen_q,
                problem.nheads_q,
                problem.head_dim,
                device="cuda",
                dtype=torch.bfloat16,
                generator=gen,
            )
            for _ in range(3)
        )
        runs = [
            partial(attention_forward, q, k, v, config, causal=problem.causal) for config in configs
        ]
    for run in runs:
        run()  # compile and warm, not profiled
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        run()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


def _family_name(args) -> str:
    return BACKWARD if args.backward else "fa4_fwd_sm90"


def _configs(args, target) -> list:
    from dataclasses import replace

    from benchmarks.ab import parse_changes
    from benchmarks.attention import parse_shape
    from fa4tune.kernels import get_kernel

    family = get_kernel(_family_name(args))
    problem = parse_shape(args.shape)
    default = family.default_config(problem, target)
    configs = [default]
    changes = parse_changes(args.set, family.name)
    if changes:
        variant = replace(default, **changes)
        reasons = family.infeasible_reasons(problem, variant, target)
        if reasons:
            raise ValueError(
                f"{variant.short()} is infeasible for {problem.key()}: {'; '.join(reasons)}"
            )
        configs.append(variant)
    return configs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape",
        default="64:16384",
        help="head_dim:seqlen[:causal][:gN] (16k tokens, hidden 2048)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="knob=value: the variant profiled beside the default",
    )
    ap.add_argument(
        "--ncu",
        default=None,
        help="the ncu binary (default: ncu on PATH, else /usr/local/cuda/bin/ncu)",
    )
    ap.add_argument(
        "--csv",
        default=None,
        help="keep ncu's CSV of the details page here (with --source also each launch's source "
        "page, one row per SASS instruction, beside it as <stem>-source<N>.csv)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds for the whole ncu run (the profile and the reading back of its report)",
    )
    ap.add_argument(
        "--source",
        action="store_true",
        help="also the source counters: which SASS opcodes the warps wait on",
    )
    ap.add_argument(
        "--backward",
        action="store_true",
        help="profile the backward's main kernel (fa4_bwd_sm90: --set takes its knobs)",
    )
    ap.add_argument(
        "--peer",
        action="store_true",
        help="with --backward: also flash-attn-4's backward main kernel, in a column of its own",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        from benchmarks.ab import parse_changes
        from benchmarks.attention import parse_shape

        parse_changes(args.set, _family_name(args))
    except ValueError as exc:
        print(f"ncu_profile: {exc}", file=sys.stderr)
        return 2
    try:
        parse_shape(args.shape)
    except (ValueError, IndexError):
        print(
            f"ncu_profile: --shape wants head_dim:seqlen[:causal][:gN] (got {args.shape!r})",
            file=sys.stderr,
        )
        return 2
    if args.peer and not args.backward:
        print(
            "ncu_profile: --peer profiles flash-attn-4's backward: give --backward too",
            file=sys.stderr,
        )
        return 2
    if args.child:
        return _child(args)

    ncu = args.ncu or shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(ncu).exists() and not shutil.which(ncu):
        print(f"ncu_profile: no Nsight Compute at {ncu} (pass --ncu PATH)", file=sys.stderr)
        return 2
    sections = SECTIONS + (("SourceCounters",) if args.source else ())
    labels = ["default"] + (["default + " + " ".join(args.set)] if args.set else [])
    labels += ["flash-attn-4"] if args.peer else []
    kernels = BACKWARD_KERNEL + (f"|{PEER_BACKWARD_KERNEL}" if args.peer else "")
    deadline = time.monotonic() + args.timeout

    def ncu_run(arguments):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise subprocess.TimeoutExpired(arguments, args.timeout)
        return subprocess.run([ncu, *arguments], capture_output=True, text=True, timeout=remaining)

    def failed(what: str, run) -> int:
        print(
            f"ncu_profile: {what}; ncu exit status {run.returncode}; its output ends:\n"
            f"{(run.stdout[-1500:] + run.stderr[-1500:]).strip()}",
            file=sys.stderr,
        )
        return 1

    with tempfile.TemporaryDirectory(prefix="ncu_profile-") as tmp:
        # The profile goes to a report file, read back once per page: the details of every launch,
        # and with --source each launch's source counters.
        report = Path(tmp) / "profile"
        try:
            done = ncu_run(
                [
                    "--profile-from-start",
                    "off",
                    "--clock-control",
                    "none",
                    "--target-processes",
                    "all",
                    *(["--kernel-name", f"regex:{kernels}"] if args.backward else []),
                    *[part for section in sections for part in ("--section", section)],
                    "--metrics",
                    ",".join(METRICS),
                    "-o",
                    str(report),
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    "--shape",
                    args.shape,
                    *(["--backward"] if args.backward else []),
                    *(["--peer"] if args.peer else []),
                    *[part for item in args.set for part in ("--set", item)],
                ]
            )
            if done.returncode != 0 or not Path(f"{report}.ncu-rep").exists():
                return failed("the profiled run wrote no report", done)
            details = ncu_run(
                ["-i", f"{report}.ncu-rep", "--page", "details", "--csv", "--print-details", "all"]
            )
            try:
                launches = parse_ncu_csv(details.stdout)
            except ValueError as exc:
                return failed(f"reading the report's details: {exc}", details)
            if len(launches) != len(labels):
                return failed(f"{len(launches)} profiled launches, expected {len(labels)}", done)
            source_summaries = []
            for i in range(len(launches) if args.source else 0):
                source = ncu_run(
                    [
                        "-i",
                        f"{report}.ncu-rep",
                        "--page",
                        "source",
                        "--csv",
                        "--print-source",
                        "sass",
                        "--launch-skip",
                        str(i),
                        "--launch-count",
                        "1",
                    ]
                )
                if args.csv:
                    csv_path = Path(args.csv)
                    csv_path.with_name(f"{csv_path.stem}-source{i}.csv").write_text(source.stdout)
                try:
                    source_summaries.append(summarize_source(parse_source_csv(source.stdout)))
                except ValueError as exc:
                    return failed(f"reading launch {i}'s source counters: {exc}", source)
        except subprocess.TimeoutExpired:
            print(
                f"ncu_profile: ncu did not finish in {args.timeout:.0f} s (--timeout)",
                file=sys.stderr,
            )
            return 1
    if args.csv:
        Path(args.csv).write_text(details.stdout)
    summaries = [summarize(m) for m in launches]
    if args.json:
        columns = dict(zip(labels, summaries))
        for label, ops in zip(labels, source_summaries):  # none without --source
            columns[label] = dict(columns[label], opcodes=ops)
        Path(args.json).write_text(
            json.dumps({"shape": args.shape, "set": args.set, "columns": columns}, indent=1)
        )
    print(table(args.shape, labels, summaries))
    if args.source:
        print("\n" + source_table(labels, source_summaries))
    return 0


def table(shape: str, labels: list[str], summaries: list[dict]) -> str:
    """A markdown table: one row per metric of ROWS, then the largest stall reasons."""

    def cell(value):
        if value is None:
            return "-"
        return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"

    out = [
        f"ncu, one launch per column, shape {shape} (clocks not controlled)\n",
        "| metric | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for label, *_ in ROWS:
        out.append(f"| {label} | " + " | ".join(cell(s[label]) for s in summaries) + " |")
    for name in _first_of_each((s["stalls"] for s in summaries), STALLS_SHOWN):
        out.append(
            f"| stall: {name} (cycles per issued instruction) | "
            + " | ".join(cell(s["stalls"].get(name)) for s in summaries)
            + " |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
