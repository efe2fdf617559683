"""The gpu backend's process machinery on the CPU, with a planted worker module (planted_worker.py):
crashing, exiting, hanging and raising candidates are recorded as failed and the worker is replaced;
a wrong result never becomes best; a SIGKILLed search loses no finished trial and resumes."""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import planted_worker as planted
import pytest
from conftest import kill_processes, still_alive_after, write_job

from fa4tune.db import ResultsDB
from fa4tune.errors import BackendError
from fa4tune.kernels import get_kernel
from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
from fa4tune.measure.gpu import GpuBackend
from fa4tune.problem import Problem
from fa4tune.tune.job import load_job
from fa4tune.tune.search import run_search

KERNEL = get_kernel()
PROBLEM = Problem(head_dim=128, seqlen_q=2048, batch=2, nheads_q=8)
TESTS = Path(__file__).resolve().parent
quiet = lambda *a, **k: None  # noqa: E731
PLANTED = {
    "worker_module": "planted_worker",
    "compile_workers": 0,
    "compile_timeout": 5,
    "run_timeout": 1.5,
    "start_timeout": 60,
    "prune_margin": None,
}


def config(tile_n: int) -> FwdConfig:
    return FwdConfig(tile_n=tile_n)


@pytest.fixture
def backend(workdir):
    with GpuBackend(KERNEL, None, **{**PLANTED, "cache_dir": str(workdir / "kernels")}) as b:
        yield b


def test_crash_exit_hang_and_device_error_fail_and_replace_the_worker(backend):
    assert backend.target.name == "H200" and backend.provenance()["gpu_name"].startswith("planted")
    first = backend.measure(PROBLEM, config(128))
    # Every trial says where it ran (a resumed run keeps its first session's provenance).
    assert first.details["device"] == {
        "gpu_name": "planted H200 (CPU test)",
        "sm_count": 132,
        "nvidia_driver": "planted",
        "cuda_driver": "12.8",
        "cuda_version": "12.8",
    }
    assert first.status == "ok" and first.time_ms > 0 and first.spread_ms > 0
    pid = first.details["pid"]
    again = backend.measure(PROBLEM, config(64))
    assert again.details["pid"] == pid and again.details["served"] == 2, (
        "the worker keeps its state"
    )

    expected = {
        planted.SEGFAULT_TILE_N: "died during run (killed by SIGSEGV)",
        planted.EXIT_TILE_N: "died during compile (exit status 3)",
        planted.HANG_TILE_N: "run timed out after 1.5 s",
        planted.DEVICE_ERROR_TILE_N: "RuntimeError: CUDA error: an illegal memory access",
    }
    for tile_n, reason in expected.items():
        started = time.monotonic()
        failed = backend.measure(PROBLEM, config(tile_n))
        assert (
            failed.status == "failed"
            and reason in failed.reason
            and "worker replaced" in failed.reason
        ), failed
        assert time.monotonic() - started < 20
        after = backend.measure(PROBLEM, config(128))
        assert after.status == "ok" and after.details["pid"] != pid, (
            "a fresh worker serves the next candidate"
        )
        pid = after.details["pid"]

    # An error before the run phase leaves the worker (and its state) in place.
    compile_error = backend.measure(PROBLEM, config(planted.COMPILE_ERROR_TILE_N))
    assert compile_error.status == "failed" and "planted compile error" in compile_error.reason
    assert "replaced" not in compile_error.reason
    assert backend.measure(PROBLEM, config(128)).details["pid"] == pid


def test_backend_turns_an_out_of_tolerance_ok_into_wrong(backend):
    wrong = backend.measure(PROBLEM, config(planted.WRONG_TILE_N))
    assert wrong.status == "wrong" and "output error 0.5" in wrong.reason and wrong.max_error == 0.5


def test_worker_that_cannot_start_is_a_clear_error(workdir):
    from fa4tune.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="ModuleNotFoundError.*no_such_worker_module"):
        GpuBackend(KERNEL, None, **{**PLANTED, "worker_module": "no_such_worker_module"})
    with pytest.raises(BackendError, match="targets H100-SXM but this GPU is H200"):
        GpuBackend(KERNEL, "H100-SXM", **PLANTED)


def test_bad_options_are_refused_with_the_field_named(workdir):
    with pytest.raises(BackendError, match="measure.run_timeout: a positive number"):
        GpuBackend(KERNEL, None, **{**PLANTED, "run_timeout": 0})
    from fa4tune.errors import JobError

    path = write_job(workdir, backend="gpu", measure={"compile_workers": -1})
    with pytest.raises(JobError, match="measure.compile_workers"):
        load_job(path)
    path = write_job(workdir, backend="gpu", measure={"min_gain": 1.5})
    with pytest.raises(JobError, match="measure.min_gain: a fraction"):
        load_job(path)


def test_repeated_deaths_stop_the_search(workdir):
    from fa4tune.errors import BackendUnavailable

    with GpuBackend(KERNEL, None, **{**PLANTED, "max_worker_deaths": 2}) as b:
        assert b.measure(PROBLEM, config(planted.SEGFAULT_TILE_N)).status == "failed"
        # The death that reaches the limit still gives its candidate's outcome (stored, never run
        # again by a resume); the next request is refused.
        assert b.measure(PROBLEM, config(planted.HANG_TILE_N)).status == "failed"
        with pytest.raises(
            BackendUnavailable, match="died 2 times in a row .*timed out.*no config of this problem"
        ):
            b.measure(PROBLEM, config(64))


