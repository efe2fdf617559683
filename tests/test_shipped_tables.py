"""The tuned tables fa4tune ships (tuning_configs/tables, reached through fa4tune/shipped_tables):
every entry is a measured, feasible config that the lookup returns for its problem, and a wheel
carries them."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fa4tune.kernels import get_kernel
from fa4tune.problem import Problem
from fa4tune.runtime.lookup import PACKAGE_TABLES, Lookup
from fa4tune.runtime.tables import read_table
from fa4tune.target import get_target

REPO = Path(__file__).resolve().parent.parent
TABLES = sorted(PACKAGE_TABLES.glob("*.yaml"))


def test_the_package_reaches_the_tables_of_tuning_configs():
    assert TABLES, f"no shipped table under {PACKAGE_TABLES}"
    assert PACKAGE_TABLES.resolve() == (REPO / "tuning_configs" / "tables").resolve()


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_every_shipped_entry_is_measured_feasible_and_found(path):
    table = read_table(path)
    assert table["entries"]
    kernel, target = get_kernel(table["kernel"]), get_target(table["target"])
    lookup = Lookup(path)
    for entry in table["entries"]:
        problem, config = Problem.from_dict(entry["problem"]), kernel.config(entry["config"])
        assert not entry["is_estimate"], (
            f"{entry['problem_key']}: a cost-model estimate in a shipped table"
        )
        assert entry["provenance"].get("backend") == "gpu" and entry["provenance"].get("confirmed")
        assert kernel.infeasible_reasons(problem, config, target) == []
        assert kernel.avoid_reasons(problem, config, target) == [], entry["problem_key"]
        found = lookup(problem, target, kernel.name)
        assert (found.source, found.config) == ("exact", config)


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_every_shipped_table_was_tuned_for_the_installed_kernel_code(path):
    """A kernel code change without a re-tune (or a carry, for code that compiles the same) would
    ship configs measured on other code (the lookup still uses them, with a warning). Comments and
    docstrings do not count (tests/test_kernel_hash.py)."""
    table = read_table(path)
    installed = get_kernel(table["kernel"]).source_hash()
    assert table["kernel_hash"] == installed, (
        f"{path.name} was tuned for {table['kernel']} {table['kernel_hash'][:12]}, "
        f"installed {installed[:12]}: "
        "re-tune it (fa4tune search); if the change leaves the compiled code alone, `fa4tune carry "
        f"tuning_configs/tables/{path.name} --from REV --write` checks that and carries it"
    )


def test_a_wheel_carries_the_shipped_tables(tmp_path):
    # Built from a copy without build/ and *.egg-info: a stale build/lib would carry the tables even
    # if the package data were gone (and the build would write into the checkout).
    source = tmp_path / "src"
    shutil.copytree(
        REPO,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            "fa4tune-results",
            ".gpuA",
            ".gpuB",
            ".run",
            ".whl",
            "out",
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("fa4tune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for table in TABLES:
        assert f"fa4tune/shipped_tables/{table.name}" in names
