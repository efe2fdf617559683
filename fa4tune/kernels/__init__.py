"""The kernel families: built-in ones by name, third-party ones by entry point, and ones registered
in this process. Families are imported on first use; importing a family imports neither torch nor
the CuTe DSL (family.py says what a family provides).

Third-party packages register a KernelFamily instance under the entry-point group `fa4tune.kernels`:

    [project.entry-points."fa4tune.kernels"]
    my_kernel = "my_package.my_family:FAMILY"
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points

from ..errors import KernelError
from .family import Check, KernelFamily, Peer, PeerUnavailable, Rule, Tolerance
from .source import code_text

ENTRY_POINT_GROUP = "fa4tune.kernels"
DEFAULT_KERNEL = "fa4_fwd_sm90"

_BUILTINS = {
    "fa4_fwd_sm90": "fa4tune.kernels.fa4_fwd_sm90:FAMILY",
    "fa4_bwd_sm90": "fa4tune.kernels.fa4_bwd_sm90:FAMILY",
}

_registered: dict[str, KernelFamily] = {}
_loaded: dict[str, KernelFamily] = {}
_discovered: dict[str, KernelFamily] | None = None
_unloadable: dict[str, str] = {}  # entry point name: why its family did not load
_lock = threading.RLock()


def register_family(family: KernelFamily) -> KernelFamily:
    """Register a family instance in this process (a test's, say); its name must be new."""
    _validate(family, f"family {family!r}")
    with _lock:
        if family.name in _BUILTINS:
            raise KernelError(f"kernel family {family.name!r} is a built-in name")
        _registered[family.name] = family
    return family


def unregister_family(name: str) -> None:
    with _lock:
        _registered.pop(name, None)


def _validate(family, origin: str) -> None:
    if not isinstance(family, KernelFamily):
        raise KernelError(f"{origin} is not a fa4tune.kernels.KernelFamily instance")
    if not family.name or not family.knobs or not getattr(family, "config_type", None):
        raise KernelError(f"{origin} must set `name`, `knobs` and `config_type`")


def _load(target: str) -> KernelFamily:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _builtin(name: str) -> KernelFamily:
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(_BUILTINS[name])
        return _loaded[name]


def _load_entry_point(ep) -> KernelFamily:
    origin = f"entry point {ep.name!r} = {ep.value!r} ({ENTRY_POINT_GROUP})"
    try:
        family = ep.load()
    except Exception as exc:  # a broken plugin must say which one it is
        raise KernelError(
            f"cannot load kernel family {origin}: {type(exc).__name__}: {exc}"
        ) from exc
    _validate(family, origin)
    if family.name != ep.name:
        raise KernelError(
            f"{origin} names its family {family.name!r}; the entry point must use that name"
        )
    if ep.name in _BUILTINS:
        raise KernelError(f"{origin} reuses the built-in kernel family name {ep.name!r}")
    return family


def _entry_point_families() -> dict[str, KernelFamily]:
    """The entry points' families that load; the others' errors go to _unloadable."""
    global _discovered, _unloadable
    with _lock:
        if _discovered is None:
            found, broken = {}, {}
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    found[ep.name] = _load_entry_point(ep)
                except KernelError as exc:
                    broken[ep.name] = str(exc)
            _discovered, _unloadable = found, broken
        return _discovered


def rediscover() -> None:
    """Forget the entry points seen so far (after installing a plugin in the same process)."""
    global _discovered, _unloadable
    with _lock:
        _discovered, _unloadable = None, {}


def loadable_families() -> tuple[dict[str, KernelFamily], list[str]]:
    """Every family that loads, by name (built-ins, entry points, registered ones), and why each
    third-party entry point that does not load failed: for the callers that go on without it
    (doctor reports it and checks the rest; the dispatcher serves the GPUs the others serve)."""
    found = {name: _builtin(name) for name in _BUILTINS}
    found.update(_entry_point_families())
    with _lock:
        found.update(_registered)
        broken = list(_unloadable.values())
    return found, broken


def families() -> dict[str, KernelFamily]:
    """Every known family by name: built-ins, entry points, and registered ones. An entry point
    that does not load is an error that names it (loadable_families goes on without it)."""
    found, broken = loadable_families()
    if broken:
        raise KernelError("; ".join(broken))
    return found


def get_kernel(name: str | KernelFamily | None = None) -> KernelFamily:
    """A family by name (None: the default one); an unknown name is an error that lists the known
    ones. Built-in and registered families are found without loading the entry points."""
    if isinstance(name, KernelFamily):
        return name
    key = DEFAULT_KERNEL if name is None else str(name)
    if key in _registered:
        return _registered[key]
    if key in _BUILTINS:
        return _builtin(key)
    named = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == key]
    if named:
        with _lock:
            if _discovered is not None and key in _discovered:
                return _discovered[key]
        return _load_entry_point(named[0])
    raise KernelError(f"unknown kernel {name!r}; known kernels: {', '.join(sorted(families()))}")


def family_for_problem(problem) -> KernelFamily:
    """The family that takes problems of this kind: the default family when it does, else the only
    other one that does; an error when none or several do."""
    default = get_kernel(None)
    if isinstance(problem, default.problem_type):
        return default
    takers = [f for f in families().values() if isinstance(problem, f.problem_type)]
    if len(takers) != 1:
        names = ", ".join(sorted(f.name for f in takers)) or "none"
        hint = "pass kernel=" if takers else "a problem is a fa4tune.Problem (or a family's own)"
        raise KernelError(f"which kernel family takes a {type(problem).__name__}? {names}; {hint}")
    return takers[0]


__all__ = [
    "DEFAULT_KERNEL",
    "ENTRY_POINT_GROUP",
    "Check",
    "KernelFamily",
    "Peer",
    "PeerUnavailable",
    "Rule",
    "Tolerance",
    "code_text",
    "families",
    "loadable_families",
    "family_for_problem",
    "get_kernel",
    "register_family",
    "rediscover",
    "unregister_family",
]