def test_deaths_in_a_row_on_a_good_gpu_do_not_stop_the_search(workdir):
    """A stretch of crashing candidates reaches max_worker_deaths, but the config that measured ok
    before measures ok again (the GPU is fine): the search goes on, and the count starts again."""
    with GpuBackend(KERNEL, None, **{**PLANTED, "max_worker_deaths": 2}) as b:
        assert b.measure(PROBLEM, config(128)).status == "ok"
        for _ in range(3):  # each time two deaths, then the check, which passes
            for tile_n in (planted.SEGFAULT_TILE_N, planted.HANG_TILE_N):
                assert b.measure(PROBLEM, config(tile_n)).status == "failed"
            after = b.measure(PROBLEM, config(64))
            assert after.status == "ok" and b.deaths == 0
            assert after.details["served"] == 2, (
                "the check ran in the new worker, before this candidate"
            )


def test_deaths_in_a_row_stop_the_search_when_the_good_config_fails_too(workdir, monkeypatch):
    from fa4tune.errors import BackendUnavailable

    down = workdir / "gpu-down"
    monkeypatch.setenv("PLANTED_GPU_DOWN", str(down))
    with GpuBackend(KERNEL, None, **{**PLANTED, "max_worker_deaths": 2}) as b:
        assert b.measure(PROBLEM, config(128)).status == "ok"
        down.touch()  # from now on every run crashes
        assert b.measure(PROBLEM, config(64)).status == "failed"
        assert b.measure(PROBLEM, config(112)).status == "failed"
        with pytest.raises(
            BackendUnavailable,
            match=r"died 2 times in a row .*a config of this problem that measured "
            r"ok before \(128x128.*\) failed too: failed, .*SIGSEGV.*GPU may be "
            "unusable",
        ):
            b.measure(PROBLEM, config(64))


@pytest.mark.parametrize("vouching", ["another problem's config", "a config stored as wrong"])
def test_only_a_good_config_of_the_same_problem_vouches_for_the_gpu(workdir, vouching):
    """A problem whose every candidate kills the worker (its inputs do not fit, say) stops the
    search, though another problem's config still runs; and a config the backend stored as wrong
    (the worker said ok) vouches for nothing."""
    from fa4tune.errors import BackendUnavailable

    other = Problem(head_dim=128, seqlen_q=1024, batch=2, nheads_q=8)
    with GpuBackend(KERNEL, None, **{**PLANTED, "max_worker_deaths": 2}) as b:
        if vouching == "another problem's config":
            assert b.measure(other, config(128)).status == "ok"
        else:
            assert b.measure(PROBLEM, config(planted.WRONG_TILE_N)).status == "wrong"
        for tile_n in (planted.SEGFAULT_TILE_N, planted.HANG_TILE_N):
            assert b.measure(PROBLEM, config(tile_n)).status == "failed"
        with pytest.raises(BackendUnavailable, match="no config of this problem has measured ok"):
            b.measure(PROBLEM, config(64))


# hdim 256: the default's tile_n is 80, which kills the planted worker while compiling, as does
# every config of this space (tile_n 80 throughout); tile_n 64 measures ok.
HDIM256 = {"head_dim": 256, "seqlen_q": 2048, "batch": 2, "nheads_q": 8}
CRASHING_SPACE = {
    "tiles": {"tile_m": [128], "tile_n": [planted.EXIT_TILE_N]},
    "pipeline": {
        "num_stages": [1, 2],
        "intra_wg_overlap": [True],
        "wg_pingpong": [True, False],
        "persistent": [False],
        "wg_epilogue": [False],
        "q_stages": [1],
    },
}
RESULTS = "fa4tune-results/results.db"


def crashing_job(workdir):
    """A new search of HDIM256 whose four candidates all kill the worker: two deaths, the health
    check, two more."""
    return load_job(
        write_job(
            workdir,
            name="crashing",
            backend="gpu",
            target=None,
            spaces=CRASHING_SPACE,
            sampler="grid",
            problems=[HDIM256],
            measure={**PLANTED, "max_worker_deaths": 2},
        )
    )


@pytest.mark.parametrize("gpu", ["healthy", "down"])
def test_a_config_the_results_db_holds_as_ok_vouches_for_the_gpu(workdir, monkeypatch, gpu):
    """A search (a resume, say) whose first candidates all kill the worker has no good config of its
    own: the GPU is checked with the one an earlier run measured ok (compiled again, by the
    measuring worker), and the search goes on while that still measures ok."""
    from fa4tune.errors import BackendUnavailable

    down = workdir / "gpu-down"
    monkeypatch.setenv("PLANTED_GPU_DOWN", str(down))
    earlier = write_job(
        workdir,
        name="earlier",
        backend="gpu",
        target=None,
        sampler="grid",
        problems=[HDIM256],
        spaces={"tiles": {"tile_m": [128], "tile_n": [64, planted.EXIT_TILE_N]}},
        measure={**PLANTED, "confirm_rounds": 1},
    )
    run_search(load_job(earlier), say=quiet)
    with ResultsDB.open(RESULTS, create=False) as db:
        assert [b.config["tile_n"] for b in db.best_configs()] == [64]
    if gpu == "down":
        down.touch()
        with pytest.raises(
            BackendUnavailable,
            match=r"died 2 times in a row .*a config of this problem that measured "
            r"ok before \(128x64.*\) failed too: failed, .*SIGSEGV",
        ):
            run_search(crashing_job(workdir), say=quiet)
        return
    [result] = run_search(crashing_job(workdir), say=quiet).results
    assert "exhausted" in result.stopped and result.measured == 4
    with ResultsDB.open(RESULTS, create=False) as db:
        later = [
            t
            for t in db.trials()
            if t["config"]["tile_n"] == planted.EXIT_TILE_N and t["run_id"] == 2
        ]
    assert len(later) == 4 and all("exit status 3" in t["reason"] for t in later)


