"""Search-space plugins: the registry. Built-ins live in this package; third-party plugins register
a SearchSpace subclass under the entry-point group `fa4tune.spaces`:

    [project.entry-points."fa4tune.spaces"]
    my_space = "my_package.my_module:MySpace"
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points

from ..errors import SpaceError
from .base import Choice, Param, Range, SearchSpace, domain_of, parse_domain
from .compose import ComposedSpace

ENTRY_POINT_GROUP = "fa4tune.spaces"

_BUILTINS = {
    "tiles": "fa4tune.space.tiles:TilesSpace",
    "pipeline": "fa4tune.space.pipeline:PipelineSpace",
    "exp2": "fa4tune.space.exp2:Exp2Space",
    "softmax": "fa4tune.space.softmax:SoftmaxSpace",
    "decode": "fa4tune.space.decode:DecodeSpace",
    "backward": "fa4tune.space.backward:BackwardSpace",
}

_registered: dict[str, type[SearchSpace]] = {}
_discovered: dict[str, type[SearchSpace]] | None = None
_lock = threading.Lock()


def register_space(cls: type[SearchSpace]) -> type[SearchSpace]:
    """Register a plugin class by its `name` (usable as a decorator)."""
    _validate_class(cls, f"class {cls.__module__}.{cls.__qualname__}")
    _registered[cls.name] = cls
    return cls


def _validate_class(cls, origin: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, SearchSpace)):
        raise SpaceError(f"{origin} is not a fa4tune.space.SearchSpace subclass")
    if not cls.name or not cls.knobs:
        raise SpaceError(f"{origin} must set `name` and `knobs`")


def _load(target: str) -> type:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _load_entry_point(ep) -> type[SearchSpace]:
    origin = f"entry point {ep.name!r} = {ep.value!r} ({ENTRY_POINT_GROUP})"
    try:
        cls = ep.load()
    except Exception as exc:  # a broken plugin must say which one it is
        raise SpaceError(f"cannot load search space {origin}: {type(exc).__name__}: {exc}") from exc
    _validate_class(cls, origin)
    if cls.name != ep.name:
        raise SpaceError(
            f"{origin} names its class {cls.name!r}; the entry point must use that name"
        )
    if ep.name in _BUILTINS:
        raise SpaceError(f"{origin} reuses the built-in space name {ep.name!r}")
    return cls


def _discover() -> dict[str, type[SearchSpace]]:
    return {ep.name: _load_entry_point(ep) for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_spaces() -> dict[str, type[SearchSpace]]:
    """Every known plugin class by name: built-ins, registered ones, and entry points."""
    global _discovered
    with _lock:
        if _discovered is None:
            _discovered = _discover()
        spaces = {name: _load(target) for name, target in _BUILTINS.items()}
        spaces.update(_discovered)
        spaces.update(_registered)
        return spaces


def rediscover() -> None:
    """Forget the entry points seen so far (after installing a plugin in the same process)."""
    global _discovered
    with _lock:
        _discovered = None


def get_space(name: str) -> type[SearchSpace]:
    """A plugin class by name. Built-in and registered ones are found without loading the entry
    points, so that a broken third-party plugin stops only the jobs that name it (or an unknown
    name)."""
    if name in _registered:
        return _registered[name]
    if name in _BUILTINS:
        return _load(_BUILTINS[name])
    with _lock:
        if _discovered is not None and name in _discovered:
            return _discovered[name]
    named = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if named:
        return _load_entry_point(named[0])
    spaces = available_spaces()  # unknown: the error lists every space (and names a broken plugin)
    if name not in spaces:
        raise SpaceError(
            f"unknown search space {name!r}; known spaces: {', '.join(sorted(spaces))}"
        )
    return spaces[name]


def compose(kernel, spec: dict[str, dict[str, Param]] | None = None) -> ComposedSpace:
    """The search over the named plugins, each with optional narrowed domains; None means the
    kernel's default spaces."""
    if spec is None:
        spec = {name: {} for name in kernel.default_spaces}
    return ComposedSpace(
        kernel, [get_space(name)(kernel, overrides) for name, overrides in spec.items()]
    )


__all__ = [
    "Choice",
    "ComposedSpace",
    "ENTRY_POINT_GROUP",
    "Param",
    "Range",
    "SearchSpace",
    "available_spaces",
    "compose",
    "domain_of",
    "get_space",
    "parse_domain",
    "rediscover",
    "register_space",
]
