"""Reading the YAML / JSON documents fa4tune takes (jobs, tables) with errors that name the file,
and writing files whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml


def load_document(path: str | os.PathLike, what: str, error: type[Exception]) -> tuple[str, object]:
    """(text, parsed data) of a YAML file, or JSON by its suffix; `error` names the file, and for
    YAML the line and column of a syntax error."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:  # a binary file (a results DB, say) given in its place
        raise error(
            f"cannot read {what} {path}: not {exc.encoding} text (byte {exc.start} is "
            f"0x{exc.object[exc.start : exc.start + 1].hex()}); is it a {what}?"
        ) from exc
    if path.suffix == ".json":
        try:
            return text, json.loads(text)
        except json.JSONDecodeError as exc:
            raise error(
                f"{path}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from exc
    try:
        # libyaml's loader when present: a shipped table loads several times faster.
        return text, yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"{path}: malformed YAML{where}: {problem}") from exc


def unwritable_ancestor(path: Path) -> Path | None:
    """Where creating `path` (and its missing parent directories) would fail: its nearest existing
    ancestor, when that is not a writable directory; None when it can be created."""
    existing = path.parent if str(path.parent) else Path(".")
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return existing
    return None if _can_create_in(existing) else existing


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be made in `directory`. os.access answers from the permission bits, which
    do not bind root and know nothing of a read-only mount or of /proc, which refuses new files: so
    a probe file is made and removed at once."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".fa4tune-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; these files are for sharing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
