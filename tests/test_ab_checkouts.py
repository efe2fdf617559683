"""benchmarks/ab_checkouts.py without a GPU: bad input, the rounds' order and roots, the table."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import ab_checkouts
from benchmarks.ab_checkouts import main, table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--old", "no-such-revision"], "no git revision 'no-such-revision'"),
        (["--old", "HEAD", "--shapes", "64"], "--shapes wants head_dim:seqlen[:causal][:gN]"),
        (["--old", "HEAD", "--kernel", "nope"], "unknown kernel 'nope'"),
        (["--shapes", "64:1024"], "--old REV and --rounds >= 1 are needed"),
        (["--old", "HEAD", "--rounds", "0"], "--old REV and --rounds >= 1 are needed"),
        (["--old", "HEAD", "--set", "nope=1"], "--set wants knob=value with a knob of"),
        (["--old", "HEAD", "--set", "deterministic=maybe"], "neither a number nor true/false"),
    ],
)
def test_bad_input_says_what_is_wrong(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_shapes_name_causal_and_gqa():
    """'head_dim:seqlen[:causal][:gN]', as every benchmark script parses it (attention.parse_shape):
    16k tokens, hidden 2048, N query heads per K/V head."""
    from benchmarks.attention import parse_shape

    p = parse_shape("128:4096:causal:g4")
    assert (p.head_dim, p.seqlen_q, p.batch, p.nheads_q, p.nheads_kv, p.causal) == (
        128, 4096, 4, 16, 4, True
    )  # fmt: skip
    assert parse_shape("64:1024:g32").nheads_kv == 1 and not parse_shape("64:1024:g32").causal
    assert parse_shape("64:1024").nheads_kv == 32
    for bad in ("128:4096:g3", "128:4096:causal:causal", "128:4096:gqa4", "128:4096:g4:g2"):
        with pytest.raises(ValueError):
            parse_shape(bad)


def row(label, shape, tflops, wrong=None, error=2.4e-3):
    ms = None if tflops is None else 1.0
    return dict(label=label, shape=shape, config="64x128s2", wrong=wrong, error=error, ms=ms,
                tflops=tflops)  # fmt: skip


def test_the_table_takes_each_sides_median_and_says_what_was_wrong():
    rows = [
        row("old", "128:4096", 500.0),
        row("new", "128:4096", 550.0),
        row("old", "128:4096", 510.0),
        row("new", "128:4096", 540.0),
        row("old", "128:4096", 505.0),
        row("new", "128:4096", 545.0),
        row("old", "64:1024", 300.0),
        row("new", "64:1024", None, wrong="wrong (dq error 0.5 > 0.02)"),
    ]
    lines = table(rows).splitlines()
    assert lines[2] == (
        "| 128:4096 | 64x128s2 / 64x128s2 | 505.0 | 545.0 | 1.079 | 2.0% / 1.8% "
        "| 2.40e-03 / 2.40e-03 |"
    )
    assert "| 64:1024 | 64x128s2 / 64x128s2 | 300.0 | wrong (dq error 0.5 > 0.02) | - |" in lines[3]


def test_rounds_alternate_the_sides_each_on_its_own_checkout(monkeypatch, tmp_path, capsys):
    """The old side runs in a `git archive` of the revision, the new one here; old first in odd
    rounds, new first in even ones; each child's rows are kept, in order."""
    real_run = subprocess.run
    calls = []

    def fake_run(argv, **kwargs):
        if "--child" not in argv:
            return real_run(argv, **kwargs)  # git rev-parse, git archive, tar
        root, label = argv[argv.index("--child") + 1 :]
        calls.append((label, root, kwargs["env"]["PYTHONPATH"], kwargs["cwd"]))
        keys = argv[argv.index("--keys") + 1].split(",")
        assert keys == ["bf16-d128x128-full-q4096-k4096-b4-h16x16",
                        "bf16-d64x64-full-q1024-k1024-b16-h32x32"]  # fmt: skip
        assert (Path(root) / "fa4tune" / "__init__.py").is_file()
        out = "\n".join(json.dumps(row(label, s, 100.0)) for s in ("128:4096", "64:1024"))
        return subprocess.CompletedProcess(argv, 0, stdout="some output\n" + out, stderr="")

    monkeypatch.setattr(ab_checkouts.subprocess, "run", fake_run)
    out_json = tmp_path / "rows.json"
    argv = ["--old", "HEAD", "--shapes", "128:4096,64:1024", "--rounds", "3"]
    assert main(argv + ["--json", str(out_json)]) == 0
    assert [label for label, *_ in calls] == ["old", "new", "new", "old", "old", "new"]
    here = str(Path(ab_checkouts.__file__).resolve().parents[1])
    for label, root, pythonpath, cwd in calls:
        assert root == pythonpath == str(cwd)
        assert (root == here) == (label == "new")
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 12 and rows[0]["label"] == "old"
    assert "| 128:4096 | 64x128s2 / 64x128s2 | 100.0 | 100.0 | 1.000 |" in capsys.readouterr().out


