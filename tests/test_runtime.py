import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace

import pytest

import fa4tune
from fa4tune.best import BestEntry
from fa4tune.db import ResultsDB
from fa4tune.kernels import get_kernel
from fa4tune.problem import Problem
from fa4tune.runtime.lookup import Lookup, lookup
from fa4tune.runtime.tables import render_yaml, table_document

KERNEL = get_kernel()
TUNED_4K = Problem(head_dim=128, seqlen_q=4096, batch=2, nheads_q=16)
TUNED_16K = Problem(head_dim=128, seqlen_q=16384, batch=2, nheads_q=16)


def entry(problem, tile_n, kernel_hash=None, target="H200", is_estimate=True):
    config = {**KERNEL.default_config(problem, None).to_dict(), "tile_n": tile_n}
    return BestEntry(
        kernel=KERNEL.name,
        kernel_hash=kernel_hash or KERNEL.source_hash(),
        target=target,
        problem=problem.to_dict(),
        problem_key=problem.key(),
        bucket_key=problem.bucket().key(),
        config=config,
        time_ms=1.0,
        tflops=500.0,
        is_estimate=is_estimate,
        provenance={},
        source="test",
    )


def write_table_file(path, entries):
    path.write_text(render_yaml(table_document(entries, KERNEL.name, KERNEL.source_hash(), "H200")))


@pytest.fixture
def tuned_db(workdir):
    path = str(workdir / "tuned.db")
    with ResultsDB.open(path) as db:
        db.merge_best([entry(TUNED_4K, 96), entry(TUNED_16K, 160)])
    return path


def test_the_fallback_ladder(tuned_db):
    config, how = lookup(TUNED_4K, "H200", source=tuned_db)
    assert (how, config.tile_n) == ("exact", 96)
    same_bucket = Problem(head_dim=128, seqlen_q=3000, batch=2, nheads_q=16)
    hit = lookup(same_bucket, "H200", source=tuned_db)
    assert (hit.source, hit.config.tile_n, hit.problem_key) == ("bucket", 96, TUNED_4K.key())
    far = Problem(head_dim=128, seqlen_q=65536, batch=1, nheads_q=16)
    hit = lookup(far, "H200", source=tuned_db)
    assert (hit.source, hit.config.tile_n, hit.problem_key) == ("nearest", 160, TUNED_16K.key())
    for other_family in (
        Problem(head_dim=128, seqlen_q=4096, batch=2, nheads_q=16, causal=True),
        Problem(head_dim=64, seqlen_q=4096),
        # Decode: the prefill problems lend it nothing (nor it them), whatever the distance.
        Problem(head_dim=128, seqlen_q=1, seqlen_k=4096, batch=2, nheads_q=16),
    ):
        hit = lookup(other_family, "H200", source=tuned_db)
        assert hit.source == "default" and hit.config == KERNEL.default_config(other_family, None)
    # fp16 has no tuned problem: the nearest bf16 one of its head dims and causality lends its
    # config.
    hit = lookup(
        Problem(dtype="fp16", head_dim=128, seqlen_q=4096, batch=2, nheads_q=16),
        "H200",
        source=tuned_db,
    )
    assert (hit.source, hit.config.tile_n, hit.problem_key) == ("other-dtype", 96, TUNED_4K.key())
    # Another target has no tuned configs.
    assert lookup(TUNED_4K, "H100-SXM", source=tuned_db).source == "default"


def test_within_a_rung_the_closest_tuned_problem_lends_its_config(workdir):
    """Two tuned problems in one bucket (2500 and 4096 tokens round up to 4096): 3000 tokens borrow
    from 2500, 3900 from 4096, whatever order their keys sort in; the same among nearest buckets."""
    path = str(workdir / "tuned.db")
    tuned_2500 = Problem(head_dim=128, seqlen_q=2500, batch=2, nheads_q=16)
    tuned_9000 = Problem(
        head_dim=128, seqlen_q=9000, batch=2, nheads_q=16
    )  # bucket 16k, as TUNED_16K
    with ResultsDB.open(path) as db:
        db.merge_best(
            [
                entry(tuned_2500, 64),
                entry(TUNED_4K, 96),
                entry(tuned_9000, 128),
                entry(TUNED_16K, 160),
            ]
        )
    for seqlen, tile_n, source in (
        (3000, 64, "bucket"),
        (3900, 96, "bucket"),
        (10000, 128, "bucket"),
        (16000, 160, "bucket"),
        (20000, 160, "nearest"),
    ):
        hit = lookup(
            Problem(head_dim=128, seqlen_q=seqlen, batch=2, nheads_q=16), "H200", source=path
        )
        assert (seqlen, hit.source, hit.config.tile_n) == (seqlen, source, tile_n)
    # Among entries of one nearest bucket, the closer problem: 40000 tokens (bucket 64k) from 16k's
    # bucket.
    hit = lookup(Problem(head_dim=128, seqlen_q=40000, batch=2, nheads_q=16), "H200", source=path)
    assert (hit.source, hit.config.tile_n) == ("nearest", 160)


