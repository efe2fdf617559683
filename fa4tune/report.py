"""`fa4tune report`: plots of the searches in a results DB, as PNG files and one HTML page:
per problem the optimisation history and the parameter importances (Optuna's matplotlib plots of the
stored study), and over all problems the default against the tuned config."""

from __future__ import annotations

import html
import importlib.util
import re
import warnings
from pathlib import Path

from .db import ResultsDB, shown_location, sqlite_path
from .errors import Fa4tuneError, StorageError
from .files import unwritable_ancestor
from .tune.provenance import run_l2_flush
from .tune.studies import journal_path, open_storage, quiet_optuna


class ReportError(Fa4tuneError):
    pass


def _require_matplotlib():
    if importlib.util.find_spec("matplotlib") is None:
        raise ReportError(
            "fa4tune report needs matplotlib, which is not installed: "
            "pip install 'fa4tune[report]' (or pip install matplotlib)"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def write_report(db_location: str | None, out_dir: str, storage: str | None = None) -> dict:
    plt = _require_matplotlib()
    import optuna
    from optuna.visualization import matplotlib as optuna_plots

    quiet_optuna()
    out = Path(out_dir)
    blocked = unwritable_ancestor(out / "index.html")  # a file named like the directory, say
    if blocked is not None:
        raise ReportError(
            f"cannot write the report to {out}: {blocked} is not a writable directory; "
            "give another --out"
        )
    with ResultsDB.open(db_location, create=False) as db:
        runs = {r["id"]: r for r in db.runs()}
        trials = db.trials()
        best = db.best_configs()
        db_location = db.location
    if not trials:
        raise ReportError(f"no trials in {shown_location(db_location)}: run `fa4tune search` first")
    # Every study found before anything is written.
    names = sorted({(t["study_name"], t["run_id"]) for t in trials})
    studies = _load_studies(names, runs, db_location, storage)
    out.mkdir(parents=True, exist_ok=True)
    pngs: list[str] = []
    sections: list[str] = []

    # Default against tuned, per problem, from the trials marked as the default; per L2 flush
    # where the DB holds runs of more than one (their times do not compare: policy.better).
    flushes = {run_id: run_l2_flush(run) for run_id, run in runs.items()}
    several = len({flushes[t["run_id"]] for t in trials}) > 1
    by_problem: dict[str, dict] = {}
    for t in trials:
        if t["status"] == "ok":
            key = t["problem_key"]
            if several:
                key = f"{key} [{flushes[t['run_id']]} flush]"
            slot = by_problem.setdefault(key, {"default": None, "best": None})
            if t["source"] == "default":
                slot["default"] = min(slot["default"] or t["time_ms"], t["time_ms"])
            slot["best"] = min(slot["best"] or t["time_ms"], t["time_ms"])
    keys = sorted(by_problem)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 4))
    speedups = [
        (by_problem[k]["default"] or by_problem[k]["best"]) / by_problem[k]["best"] for k in keys
    ]
    ax.bar(range(len(keys)), speedups, color="tab:blue")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(keys, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("tuned speed-up over default")
    ax.set_title("default vs tuned per problem")
    fig.tight_layout()
    path = out / "default_vs_tuned.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    pngs.append(str(path))
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{by_problem[k]['default'] or float('nan'):.4g}</td>"
        f"<td>{by_problem[k]['best']:.4g}</td><td>{s:.3f}</td></tr>"
        for k, s in zip(keys, speedups)
    )
    sections.append(
        f"<h2>Default vs tuned</h2><img src='{path.name}'><table border=1><tr><th>problem</th>"
        f"<th>default ms</th><th>tuned ms</th><th>speed-up</th></tr>{rows}</table>"
    )

    # Per study: Optuna's own plots of the stored study.
    for name, study in studies.items():
        images = []
        for kind, plot in (
            ("history", optuna_plots.plot_optimization_history),
            ("importances", optuna_plots.plot_param_importances),
        ):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    axes = plot(study)
            except (
                ValueError,
                RuntimeError,
                ZeroDivisionError,
            ) as exc:  # too few trials for the plot
                images.append(f"<p>{kind}: {html.escape(str(exc))}</p>")
                continue
            figure = axes.get_figure() if hasattr(axes, "get_figure") else axes
            png = out / f"{_slug(name)}-{kind}.png"
            figure.tight_layout()
            figure.savefig(png, dpi=90)
            plt.close(figure)
            pngs.append(str(png))
            images.append(f"<img src='{png.name}'>")
        sections.append(f"<h2>{html.escape(name)}</h2>{''.join(images)}")

    estimates = any(r["is_estimate"] for r in runs.values())
    note = "<p><b>Times are cost-model estimates.</b></p>" if estimates else ""
    index = out / "index.html"
    index.write_text(
        f"<html><head><title>fa4tune report</title></head><body><h1>fa4tune report</h1>{note}"
        f"<p>{len(best)} best configs, {len(trials)} trials.</p>{''.join(sections)}</body></html>\n"
    )
    return {"html": str(index), "png": pngs}


def _load_studies(
    names: list[tuple[str, int]], runs: dict, db_location: str, storage: str | None
) -> dict:
    """The Optuna study of each (study name, run id), from `storage` or the one its run recorded;
    a ReportError naming the study and the storage when either is missing. Nothing is created."""
    import optuna

    storages: dict[str, object] = {}
    studies = {}
    for name, run_id in names:
        recorded = runs[run_id]["storage_url"]
        location = storage or _recorded_storage(recorded, db_location, name, run_id)
        shown = shown_location(location)
        if location not in storages:
            try:
                storages[location] = open_storage(location, create=False)
            except StorageError as exc:
                raise ReportError(
                    f"cannot read study {name!r} of run {run_id}: {exc}. Give the "
                    "Optuna storage that holds it with --storage"
                ) from exc
        try:
            studies[name] = optuna.load_study(study_name=name, storage=storages[location])
        except KeyError:
            raise ReportError(
                f"study {name!r} of run {run_id} is not in the Optuna storage "
                f"{shown!r}; give the storage that holds it with --storage"
            ) from None
    return studies


def _recorded_storage(recorded: str | None, db_location: str, name: str, run_id: int) -> str:
    """The storage a run recorded. Runs of earlier fa4tune versions recorded a journal path relative
    to the search's working directory, which is not the report's: such a path is looked for from
    the results DB's directory, as given (the search ran there) or by its name alone (the journal
    beside the DB, where it goes by default)."""

    if not recorded:
        raise ReportError(
            f"run {run_id} recorded no Optuna storage for study {name!r}; give the "
            "storage that holds it with --storage"
        )
    path = journal_path(recorded)
    if path is None or path.is_absolute():
        return recorded
    db_file = sqlite_path(db_location)
    directory = None if db_file is None else db_file.resolve().parent
    beside = [] if directory is None else [directory / path, directory / path.name]
    for candidate in beside:
        if candidate.is_file():
            return str(candidate)
    looked = f" (looked for it from {directory}, the results DB's directory)" if directory else ""
    raise ReportError(
        f"cannot read study {name!r} of run {run_id}: its Optuna journal "
        f"{recorded!r}, a path relative to where that search ran, was not "
        f"found{looked}; give it with --storage"
    )
