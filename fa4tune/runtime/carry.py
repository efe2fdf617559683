"""Carry a tuned table over a kernel change that leaves its compiled code alone.

A table names the kernel code it was tuned for (its `kernel_hash`, over the kernel files' code). Any
code edit, a refactor or a host-side mend included, gives a new hash and so a stale table until a
re-tune on the GPU. But a table's measurements stay true for as long as what runs stays the same:
the compiled kernel and the launch fa4tune makes of it. `carry_table` checks exactly that on the
CPU, entry by entry, between the tree the table was tuned on (a git revision) and the installed one:

- the compiled kernel: the DSL's module after canonicalisation (host launch code and device kernel,
  `CUTE_DSL_KEEP=ir`) and the PTX built from it (`ptx`), both compiled for the table's arch, with
  the module path in the kernel's symbol names left out (a moved module compiles to the same code);
- the run-time arguments that fa4tune's Python passes at launch and that shape the work: the number
  of heads run side by side for L2 reuse, and whether the kernel takes its tiles from a counter.

Not checked: the DSL itself (both trees compile with the installed one; the kernel hash does not
cover it either), and the Python that prepares the tensors and the softmax scale for a launch, which
the correctness tests cover. Each tree is compiled in its own Python process (the old one from
`git archive`), with the DSL's file cache off. Only when every entry agrees is the table rewritten,
with the installed hash and a record of the carry (`carried`: from which hash and revision, how
checked, when). Anything else is a CarryError that names the entries whose code changed: those need
a re-tune.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from io import BytesIO
from pathlib import Path

from ..errors import Fa4tuneError
from ..kernels import get_kernel
from ..target import get_target
from .tables import read_table, write_table

# Run in each tree's own interpreter (PYTHONPATH = that tree): compiles every job read from stdin
# and prints one JSON line per job with the digests of what it compiled. It takes the kernel
# family's API (family.compile, family.launch_arguments) where the tree has one, else the API of
# trees before kernel families (interface.compile_forward, heads_per_l2_group). A kernel's symbol
# names carry the module path of its class (`fa4tunekernelsfwd_sm90FlashForwardSm90...`, cut at a
# fixed length): each symbol that holds it is renamed by its order of first use before hashing, so
# that moving the kernel's module changes no digest.
_FINGERPRINT = r"""
import hashlib, json, os, re, sys
from pathlib import Path

root = Path(sys.argv[1]).resolve()
# An editable install's finder would serve modules this tree lacks from another checkout.
sys.meta_path[:] = [f for f in sys.meta_path
                    if not any("editable" in str(getattr(x, attr, "")).lower()
                               for x in (f, type(f)) for attr in ("__module__", "__name__"))]
import fa4tune
from fa4tune.kernels import get_kernel
from fa4tune.problem import Problem
from fa4tune.target import get_target


def check_origin():
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if ((name == "fa4tune" or name.startswith("fa4tune.")) and path
                and not Path(path).resolve().is_relative_to(root)):
            sys.exit(f"imported {name} from {path}, not from the tree at {root}")


def compile_and_launch(spec, problem, config, target):
    if hasattr(spec, "launch_arguments"):  # a kernel family
        return (spec.compile(problem, config, target, use_cache=False),
                spec.launch_arguments(problem, config, target))
    from fa4tune.kernels import interface
    compiled = interface.compile_forward(config, problem.dtype, problem.head_dim,
                                         problem.head_dim_v, problem.causal, target,
                                         use_cache=False)
    return compiled, {"heads_per_l2_group": interface.heads_per_l2_group(problem, target),
                      "tile_counter": bool(config.uses_tile_counter(problem.causal))}


