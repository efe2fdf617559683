"""`fa4tune carry`: a table moves to new kernel code only when every entry compiles to the same
module and PTX and launches alike; otherwise nothing is written and the changed entries are
named."""

import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from fa4tune.cli import main
from fa4tune.kernels import get_kernel
from fa4tune.runtime.carry import CarryError, carry_table
from fa4tune.runtime.lookup import PACKAGE_TABLES
from fa4tune.runtime.tables import read_table, render_yaml

PACKAGE = Path(__file__).resolve().parent.parent / "fa4tune"
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

# Two entries of the shipped table: a persistent hdim-64 causal kernel with tile_m 192 (its heads
# per L2 group is above 1), and an hdim-128 one.
KEYS = ("bf16-d64x64-causal-q1024-k1024-b16-h32x32", "bf16-d128x128-full-q4096-k4096-b4-h16x16")


def git(repo, *args):
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def repo(tmp_path):
    """A git repository holding a copy of the installed fa4tune package, committed as v1."""
    root = tmp_path / "repo"
    shutil.copytree(
        PACKAGE, root / "fa4tune", symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "v1")
    return root


@pytest.fixture
def table(tmp_path):
    """Two shipped entries, as a table tuned on v1 (the installed code), with a carry behind it."""
    document = read_table(next(PACKAGE_TABLES.glob("h200-bf16.yaml")))
    document["entries"] = [e for e in document["entries"] if e["problem_key"] in KEYS]
    assert len(document["entries"]) == 2
    document["kernel_hash"] = get_kernel(document["kernel"]).source_hash()
    document["carried"] = [
        {
            "from_hash": "a" * 64,
            "from_revision": "b" * 40,
            "to_hash": document["kernel_hash"],
            "checked": "ir, ptx and launch arguments of all 2 entries identical",
            "date": "2026-11-28T00:00:00Z",
        }
    ]
    path = tmp_path / "table.yaml"
    path.write_text(render_yaml(document))
    return path


def edit(repo, name, old, new):
    path = repo / "fa4tune" / "kernels" / name
    text = path.read_text()
    assert old in text, f"{name} no longer has {old!r}: update this test"
    path.write_text(text.replace(old, new, 1))


def test_a_table_tuned_for_the_code_at_hand_has_nothing_to_carry(repo, table):
    with pytest.raises(CarryError, match="nothing to carry"):
        carry_table(table, "HEAD", repo=repo, tree=repo, say=lambda *a: None)


def test_the_revision_must_be_the_one_the_table_was_tuned_on(repo, table):
    edit(
        repo,
        "fa4_fwd_sm90/compile.py",
        "def compile_key(",
        "def _spare():\n    return 0\n\n\ndef compile_key(",
    )
    git(repo, "commit", "-qam", "v2")
    before = table.read_text()
    with pytest.raises(
        CarryError, match=r"hashes to [0-9a-f]{12}: name the revision it was tuned on"
    ):
        carry_table(table, "HEAD", repo=repo, tree=repo, say=lambda *a: None)
    with pytest.raises(CarryError, match="git rev-parse"):
        carry_table(table, "no-such-revision", repo=repo, tree=repo, say=lambda *a: None)
    assert main(["carry", str(table), "--from", "no-such-revision", "--repo", str(repo)]) == 2
    assert table.read_text() == before


@pytest.mark.compile
def test_a_refactor_that_compiles_to_the_same_code_carries_the_table(
    repo, table, capsys, monkeypatch
):
    tuned = read_table(table)
    edit(
        repo,
        "fa4_fwd_sm90/compile.py",
        "def compile_key(",
        "def _spare():\n    return 0\n\n\ndef compile_key(",
    )
    when = datetime(2026, 11, 29, tzinfo=timezone.utc)
    # The user's DSL settings do not reach the compiles (line info puts source line numbers into
    # the PTX, and the refactor moved lines), and the repository may be named by any directory in
    # it.
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    carried = carry_table(
        table, "HEAD", repo=repo / "fa4tune" / "kernels", tree=repo, write=True, now=when
    )
    assert "all 2 entries compile to the same code and launch" in capsys.readouterr().out
    written = read_table(table)
    assert written == read_table(table.with_suffix(".json")) == carried
    assert written["kernel_hash"] not in (tuned["kernel_hash"], None)
    assert written["entries"] == tuned["entries"]
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout
    assert written["carried"] == tuned.get("carried", []) + [
        {  # earlier carries are kept
            "from_hash": tuned["kernel_hash"],
            "from_revision": head.strip(),
            "to_hash": written["kernel_hash"],
            "checked": "ir, ptx and launch arguments of all 2 entries identical",
            "date": "2026-11-29T00:00:00Z",
        }
    ]


@pytest.mark.compile
def test_a_moved_kernel_module_carries_the_table(repo, table):
    """The kernel's symbol names carry its module's path (and are cut at a fixed length): a move of
    the module changes them, not the code."""
    family = repo / "fa4tune" / "kernels" / "fa4_fwd_sm90"
    git(
        repo,
        "mv",
        str(family / "kernel.py"),
        str(family / "forward_kernel_moved_to_a_longer_name.py"),
    )
    edit(
        repo,
        "fa4_fwd_sm90/compile.py",
        "from .kernel import",
        "from .forward_kernel_moved_to_a_longer_name import",
    )
    carried = carry_table(table, "HEAD", repo=repo, tree=repo, say=lambda *a: None)
    assert carried["entries"] == read_table(table)["entries"]
    assert carried["kernel_hash"] != read_table(table)["kernel_hash"]


@pytest.mark.compile
def test_a_change_to_the_compiled_code_or_the_launch_names_each_entry_and_writes_nothing(
    repo, table
):
    before = table.read_text()
    # The kernel: the fake counter the compile sees is declared 8-byte aligned (a different module).
    edit(
        repo,
        "fa4_fwd_sm90/compile.py",
        "memspace=AddressSpace.generic, assumed_align=4\n    )",
        "memspace=AddressSpace.generic, assumed_align=8\n    )",
    )
    with pytest.raises(CarryError) as caught:
        carry_table(table, "HEAD", repo=repo, tree=repo, write=True, say=lambda *a: None)
    message = str(caught.value)
    assert "the code of 2 of 2 entries changed" in message
    assert all(f"{key} (ir" in message for key in KEYS), message  # the PTX may well be the same
    git(repo, "checkout", "-q", "--", ".")
    # The launch only: at most 16 heads per L2 group (the hdim-64 entry has 64, the other 8).
    edit(
        repo,
        "fa4_fwd_sm90/launch.py",
        "min(group, problem.batch * problem.nheads_q)",
        "min(group, 16, problem.batch * problem.nheads_q)",
    )
    with pytest.raises(CarryError) as caught:
        carry_table(table, "HEAD", repo=repo, tree=repo, write=True, say=lambda *a: None)
    message = str(caught.value)
    assert "the code of 1 of 2 entries changed" in message
    assert f"{KEYS[0]} (heads_per_l2_group 64 -> 16)" in message and KEYS[1] not in message, message
    assert table.read_text() == before and not table.with_suffix(".json").exists()
