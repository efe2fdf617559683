"""The search over several plugins at once: their parameters side by side (a knob declared by two
plugins is an error), knobs no plugin searches fixed at the kernel's default for the problem, and
the kernel family's rules (with any rules of the plugins' own) deciding whether a config may reach
the backend. A config leaves here as the family's config value, canonical: two params that build the
same kernel give equal configs."""

from __future__ import annotations

import hashlib
import json

from ..best import config_key
from ..errors import SpaceError
from .base import Param, SearchSpace, _same


class ComposedSpace:
    def __init__(self, kernel, spaces: list[SearchSpace]) -> None:
        if not spaces:
            raise SpaceError("a search needs at least one search space")
        owner: dict[str, str] = {}
        for space in spaces:
            for param in space.domains:
                if param in owner:
                    raise SpaceError(
                        f"parameter {param!r} is declared by both space {owner[param]!r} and space "
                        f"{space.name!r}; drop one of them from the job"
                    )
                owner[param] = space.name
        self.kernel = kernel
        self.spaces = list(spaces)
        self.owner = owner

    @property
    def param_names(self) -> list[str]:
        return list(self.owner)

    # ---- per-problem domains and defaults -------------------------------------------------------
    def default_values(self, problem, target) -> dict:
        """The knob values of the kernel's default for the problem, with the starting values of
        plugins that override `SearchSpace.default` (each for its own knobs)."""
        config = self.kernel.default_config(problem, target).to_dict()
        for space in self.spaces:
            if type(space).default is SearchSpace.default:
                continue
            values = space.default(problem, target)
            stray = sorted(set(values) - set(space.domains)) if isinstance(values, dict) else None
            if stray is None or stray:
                raise SpaceError(
                    f"space {space.name!r}: default() must return a dict of its own knobs "
                    f"({', '.join(space.domains)}), got {values!r}"
                )
            config.update(values)
        return config

    def domains(self, problem, target) -> dict[str, Param]:
        """Each parameter's domain, widened to hold the problem's default, making it measurable."""
        default = self.default_values(problem, target)
        return {
            name: domain.with_value(default[name])
            for space in self.spaces
            for name, domain in space.domains.items()
        }

    def default_params(self, problem, target) -> dict:
        default = self.default_values(problem, target)
        return {name: default[name] for name in self.param_names}

    def size(self, problem, target) -> int | None:
        """Number of distinct configs, or None when a parameter is continuous."""
        total = 1
        for domain in self.domains(problem, target).values():
            values = domain.values()
            if values is None:
                return None
            total *= len(values)
        return total

    def grid(self, problem, target) -> dict[str, list]:
        grid = {}
        for name, domain in self.domains(problem, target).items():
            values = domain.values()
            if values is None:
                raise SpaceError(
                    f"the grid sampler needs a finite domain, but {name} is a continuous range "
                    f"({domain.describe()}); give it a step or a list of values"
                )
            grid[name] = values
        return grid

    def signature(self) -> str:
        """A short hash of the spaces and their domains: part of a study's name, so that a resumed
        search never continues a study over another space."""
        described = {
            space.name: {name: domain.describe() for name, domain in space.domains.items()}
            for space in self.spaces
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:10]

    # ---- one trial ------------------------------------------------------------------------------
    def suggest(self, trial, problem, target) -> dict:
        domains = self.domains(problem, target)
        params: dict = {}
        for space in self.spaces:
            params.update(space.suggest(trial, problem, target, domains))
        return params

    def full_config(self, problem, target, params: dict):
        """The kernel's config: its default for the problem with the searched parameters replaced,
        in canonical form (knobs without effect reset), so equal kernels get equal configs."""
        return self.kernel.config({**self.default_values(problem, target), **params}).canonical()

    def default_config(self, problem, target):
        """The config the search measures first."""
        return self.full_config(problem, target, self.default_params(problem, target))

    def probes(self, problem, target, count: int) -> list[dict]:
        """Up to `count` params that each change one knob of the problem's default, feasible and
        distinct as kernels: first the nearest other value of every knob in turn (for numbers the
        next one up or down; both, the larger first, when they are equally near), then the next
        nearest, and so on. Knobs with a continuous domain are not probed. Measured right after the
        default, they show the sampler which single knobs matter before it models the space.

        A value that is infeasible beside the default's other knobs (four consumer warpgroups with
        the default's wide K/V blocks, say) is probed with the nearest feasible change of one or two
        other knobs: each other value counts as its place in that knob's order (1 for the nearest),
        a change as the sum, fewer knobs first on a tie. Otherwise such a value would only ever be
        measured if the sampler happened on a feasible combination by chance."""
        if count <= 0:
            return []
        default = self.default_params(problem, target)
        seen = {config_key(self.full_config(problem, target, default))}
        alternatives, levels = {}, {}
        for name, domain in self.domains(problem, target).items():
            values = [v for v in (domain.values() or []) if not _same(v, default[name])]
            if all(
                isinstance(v, (int, float)) and not isinstance(v, bool)
                for v in [*values, default[name]]
            ):
                values.sort(key=lambda v: (abs(v - default[name]), -v))
                distances = sorted({abs(v - default[name]) for v in values})
                levels[name] = [distances.index(abs(v - default[name])) for v in values]
            else:
                levels[name] = list(range(len(values)))
            alternatives[name] = values

        checked: dict[str, bool] = {}  # config key -> feasible; repairs try the same configs often

        def feasible(params: dict):
            config = self.full_config(problem, target, params)
            key = config_key(config)
            if key not in checked:
                checked[key] = not self.check(problem, config, target)
            return key if checked[key] else None

        probes = []
        for level in range(max((len(v) for v in alternatives.values()), default=0)):
            for name, values in alternatives.items():
                for value in (v for v, lv in zip(values, levels[name]) if lv == level):
                    params = {**default, name: value}
                    key = feasible(params)
                    if key is None:
                        params, key = self._repair(params, name, alternatives, feasible)
                    if key is None or key in seen:
                        continue
                    seen.add(key)
                    probes.append(params)
                    if len(probes) >= count:
                        return probes
        return probes

    @staticmethod
    def _repair(
        params: dict, fixed: str, alternatives: dict, feasible
    ) -> tuple[dict | None, str | None]:
        """The nearest feasible params that keep `fixed` and change one or two other knobs to their
        listed alternatives (distance: the sum of the alternatives' places, 1 for the nearest; one
        knob before two at equal distance), with its config key; (None, None) if there is none."""
        others = [
            (name, values) for name, values in alternatives.items() if name != fixed and values
        ]
        longest = max((len(values) for _, values in others), default=0)
        for distance in range(1, 2 * longest + 1):
            for name, values in others:
                if distance <= len(values):
                    candidate = {**params, name: values[distance - 1]}
                    if (key := feasible(candidate)) is not None:
                        return candidate, key
            for i, (first, first_values) in enumerate(others):
                for second, second_values in others[i + 1 :]:
                    for a in range(1, min(distance, len(first_values) + 1)):
                        b = distance - a
                        if 1 <= b <= len(second_values):
                            candidate = {
                                **params,
                                first: first_values[a - 1],
                                second: second_values[b - 1],
                            }
                            if (key := feasible(candidate)) is not None:
                                return candidate, key
        return None, None

    def check(self, problem, config, target) -> list[str]:
        """Every reason the search passes over the config: the family's rules and what it avoids
        (KernelFamily.avoid_reasons), then the plugins' own."""
        reasons = self.kernel.infeasible_reasons(problem, config, target)
        reasons += self.kernel.avoid_reasons(problem, config, target)
        for space in self.spaces:
            if type(space).check is SearchSpace.check:
                continue
            try:
                found = space.check(problem, config, target)
            except Exception as exc:  # a plugin's bug, named as such
                raise SpaceError(
                    f"space {space.name!r}: check() raised {type(exc).__name__}: {exc} (config "
                    f"{config.to_dict()})"
                ) from exc
            if not isinstance(found, (list, tuple)):
                raise SpaceError(
                    f"space {space.name!r}: check() must return a list of reasons, got {found!r}"
                )
            reasons.extend(str(r) for r in found)
        return reasons

    def describe(self, problem, target) -> list[str]:
        lines = []
        for space in self.spaces:
            for name in space.domains:
                lines.append(
                    f"{space.name}.{name}: {self.domains(problem, target)[name].describe()}"
                )
        return lines