check_origin()
dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
print(json.dumps({"hash": get_kernel(sys.argv[2]).source_hash()}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    spec, target = get_kernel(job["kernel"]), get_target(job["target"])
    family = hasattr(spec, "launch_arguments")
    problem = spec.problem(job["problem"]) if family else Problem.from_dict(job["problem"])
    config = spec.config(job["config"]) if family else spec.make_config(job["config"])
    for old in dump.iterdir():
        old.unlink()
    compiled, launch = compile_and_launch(spec, problem, config, target)
    cls = type(compiled.kernel)
    mangled = re.escape((cls.__module__.replace(".", "") + cls.__qualname__).encode())
    digests = {}
    for path in sorted(dump.iterdir()):
        kind = ("ir" if path.name.endswith(".mlir")
                else "ptx" if path.name.endswith(".ptx") else None)
        if kind is None:
            continue
        if kind in digests:
            sys.exit(f"two {kind} files for one compile in {dump}")
        names = {}
        text = re.sub(rb"[A-Za-z0-9_]*" + mangled + rb"[A-Za-z0-9_]*",
                      lambda m: names.setdefault(m.group(0), b"SYMBOL%d" % len(names)),
                      path.read_bytes())
        digests[kind] = hashlib.sha256(text).hexdigest()
    check_origin()
    print(json.dumps({"key": job["key"], "digests": digests, "launch": launch}), flush=True)
"""

ARTIFACTS = ("ir", "ptx")


class CarryError(Fa4tuneError):
    """The table cannot be carried over: what differs, or what is missing."""


def _git(repo: Path, *args: str) -> bytes:
    try:
        return subprocess.run(
            ["git", "-C", str(repo), *args], check=True, capture_output=True
        ).stdout
    except FileNotFoundError as exc:
        raise CarryError(
            "git is not installed: carrying a table needs the revision it was tuned on"
        ) from exc
    except subprocess.CalledProcessError as exc:
        raise CarryError(
            f"git {' '.join(args)}: {exc.stderr.decode(errors='replace').strip()}"
        ) from exc


def export_tree(repo: Path, rev: str, into: Path) -> str:
    """The `fa4tune` package of `rev` written under `into`; returns the full commit id."""
    commit = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    top = Path(
        _git(repo, "rev-parse", "--show-toplevel").decode().strip()
    )  # `repo` may be inside it
    archive = _git(top, "archive", "--format=tar", commit, "fa4tune")
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, filter="data")
        else:  # a Python without extraction filters: git's own archive of the repository
            tar.extractall(into)
    return commit


def fingerprints(
    root: Path, kernel: str, jobs: list[dict], dump: Path, timeout: float = 3600
) -> tuple[str, dict]:
    """(kernel hash, {job key: {"digests", "launch"}}) of the fa4tune tree at `root`: every job is
    compiled, for its target's arch, in one child interpreter that imports nothing of fa4tune from
    elsewhere."""
    dump.mkdir(parents=True, exist_ok=True)
    arches = {get_target(job["target"]).arch for job in jobs}
    if len(arches) > 1:
        raise CarryError(f"one table, one arch; these jobs are for {', '.join(sorted(arches))}")
    # The user's DSL settings stay out (line info, debug code and the like would change the PTX of
    # both trees, or of one); the tree comes first on the path, before the user's own entries.
    env = {name: value for name, value in os.environ.items() if not name.startswith("CUTE_DSL_")}
    env.update(
        PYTHONPATH=os.pathsep.join(
            [str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        ),
        CUTE_DSL_KEEP=",".join(ARTIFACTS),
        CUTE_DSL_DUMP_DIR=str(dump),
        CUTE_DSL_DISABLE_FILE_CACHING="1",
        CUTE_DSL_ARCH=arches.pop() if arches else "sm_90a",
    )
    stdin = "".join(json.dumps(job) + "\n" for job in jobs)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _FINGERPRINT, str(root), kernel],
            input=stdin,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(dump),
        )
    except subprocess.TimeoutExpired as exc:
        raise CarryError(
            f"compiling {len(jobs)} configs of the tree at {root} took over {timeout:.0f} s"
        ) from exc
    if done.returncode:
        raise CarryError(
            f"compiling the configs of the tree at {root} failed (exit {done.returncode}):\n"
            + (done.stderr.strip()[-3000:] or done.stdout.strip()[-3000:])
        )
    lines = []
    for line in done.stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue  # the DSL's or a library's own output
    lines = [line for line in lines if isinstance(line, dict)]
    if not lines or "hash" not in lines[0]:
        raise CarryError(f"the tree at {root} printed no kernel hash:\n{done.stdout[-2000:]}")
    results = {line["key"]: line for line in lines[1:] if "key" in line}
    missing = [job["name"] for job in jobs if job["key"] not in results]
    if missing:
        raise CarryError(f"the tree at {root} compiled no code for {', '.join(missing)}")
    for job in jobs:
        result = results[job["key"]]
        if set(result["digests"]) != set(ARTIFACTS):
            raise CarryError(
                f"{job['name']}: the DSL kept {sorted(result['digests'])} of {list(ARTIFACTS)} "
                f"(CUTE_DSL_KEEP={env['CUTE_DSL_KEEP']}); this DSL version cannot be checked"
            )
    return lines[0]["hash"], results


def table_jobs(document: dict) -> list[dict]:
    """One compile job per table entry (the launch arguments depend on the whole problem, not only
    on what the compile sees)."""
    return [
        {
            "key": str(index),
            "name": row["problem_key"],
            "kernel": document["kernel"],
            "target": document["target"],
            "problem": row["problem"],
            "config": row["config"],
        }
        for index, row in enumerate(document["entries"])
    ]


def installed_tree() -> Path:
    """The root of the installed fa4tune tree (the directory holding the package)."""
    return Path(__file__).resolve().parents[2]


def carry_table(
    path: str | os.PathLike,
    rev: str,
    repo: str | os.PathLike = ".",
    write: bool = False,
    say=print,
    tree: str | os.PathLike | None = None,
    now: datetime | None = None,
) -> dict:
    """Check that the fa4tune tree at `tree` (default: the installed one) compiles every entry of
    the table at `path` to the code that the tree at git revision `rev` of `repo` compiles it to,
    and launches it alike; with `write`, rewrite the table (YAML and JSON) for the new tree's kernel
    hash. Returns the carried document; CarryError when it cannot be carried (TableError when it
    cannot be written: the YAML and JSON pair is then put back as it was)."""
    path = Path(path)
    document = read_table(path)
    spec = get_kernel(document["kernel"])
    tree = Path(tree).resolve() if tree is not None else installed_tree()
    repo = Path(repo).resolve()
    jobs = table_jobs(document)
    with tempfile.TemporaryDirectory(prefix="fa4tune-carry-") as tmp:
        tmp = Path(tmp)
        new_hash, _ = fingerprints(tree, spec.name, [], tmp / "dump-new")
        if document["kernel_hash"] == new_hash:
            raise CarryError(
                f"{path}: already tuned for the {spec.name} code of {tree} ({new_hash[:12]}); "
                "nothing to carry"
            )
        commit = export_tree(repo, rev, tmp / "old")
        old_hash, _ = fingerprints(tmp / "old", spec.name, [], tmp / "dump-old")
        if old_hash != document["kernel_hash"]:
            raise CarryError(
                f"{path} was tuned for {spec.name} {document['kernel_hash'][:12]}, but its code at "
                f"{rev} ({commit[:12]}) hashes to {old_hash[:12]}: name the "
                "revision it was tuned on"
            )
        say(
            f"fa4tune carry: compiling {len(jobs)} entries with {spec.name} at "
            f"{commit[:12]} ({old_hash[:12]}) ..."
        )
        _, old = fingerprints(tmp / "old", spec.name, jobs, tmp / "dump-old")
        say(
            f"fa4tune carry: compiling {len(jobs)} entries with {spec.name} of "
            f"{tree} ({new_hash[:12]}) ..."
        )
        _, new = fingerprints(tree, spec.name, jobs, tmp / "dump-new")
    changed = []
    for job in jobs:
        a, b = old[job["key"]], new[job["key"]]
        what = [kind for kind in ARTIFACTS if a["digests"][kind] != b["digests"][kind]]
        what += [
            f"{name} {a['launch'][name]} -> {b['launch'].get(name)}"
            for name in a["launch"]
            if a["launch"][name] != b["launch"].get(name)
        ]
        if what:
            changed.append(f"{job['name']} ({', '.join(what)})")
    if changed:
        raise CarryError(
            f"{path}: the code of {len(changed)} of {len(jobs)} entries changed from "
            f"{old_hash[:12]} to {new_hash[:12]}; re-tune them:\n  " + "\n  ".join(changed)
        )
    carried = dict(document)
    record = {
        "from_hash": old_hash,
        "from_revision": commit,
        "to_hash": new_hash,
        "checked": (
            f"{', '.join(ARTIFACTS)} and launch arguments of all {len(jobs)} entries identical"
        ),
        "date": (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    carried["carried"] = list(document.get("carried", [])) + [record]
    carried["kernel_hash"] = new_hash
    say(
        f"fa4tune carry: all {len(jobs)} entries compile to the same code and launch; "
        f"{old_hash[:12]} -> {new_hash[:12]}"
    )
    if write:
        say(f"fa4tune carry: wrote {', '.join(write_table(carried, path))}")
    return carried
