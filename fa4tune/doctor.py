"""`fa4tune doctor`: what this machine can do: GPU, CUDA driver, CuTe DSL, torch, the kernel
families, the shipped tables (which GPU each serves, and whether it was tuned for the installed
kernel code), the results DB."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from . import __version__
from .db import SCHEMA_VERSION, ResultsDB, resolve_location, shown_location, sqlite_path
from .errors import ResultsDBError
from .kernels import loadable_families
from .target import is_described, target_for_device


def package_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


NOTE = None  # a line's state that is neither healthy nor not: an optional extra that is missing


def diagnose(db_location: str | None = None) -> list[tuple[str, bool | None, str]]:
    """(check, healthy, detail) lines; a missing GPU is healthy (the model backend runs), a missing
    optional extra is a NOTE (what it would add is not there, yet nothing is broken)."""

    lines: list[tuple[str, bool | None, str]] = [("fa4tune", True, __version__)]
    torch_version = package_version("torch")
    gpu_detail, gpu_ok = "none: searches use the cost model (estimates)", True
    gpu_target = None
    if torch_version is None:
        lines.append(("torch", False, "not installed (pip install torch)"))
    else:
        try:
            import torch

            lines.append(
                ("torch", True, f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'})")
            )
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                name = props.name
                target = target_for_device(props)
                if target is None:
                    known = "target UNKNOWN (no tuned tables)"
                elif is_described(target):
                    known = f"target {target.name}"
                else:  # fa4tune.attention runs it (target.undescribed_hopper); a search does not
                    known = (
                        "target UNKNOWN: fa4tune.attention runs the default configs, searches "
                        "need a described GPU (fa4tune/target.py)"
                    )
                gpu_detail = (
                    f"{name}, {props.multi_processor_count} SMs, "
                    f"sm_{props.major}{props.minor}; {known}"
                )
                gpu_ok = target is not None
                gpu_target = target
        except Exception as exc:
            lines.append(("torch", False, f"import failed: {exc}"))
    lines.append(("gpu", gpu_ok, gpu_detail))
    lines.append(("cuda driver", True, cuda_driver_version() or "none"))
    dsl = package_version("nvidia-cutlass-dsl")
    lines.append(
        ("cute dsl", dsl is not None, f"nvidia-cutlass-dsl {dsl}" if dsl else "not installed")
    )
    found, broken = loadable_families()
    for why in broken:  # a third-party family that does not load: say so, check the rest
        lines.append(("kernel", False, why))
    for name, spec in found.items():
        try:
            lines.append(
                (
                    "kernel",
                    True,
                    f"{name} ({spec.arch}) source hash {spec.source_hash()[:12]}, "
                    f"knobs: {', '.join(spec.knobs)}",
                )
            )
        except Exception as exc:
            lines.append(("kernel", False, f"{name}: {type(exc).__name__}: {exc}"))
    lines.extend(table_lines(gpu_target))
    lines.append(_db_line(db_location))
    for extra, module in (("report", "matplotlib"), ("postgres", "psycopg")):
        import importlib.util

        have = importlib.util.find_spec(module) is not None
        state = "installed" if have else f"missing: pip install 'fa4tune[{extra}]'"
        lines.append((f"[{extra}]", True if have else NOTE, f"{module} {state}"))
    return lines


def table_lines(gpu_target=None, directory=None) -> list[tuple[str, bool | None, str]]:
    """A line per shipped table (`directory`: fa4tune's own): its kernel family, the GPU its
    entries serve, their count, and whether it was tuned for the installed kernel code (a stale
    table still serves, with a warning: a NOTE; an unreadable one is not healthy). With the local
    GPU's target, a last line says which families look up tuned configs on it and which run their
    defaults."""
    from .runtime.lookup import PACKAGE_TABLES
    from .runtime.tables import read_table

    found, _ = loadable_families()
    tuned: dict[str, list[str]] = {}
    lines: list[tuple[str, bool | None, str]] = []
    for path in sorted(Path(directory or PACKAGE_TABLES).glob("*.yaml")):
        try:
            table = read_table(path)
            installed = found[table["kernel"]].source_hash()
        except Exception as exc:  # unreadable, or a family that did not load
            lines.append(("table", False, f"{path.name}: {type(exc).__name__}: {exc}"))
            continue
        fresh = table["kernel_hash"] == installed
        state = (
            "tuned for the installed code"
            if fresh
            else f"STALE: tuned for {table['kernel_hash'][:12]}, installed {installed[:12]} "
            "(re-tune, or fa4tune carry)"
        )
        lines.append(
            (
                "table",
                True if fresh else NOTE,
                f"{path.name}: {table['kernel']} on {table['target']}, "
                f"{len(table['entries'])} entries, {state}",
            )
        )
        tuned.setdefault(table["target"], []).append(table["kernel"])
    if gpu_target is not None:
        mine = sorted(set(tuned.get(gpu_target.name, [])))
        rest = sorted(name for name in found if name not in mine)
        detail = f"{gpu_target.name}: tuned configs for {', '.join(mine) or 'no family'}"
        if rest:
            detail += f"; the default configs for {', '.join(rest)}"
        lines.append(("tables here", True, detail))
    return lines


def cuda_driver_version() -> str | None:
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if int(err) == 0 and version:
            return f"{version // 1000}.{version % 1000 // 10}"
    except Exception:
        pass
    return None


def _db_line(db_location: str | None) -> tuple[str, bool, str]:

    location = resolve_location(db_location)
    shown = shown_location(location)
    path = sqlite_path(location)
    empty = path is not None and path.is_file() and path.stat().st_size == 0
    if path is not None and (not path.exists() or empty):  # opened, an empty file would be written
        try:
            ResultsDB.check(location)  # where the first search could not create it
        except ResultsDBError as exc:
            return ("results db", False, str(exc))
        state = "an empty file, no results yet" if empty else "not created yet"
        return ("results db", True, f"{shown}: {state} (schema v{SCHEMA_VERSION} on first search)")
    try:
        with ResultsDB.open(location, create=False) as db:
            counts = db.counts()
    except ResultsDBError as exc:
        return ("results db", False, str(exc))
    return (
        "results db",
        True,
        f"{shown}: schema v{SCHEMA_VERSION}, {counts['runs']} runs, "
        f"{counts['trials']} trials, {counts['best_configs']} best configs",
    )