def test_the_nearest_rung_ranks_the_problems_not_their_buckets(workdir):
    """4100 causal tokens (bucket 8k) borrow from the 4096-token problem beside them, not from the
    one whose bucket is nearer (8192 tokens, 32 query heads over 8)."""
    tuned_4k = Problem(head_dim=128, seqlen_q=4096, batch=4, nheads_q=16, causal=True)
    tuned_8k = Problem(head_dim=128, seqlen_q=8192, batch=2, nheads_q=32, nheads_kv=8, causal=True)
    write_table_file(workdir / "t.yaml", [entry(tuned_4k, 96), entry(tuned_8k, 160)])
    hit = lookup(
        Problem(head_dim=128, seqlen_q=4100, batch=4, nheads_q=16, causal=True),
        "H200",
        source=str(workdir / "t.yaml"),
    )
    assert (hit.source, hit.problem_key, hit.config.tile_n) == ("nearest", tuned_4k.key(), 96)


def test_the_sibling_dtype_lends_after_every_problem_of_the_own_dtype(workdir):
    """fp16 and bf16 share one element width, so a config tuned for one runs the other. An fp16
    problem borrows from a far fp16 problem (16x the tokens) of its head dims and causality before
    the exact bf16 one; with none, from the closest bf16 problem whose config fits it (not from one
    of other causality); and bf16 from fp16 the same way."""
    fp16_64k = Problem(dtype="fp16", head_dim=128, seqlen_q=65536, batch=1, nheads_q=16)
    causal_8k, causal_16k, causal_64k = (
        Problem(head_dim=128, seqlen_q=s, batch=1, nheads_q=16, causal=True)
        for s in (8192, 16384, 65536)
    )
    unfit = entry(causal_8k, 192)
    unfit = replace(
        unfit, config={**unfit.config, "num_stages": 5}
    )  # more shared memory than an SM has
    fp16_256 = Problem(dtype="fp16", head_dim=256, seqlen_q=4096, batch=1, nheads_q=8, causal=True)
    path = workdir / "t.yaml"
    write_table_file(
        path,
        [
            entry(TUNED_4K, 96),
            entry(fp16_64k, 160),
            unfit,
            entry(causal_64k, 80),
            entry(causal_16k, 128),
            entry(fp16_256, 64),
        ],
    )
    cases = [
        (replace(TUNED_4K, dtype="fp16"), ("nearest", fp16_64k.key(), 160)),
        (replace(fp16_64k, dtype="bf16"), ("nearest", TUNED_4K.key(), 96)),
        (
            replace(causal_8k, dtype="fp16"),
            ("other-dtype", causal_16k.key(), 128),
        ),  # 16k is closer than 64k
        (replace(fp16_256, dtype="bf16", seqlen_q=2048), ("other-dtype", fp16_256.key(), 64)),
        (
            replace(fp16_256, causal=False),
            ("default", None, KERNEL.default_config(fp16_256, None).tile_n),
        ),
    ]
    for problem, expected in cases:
        hit = lookup(problem, "H200", source=str(path))
        assert (hit.source, hit.problem_key, hit.config.tile_n) == expected, problem.key()