def test_the_db_config_that_checks_the_gpu_comes_from_the_compile_pools_cache(workdir, monkeypatch):
    """With a compile pool, the DB's config is not compiled again by the measuring worker at every
    check: the pool hands over its object file, found in the kernel cache where the earlier run put
    it."""
    from fa4tune.measure.gpu import GpuBackend

    pool = {
        **PLANTED,
        "compile_workers": 2,
        "cache_dir": str(workdir / "kernels"),
        "confirm_rounds": 1,
    }
    earlier = write_job(
        workdir,
        name="earlier",
        backend="gpu",
        target=None,
        sampler="grid",
        problems=[HDIM256],
        spaces={"tiles": {"tile_m": [128], "tile_n": [64, planted.EXIT_TILE_N]}},
        measure=pool,
    )
    run_search(load_job(earlier), say=quiet)
    cached = {str(p) for p in (workdir / "kernels").rglob("*.o")}
    checks, request = [], GpuBackend._request

    def spy(self, problem, config, mode, artifact, salt=0):
        if mode == "retime" and self.deaths:  # a health check (after deaths), not a confirmation
            checks.append((config.tile_n, artifact))
        return request(self, problem, config, mode, artifact, salt)

    monkeypatch.setattr(GpuBackend, "_request", spy)
    crashing = write_job(
        workdir,
        name="crashing",
        backend="gpu",
        target=None,
        spaces=CRASHING_SPACE,
        sampler="grid",
        problems=[HDIM256],
        measure={**pool, "max_worker_deaths": 2},
    )
    [result] = run_search(load_job(crashing), say=quiet).results
    assert "exhausted" in result.stopped and result.measured == 4
    assert checks and all(tile_n == 64 and artifact in cached for tile_n, artifact in checks), (
        checks,
        cached,
    )


DECOYS = {
    "another problem": {"problem": Problem(head_dim=256, seqlen_q=1024, batch=2, nheads_q=8)},
    "another kernel hash": {"kernel_hash": "0" * 64},
    "another target": {"target": "H100-SXM"},
    "an estimate": {"is_estimate": True},
    "a config stored as wrong": {},
}


@pytest.mark.parametrize("decoy", DECOYS)
def test_only_a_measured_never_wrong_db_config_of_the_same_problem_and_kernel_code_vouches(
    workdir, decoy
):
    """The decoy, an ok trial in the results DB that is not this problem's, kernel code's or
    target's, an estimate, or a config that was also wrong, vouches for nothing: the search stops. A
    genuine one (slower than the decoy, which would crash if measured) then lets it go on."""
    from fa4tune.errors import BackendUnavailable
    from fa4tune.measure.base import Measurement

    db = ResultsDB.open(RESULTS)
    run_id = db.start_run(
        job_name="earlier",
        kernel=KERNEL.name,
        kernel_hash=KERNEL.source_hash(),
        target="H200",
        backend="gpu",
        is_estimate=False,
        fa4tune_version="0",
        study_prefix="p",
    )

    hdim256, installed = Problem(**HDIM256), KERNEL.source_hash()

    def store(
        study,
        tile_n,
        time_ms,
        problem=hdim256,
        kernel_hash=installed,
        target="H200",
        is_estimate=False,
        status="ok",
    ):
        measurement = (
            Measurement.ok(problem, time_ms, is_estimate=is_estimate)
            if status == "ok"
            else Measurement(status=status, reason="above tolerance")
        )
        db.add_trial(
            run_id=run_id,
            study_name=study,
            optuna_number=0,
            kernel=KERNEL.name,
            kernel_hash=kernel_hash,
            target=target,
            problem=problem,
            config=FwdConfig(tile_n=tile_n).to_dict(),
            measurement=measurement,
            source="sampler",
            provenance={},
        )

    store("decoy", planted.SEGFAULT_TILE_N, 0.5, **DECOYS[decoy])  # stored best of its problem
    if decoy == "a config stored as wrong":
        store("decoy-again", planted.SEGFAULT_TILE_N, None, status="wrong")
    with pytest.raises(BackendUnavailable, match="no config of this problem has measured ok"):
        run_search(crashing_job(workdir), say=quiet)
    store("genuine", 64, 1.0)
    db.close()
    [result] = run_search(crashing_job(workdir), say=quiet).results
    assert "exhausted" in result.stopped and result.measured == 4


GRID_SPACE = {
    "tiles": {
        "tile_m": [128],
        "tile_n": [
            64,
            planted.EXIT_TILE_N,
            planted.SEGFAULT_TILE_N,
            planted.HANG_TILE_N,
            128,
            planted.WRONG_TILE_N,
        ],
    }
}


