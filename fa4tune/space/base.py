"""The search-space plugin interface: a plugin names some of the kernel's knobs with their domains,
gives their defaults for a problem, suggests them define-by-run from an Optuna trial, and rejects
configs that cannot compile or cannot be right, with a reason, before anything is measured."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import SpaceError


# ---- parameter domains --------------------------------------------------------------------------
class Param:
    """One knob's domain. Subclasses: Choice (a list) and Range (int or float, optional step)."""

    def suggest(self, trial, name: str):
        raise NotImplementedError

    def values(self) -> list | None:
        """Every value, when the domain is finite; None for a continuous range."""
        raise NotImplementedError

    def contains(self, value) -> bool:
        raise NotImplementedError

    def with_value(self, value) -> Param:
        """This domain widened to hold `value` (the problem's default must always be measurable)."""
        if self.contains(value):
            return self
        return Choice(sorted(set(self.values() or []) | {value}, key=_sort_key))

    def describe(self) -> str:
        raise NotImplementedError


def _sort_key(value):
    return (str(type(value).__name__), value)


@dataclass(frozen=True)
class Choice(Param):
    choices: tuple

    def __init__(self, choices: Sequence):
        choices = tuple(choices)
        if not choices:
            raise SpaceError("a choice parameter needs at least one value")
        object.__setattr__(self, "choices", choices)

    def suggest(self, trial, name: str):
        return trial.suggest_categorical(name, self.choices)

    def values(self) -> list:
        return list(self.choices)

    def contains(self, value) -> bool:
        return any(_same(value, c) for c in self.choices)

    def describe(self) -> str:
        return "[" + ", ".join(map(repr, self.choices)) + "]"


