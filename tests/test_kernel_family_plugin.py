"""A kernel family is a plugin: a third-party one, known only through its entry points (tests/
plugin_pkg/fa4tune_toyfamily: a toy matmul with its own problem kind, config, rule, space and cost
model), goes search -> results DB -> export -> lookup with no change to fa4tune's own files."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from conftest import PLUGIN_DIR, install_distribution

import fa4tune
from fa4tune.cli import main
from fa4tune.db import ResultsDB
from fa4tune.runtime.tables import read_table

PROBLEMS = [{"m": [512, 4096], "n": 1024, "k": 2048}]


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The toy family installed the way pip would expose it: a dist-info with its entry points."""
    import fa4tune.kernels
    import fa4tune.space

    site = tmp_path / "site"
    install_distribution(
        site,
        "fa4tune-toyfamily",
        "[fa4tune.kernels]\ntoy_matmul = fa4tune_toyfamily:FAMILY\n\n"
        "[fa4tune.spaces]\ntoy_blocks = fa4tune_toyfamily:ToyBlocks\n",
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    # Worker processes find it the same way (PYTHONPATH reaches the spawned children's imports).
    monkeypatch.setenv(
        "PYTHONPATH", f"{site}:{PLUGIN_DIR}:" + __import__("os").environ.get("PYTHONPATH", "")
    )
    fa4tune.kernels.rediscover()
    fa4tune.space.rediscover()
    yield sys.modules.get("fa4tune_toyfamily") or __import__("fa4tune_toyfamily")
    sys.modules.pop("fa4tune_toyfamily", None)
    monkeypatch.undo()
    fa4tune.kernels.rediscover()
    fa4tune.space.rediscover()


def toy_job(directory, **fields):
    job = {
        "name": "toy",
        "kernel": "toy_matmul",
        "backend": "model",
        "target": "H200",
        "problems": PROBLEMS,
        "sampler": "random",
        "budget": {"trials": 12},
        "seed": 0,
        **fields,
    }
    path = directory / "toy.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@pytest.mark.parametrize("workers", [None, 2])
def test_a_third_party_family_goes_search_db_export_lookup(toy_family, workdir, capsys, workers):
    db, table = workdir / "toy.db", workdir / "tables" / "toy.yaml"
    args = [
        "search",
        str(toy_job(workdir)),
        "--db",
        str(db),
        "--export",
        str(table),
        "--no-progress",
    ]
    assert main(args + (["--workers", str(workers)] if workers else [])) == 0
    out = capsys.readouterr().out
    assert "mm-m512-n1024-k2048" in out and "mm-m4096-n1024-k2048" in out, out

    with ResultsDB.open(str(db), create=False) as results:
        trials = results.trials(kernel="toy_matmul")
        best = {e.problem_key: e for e in results.best_configs(kernel="toy_matmul")}
    assert {t["source"] for t in trials} >= {"default", "probe"}
    assert all(t["config"]["block"] <= t["problem"]["m"] for t in trials if t["status"] == "ok")
    pruned = [t for t in trials if t["status"] == "pruned"]
    assert all(toy_family.BLOCK_RULE in t["reason"] for t in pruned)  # the family's rule decides
    # The cost model's optimum: block m/16 (capped at 128), split k/512.
    assert best["mm-m4096-n1024-k2048"].config == {"block": 128, "split": 4}
    assert best["mm-m512-n1024-k2048"].config == {"block": 32, "split": 4}

    document = read_table(table)
    assert (
        document["kernel"] == "toy_matmul"
        and document["kernel_hash"] == toy_family.FAMILY.source_hash()
    )
    assert json.loads(table.with_suffix(".json").read_text())["entries"] == document["entries"]
    assert main(["show", "--table", str(table)]) == 0
    assert "block=128 split=4" in capsys.readouterr().out

    problem = toy_family.MatmulProblem
    exact = fa4tune.lookup(
        problem(m=4096, n=1024, k=2048), "H200", source=table
    )  # the family by kind
    assert (exact.source, exact.config) == ("exact", toy_family.ToyConfig(block=128, split=4))
    near = fa4tune.lookup(
        problem(m=4000, n=1024, k=2048), "H200", source=str(db), kernel="toy_matmul"
    )
    assert near.source == "bucket" and near.config.block == 128
    # A lender's config must fit: block 128 does not fit m 100, which falls back to the default.
    small = fa4tune.lookup(problem(m=100, n=1024, k=2048), "H200", source=table)
    assert small.source == "nearest" and small.config.block <= 100


def test_a_third_party_family_is_named_where_families_are_listed(toy_family, capsys):
    assert main(["doctor"]) in (0, 1)
    assert "toy_matmul" in capsys.readouterr().out
    with pytest.raises(Exception, match="unknown kernel 'no_such'.*toy_matmul"):
        fa4tune.kernels.get_kernel("no_such")


def test_a_broken_plugin_leaves_the_others_loadable(toy_family, broken_family_plugin, capsys):
    """One entry point that does not load hides no other: loadable_families has the built-ins and
    the toy family and names the broken one; families() refuses, naming it; doctor checks the toy
    family and reports the broken one."""
    from fa4tune.errors import KernelError

    found, broken = fa4tune.kernels.loadable_families()
    assert {"fa4_fwd_sm90", "fa4_bwd_sm90", "toy_matmul"} <= set(found) and "broken" not in found
    [why] = broken
    assert "'broken' = 'brokenfamily_mod:FAMILY'" in why and "needs a package" in why
    with pytest.raises(KernelError, match="cannot load kernel family entry point 'broken'"):
        fa4tune.kernels.families()
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith("BAD") and "'broken'" in line for line in out.splitlines())
    assert any(line.startswith("ok") and "toy_matmul" in line for line in out.splitlines()), out