def test_search_goes_on_past_bad_candidates_and_never_stores_a_wrong_best(workdir):
    path = write_job(
        workdir,
        backend="gpu",
        target=None,
        spaces=GRID_SPACE,
        sampler="grid",
        budget={"trials": 20},
        measure={**PLANTED, "confirm_rounds": 2},
    )
    summary = run_search(load_job(path), say=quiet)
    result = summary.results[0]
    assert "exhausted" in result.stopped and result.measured == 6
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        trials = {t["config"]["tile_n"]: t for t in db.trials() if t["source"] != "confirm"}
        confirms = [t for t in db.trials() if t["source"] == "confirm"]
        [best] = db.best_configs()
        run = db.runs()[0]
    assert (
        trials[planted.SEGFAULT_TILE_N]["status"] == "failed"
        and "SIGSEGV" in trials[planted.SEGFAULT_TILE_N]["reason"]
    )
    assert (
        trials[planted.HANG_TILE_N]["status"] == "failed"
        and "timed out" in trials[planted.HANG_TILE_N]["reason"]
    )
    assert trials[planted.EXIT_TILE_N]["status"] == "failed"
    assert trials[planted.WRONG_TILE_N]["status"] == "wrong"
    fastest_ok = min(
        (t for t in trials.values() if t["status"] == "ok"), key=lambda t: t["time_ms"]
    )
    assert best.config["tile_n"] == fastest_ok["config"]["tile_n"] != planted.WRONG_TILE_N
    # The best was re-timed (interleaved rounds) before it was stored, and says so.
    assert {c["config"]["tile_n"] for c in confirms} == {
        t["config"]["tile_n"] for t in trials.values() if t["status"] == "ok"
    }
    assert all(c["details"]["rounds_ms"] and len(c["details"]["rounds_ms"]) == 2 for c in confirms)
    assert best.provenance["confirmed"]["rounds"] == 2 and best.provenance["gpu_name"].startswith(
        "planted"
    )
    assert run["nvidia_driver"] == "planted" and run["cuda_version"] == "12.8"
    assert run["clocks"]["start"]["sm_mhz"] == 1980.0 and run["clocks"]["seen"]


def test_a_wrong_config_never_becomes_best_in_the_db(workdir):
    from fa4tune.best import BestEntry
    from fa4tune.measure.base import Measurement

    db = ResultsDB.open("r.db")
    run_id = db.start_run(
        job_name="j",
        kernel=KERNEL.name,
        kernel_hash="h",
        target="H200",
        backend="gpu",
        is_estimate=False,
        fa4tune_version="0",
        study_prefix="p",
    )
    common = dict(
        run_id=run_id,
        study_name="s",
        kernel=KERNEL.name,
        kernel_hash="h",
        target="H200",
        problem=PROBLEM,
        source="sampler",
        provenance={},
    )
    fast = {"tile_n": 64}
    db.add_trial(
        optuna_number=0,
        config=fast,
        measurement=Measurement(status="wrong", reason="bad"),
        **{**common, "study_name": "s-of-an-earlier-run"},
    )  # a study stores each config once
    # The same config measured ok later (another run, a lucky draw) is still refused as best...
    ok_id = db.add_trial(
        optuna_number=1, config=fast, measurement=Measurement.ok(PROBLEM, 1.0), **common
    )
    assert db.best_configs() == []
    # ...also through a confirmation, while a config that was never wrong is taken.
    other = {"tile_n": 128}
    other_id = db.add_trial(
        optuna_number=2,
        config=other,
        measurement=Measurement.ok(PROBLEM, 2.0),
        offer_best=False,
        **common,
    )
    stored = db.confirm_best(
        run_id=run_id,
        study_name="s",
        kernel=KERNEL.name,
        kernel_hash="h",
        target="H200",
        problem=PROBLEM,
        provenance={},
        confirmed=[
            ({"id": ok_id}, Measurement.ok(PROBLEM, 0.5)),
            ({"id": other_id}, Measurement.ok(PROBLEM, 2.1)),
        ],
    )
    [best] = db.best_configs()
    assert best.config == other and stored is not None
    # An imported table cannot smuggle it in either.
    entry = BestEntry(
        kernel=KERNEL.name,
        kernel_hash="h",
        target="H200",
        problem=PROBLEM.to_dict(),
        problem_key=PROBLEM.key(),
        bucket_key=PROBLEM.bucket().key(),
        config=fast,
        time_ms=0.1,
        tflops=1.0,
        is_estimate=False,
        provenance={},
        source="import",
    )
    report = db.merge_best([entry])
    assert report.conflicts and "wrong" in report.conflicts[0]
    assert db.best_configs()[0].config == other
    from fa4tune.errors import ResultsDBError

    wrong_id = db.trials()[0]["id"]
    with pytest.raises(ResultsDBError, match="not an ok trial"):
        db.confirm_best(
            run_id=run_id,
            study_name="s",
            kernel=KERNEL.name,
            kernel_hash="h",
            target="H200",
            problem=PROBLEM,
            provenance={},
            confirmed=[({"id": wrong_id}, Measurement.ok(PROBLEM, 0.1))],
        )
    db.close()


