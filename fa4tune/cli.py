"""The `fa4tune` command: search | show | export | import | carry | report | doctor.

Bad input ends with one paragraph on stderr and exit status 2; an interrupted search with status 130
after saying how to resume it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from . import __version__, interrupts, policy
from .db import ResultsDB, shown_location
from .doctor import NOTE, diagnose
from .errors import Fa4tuneError, is_user_error
from .kernels import get_kernel
from .measure.timing import flush_mode
from .report import write_report
from .runtime.carry import carry_table
from .runtime.tables import (
    TableError,
    check_importable,
    default_table_path,
    existing_tables,
    export_table,
    import_table,
    read_table,
    table_entries,
)
from .target import get_target
from .tune.job import load_job
from .tune.provenance import run_l2_flush
from .tune.search import SearchInterrupted, run_search

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def _say(message: str) -> None:
    print(message, flush=True)


# ---- search -------------------------------------------------------------------------------------
def cmd_search(args) -> int:
    job = load_job(args.job)
    if args.export is not None:
        if not args.export.strip():
            raise Fa4tuneError("--export: a table path, got an empty one")
        job = dataclasses.replace(job, export=args.export)
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    try:
        with (
            interrupts.installed()
        ):  # Ctrl-C and SIGTERM stop the search, never inside a critical section
            summary = run_search(
                job,
                db=args.db,
                storage=args.storage,
                resume=args.resume,
                backend=args.backend,
                target=args.target,
                trials=args.trials,
                seconds=args.seconds,
                progress=progress and args.workers is None and args.gpus is None,
                say=_say,
                workers=args.workers,
                gpus=args.gpus,
            )
    except SearchInterrupted as stop:
        s = stop.summary
        again = " ".join(
            f"{flag} {shown_location(str(value))}"
            for flag, value in (
                ("--db", args.db),
                ("--storage", args.storage),
                ("--export", args.export),
                ("--backend", args.backend),
                ("--target", args.target),
                ("--trials", args.trials),
                ("--seconds", args.seconds),
                ("--workers", args.workers),
                ("--gpus", ",".join(map(str, args.gpus or []))),
            )
            if value
        )
        _say(
            "fa4tune: interrupted; every finished trial is stored in "
            f"{shown_location(s.db_location)} (run {s.run_id}). Continue with: "
            f"fa4tune search {args.job} --resume" + (f" {again}" if again else "")
        )
        return EXIT_INTERRUPTED
    estimate = " (cost-model estimates)" if summary.is_estimate else ""
    workers = f" by {summary.workers} workers" if summary.workers > 1 else ""
    _say(
        f"fa4tune: run {summary.run_id} done on {summary.target} with backend "
        f"{summary.backend}{estimate}{workers}; results in {shown_location(summary.db_location)}, "
        f"studies in {shown_location(summary.storage)}"
    )
    for path in summary.exported:
        _say(f"fa4tune: exported {path}")
    return 0


def _gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of GPU indices like 0,1,3; got {text!r}"
        ) from None
    if any(g < 0 for g in gpus):
        raise argparse.ArgumentTypeError(f"GPU indices are 0 or more; got {text!r}")
    return gpus


def _count(text: str) -> int:
    """A whole number of 0 or more (a negative one would slice from the end)."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of 0 or more; got {text!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"a whole number of 0 or more; got {text!r}")
    return count