def test_across_dtypes_current_code_and_measurements_keep_their_precedence(workdir):
    """On the sibling-dtype rung as on the others: a config tuned for the installed kernel code
    comes before a stale one even of the problem's own dtype and exact shape, and in the problem's
    bucket a measurement before an estimate of the exact problem."""
    fp16_4k = replace(TUNED_4K, dtype="fp16")
    bf16_3000 = Problem(head_dim=128, seqlen_q=3000, batch=2, nheads_q=16)  # TUNED_4K's bucket
    tables = workdir / "tables"
    tables.mkdir()
    (tables / "a-stale.yaml").write_text(
        render_yaml(
            table_document(
                [entry(fp16_4k, 64, kernel_hash="0" * 64, is_estimate=False)],
                KERNEL.name,
                "0" * 64,
                "H200",
            )
        )
    )
    write_table_file(
        tables / "b.yaml",
        [entry(TUNED_4K, 96, is_estimate=True), entry(bf16_3000, 160, is_estimate=False)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the stale table is never used, so nothing warns of it
        hit = lookup(fp16_4k, "H200", source=str(tables))
    assert (hit.source, hit.problem_key, hit.config.tile_n, hit.stale, hit.estimate) == (
        "other-dtype",
        bf16_3000.key(),
        160,
        False,
        False,
    )
    with pytest.warns(
        RuntimeWarning, match="stale"
    ):  # the stale table is read, and used where nothing else fits
        assert lookup(
            replace(fp16_4k, seqlen_q=8192), "H200", source=str(tables / "a-stale.yaml")
        ).stale


def test_a_measurement_comes_before_an_estimate_at_the_same_rung(workdir):
    """`fa4tune export` of a cost-model search writes beside the shipped table (its file name sorts
    first): its estimate of the same problem must not shadow the measurement."""
    tables = workdir / "tables"
    tables.mkdir()
    write_table_file(tables / "fa4_fwd_sm90-h200.yaml", [entry(TUNED_4K, 96)])
    write_table_file(tables / "h200-bf16.yaml", [entry(TUNED_4K, 160, is_estimate=False)])
    hit = lookup(TUNED_4K, "H200", source=str(tables))
    assert (hit.source, hit.config.tile_n) == ("exact", 160) and hit.estimate is False
    same_bucket = Problem(head_dim=128, seqlen_q=3000, batch=2, nheads_q=16)
    assert lookup(same_bucket, "H200", source=str(tables)).config.tile_n == 160
    hit = lookup(
        TUNED_4K, "H200", source=str(tables / "fa4_fwd_sm90-h200.yaml")
    )  # an estimate is still used
    assert (hit.source, hit.config.tile_n, hit.estimate) == ("exact", 96, True)


def test_in_its_bucket_a_measurement_beats_an_exact_estimate_beyond_it_the_closest_problem_wins(
    workdir,
):
    """An estimate of the exact problem (3000 tokens) does not shadow a measurement of its bucket
    (4096): the cost model errs by more than tuning gains. Beyond the bucket, the closer problem
    lends its config, estimate or not: a 12000-token problem borrows from an 8192-token estimate,
    not from a 65536-token measurement."""
    tables = workdir / "tables"
    tables.mkdir()
    exact = Problem(head_dim=128, seqlen_q=3000, batch=2, nheads_q=16)
    near, far = (Problem(head_dim=128, seqlen_q=s, batch=2, nheads_q=16) for s in (8192, 65536))
    write_table_file(tables / "a-estimates.yaml", [entry(exact, 96), entry(near, 128)])
    write_table_file(
        tables / "b-measured.yaml",
        [entry(TUNED_4K, 160, is_estimate=False), entry(far, 176, is_estimate=False)],
    )
    hit = lookup(exact, "H200", source=str(tables))
    assert (hit.source, hit.config.tile_n, hit.estimate) == ("bucket", 160, False)
    hit = lookup(
        Problem(head_dim=128, seqlen_q=12000, batch=2, nheads_q=16), "H200", source=str(tables)
    )
    assert (hit.source, hit.config.tile_n, hit.estimate) == ("nearest", 128, True)


def test_missing_or_empty_sources_give_the_default_and_warn_once(workdir):
    with pytest.warns(RuntimeWarning, match="cannot read tuned configs"):
        hit = lookup(TUNED_4K, "H200", source=str(workdir / "nowhere.db"))
    assert hit.source == "default"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup(TUNED_16K, "H200", source=str(workdir / "nowhere.db")).source == "default"
    empty = workdir / "empty.yaml"
    write_table_file(empty, [])
    with pytest.warns(RuntimeWarning, match="no tuned configs"):
        assert lookup(TUNED_4K, "H200", source=str(empty)).source == "default"
    garbage = workdir / "garbage.yaml"
    garbage.write_text("{{{{ not yaml")
    with pytest.warns(RuntimeWarning):
        assert lookup(TUNED_4K, "H200", source=str(garbage)).source == "default"


def test_environment_sources(workdir, tuned_db, monkeypatch):
    monkeypatch.setenv("FA4TUNE_DB", tuned_db)
    fa4tune.runtime.reset()
    assert fa4tune.lookup(TUNED_4K, "H200").source == "exact"
    monkeypatch.setenv("FA4TUNE_TARGET", "H200")
    fa4tune.runtime.reset()
    assert fa4tune.lookup(TUNED_4K).source == "exact"


def test_stale_tables_are_flagged(workdir):
    table = workdir / "stale.yaml"
    table.write_text(
        render_yaml(
            table_document(
                [entry(TUNED_4K, 96, kernel_hash="0" * 64)], KERNEL.name, "0" * 64, "H200"
            )
        )
    )
    with pytest.warns(RuntimeWarning, match="stale"):
        hit = lookup(TUNED_4K, "H200", source=str(table))
    assert hit.stale and hit.source == "exact" and hit.config.tile_n == 96


def test_current_entries_come_before_stale_ones_at_any_rung(workdir):
    same_bucket = Problem(head_dim=128, seqlen_q=3000, batch=2, nheads_q=16)
    path = str(workdir / "mixed.db")
    with ResultsDB.open(path) as db:
        db.merge_best([entry(TUNED_4K, 96, kernel_hash="0" * 64), entry(same_bucket, 160)])
    hit = lookup(TUNED_4K, "H200", source=path)
    assert (hit.source, hit.config.tile_n, hit.stale) == ("bucket", 160, False)
    assert lookup(TUNED_16K, "H200", source=path).source == "nearest"  # current, though farther
    stale_only = str(workdir / "stale.db")
    with ResultsDB.open(stale_only) as db:  # only stale entries: still better than the default
        db.merge_best([entry(TUNED_16K, 112, kernel_hash="0" * 64)])
    with pytest.warns(RuntimeWarning, match="stale"):
        hit = lookup(TUNED_16K, "H200", source=stale_only)
    assert (hit.source, hit.config.tile_n, hit.stale) == ("exact", 112, True)


def test_the_bucket_rung_compares_problems_not_the_keys_stored_beside_them(workdir):
    """A DB row whose stored bucket key is not its problem's (an older fa4tune wrote it) is no
    reason to hand a causal config to a non-causal problem."""
    causal = Problem(head_dim=128, seqlen_q=4096, batch=2, nheads_q=16, causal=True)
    wrong = BestEntry(**{**entry(causal, 96).__dict__, "bucket_key": TUNED_4K.bucket().key()})
    path = str(workdir / "old.db")
    with ResultsDB.open(path) as db:
        db.merge_best([wrong])
    assert lookup(TUNED_4K, "H200", source=path).source == "default"
    assert lookup(causal, "H200", source=path).source == "exact"


def test_an_unreadable_entry_or_table_costs_only_itself(workdir):
    unreadable = BestEntry(
        **{**entry(TUNED_16K, 160).__dict__, "problem": {**TUNED_16K.to_dict(), "window": 128}}
    )  # a field from the future
    path = str(workdir / "shared.db")
    with ResultsDB.open(path) as db:
        db.merge_best([entry(TUNED_4K, 96), unreadable])
    source = Lookup(path)
    with pytest.warns(RuntimeWarning, match="1 entries skipped"):
        assert source(TUNED_4K, "H200").source == "exact"
    assert source(TUNED_16K, "H200").source == "nearest"  # from the 4k entry; nothing raised
    tables = workdir / "tables"
    tables.mkdir()
    write_table_file(tables / "a.yaml", [entry(TUNED_4K, 96)])
    (tables / "b.yaml").write_text("format: something-else\n")
    with pytest.warns(RuntimeWarning, match="skipped .*b.yaml"):
        assert lookup(TUNED_4K, "H200", source=str(tables)).source == "exact"


def test_an_entry_whose_config_the_kernel_cannot_take_is_skipped_with_a_warning(workdir):
    """A hand-edited table passes read_table (it does not know the knobs); its entry must not
    vanish from the ladder without a word."""
    bad = BestEntry(**{**entry(TUNED_4K, 96).__dict__, "config": {"tile_n": "wide"}})
    write_table_file(workdir / "t.yaml", [bad, entry(TUNED_16K, 160)])
    with pytest.warns(RuntimeWarning, match=f"skipped the config of {TUNED_4K.key()}.*tile_n"):
        found = lookup(TUNED_4K, "H200", source=str(workdir / "t.yaml"))
    assert found.source == "nearest" and found.problem_key == TUNED_16K.key()


def test_a_borrowed_config_that_does_not_fit_is_skipped(workdir):
    # tile_n=192 with hdim 256 and 2 stages does not fit in shared memory: the lookup falls back.
    d256 = Problem(head_dim=256, seqlen_q=4096)
    bad = BestEntry(
        **{
            **entry(d256, 80).__dict__,
            "config": {
                **KERNEL.default_config(d256, None).to_dict(),
                "tile_n": 192,
                "num_stages": 4,
            },
        }
    )
    path = str(workdir / "bad.db")
    with ResultsDB.open(path) as db:
        db.merge_best([bad])
    assert lookup(d256, "H200", source=path).source == "default"


def test_thread_safe_and_cheap(tuned_db):
    problems = [
        Problem(head_dim=128, seqlen_q=s, batch=b, nheads_q=16, causal=c)
        for s in (512, 1000, 4096, 9000, 16384, 70000)
        for b in (1, 2, 8)
        for c in (False, True)
    ]
    shared = Lookup(tuned_db)
    expected = {p: Lookup(tuned_db)(p, "H200") for p in problems}
    errors = []

    def worker():
        try:
            for _ in range(20):
                for p in problems:
                    assert shared(p, "H200") == expected[p]
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    start = time.perf_counter()
    for _ in range(20000):
        shared(TUNED_4K, "H200")
    per_call = (time.perf_counter() - start) / 20000
    assert per_call < 100e-6, f"{per_call * 1e6:.1f} us per lookup"


def test_importing_fa4tune_and_looking_up_a_table_stays_light(workdir):
    table = workdir / "t.yaml"
    write_table_file(table, [entry(TUNED_4K, 96)])
    code = (
        "import sys, fa4tune\n"
        "hit = fa4tune.lookup(fa4tune.Problem(head_dim=128, seqlen_q=4096, batch=2, nheads_q=16), "
        f"'H200', source={str(table)!r})\n"
        "assert hit.source == 'exact', hit\n"
        "heavy = [m for m in ('torch', 'cutlass', 'sqlalchemy', 'optuna') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_attention_is_the_op_wrapper_and_loads_on_first_use():
    code = (
        "import sys, fa4tune\n"
        "assert 'fa4tune.runtime.dispatch' not in sys.modules\n"
        "attention, explain = fa4tune.attention, fa4tune.explain\n"
        "assert attention is sys.modules['fa4tune.runtime.ops'].attention\n"
        "import torch\n"
        "assert torch.ops.fa4tune.attention.default is not None\n"
        "assert explain is sys.modules['fa4tune.runtime.dispatch'].explain\n"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_the_gpu_is_asked_once_torch_is_there_even_after_an_earlier_lookup():
    """A lookup before torch is imported cannot ask the GPU and uses the H200; that guess must not
    stick once torch is imported (an H100 host would keep the H200's tables)."""
    script = """
import sys
import fa4tune.target as target
import fa4tune.runtime.lookup as runtime
assert "torch" not in sys.modules
target.detect_target = lambda undescribed=False: target.get_target("H100-SXM")
first = runtime._target(None).name
import torch
print(first, runtime._target(None).name)
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "FA4TUNE_TARGET"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["H200", "H100-SXM"]


def test_the_lookup_cache_is_bounded(tuned_db, monkeypatch):
    """A server seeing ever new shapes must not grow the per-source cache without end."""
    monkeypatch.setattr(fa4tune.runtime.lookup, "MAX_CACHED", 8)
    source = Lookup(tuned_db)
    for seqlen in range(1000, 1050):
        source(Problem(head_dim=128, seqlen_q=seqlen, batch=2, nheads_q=16), "H200")
        assert len(source.index().results) <= 8
    assert source(TUNED_4K, "H200").source == "exact"


def test_a_lookup_without_target_before_torch_is_imported_says_what_it_assumed(monkeypatch):
    """Without torch the GPU is not asked (importing it costs seconds): the lookup is for H200 then,
    and says so once, since after torch is imported the same call may look up for the local GPU
    instead."""
    import fa4tune.runtime.lookup as runtime

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("FA4TUNE_TARGET", raising=False)
    monkeypatch.setattr(runtime, "_target_cache", {})
    with pytest.warns(
        RuntimeWarning, match="torch not imported, so the GPU was not asked: looking up for H200"
    ):
        assert runtime._target(None).name == "H200"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime._target(None).name == "H200"  # said once