def default_and_probe_trials():
    """A results DB with a default (tile_n 128, 1.0 ms) and a probe (tile_n 96, 0.99 ms) trial of
    one study, none of them offered as best yet: (db, the keywords confirm_best needs, default id,
    probe id)."""
    from fa4tune.measure.base import Measurement

    db = ResultsDB.open("r.db")
    run_id = db.start_run(
        job_name="j",
        kernel=KERNEL.name,
        kernel_hash="h",
        target="H200",
        backend="gpu",
        is_estimate=False,
        fa4tune_version="0",
        study_prefix="p",
    )
    confirm = dict(
        run_id=run_id,
        study_name="s",
        kernel=KERNEL.name,
        kernel_hash="h",
        target="H200",
        problem=PROBLEM,
        provenance={},
    )
    default_id = db.add_trial(
        optuna_number=0,
        config={"tile_n": 128},
        source="default",
        measurement=Measurement.ok(PROBLEM, 1.0),
        offer_best=False,
        **confirm,
    )
    other_id = db.add_trial(
        optuna_number=1,
        config={"tile_n": 96},
        source="probe",
        measurement=Measurement.ok(PROBLEM, 0.99),
        offer_best=False,
        **confirm,
    )
    return db, confirm, default_id, other_id


@pytest.mark.parametrize("fastest_ms, kept", [(0.995, True), (0.98, False)])
def test_the_default_stays_best_unless_the_fastest_beats_it_by_min_gain(workdir, fastest_ms, kept):
    from fa4tune.measure.base import Measurement

    db, confirm, default_id, other_id = default_and_probe_trials()
    db.confirm_best(
        **confirm,
        prefer=default_id,
        min_gain=0.01,
        confirmed=[
            ({"id": other_id}, Measurement.ok(PROBLEM, fastest_ms)),
            ({"id": default_id}, Measurement.ok(PROBLEM, 1.0)),
        ],
    )
    [best] = db.best_configs()
    assert best.config == ({"tile_n": 128} if kept else {"tile_n": 96})
    assert ("kept_default" in best.provenance) == kept
    db.close()