# ---- show ---------------------------------------------------------------------------------------
def _format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in headers]] + [
        ["" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def config_text(config: dict, reference: dict | None = None, unchanged: str = "(default)") -> str:
    """The knobs of `config` that differ from `reference` (all of them without one), as k=v words;
    `unchanged` when none differs."""
    shown = {k: v for k, v in config.items() if reference is None or reference.get(k) != v}
    return " ".join(f"{k}={v}" for k, v in shown.items()) or unchanged


def _default_of(kernel, problem_dict: dict, target_name: str) -> dict | None:
    try:
        return kernel.default_config(
            kernel.problem(problem_dict), get_target(target_name)
        ).to_dict()
    except Exception:
        return None


def _installed_hash(kernel: str) -> str:
    """The installed source hash of the family named `kernel`: asked only of the families the shown
    entries name, so that a third-party family that does not load stops only a show that needs
    it."""
    return get_kernel(kernel).source_hash()


def _entries_rows(entries) -> list[list]:
    rows = []
    for e in entries:
        kernel = get_kernel(e.kernel)
        stale = "STALE" if _installed_hash(e.kernel) != e.kernel_hash else ""
        rows.append(
            [
                e.problem_key,
                e.target,
                f"{e.time_ms:.4g}",
                f"{e.tflops:.0f}",
                "estimate" if e.is_estimate else "measured",
                "-" if e.is_estimate else policy.flush_of(e),
                stale,
                config_text(e.config, _default_of(kernel, e.problem, e.target)),
            ]
        )
    return rows


def cmd_show(args) -> int:
    kernel = get_kernel(args.kernel).name if args.kernel else None  # an unknown name is an error
    headers = [
        "problem",
        "target",
        "ms",
        "TFLOP/s",
        "kind",
        "L2 flush",
        "stale",
        "config (knobs that differ from default)",
    ]
    if args.table:
        document = read_table(args.table)
        entries = table_entries(document)
        _say(
            f"table {args.table}: {document['kernel']} hash {document['kernel_hash'][:12]} on "
            f"{document['target']}, {len(entries)} entries"
        )
        for record in document.get("carried", []):
            _say(
                f"carried from {record['from_hash'][:12]} (the code of "
                f"{record['from_revision'][:12]}) to {record['to_hash'][:12]} on "
                f"{record['date'][:10]}: {record['checked']}"
            )
        installed = _installed_hash(document["kernel"])
        if installed != document["kernel_hash"]:
            _say(
                f"STALE: the installed {document['kernel']} has hash "
                f"{installed[:12]}; these configs "
                "were tuned for other code"
            )
        _say(_format_table(headers, _entries_rows(entries)))
        return 0

    target = (
        get_target(args.target).name if args.target else None
    )  # the DB holds "H200", not "h200"
    with ResultsDB.open(args.db, create=False) as db:
        entries = [e for e in db.best_configs(kernel=kernel, target=target)]
        if not entries:
            _say(f"no best configs in {db.location}")
            return 0
        stale = [e for e in entries if _installed_hash(e.kernel) != e.kernel_hash]
        _say(f"best configs in {db.location} ({len(entries)}; {len(stale)} stale)")
        _say(_format_table(headers, _entries_rows(entries)))
        if args.top:
            # A measured best config's trials are ranked with the others of its L2 flush only:
            # times under the other flush do not compare (policy.better).
            run_flush = {r["id"]: run_l2_flush(r) for r in db.runs()}
            for e in entries:
                trials = [
                    t
                    for t in db.trials(problem_key=e.problem_key, kernel=e.kernel, target=e.target)
                    if t["kernel_hash"] == e.kernel_hash
                ]
                other_flush, flush = 0, None if e.is_estimate else policy.flush_of(e)
                if flush is not None:
                    kept = [t for t in trials if run_flush.get(t["run_id"]) == flush]
                    other_flush = len(trials) - len(kept)
                    trials = kept
                ok = sorted((t for t in trials if t["status"] == "ok"), key=lambda t: t["time_ms"])[
                    : args.top
                ]
                search = [
                    t for t in trials if t["source"] != "confirm"
                ]  # confirm: the re-timing of the best
                counts = {
                    s: sum(t["status"] == s for t in search)
                    for s in ("ok", "stopped", "pruned", "failed", "wrong")
                }
                counts["confirmed"] = len(trials) - len(search)
                _say(
                    f"\n{e.problem_key} on {e.target}"
                    + ("" if flush is None else f" (L2 flush {flush})")
                    + ": "
                    + ", ".join(f"{n} {s}" for s, n in counts.items())
                    + (
                        f"; {other_flush} under another L2 flush, not ranked with these"
                        if other_flush
                        else ""
                    )
                )
                if ok:
                    default = _default_of(get_kernel(e.kernel), e.problem, e.target)
                    _say(
                        _format_table(
                            ["#", "ms", "TFLOP/s", "source", "config"],
                            [
                                [
                                    i + 1,
                                    f"{t['time_ms']:.4g}",
                                    f"{t['tflops']:.0f}",
                                    t["source"],
                                    config_text(t["config"], default),
                                ]
                                for i, t in enumerate(ok)
                            ],
                        )
                    )
    return 0


# ---- export / import ----------------------------------------------------------------------------
def _refuse_overwrite(out: str) -> None:
    """An existing table is someone's tuning (the shipped one: measurements and their carry
    records): `export` replaces it only when told to, and says what would be lost."""

    for path, document in existing_tables(out):
        if isinstance(document, TableError):
            holds = f"something that is not a readable table ({document})"
        else:
            rows = document["entries"]
            estimated = sum(row["is_estimate"] for row in rows)
            carried = len(document.get("carried", []))
            holds = (
                f"{len(rows)} entries ({len(rows) - estimated} measured, {estimated} "
                f"cost-model estimates) of {document['kernel']} hash "
                f"{document['kernel_hash'][:12]} on {document['target']}"
                + (f", with {carried} carry record{'s' if carried > 1 else ''}" if carried else "")
            )
        raise Fa4tuneError(
            f"{path} exists and holds {holds}; export writes nothing over it without --force "
            "(or give another --out)"
        )


def cmd_export(args) -> int:
    kernel = get_kernel(args.kernel)
    with ResultsDB.open(args.db, create=False) as db:
        targets = (
            [get_target(args.target).name]
            if args.target
            else sorted({e.target for e in db.best_configs(kernel=kernel.name)})
        )
        if not targets:
            raise Fa4tuneError(
                f"no best configs of {kernel.name} in {db.location}: nothing to export"
            )
        if args.out and len(targets) > 1:
            raise Fa4tuneError(
                f"the DB has configs for several targets ({', '.join(targets)}); "
                "pick one with --target when giving --out"
            )
        outs = {target: args.out or default_table_path(kernel.name, target) for target in targets}
        if not args.force:
            for out in outs.values():  # every table checked before any is written
                _refuse_overwrite(out)
        for target, out in outs.items():
            for path in export_table(
                db, out, kernel=kernel, target=target, kernel_hash=args.kernel_hash
            ):
                _say(f"fa4tune: exported {path}")
    return 0


def cmd_import(args) -> int:
    check_importable(args.table)  # a bad or stale table fails before a DB is created
    flush = flush_mode()  # and a bad FA4TUNE_L2_FLUSH
    with ResultsDB.open(args.db, create=True) as db:
        report = import_table(db, args.table, flush)
        _say(
            f"fa4tune: imported {args.table} into {db.location}: {len(report.added)} added, "
            f"{len(report.replaced)} replaced by better entries, {len(report.kept)} kept"
        )
        for line in report.conflicts:
            _say(f"  conflict: {line}")
    return 0


def cmd_carry(args) -> int:
    carry_table(args.table, args.rev, repo=args.repo, write=args.write, say=_say)
    if not args.write:
        _say("fa4tune carry: checked only; --write rewrites the table")
    return 0


# ---- report / doctor ----------------------------------------------------------------------------
def cmd_report(args) -> int:
    paths = write_report(args.db, args.out, storage=args.storage)
    _say(f"fa4tune: report written: {paths['html']} ({len(paths['png'])} PNG plots)")
    return 0


def cmd_doctor(args) -> int:
    labels = {True: "ok ", False: "BAD", NOTE: "-- "}  # a note does not fail the check
    healthy = True
    for name, ok, detail in diagnose(args.db):
        healthy &= ok is not False
        _say(f"{labels[ok]}  {name:12s} {detail}")
    return 0 if healthy else 1


# ---- entry point --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fa4tune", description="Autotune FlashAttention-4-style kernels."
    )
    parser.add_argument("--version", action="version", version=f"fa4tune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    db_help = (
        "results DB: a SQLite path or SQLAlchemy URL (default: $FA4TUNE_DB, "
        "else fa4tune-results/results.db)"
    )

    p = sub.add_parser("search", help="run a search job (tuning_configs/*.yaml)")
    p.add_argument("job", help="the job's YAML file")
    p.add_argument("--db", help=db_help)
    p.add_argument(
        "--storage",
        help="Optuna storage: journal file or RDB URL (default: a journal next to the DB)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the latest run of this job (or join it: another host is running it)",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="N worker processes sharing the studies: GPUs 0..N-1 (gpu backend) or N CPU processes "
        "(model backend)",
    )
    p.add_argument(
        "--gpus",
        type=_gpu_list,
        metavar="LIST",
        help="one worker process per listed GPU, e.g. 0,1,2,3",
    )
    p.add_argument("--backend", choices=["auto", "model", "gpu"], help="override the job's backend")
    p.add_argument("--target", help="override the job's target (model backend)")
    p.add_argument(
        "--export", metavar="PATH", help="write the table here instead of the job's `export` path"
    )
    p.add_argument("--trials", type=int, help="override the measured-trial budget per problem")
    p.add_argument("--seconds", type=float, help="override the time budget per problem")
    p.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="show progress bars"
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="hide progress bars"
    )
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("show", help="print best configs and top trials")
    p.add_argument("--db", help=db_help)
    p.add_argument("--table", help="show an exported table instead of a DB")
    p.add_argument("--kernel")
    p.add_argument("--target")
    p.add_argument("--top", type=_count, default=3, help="top trials per problem (0: none)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("export", help="write best configs as a sorted YAML + JSON table")
    p.add_argument("--db", help=db_help)
    p.add_argument("--out", help="table path (default tuning_configs/tables/KERNEL-TARGET.yaml)")
    p.add_argument("--kernel")
    p.add_argument("--target")
    p.add_argument(
        "--kernel-hash", help="export configs of another kernel version (default: installed)"
    )
    p.add_argument(
        "--force", action="store_true", help="replace an existing table at the output path"
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="merge an exported table into a DB")
    p.add_argument("table")
    p.add_argument("--db", help=db_help)
    p.set_defaults(func=cmd_import)

    p = sub.add_parser(
        "carry",
        help="carry a table over a kernel change that compiles its entries to the same code",
    )
    p.add_argument("table")
    p.add_argument(
        "--from",
        dest="rev",
        required=True,
        metavar="REV",
        help="the git revision the table was tuned on (its kernel_hash must be that code's)",
    )
    p.add_argument(
        "--repo", default=".", help="the git repository (default: the current directory)"
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="rewrite the table (YAML and JSON) once every entry agrees",
    )
    p.set_defaults(func=cmd_carry)

    p = sub.add_parser("report", help="write plots (HTML + PNG) of the searches in a DB")
    p.add_argument("--db", help=db_help)
    p.add_argument("--out", default="fa4tune-results/report", help="output directory")
    p.add_argument("--storage", help="Optuna storage (default: the one each run recorded)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("doctor", help="report GPU, CUDA, DSL, torch and DB state")
    p.add_argument("--db", help=db_help)
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("fa4tune: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`fa4tune show | head`): not an error; keep Python from complaining
        # at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        if not is_user_error(exc):
            raise
        print(f"fa4tune: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
