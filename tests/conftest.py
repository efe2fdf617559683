import itertools
import os
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin_pkg"


def pytest_collection_modifyitems(config, items):
    """FA4TUNE_TEST_SHARD=i/n keeps every n-th test from the i-th (from 0): n processes then share
    one GPU host's CPUs, whose compiles are most of the GPU tests' time. Tests marked `gpu` run only
    where a CUDA GPU is present."""
    shard = os.environ.get("FA4TUNE_TEST_SHARD")
    if shard:
        index, count = (int(part) for part in shard.split("/"))
        config.hook.pytest_deselected(
            items=[item for n, item in enumerate(items) if n % count != index]
        )
        items[:] = [item for n, item in enumerate(items) if n % count == index]
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    from fa4tune.measure.base import cuda_available

    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def sigint_default() -> None:
    """preexec_fn of a search started by a test that sends it SIGINT: a child inherits an ignored
    SIGINT (tests run as a background job of a non-interactive shell have one), and Python then
    never raises KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (exited, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def still_alive_after(pids, seconds: float) -> set:
    """The processes of `pids` still running after waiting up to `seconds` for all to end."""
    import time

    deadline = time.monotonic() + seconds
    alive = {pid for pid in pids if process_alive(pid)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {pid for pid in alive if process_alive(pid)}
    return alive


def kill_processes(pids) -> None:
    """SIGKILL those of `pids` that still run (a test's own, left behind when it fails)."""
    import signal

    for pid in pids:
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


POISON_ATTEMPTS = 4  # calls poisoned_attention makes before it gives up on the allocator


def poisoned_attention(
    q, k, v, causal: bool = False, softmax_scale: float | None = None, call=None
):
    """fa4tune.attention(q, k, v, causal, softmax_scale) (or `call` with the same arguments: the op,
    a compiled function around it) with its outputs on NaN-poisoned memory,
    for GPU tests: an element a launch leaves unwritten shows as NaN, not as what an earlier call
    left in that memory. fa4tune.attention allocates O and the LSE itself (torch.empty, on the
    tensors' device and its current stream), so tensors of their sizes are filled with NaN and
    freed just before the call, and the caching allocator hands their blocks out again. The
    outputs' pointers say whether it did; outputs that landed elsewhere are held (they cannot land
    there again) and the call is made again. AssertionError when the poison never lands, or when
    NaN is left in the outputs."""
    import math

    import torch

    import fa4tune

    batch, seqlen_q, nheads_q, _ = q.shape
    out_shape, lse_shape = (batch, seqlen_q, nheads_q, v.shape[3]), (batch, nheads_q, seqlen_q)
    assert math.prod(out_shape) > 0, "empty outputs: nothing to poison"
    elsewhere = []
    for _ in range(POISON_ATTEMPTS):
        poison = [
            torch.full(out_shape, math.nan, dtype=q.dtype, device=q.device),
            torch.full(lse_shape, math.nan, dtype=torch.float32, device=q.device),
        ]
        poisoned = [t.data_ptr() for t in poison]
        del poison  # back to the caching allocator, NaN in them
        out, lse = (call or fa4tune.attention)(q, k, v, causal=causal, softmax_scale=softmax_scale)
        if [out.data_ptr(), lse.data_ptr()] == poisoned:
            break
        elsewhere.append((out, lse))
    else:
        raise AssertionError(
            f"fa4tune.attention's outputs never landed on the poisoned blocks "
            f"({POISON_ATTEMPTS} calls): the poison would not show unwritten "
            "elements"
        )
    assert not torch.isnan(out).any().item(), "NaN in the output: some elements were never written"
    assert not torch.isnan(lse).any().item(), "NaN in the LSE: some rows were never written"
    return out, lse


# A grid of 8 points but 4 configs: poly_degree has no effect while emu_share is 0, and equal
# kernels are one config, so the configs a grid search stores never reach the grid's size.
COLLAPSED_GRID = {
    "tiles": {"tile_m": [128, 192], "tile_n": [64, 128]},
    "exp2": {"poly_degree": [3, 4], "emu_share": [0.0]},
}


def write_job(directory: Path, name: str = "job", **fields) -> Path:
    """A small model-backend job; fields override the defaults."""
    job = {
        "name": name,
        "kernel": "fa4_fwd_sm90",
        "backend": "model",
        "target": "H200",
        "spaces": {"tiles": {}},
        "problems": [{"head_dim": 128, "seqlen_q": 2048, "batch": 2, "nheads_q": 8}],
        "sampler": "tpe",
        "budget": {"trials": 8},
        "seed": 0,
        "warm_start": 0,
    }
    job.update(fields)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A clean working directory with no FA4TUNE_* variables set."""
    for var in ("FA4TUNE_DB", "FA4TUNE_TABLE", "FA4TUNE_TARGET", "FA4TUNE_L2_FLUSH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    import fa4tune.runtime

    fa4tune.runtime.reset()
    yield tmp_path
    fa4tune.runtime.reset()


@pytest.fixture
def entry_point_plugin(tmp_path, monkeypatch):
    """Install the test plugin the way pip would expose it: a dist-info with an entry point."""
    site = tmp_path / "site"
    install_distribution(
        site,
        "fa4tune-testplugin",
        "[fa4tune.spaces]\neven_stages = fa4tune_testplugin:EvenStagesSpace\n",
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    import fa4tune.space

    fa4tune.space.rediscover()
    yield
    sys.modules.pop("fa4tune_testplugin", None)
    monkeypatch.undo()
    fa4tune.space.rediscover()


_database_numbers = itertools.count()


@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL server on the loopback for the session (see tests/pgserver.py)."""
    from pgserver import PostgresServer

    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture
def postgres(postgres_server, request):
    """Two fresh databases on the test server: (results DB URL, Optuna storage URL)."""
    import re

    base = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40]
    stamp = f"{os.getpid()}_{next(_database_numbers)}"
    return (
        postgres_server.create_database(f"r_{base}_{stamp}"),
        postgres_server.create_database(f"o_{base}_{stamp}"),
    )


def study_states(job):
    """(name, trial states) of the one study in the working directory's default journal."""
    import optuna

    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend("fa4tune-results/results.optuna.journal")
    )
    summaries = optuna.get_all_study_summaries(storage)
    assert len(summaries) == 1
    study = optuna.load_study(study_name=summaries[0].study_name, storage=storage)
    return summaries[0].study_name, [t.state for t in study.get_trials(deepcopy=False)]


def install_distribution(site, name: str, entry_points: str) -> None:
    """A distribution `name` 1.0 under `site` as pip would lay it out (its dist-info with METADATA
    and entry_points.txt), for importlib.metadata to find once `site` is on sys.path."""
    dist = site / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def broken_family_plugin(tmp_path, monkeypatch):
    """A third-party kernel family installed as pip would, whose module does not import."""
    import fa4tune.kernels

    site = tmp_path / "site"
    install_distribution(
        site, "brokenfamily", "[fa4tune.kernels]\nbroken = brokenfamily_mod:FAMILY\n"
    )
    (site / "brokenfamily_mod.py").write_text(
        "raise ImportError('needs a package not installed')\n"
    )
    monkeypatch.syspath_prepend(str(site))
    fa4tune.kernels.rediscover()
    yield
    monkeypatch.undo()
    fa4tune.kernels.rediscover()