def rounds(problem, *times_ms):
    """A confirmation's measurement with its paired rounds: the median of `times_ms`."""
    from fa4tune.measure.base import Measurement

    return Measurement.ok(
        problem, sorted(times_ms)[len(times_ms) // 2], details={"rounds_ms": list(times_ms)}
    )


@pytest.mark.parametrize(
    "other_rounds, third_rounds, best_tile_n",
    [
        # tile_n 96 is the fastest by the median (2%) but loses the fourth round to the default: a
        # slow spell of the GPU may do that once, so it cannot be told from the default.
        (
            (0.97, 0.98, 0.98, 1.01, 0.97),
            (0.99, 0.99, 0.99, 0.99, 0.99),
            64,
        ),  # 64: 1% faster in every round
        (
            (0.97, 0.98, 0.98, 1.01, 0.97),
            (0.99, 0.99, 1.001, 0.99, 0.99),
            128,
        ),  # 64 loses a round: kept
        (
            (0.97, 0.98, 0.98, 0.99, 0.97),
            (0.99, 0.99, 0.99, 0.99, 0.99),
            96,
        ),  # both win every round: the faster
        (
            (0.97, 0.98, 0.98, 0.97),
            (0.99, 0.99, 1.001, 0.99, 0.99),
            128,
        ),  # 4 rounds against 5 pair up with none
    ],
)
def test_a_config_replaces_the_default_only_when_faster_in_every_round(
    workdir, other_rounds, third_rounds, best_tile_n
):
    db, confirm, default_id, other_id = default_and_probe_trials()
    from fa4tune.measure.base import Measurement

    third_id = db.add_trial(
        optuna_number=2,
        config={"tile_n": 64},
        source="sampler",
        measurement=Measurement.ok(PROBLEM, 0.995),
        offer_best=False,
        **confirm,
    )
    db.confirm_best(
        **confirm,
        prefer=default_id,
        min_gain=0.003,
        confirmed=[
            ({"id": other_id}, rounds(PROBLEM, *other_rounds)),
            ({"id": third_id}, rounds(PROBLEM, *third_rounds)),
            ({"id": default_id}, rounds(PROBLEM, 1.0, 1.0, 1.0, 1.0, 1.0)),
        ],
    )
    [best] = db.best_configs()
    assert best.config == {"tile_n": best_tile_n}
    if best_tile_n == 128:
        won = [4, 5] if len(other_rounds) == 5 else None
        assert best.provenance["kept_default"] == {
            "fastest_gain": 0.02,
            "min_gain": 0.003,
            "rounds_won": won,
        }
    else:
        assert (
            "kept_default" not in best.provenance
            and best.time_ms == {64: 0.99, 96: 0.98}[best_tile_n]
        )
    db.close()


def test_each_confirmation_round_starts_with_the_next_config(backend, monkeypatch):
    # Paired rounds compare configs timed back to back: none may always go first or last.
    configs = [FwdConfig(tile_n=64), FwdConfig(tile_n=128), FwdConfig(tile_n=128, num_stages=3)]
    order = []
    request = backend._request

    def recording(problem, config, mode, *args, **kwargs):
        order.append(configs.index(config))
        return request(problem, config, mode, *args, **kwargs)

    monkeypatch.setattr(backend, "_request", recording)
    results = backend.confirm(PROBLEM, configs)
    assert all(
        r.status == "ok" and len(r.details["rounds_ms"]) == backend.options.confirm_rounds
        for r in results
    )
    assert order[:9] == [0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_a_confirmation_judges_a_stored_best_it_retimed_by_its_own_rounds(workdir):
    from fa4tune.measure.base import Measurement

    db, confirm, default_id, other_id = default_and_probe_trials()
    third_id = db.add_trial(
        optuna_number=2,
        config={"tile_n": 64},
        source="sampler",
        measurement=Measurement.ok(PROBLEM, 1.2),
        offer_best=False,
        **confirm,
    )
    # An earlier session stored tile_n 96 at 0.90 ms (a faster spell of the GPU)...
    db.confirm_best(**confirm, confirmed=[({"id": other_id}, Measurement.ok(PROBLEM, 0.90))])
    assert db.best_configs()[0].config == {"tile_n": 96}
    # ...these rounds time it 0.4% faster than the default: within min_gain, so the default takes
    # over, however much lower the earlier session's time was.
    db.confirm_best(
        **confirm,
        prefer=default_id,
        min_gain=0.01,
        confirmed=[
            ({"id": other_id}, Measurement.ok(PROBLEM, 0.996)),
            ({"id": default_id}, Measurement.ok(PROBLEM, 1.0)),
        ],
    )
    [best] = db.best_configs()
    assert best.config == {"tile_n": 128} and best.provenance["kept_default"]["min_gain"] == 0.01
    # A config these rounds did not re-time is compared by time: a slower one does not replace it,
    # and the label stays with the default's entry.
    db.confirm_best(**confirm, confirmed=[({"id": third_id}, Measurement.ok(PROBLEM, 1.1))])
    [best] = db.best_configs()
    assert best.config == {"tile_n": 128}
    db.close()


def test_the_db_vouches_with_the_best_configs_trial_else_the_fastest_never_a_wrong_one(workdir):
    from fa4tune.measure.base import Measurement

    db, confirm, default_id, probe_id = default_and_probe_trials()
    where = dict(kernel=KERNEL.name, kernel_hash="h", target="H200", problem_key=PROBLEM.key())
    assert db.known_good_config(**where) == {"tile_n": 96}  # no best yet: the fastest
    db.confirm_best(
        **confirm,
        prefer=default_id,
        min_gain=0.01,
        confirmed=[
            ({"id": probe_id}, Measurement.ok(PROBLEM, 0.995)),
            ({"id": default_id}, Measurement.ok(PROBLEM, 1.0)),
        ],
    )
    assert db.best_configs()[0].config == {"tile_n": 128}
    assert db.known_good_config(**where) == {"tile_n": 128}  # the best, though not the fastest
    db.add_trial(
        **{**confirm, "study_name": "another study"},
        optuna_number=0,
        config={"tile_n": 128},
        source="sampler",
        measurement=Measurement(status="wrong", reason="above tolerance"),
    )
    assert db.known_good_config(**where) == {"tile_n": 96}
    assert db.known_good_config(**{**where, "kernel_hash": "other"}) is None
    db.close()


def test_a_measured_best_imported_without_a_trial_vouches_unless_it_was_wrong_here(workdir):
    """A table's measured entry, imported into a DB that has no trial of its problem, is evidence
    that the problem runs (it was measured where the table was made); an estimate is not, nor a
    config this DB has seen give a wrong result."""
    from fa4tune.best import BestEntry
    from fa4tune.measure.base import Measurement

    where = dict(kernel=KERNEL.name, kernel_hash="h", target="H200", problem_key=PROBLEM.key())
    entry = BestEntry(
        kernel=KERNEL.name,
        kernel_hash="h",
        target="H200",
        problem=PROBLEM.to_dict(),
        problem_key=PROBLEM.key(),
        bucket_key=PROBLEM.bucket().key(),
        config={"tile_n": 112},
        time_ms=1.0,
        tflops=1.0,
        is_estimate=True,
        provenance={},
        source="import",
    )
    with ResultsDB.open("estimate.db") as db:
        db.merge_best([entry])
        assert db.known_good_config(**where) is None
    with ResultsDB.open("measured.db") as db:
        db.merge_best([dataclasses.replace(entry, is_estimate=False)])
        assert db.known_good_config(**where) == {"tile_n": 112}
        assert db.known_good_config(**{**where, "target": "H100-SXM"}) is None
        run = db.start_run(
            job_name="j",
            kernel=KERNEL.name,
            kernel_hash="h",
            target="H200",
            backend="gpu",
            is_estimate=False,
            fa4tune_version="0",
            study_prefix="p",
        )
        db.add_trial(
            run_id=run,
            study_name="s",
            optuna_number=0,
            kernel=KERNEL.name,
            kernel_hash="h",
            target="H200",
            problem=PROBLEM,
            config={"tile_n": 112},
            measurement=Measurement(status="wrong", reason="x"),
            source="sampler",
            provenance={},
        )
        assert db.known_good_config(**where) is None


@pytest.mark.parametrize("min_gain, kept", [(0.5, True), (0.01, False)])
def test_a_search_confirms_the_default_beside_the_best_and_keeps_it_within_min_gain(
    workdir, min_gain, kept
):
    # hdim 64 causal at 1k: the default tile_m is 192; 128 is ~15% faster on the planted
    # (cost-model) GPU
    problem = {"head_dim": 64, "seqlen_q": 1024, "batch": 16, "nheads_q": 32, "causal": True}
    path = write_job(
        workdir,
        backend="gpu",
        target=None,
        spaces={"tiles": {"tile_m": [128, 192], "tile_n": [128]}},
        sampler="grid",
        problems=[problem],
        budget={"trials": 5},
        measure={**PLANTED, "confirm_rounds": 1, "confirm_top": 1, "min_gain": min_gain},
    )
    run_search(load_job(path), say=quiet)
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        [default] = [t for t in db.trials() if t["source"] == "default"]
        confirmed = {t["config_key"] for t in db.trials() if t["source"] == "confirm"}
        [best] = db.best_configs()
    assert (
        default["config"]["tile_m"] == 192
        and default["config_key"] in confirmed
        and len(confirmed) == 2
    )
    assert best.config["tile_m"] == (192 if kept else 128)
    assert ("kept_default" in best.provenance) == kept


def test_pruner_stops_clearly_slower_candidates_after_the_cheap_timing(workdir):
    space = {
        "tiles": {"tile_n": [64, 128, 160]},
        "pipeline": {"num_stages": [1, 2, 3]},
        "exp2": {"emu_share": [0.0, 0.25, 0.5], "poly_degree": [3]},
    }
    path = write_job(
        workdir,
        backend="gpu",
        target=None,
        spaces=space,
        sampler="grid",
        budget={"trials": 40},
        measure={**PLANTED, "prune_margin": 0.05, "prune_after": 2, "confirm_rounds": 1},
        problems=[{"head_dim": 64, "seqlen_q": 1024, "batch": 1, "nheads_q": 4}],
    )
    summary = run_search(load_job(path), say=quiet)
    result = summary.results[0]
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        trials = [t for t in db.trials() if t["source"] != "confirm"]
    stopped = [t for t in trials if t["status"] == "stopped"]
    assert result.stopped_early == len(stopped) > 0
    best_ok = min(t["time_ms"] for t in trials if t["status"] == "ok")
    for t in stopped:
        assert "stopped after the cheap timing" in t["reason"] and t["time_ms"] > best_ok * 1.05
    import optuna

    study = optuna.load_study(
        study_name=result.study_name,
        storage=optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend("fa4tune-results/results.optuna.journal")
        ),
    )
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    for t in stopped:
        assert states[t["optuna_number"]] == optuna.trial.TrialState.PRUNED


def test_compile_pool_hands_over_artifacts_and_survives_crashing_and_hanging_compiles(workdir):
    space = {
        "tiles": {
            "tile_m": [128],
            "tile_n": [64, 128, planted.POOL_CRASH_TILE_N, planted.POOL_HANG_TILE_N],
        }
    }
    # Head dim 64: shared memory and registers take every one of these tiles at tile_m 128; the
    # space also holds the default's tile_m 192, where 160 and 176 spill and are rejected before any
    # compile.
    path = write_job(
        workdir,
        backend="gpu",
        target=None,
        spaces=space,
        sampler="grid",
        budget={"trials": 10},
        problems=[{"head_dim": 64, "seqlen_q": 2048, "batch": 2, "nheads_q": 8, "causal": True}],
        measure={
            **PLANTED,
            "compile_workers": 2,
            "cache_dir": str(workdir / "kernels"),
            "confirm_rounds": 1,
            "compile_timeout": 2,
        },
    )
    summary = run_search(load_job(path), say=quiet)
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        trials = {
            (t["config"]["tile_m"], t["config"]["tile_n"]): t
            for t in db.trials()
            if t["source"] != "confirm"
        }
    assert summary.results[0].measured == 6
    assert {trials[192, n]["status"] for n in (160, 176)} == {"pruned"}  # rejected, never compiled
    trials = {tile_n: t for (tile_m, tile_n), t in trials.items() if tile_m == 128}
    crashed = trials[planted.POOL_CRASH_TILE_N]
    assert (
        crashed["status"] == "failed"
        and crashed["reason"].startswith("compile failed")
        and "exit status 4" in crashed["reason"]
    )
    hung = trials[planted.POOL_HANG_TILE_N]
    assert hung["status"] == "failed" and "compile timed out after 2 s" in hung["reason"]
    for tile_n in (64, 128):
        assert trials[tile_n]["status"] == "ok" and trials[tile_n]["details"]["artifact_seen"]
    assert len(list((workdir / "kernels").rglob("*.o"))) == 4  # 128 and 192 rows, 64 and 128 keys


# The CLI with the planted worker, slowed down so that a kill lands in the middle of the search.
def start_cli(job_path, workdir, **extra_env):
    env = {
        **os.environ,
        "PLANTED_DELAY": "0.15",
        **extra_env,
        "PYTHONPATH": os.pathsep.join(
            [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "fa4tune.cli", "search", str(job_path), "--no-progress"],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_sigkilled_gpu_search_loses_no_finished_trial_and_resumes(workdir):
    space = {"tiles": {"tile_n": [64, 128, 160, 192]}, "pipeline": {"num_stages": [1, 2, 3]}}
    job_path = write_job(
        workdir,
        backend="gpu",
        target=None,
        spaces=space,
        sampler="random",
        budget={"trials": 10},
        measure={**PLANTED, "run_timeout": 30, "confirm_rounds": 1},
        problems=[{"head_dim": 64, "seqlen_q": 1024, "batch": 1, "nheads_q": 4}],
    )
    proc = start_cli(job_path, workdir)
    db_path = workdir / "fa4tune-results" / "results.db"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            with ResultsDB.open(str(db_path), create=False) as db:
                if db.counts()["trials"] >= 4:
                    break
        except Exception:
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with ResultsDB.open(str(db_path), create=False) as db:
        before = db.trials()
    worker_pids = {t["details"]["pid"] for t in before if "pid" in t["details"]}
    assert worker_pids and 4 <= len(before) < 10
    # the orphaned worker notices its parent is gone and leaves
    assert not still_alive_after(worker_pids, 10), "a worker outlived its killed search"

    summary = run_search(load_job(job_path), resume=True, say=quiet)
    assert summary.resumed
    with ResultsDB.open(str(db_path), create=False) as db:
        after = db.trials()
        assert len(db.best_configs()) == 1 and db.runs()[0]["status"] == "finished"
    kept = {t["id"]: t for t in after}
    assert all(kept[t["id"]] == t for t in before), "a finished trial changed or vanished"
    search = [t for t in after if t["source"] != "confirm"]
    assert sum(t["status"] != "pruned" for t in search) == 10
    keys = [t["config_key"] for t in search]
    assert len(keys) == len(set(keys)), "a config was measured twice"
    assert any(t["source"] == "default" for t in search)


def test_a_worker_hung_in_a_run_leaves_when_its_search_is_sigkilled(workdir):
    """The measuring worker hangs in a candidate's run, far from its deadline, when the search is
    SIGKILLed: nothing will ever read the pipe, so the worker must see its parent go and exit."""
    pid_file = workdir / "hung-worker.pid"
    job_path = write_job(
        workdir,
        backend="gpu",
        target=None,
        budget={"trials": 2},
        measure={**PLANTED, "run_timeout": 600},
        problems=[{"head_dim": 64, "seqlen_q": 1024, "batch": 1, "nheads_q": 4}],
    )
    proc = start_cli(job_path, workdir, PLANTED_HANG_PID_FILE=str(pid_file))
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the worker never started its run"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        proc.kill()
        proc.wait()
        assert not still_alive_after([worker], 10), "the hung worker outlived its killed search"
    finally:
        proc.kill()
        if worker is not None:
            kill_processes([worker])


def test_a_failing_early_stop_verdict_measures_fully_and_keeps_the_worker(backend):
    def broken_verdict(cheap_ms):
        raise RuntimeError("database is locked")

    first = backend.measure(PROBLEM, config(128), should_stop=broken_verdict)
    assert first.status == "ok", first.reason
    assert "no early-stop verdict (RuntimeError: database is locked)" in first.details["notes"][0]
    second = backend.measure(PROBLEM, config(64), should_stop=lambda ms: None)
    assert second.status == "ok", second.reason
    assert second.details["pid"] == first.details["pid"] and second.details["served"] == 2


def test_a_reply_waiting_in_the_pipe_is_taken_though_the_caller_came_past_the_deadline(workdir):
    """The compile pool's one thread may be busy starting another worker while a compile finishes:
    the reply that waits in the pipe is the candidate's, not a timeout (which would kill the worker
    and fail a good config for good)."""
    import time

    from fa4tune.measure.worker import WorkerProcess

    worker = WorkerProcess(
        "planted_worker", start_timeout=60, env={"FA4TUNE_WORKER_ROLE": "compile"}
    )
    worker.start()
    try:
        worker.submit(
            {"op": "compile", "config": {"tile_n": 128}, "artifact": str(workdir / "a.o")},
            {"compile": 0.5},
        )
        time.sleep(1.0)  # past the 0.5 s deadline; the compile took 0.01 s
        assert worker.connection.poll(5)
        reply = worker.step(0.05)
        assert (
            reply.ok and reply.result["artifact"] == str(workdir / "a.o") and not reply.restarted
        ), reply
    finally:
        worker.close()


def test_a_compile_pool_that_cannot_work_fails_no_candidate(workdir, monkeypatch):
    """When no compile worker starts, that is the pool's failure, not the candidates': the measuring
    worker compiles them itself, and every good config is measured."""
    monkeypatch.setenv("PLANTED_POOL_DOWN", "1")
    space = {"tiles": {"tile_m": [128], "tile_n": [64, 128]}}
    path = write_job(
        workdir,
        backend="gpu",
        target=None,
        spaces=space,
        sampler="grid",
        budget={"trials": 10},
        problems=[{"head_dim": 64, "seqlen_q": 2048, "batch": 2, "nheads_q": 8}],
        measure={
            **PLANTED,
            "compile_workers": 2,
            "cache_dir": str(workdir / "kernels"),
            "confirm_rounds": 1,
        },
    )
    summary = run_search(load_job(path), say=quiet)
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        trials = [
            t for t in db.trials() if t["source"] != "confirm" and t["config"]["tile_m"] == 128
        ]
        assert db.best_configs()
    assert summary.results[0].measured >= 2
    assert {t["config"]["tile_n"]: t["status"] for t in trials} == {64: "ok", 128: "ok"}
    assert not any(
        t["details"].get("artifact_seen") for t in trials
    )  # compiled by the measuring worker


def test_prefetched_compiles_that_will_not_be_measured_are_dropped():
    from fa4tune.measure.pool import CompilePool

    pool = CompilePool(
        "planted_worker", 1, 30, env={"FA4TUNE_WORKER_ROLE": "compile"}, start_timeout=60
    )
    try:
        hang = {
            "op": "compile",
            "config": {"tile_n": planted.POOL_HANG_TILE_N},
            "artifact": "/tmp/never.o",
        }
        pool.submit("busy", hang)  # occupies the one worker
        pool.submit(
            "queued", {"op": "compile", "config": {"tile_n": 64}, "artifact": "/tmp/queued.o"}
        )
        deadline = time.monotonic() + 30
        while not pool._running and time.monotonic() < deadline:
            time.sleep(0.05)
        pool.discard("queued")
        pool.discard("busy")  # running: left to finish
        assert not pool.submitted("queued") and pool.submitted("busy")
        assert "queued" not in pool._queue
    finally:
        pool.close()