def test_old_may_be_a_tree_written_beforehand(monkeypatch, tmp_path, capsys):
    """The device machine's copy of the checkout has no git: `--old DIR` takes a tree written with
    `git archive` beforehand, runs the old side there and asks git nothing; a directory that holds
    no fa4tune is refused."""
    roots = []

    def fake_run(argv, **kwargs):
        assert "--child" in argv, f"asked {argv[0]} with an old tree given"
        root, label = argv[argv.index("--child") + 1 :]
        roots.append((label, root, kwargs["cwd"]))
        out = json.dumps(row(label, "64:1024", 100.0 if label == "old" else 110.0))
        return subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")

    monkeypatch.setattr(ab_checkouts.subprocess, "run", fake_run)
    assert main(["--old", str(tmp_path), "--shapes", "64:1024"]) == 2
    assert "without fa4tune/__init__.py" in capsys.readouterr().err
    (tmp_path / "fa4tune").mkdir()
    (tmp_path / "fa4tune" / "__init__.py").write_text("")
    assert main(["--old", str(tmp_path), "--shapes", "64:1024", "--rounds", "2"]) == 0
    here = str(Path(ab_checkouts.__file__).resolve().parents[1])
    old, new = str(tmp_path.resolve()), here
    assert [(label, root) for label, root, _ in roots] == [
        ("old", old), ("new", new), ("new", new), ("old", old)
    ]  # fmt: skip
    assert all(root == str(cwd) for _, root, cwd in roots)
    assert "| 64:1024 | 64x128s2 / 64x128s2 | 100.0 | 110.0 | 1.100 |" in capsys.readouterr().out


def test_a_side_that_stops_is_reported(monkeypatch, capsys):
    real_run = subprocess.run

    def fake_run(argv, **kwargs):
        if "--child" not in argv:
            return real_run(argv, **kwargs)
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="CUDA error: no device\n")

    monkeypatch.setattr(ab_checkouts.subprocess, "run", fake_run)
    assert main(["--old", "HEAD", "--shapes", "128:4096", "--rounds", "1"]) == 1
    err = capsys.readouterr().err
    assert "the old side, round 1, stopped (exit 1)" in err and "CUDA error: no device" in err


def test_a_side_that_reads_a_shape_otherwise_refuses_before_measuring(capsys):
    """The child parses the shapes with its own revision's parse_shape; where that problem is not
    the one this checkout reads (an older revision without `:gN` reads `:g4` as MHA), it refuses,
    before it looks for a GPU."""
    root = str(Path(ab_checkouts.__file__).resolve().parents[1])
    shapes = ["128:4096:causal:g4"]
    mha = "bf16-d128x128-causal-q4096-k4096-b4-h16x16"
    assert ab_checkouts._child(root, "old", "fa4_bwd_sm90", shapes, [mha], {}) == 2
    err = capsys.readouterr().err
    assert "the old side reads '128:4096:causal:g4' as " in err and f"as {mha}" in err
    assert "h16x4" in err


