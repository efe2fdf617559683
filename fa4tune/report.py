"""`fa4tune report`: plots of the searches in a results DB, as PNG files and one HTML page:
per problem the optimisation history and the parameter importances (Optuna's matplotlib plots of the
stored study), and over all problems the default against the tuned config."""

from __future__ import annotations

import html
import importlib.util
import re
import warnings
from pathlib import Path

from .errors import Fa4tuneError


class ReportError(Fa4tuneError):
    pass


def _require_matplotlib():
    if importlib.util.find_spec("matplotlib") is None:
        raise ReportError("fa4tune report needs matplotlib, which is not installed: "
                          "pip install 'fa4tune[report]' (or pip install matplotlib)")
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

    from .db import ResultsDB
    from .tune.studies import open_storage, quiet_optuna

    quiet_optuna()
    out = Path(out_dir)
    with ResultsDB.open(db_location, create=False) as db:
        runs = {r["id"]: r for r in db.runs()}
        trials = db.trials()
        best = db.best_configs()
    if not trials:
        raise ReportError(f"no trials in {db_location or 'the results DB'}: run `fa4tune search` first")
    out.mkdir(parents=True, exist_ok=True)
    pngs: list[str] = []
    sections: list[str] = []

    # Default against tuned, per problem, from the trials marked as the default.
    by_problem: dict[str, dict] = {}
    for t in trials:
        if t["status"] == "ok":
            slot = by_problem.setdefault(t["problem_key"], {"default": None, "best": None})
            if t["source"] == "default":
                slot["default"] = min(slot["default"] or t["time_ms"], t["time_ms"])
            slot["best"] = min(slot["best"] or t["time_ms"], t["time_ms"])
    keys = sorted(by_problem)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 4))
    speedups = [(by_problem[k]["default"] or by_problem[k]["best"]) / by_problem[k]["best"] for k in keys]
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
        f"<td>{by_problem[k]['best']:.4g}</td><td>{s:.3f}</td></tr>" for k, s in zip(keys, speedups)
    )
    sections.append(f"<h2>Default vs tuned</h2><img src='{path.name}'><table border=1><tr><th>problem</th>"
                    f"<th>default ms</th><th>tuned ms</th><th>speed-up</th></tr>{rows}</table>")

    # Per study: Optuna's own plots of the stored study.
    studies = sorted({(t["study_name"], t["run_id"]) for t in trials})
    storages: dict[str, object] = {}
    for name, run_id in studies:
        location = storage or runs[run_id]["storage_url"]
        if location not in storages:
            storages[location] = open_storage(location)
        try:
            study = optuna.load_study(study_name=name, storage=storages[location])
        except KeyError:
            sections.append(f"<h2>{html.escape(name)}</h2><p>study not found in {html.escape(location)}</p>")
            continue
        images = []
        for kind, plot in (("history", optuna_plots.plot_optimization_history),
                           ("importances", optuna_plots.plot_param_importances)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    axes = plot(study)
            except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # too few trials for the plot
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
    index.write_text(f"<html><head><title>fa4tune report</title></head><body><h1>fa4tune report</h1>{note}"
                     f"<p>{len(best)} best configs, {len(trials)} trials.</p>{''.join(sections)}</body></html>\n")
    return {"html": str(index), "png": pngs}