@dataclass(frozen=True)
class Range(Param):
    low: float
    high: float
    step: float | None = None
    log: bool = False
    integer: bool = False

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise SpaceError(f"range low {self.low} is above high {self.high}")
        if self.step is not None and self.step <= 0:
            raise SpaceError(f"range step must be positive, got {self.step}")
        if self.log and (self.low <= 0 or self.step is not None):
            raise SpaceError("a log range needs a positive low and no step")

    def suggest(self, trial, name: str):
        if self.integer:
            return trial.suggest_int(
                name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log
            )
        return trial.suggest_float(name, self.low, self.high, step=self.step, log=self.log)

    def values(self) -> list | None:
        if self.integer:
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.step is None:
            return None
        count = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        return [round(self.low + i * self.step, 12) for i in range(count)]

    def contains(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and int(value) != value:
            return False
        if not self.low - 1e-12 <= value <= self.high + 1e-12:
            return False
        if self.step is None:
            return True
        k = (value - self.low) / self.step
        return abs(k - round(k)) < 1e-9

    def with_value(self, value) -> Param:
        """A continuous range widens to the value (a Choice of it alone would drop the range)."""
        if (
            self.contains(value)
            or self.values() is not None
            or not isinstance(value, (int, float))
            or isinstance(value, bool)
        ):
            return super().with_value(value)
        return Range(min(self.low, value), max(self.high, value), log=self.log and value > 0)

    def describe(self) -> str:
        kind = "int" if self.integer else "float"
        step = f" step {self.step:g}" if self.step else ""
        return f"{kind} {self.low:g}..{self.high:g}{step}{' log' if self.log else ''}"


def _same(a, b) -> bool:
    # True == 1 in Python; a knob domain must keep bools and numbers apart.
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def domain_of(values: Sequence) -> Param:
    """The natural domain for a kernel knob's legal values: an evenly spaced numeric run becomes a
    stepped range (samplers such as TPE, CMA-ES and GP model it as ordered), anything else a
    choice."""
    values = list(values)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numeric and len(values) >= 3 and values == sorted(values):
        steps = {round(b - a, 12) for a, b in zip(values, values[1:])}
        if len(steps) == 1:
            step = steps.pop()
            if all(isinstance(v, int) for v in values):
                return Range(values[0], values[-1], step=int(step), integer=True)
            return Range(float(values[0]), float(values[-1]), step=float(step))
    return Choice(values)


def parse_domain(spec: Any, where: str) -> Param:
    """A domain written in a job file: a list of values, or {low, high[, step][, log]}."""
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise SpaceError(f"{where}: an empty list of values")
        return Choice(spec)
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - {"low", "high", "step", "log"})
        if unknown or "low" not in spec or "high" not in spec:
            raise SpaceError(
                f"{where}: a range is written {{low: L, high: H, step: S, "
                f"log: false}}, got {spec!r}"
            )
        low, high, step = spec["low"], spec["high"], spec.get("step")
        for key, value in (("low", low), ("high", high), ("step", step)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise SpaceError(f"{where}.{key}: a number is needed, got {value!r}")
        integer = all(isinstance(v, int) for v in (low, high, step) if v is not None)
        return Range(low, high, step=step, log=bool(spec.get("log", False)), integer=integer)
    # A single value pins the knob.
    return Choice([spec])


# ---- the plugin base class ----------------------------------------------------------------------
class SearchSpace:
    """A search-space plugin. Subclasses set `name` and `knobs` (the kernel knobs they search); most
    need nothing else. The kernel family's rules judge every config; override `check` for rules of
    the plugin's own. Override `params` for a domain narrower than the kernel's legal values,
    `default` for a default other than the kernel's, `suggest` for conditional params."""

    name: ClassVar[str] = ""
    knobs: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""

    def __init__(self, kernel, overrides: dict[str, Param] | None = None) -> None:
        self.kernel = kernel
        base = self._checked_params()
        overrides = overrides or {}
        unknown = sorted(set(overrides) - set(base))
        if unknown:
            raise SpaceError(
                f"space {self.name!r} has no parameter {', '.join(map(repr, unknown))}; "
                f"its parameters: {', '.join(base) or 'none'}"
            )
        overrides = dict(overrides)
        for name, domain in overrides.items():
            legal = base[name].values()
            # A range without a step (YAML's {low: 0, high: 8} is an integer one) over a knob with a
            # few legal values, some of the range's values not among them, means the legal values
            # in it: its ends alone being legal does not make the values between them legal.
            if (
                legal is not None
                and isinstance(domain, Range)
                and domain.step is None
                and (
                    domain.values() is None
                    or not all(base[name].contains(v) for v in domain.values())
                )
            ):
                inside = [v for v in legal if domain.low - 1e-12 <= v <= domain.high + 1e-12]
                if not inside:
                    raise SpaceError(
                        f"space {self.name!r}: {name} range {domain.describe()} holds none of its "
                        f"values {base[name].describe()}"
                    )
                overrides[name] = domain_of(inside)  # an evenly spaced run stays an ordered range
                continue
            illegal = [
                v
                for v in (domain.values() or [domain.low, domain.high])
                if not base[name].contains(v)
            ]
            if illegal:
                raise SpaceError(
                    f"space {self.name!r}: {name} value(s) {', '.join(map(repr, illegal))} are "
                    f"outside its domain {base[name].describe()}"
                )
        self.domains: dict[str, Param] = {**base, **overrides}

    def _checked_params(self) -> dict[str, Param]:
        """params(), checked against the class's knobs and the kernel's legal values: a plugin's
        mistake is named here, before any search, not as a traceback in the middle of one."""
        who = f"space {self.name!r} ({type(self).__module__}.{type(self).__qualname__})"
        base = self.params()
        if not isinstance(base, dict):
            raise SpaceError(
                f"{who}: params() must return a dict of knob name to domain, "
                f"got {type(base).__name__}"
            )
        if set(base) != set(self.knobs):
            raise SpaceError(
                f"{who}: params() must give a domain to each of its knobs "
                f"({', '.join(self.knobs)}); it gave {', '.join(map(str, base)) or 'none'}"
            )
        legal = self.kernel.knobs
        for name, domain in base.items():
            if not isinstance(domain, Param):
                raise SpaceError(
                    f"{who}: the domain of {name} must be a Choice or a Range, got {domain!r}"
                )
            values = domain.values()
            if name in legal and values is None:
                raise SpaceError(
                    f"{who}: {name} is a continuous range ({domain.describe()}), but "
                    f"the kernel takes only {', '.join(map(repr, legal[name]))}: give "
                    "it a step or a list of values"
                )
            if name in legal and values is not None:
                illegal = [v for v in values if not any(_same(v, ok) for ok in legal[name])]
                if illegal:
                    raise SpaceError(
                        f"{who}: {name} value(s) {', '.join(map(repr, illegal))} are not values "
                        f"the kernel takes ({', '.join(map(repr, legal[name]))})"
                    )
        return base

    def params(self) -> dict[str, Param]:
        """The full domain of each parameter: by default the kernel's legal values of that knob."""
        legal = self.kernel.knobs
        missing = [k for k in self.knobs if k not in legal]
        if missing:
            raise SpaceError(
                f"space {self.name!r} searches {', '.join(missing)}, which kernel "
                f"{self.kernel.name} does not have; its knobs: {', '.join(legal)}"
            )
        return {k: domain_of(legal[k]) for k in self.knobs}

    def default(self, problem, target) -> dict:
        """This plugin's knobs in the kernel's default config for the problem."""
        config = self.kernel.default_config(problem, target).to_dict()
        return {k: config[k] for k in self.domains}

    def suggest(self, trial, problem, target, domains: dict[str, Param] | None = None) -> dict:
        """Define-by-run: ask the trial for each parameter."""
        domains = domains or self.domains
        return {name: domains[name].suggest(trial, name) for name in self.domains}

    def check(self, problem, config, target) -> list[str]:
        """Reasons the full config (the kernel's config value) is infeasible beyond the kernel
        family's own rules, which always apply; empty when it is fine."""
        return []
