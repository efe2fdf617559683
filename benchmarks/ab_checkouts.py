"""A/B of a code change: one kernel family's default config per shape, as an earlier revision of
fa4tune builds it against this checkout, timed in alternating processes.

    python benchmarks/ab_checkouts.py --old REV|DIR [--kernel fa4_bwd_sm90]
                                      [--shapes 128:4096,64:1024:causal | --job JOB.yaml
                                      [--match TEXT]] [--rounds 3]
                                      [--set deterministic=true] [--json out.json]

`benchmarks/ab.py` A/Bs a knob, both sides in one process; a change to the code itself (the kernel,
its launch) cannot be a knob, and two versions of one package do not import side by side. So the
old revision is written out with `git archive` to a temporary directory (or `--old` names such a
directory, written beforehand: the device machine's copy of the checkout has no git) and each
round runs one child process per side, old first on odd rounds and new first on even ones, each
with its own compile cache. A child builds the family's default config for each shape (with
`--set`'s knobs changed on both sides: e.g. the deterministic mode of a code change; a side whose
rules refuse the result says so), checks it
against the fp32 reference on the family's measurement case (outputs poisoned first), then times
it with `fa4tune.measure.timing.time_cuda` (L2 flushed before every run): benchmarks/ab.py's
`measure`, one round; it prints a JSON line per shape.
The table, last: TFLOP/s per side (the median of the rounds; the family's `work_flops`), new / old,
the spread of each side's rounds, and O's error per side. Shapes are
'head_dim:seqlen[:causal][:gN]' at 16k tokens and hidden 2048 (gN: N query heads per K/V head;
benchmarks/attention.py). `--job` takes a tuning job's problems instead (decode: the forward's
decode default, its split-KV combine included), `--match` keeps those whose key holds the text;
each side makes them with its own kernel family, and refuses one it reads otherwise."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_SHAPES = "128:4096,128:4096:causal,128:1024,64:4096,64:1024:causal"


def _child(
    root: str,
    label: str,
    kernel: str,
    shapes: list[str],
    keys: list[str],
    changes: dict,
    problems: list[dict] | None = None,
) -> int:
    """Measure the default configs of `kernel` with the fa4tune found under `root`, with `changes`
    ({knob: value}) applied, on the problems this checkout reads the shapes as (`keys`: an older
    revision's parse_shape may read a shape otherwise, as one without `:gN` reads `:g4` as nothing;
    then this side refuses). `problems`: a job's problems as dicts (--job), in place of shapes, each
    made by this side's kernel family (a field it lacks refuses the same way)."""
    sys.path.insert(0, root)
    import fa4tune

    if not Path(fa4tune.__file__).resolve().is_relative_to(Path(root).resolve()):
        print(f"ab_checkouts: fa4tune came from {fa4tune.__file__}, not {root}", file=sys.stderr)
        return 2
    from benchmarks.ab import measure
    from benchmarks.attention import parse_shape
    from fa4tune.kernels import get_kernel
    from fa4tune.target import detect_target

    family = get_kernel(kernel)
    if problems is None:
        problems = [parse_shape(spec) for spec in shapes]
        why = "its benchmarks/attention.py does not take the shape"
    else:
        try:
            problems = [family.problem(values) for values in problems]
        except Exception as exc:  # noqa: BLE001 - an older Problem may lack a field: refuse
            print(
                f"ab_checkouts: the {label} side cannot make a job's problem: {exc}",
                file=sys.stderr,
            )
            return 2
        why = "its Problem reads the job's problem otherwise"
    for spec, problem, key in zip(shapes, problems, keys, strict=True):
        if problem.key() != key:
            print(
                f"ab_checkouts: the {label} side reads {spec!r} as {problem.key()}, this checkout "
                f"as {key}: {why}",
                file=sys.stderr,
            )
            return 2
    target = detect_target()
    for spec, problem in zip(shapes, problems):
        config = family.default_config(problem, target)
        refused = None
        if changes:
            try:
                config = type(config).from_dict(changes, base=config)  # as ab.py's columns
            except ValueError as exc:  # this side's schema does not take the change
                refused = f"refused: {exc}"
            else:
                reasons = family.infeasible_reasons(problem, config, target)
                refused = f"refused: {'; '.join(reasons)}" if reasons else None
        row = dict(label=label, shape=spec, config=config.short())
        if refused:
            row.update(wrong=refused, error=None, ms=None, tflops=None)
            print(json.dumps(row), flush=True)
            continue
        # ab.py's check then time, one round a process (the rounds alternate the processes).
        cell = measure(problem, {"default": config}, family, target, 1)["default"]
        if isinstance(cell, str):  # wrong, or failed: the reason, not timed
            row.update(wrong=cell, error=None, ms=None, tflops=None)
        else:
            row.update(wrong=None, error=cell["out_error"], ms=cell["ms"], tflops=cell["tflops"])
        print(json.dumps(row), flush=True)
    return 0


