"""Search jobs: the YAML files in tuning_configs/, parsed and checked completely before anything is
written. Every error names the file and the field."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Fa4tuneError, JobError, SpaceError
from ..files import load_document
from ..kernels import get_kernel
from ..measure.base import BACKENDS
from ..measure.gpu import GpuOptions
from ..space import compose, get_space, parse_domain
from ..target import Target, TargetError, get_target

SAMPLERS = ("tpe", "random", "cmaes", "gp", "grid")
JOB_KEYS = {
    "name": "a name for the job (default: the file's stem); studies and runs are named after it",
    "description": "free text",
    "kernel": "kernel name (default fa4_fwd_sm90)",
    "target": "GPU target for the model backend (default: the local GPU, else H200)",
    "backend": "auto | model | gpu (default auto)",
    "spaces": "search-space plugins, optionally with narrowed domains",
    "problems": "list of problems; a list value in an item makes a grid",
    "sampler": "tpe | random | cmaes | gp | grid, or {name: ..., options...}",
    "budget": "{trials: N, seconds: S} per problem",
    "seed": "integer seed (default 0)",
    "db": "results DB path or SQLAlchemy URL",
    "storage": "Optuna storage: a journal file path or an RDB URL",
    "export": "table path to export the best configs to when the search ends",
    "warm_start": "how many neighbouring tuned problems to enqueue (default 3)",
    "probes": "how many one-knob changes of the default to enqueue after it (default 8)",
    "measure": "options of the gpu backend: compile_workers, compile_timeout, run_timeout, "
    "prune_margin, confirm_top, confirm_rounds, ...",
}


@dataclass(frozen=True)
class Budget:
    trials: int | None = 30
    seconds: float | None = None
    max_pruned: int | None = None  # infeasible suggestions tolerated per problem

    @property
    def pruned_cap(self) -> int:
        if self.max_pruned is not None:
            return self.max_pruned
        return 20 * (self.trials or 50) + 200


@dataclass(frozen=True)
class SamplerSpec:
    name: str = "tpe"
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Job:
    name: str
    path: str | None
    text: str | None
    kernel: Any
    target: Target | None  # None: decided with the backend (local GPU or H200)
    backend: str
    spaces: dict  # space name -> {param: Param}
    problems: list  # the kernel family's problems
    sampler: SamplerSpec
    budget: Budget
    seed: int
    db: str | None
    storage: str | None
    export: str | None
    warm_start: int
    probes: int = 8
    measure: dict = field(default_factory=dict)  # gpu backend options (GpuOptions), checked at load


def load_job(path: str | Path) -> Job:
    text, data = load_document(path, "job file", JobError)
    return parse_job(data, source=str(path), text=text, default_name=Path(path).stem)


def parse_job(
    data: Any, source: str = "<job>", text: str | None = None, default_name: str = "job"
) -> Job:
    def fail(where: str, message: str) -> JobError:
        return JobError(f"{source}: {where}: {message}")

    if not isinstance(data, dict):
        raise JobError(f"{source}: a job is a YAML mapping with keys {', '.join(JOB_KEYS)}")
    unknown = sorted(set(data) - set(JOB_KEYS))
    if unknown:
        raise fail(", ".join(unknown), f"unknown field; known fields: {', '.join(JOB_KEYS)}")

    name = data.get("name", default_name)
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise fail("name", f"a non-empty name without '/', got {name!r}")

    try:
        kernel = get_kernel(data.get("kernel"))
    except Fa4tuneError as exc:
        raise fail("kernel", str(exc)) from exc

    target = None
    if data.get("target") is not None:
        try:
            target = get_target(str(data["target"]))
        except TargetError as exc:
            raise fail("target", str(exc)) from exc

    backend = data.get("backend", "auto")
    if backend not in ("auto", *BACKENDS):
        raise fail(
            "backend", f"unknown backend {backend!r}; known backends: auto, {', '.join(BACKENDS)}"
        )

    spaces = _parse_spaces(data.get("spaces"), kernel, fail)
    sampler = _parse_sampler(data.get("sampler", "tpe"), fail)
    budget = _parse_budget(data.get("budget", {}), fail)

    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fail("seed", f"an integer, got {seed!r}")
    counts = {}  # how many configs to enqueue after the default
    for key, default in (("warm_start", 3), ("probes", 8)):
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise fail(key, f"a non-negative integer, got {value!r}")
        counts[key] = value
    for key in ("db", "storage", "export"):
        # An empty one would be read as not given: `export: ''` would export nothing, silently.
        if data.get(key) is not None and not (isinstance(data[key], str) and data[key].strip()):
            raise fail(key, f"a path or URL string, got {data[key]!r}")

    measure = data.get("measure") or {}
    if not isinstance(measure, dict):
        raise fail("measure", f"a mapping of gpu backend options, got {measure!r}")
    try:
        GpuOptions.parse(measure)
    except ValueError as exc:
        raise fail("measure", str(exc)) from exc

    problems = _parse_problems(data.get("problems"), kernel, fail)
    return Job(
        name=name,
        path=source,
        text=text,
        kernel=kernel,
        target=target,
        backend=backend,
        spaces=spaces,
        problems=problems,
        sampler=sampler,
        budget=budget,
        seed=seed,
        db=data.get("db"),
        storage=data.get("storage"),
        export=data.get("export"),
        **counts,
        measure=dict(measure),
    )


def _parse_spaces(spec, kernel, fail) -> dict:
    if spec is None:
        return {name: {} for name in kernel.default_spaces}
    if isinstance(spec, list):
        spec = {name: {} for name in spec}
    if not isinstance(spec, dict) or not spec:
        raise fail("spaces", "a list of space names, or a mapping of space name to {param: domain}")
    parsed = {}
    for name, params in spec.items():
        where = f"spaces.{name}"
        try:
            get_space(str(name))
        except SpaceError as exc:
            raise fail(where, str(exc)) from exc
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise fail(where, f"a mapping of parameter to domain, got {params!r}")
        try:
            parsed[name] = {p: parse_domain(d, str(p)) for p, d in params.items()}
        except SpaceError as exc:
            raise fail(where, str(exc)) from exc
    try:
        compose(kernel, parsed)  # unknown or doubly declared parameters, values outside a domain
    except SpaceError as exc:
        raise fail("spaces", str(exc)) from exc
    return parsed


def _parse_sampler(spec, fail) -> SamplerSpec:
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or "name" not in spec:
        raise fail("sampler", f"a sampler name ({', '.join(SAMPLERS)}) or {{name: ..., options}}")
    name = spec["name"]
    if name not in SAMPLERS:
        raise fail(
            "sampler.name", f"unknown sampler {name!r}; known samplers: {', '.join(SAMPLERS)}"
        )
    options = {k: v for k, v in spec.items() if k != "name"}
    return SamplerSpec(name=name, options=options)


def _parse_budget(spec, fail) -> Budget:
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = {"trials": spec}
    if not isinstance(spec, dict):
        raise fail("budget", f"{{trials: N, seconds: S}}, got {spec!r}")
    unknown = sorted(set(spec) - {"trials", "seconds", "max_pruned"})
    if unknown:
        raise fail(f"budget.{unknown[0]}", "unknown field; known: trials, seconds, max_pruned")
    trials = spec.get("trials", 30 if "seconds" not in spec else None)
    seconds = spec.get("seconds")
    max_pruned = spec.get("max_pruned")
    for key, value in (("trials", trials), ("max_pruned", max_pruned)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise fail(f"budget.{key}", f"a positive integer, got {value!r}")
    if seconds is not None and (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)  # .nan would never end a problem's search; .inf neither
        or seconds <= 0
    ):
        raise fail("budget.seconds", f"a positive finite number, got {seconds!r}")
    return Budget(trials=trials, seconds=seconds, max_pruned=max_pruned)


def _parse_problems(spec, kernel, fail) -> list:
    if not isinstance(spec, list) or not spec:
        raise fail(
            "problems", "a non-empty list of problems, e.g. [{head_dim: 128, seqlen_q: 4096}]"
        )
    problems: list = []
    for index, item in enumerate(spec):
        where = f"problems[{index}]"
        if not isinstance(item, dict):
            raise fail(where, f"a mapping of problem fields, got {item!r}")
        keys = list(item)
        axes = [v if isinstance(v, list) else [v] for v in item.values()]
        for key, axis in zip(keys, axes):
            if not axis:
                raise fail(f"{where}.{key}", "an empty list")
        for combo in itertools.product(*axes):
            fields = dict(zip(keys, combo))
            try:
                problem = kernel.problem_from_job(fields)
            except (ValueError, TypeError) as exc:
                raise fail(where, f"{exc} (in {fields})") from exc
            if problem not in problems:
                problems.append(problem)
    return problems