def test_set_changes_the_default_on_both_sides(monkeypatch, capsys):
    """--set's knobs reach each child as JSON; a child applies them to its default config and
    reports a result its rules refuse as such, without measuring it (no GPU asked)."""
    real_run = subprocess.run
    seen = []

    def fake_run(argv, **kwargs):
        if "--child" not in argv:
            return real_run(argv, **kwargs)
        label = argv[-1]
        seen.append(json.loads(argv[argv.index("--changes") + 1]))
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(row(label, "128:4096", 90.0)),
                                           stderr="")  # fmt: skip

    monkeypatch.setattr(ab_checkouts.subprocess, "run", fake_run)
    argv = ["--old", "HEAD", "--shapes", "128:4096", "--rounds", "1", "--set", "deterministic=true"]
    assert main(argv) == 0
    assert seen == [{"deterministic": True}] * 2
    root = str(Path(ab_checkouts.__file__).resolve().parents[1])
    key = "bf16-d128x128-full-q4096-k4096-b4-h16x16"
    changes = {"tile_m": 80, "dq_swap": False}
    import fa4tune.target

    monkeypatch.setattr(fa4tune.target, "detect_target", lambda: fa4tune.target.get_target("H200"))
    capsys.readouterr()
    assert ab_checkouts._child(root, "new", "fa4_bwd_sm90", ["128:4096"], [key], changes) == 0
    [line] = capsys.readouterr().out.splitlines()
    refused = json.loads(line)
    assert refused["config"].startswith("80x128") and refused["tflops"] is None
    assert (
        refused["wrong"].startswith("refused: ") and "tile_m=80 without dq_swap" in refused["wrong"]
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--old", "HEAD", "--shapes", "64:1024", "--job", "x.yaml"], "not both"),
        (["--old", "HEAD", "--match", "k4096"], "give --job"),
        (["--old", "HEAD", "--job", "nope.yaml"], "--job nope.yaml"),
        (["--old", "HEAD", "--kernel", "fa4_fwd_sm90", "--job",
          "tuning_configs/h200-bf16-train.yaml"], "tunes fa4_bwd_sm90, not --kernel fa4_fwd_sm90"),
    ],
)  # fmt: skip
def test_bad_job_arguments_say_what_is_wrong(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_jobs_problems_reach_each_side_as_dicts(monkeypatch, capsys):
    """--job's problems go to the children as JSON; each side makes them with its own kernel
    family, measures the family's default for them (the forward's decode default here) and refuses
    one whose key it reads otherwise, before it looks for a GPU."""
    real_run = subprocess.run
    seen = []
    key = "bf16-d64x64-full-q1-k131072-b1-h32x8"

    def fake_run(argv, **kwargs):
        if "--child" not in argv:
            return real_run(argv, **kwargs)
        seen.append((json.loads(argv[argv.index("--problems") + 1]), argv[-1]))
        return subprocess.CompletedProcess(
            argv, 0, stdout=json.dumps(row(argv[-1], key, 9.0)), stderr=""
        )

    monkeypatch.setattr(ab_checkouts.subprocess, "run", fake_run)
    argv = ["--old", "HEAD", "--kernel", "fa4_fwd_sm90", "--rounds", "1"]
    argv += ["--job", "tuning_configs/h200-bf16-decode.yaml", "--match", "d64x64-full-q1-k131072"]
    assert main(argv) == 0
    assert [label for _, label in seen] == ["old", "new"]
    [problem] = seen[0][0]
    assert problem["seqlen_k"] == 131072 and problem["head_dim"] == 64
    assert f"| {key} | 64x128s2 / 64x128s2 | 9.0 | 9.0 | 1.000 |" in capsys.readouterr().out

    root = str(Path(ab_checkouts.__file__).resolve().parents[1])
    import fa4tune.target

    def no_gpu():
        raise AssertionError("looked for a GPU before refusing")

    monkeypatch.setattr(fa4tune.target, "detect_target", no_gpu)
    other = dict(problem, seqlen_k=65536)
    assert ab_checkouts._child(root, "old", "fa4_fwd_sm90", [key], [key], {}, [other]) == 2
    err = capsys.readouterr().err
    assert f"the old side reads {key!r} as bf16-d64x64-full-q1-k65536" in err
    assert "its Problem reads the job's problem otherwise" in err