def table(rows: list[dict]) -> str:
    """Markdown: one line per shape, the sides' medians over the rounds and their ratio."""
    by: dict[tuple, list[dict]] = {}
    for row in rows:
        by.setdefault((row["shape"], row["label"]), []).append(row)
    out = [
        "| shape | config (old / new) | old TFLOP/s | new TFLOP/s | new / old | spread old / new "
        "| O error old / new |",
        "|---|---|---|---|---|---|---|",
    ]

    def side(label, shape):
        cells = by.get((shape, label), [])
        values = [c["tflops"] for c in cells if c["tflops"]]
        wrong = next((c["wrong"] for c in cells if c["wrong"]), None)
        if not values:
            return cells, None, None, wrong
        spread = (max(values) - min(values)) / statistics.median(values)
        return cells, statistics.median(values), spread, wrong

    for shape in dict.fromkeys(row["shape"] for row in rows):
        (old, o, so, wo), (new, n, sn, wn) = side("old", shape), side("new", shape)
        configs = f"{old[0]['config'] if old else '-'} / {new[0]['config'] if new else '-'}"
        ratio = f"{n / o:.3f}" if o and n else "-"

        def value(v, wrong):
            return wrong if wrong else "-" if v is None else f"{v:.1f}"

        def pct(v):
            return "-" if v is None else f"{100 * v:.1f}%"

        def err(cells):
            return f"{cells[0]['error']:.2e}" if cells and cells[0]["error"] is not None else "-"

        out.append(
            f"| {shape} | {configs} | {value(o, wo)} | {value(n, wn)} | {ratio} | "
            f"{pct(so)} / {pct(sn)} | {err(old)} / {err(new)} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--old",
        help="the git revision to compare against (e.g. main, HEAD~1), or a directory holding "
        "one's tree",
    )
    ap.add_argument("--kernel", default="fa4_bwd_sm90", help="the kernel family")
    ap.add_argument("--shapes", default=None, help="comma-separated shapes")
    ap.add_argument("--job", default=None, help="a tuning job whose problems to use instead")
    ap.add_argument(
        "--match", action="append", default=[], help="with --job: keep problems whose key has it"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="change a knob of the default config on both sides (repeatable)",
    )
    ap.add_argument("--json", default=None, help="keep every round's rows here")
    ap.add_argument("--child", nargs=2, metavar=("ROOT", "LABEL"), help=argparse.SUPPRESS)
    ap.add_argument("--keys", default="", help=argparse.SUPPRESS)  # the shapes' problem keys
    ap.add_argument("--changes", default="{}", help=argparse.SUPPRESS)  # --set, as JSON
    ap.add_argument("--problems", default=None, help=argparse.SUPPRESS)  # --job's, as JSON
    args = ap.parse_args(argv)
    shapes = [s for s in (args.shapes or ("" if args.job else DEFAULT_SHAPES)).split(",") if s]
    if args.child:  # before anything imports fa4tune: the child's comes from its root
        changes = json.loads(args.changes)
        problems = json.loads(args.problems) if args.problems else None
        return _child(*args.child, args.kernel, shapes, args.keys.split(","), changes, problems)
    from benchmarks.ab import job_selection, parse_changes
    from benchmarks.attention import parse_shape
    from fa4tune.errors import KernelError
    from fa4tune.kernels import get_kernel

    try:
        get_kernel(args.kernel)
    except KernelError as exc:
        print(f"ab_checkouts: {exc}", file=sys.stderr)
        return 2
    try:
        changes = parse_changes(args.set, args.kernel)
    except ValueError as exc:
        print(f"ab_checkouts: {exc}", file=sys.stderr)
        return 2
    keys, problems = [], None
    try:
        found = job_selection(args.shapes, args.job, args.match, args.kernel)
    except ValueError as exc:
        print(f"ab_checkouts: {exc}", file=sys.stderr)
        return 2
    if found is not None:
        shapes = keys = [problem.key() for problem in found]
        problems = [problem.to_dict() for problem in found]
    for spec in shapes if problems is None else ():
        try:
            keys.append(parse_shape(spec).key())
        except (ValueError, IndexError):
            print(
                f"ab_checkouts: --shapes wants head_dim:seqlen[:causal][:gN] (got {spec!r})",
                file=sys.stderr,
            )
            return 2
    if not args.old or args.rounds < 1:
        print("ab_checkouts: --old REV and --rounds >= 1 are needed", file=sys.stderr)
        return 2
    tree = Path(args.old).resolve() if Path(args.old).is_dir() else None  # else a git revision
    if tree is not None:
        if not (tree / "fa4tune" / "__init__.py").is_file():
            print(
                f"ab_checkouts: {args.old!r} is a directory without fa4tune/__init__.py: --old "
                "wants a git revision or an fa4tune tree (`git archive REV | tar x -C DIR`)",
                file=sys.stderr,
            )
            return 2
    else:
        check = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{args.old}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            print(f"ab_checkouts: no git revision {args.old!r} in {ROOT}", file=sys.stderr)
            return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="ab_checkouts-") as tmp:
        old_root = tree
        if tree is None:
            old_root = Path(tmp) / "old"
            old_root.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", "--format=tar", args.old],
                capture_output=True,
                check=True,
            )
            subprocess.run(
                ["tar", "xf", "-", "-C", str(old_root)], input=archive.stdout, check=True
            )
        sides = {"old": old_root, "new": ROOT}
        for round_index in range(args.rounds):
            order = ["old", "new"] if round_index % 2 == 0 else ["new", "old"]
            for label in order:
                env = dict(os.environ, FA4TUNE_KERNEL_CACHE=str(Path(tmp) / f"cache-{label}"))
                env["PYTHONPATH"] = str(sides[label])
                child = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--kernel", args.kernel]
                    + ["--shapes", ",".join(shapes), "--keys", ",".join(keys)]
                    + ["--changes", json.dumps(changes)]
                    + (["--problems", json.dumps(problems)] if problems is not None else [])
                    + ["--child", str(sides[label]), label],
                    cwd=sides[label],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                got = [
                    json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")
                ]
                rows += got
                if child.returncode != 0 or len(got) != len(shapes):
                    print(
                        f"ab_checkouts: the {label} side, round {round_index + 1}, stopped "
                        f"(exit {child.returncode}); its output ends:\n{child.stderr[-1500:]}",
                        file=sys.stderr,
                    )
                    return 1
                print(f"round {round_index + 1}, {label}: done", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"old": args.old, "rows": rows}, indent=1))
    print(f"{args.kernel}: {args.old} (old) against this checkout (new), {args.rounds} rounds\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
