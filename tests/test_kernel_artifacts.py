"""A kernel compiled and exported by one process is loaded by another in milliseconds (what the
compile workers hand the measuring worker), on the CPU; running it is a GPU test."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile
REPO = Path(__file__).resolve().parent.parent


def test_export_in_one_process_load_in_another(tmp_path):
    from fa4tune.kernels.fa4_fwd_sm90.compile import (
        _CACHE,
        compile_forward,
        compile_key,
        load_compiled,
    )
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.target import get_target

    config = FwdConfig(tile_n=96, num_stages=3)
    path = tmp_path / "k.o"
    script = (
        "from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig\n"
        "from fa4tune.kernels.fa4_fwd_sm90.compile import compile_forward, export_compiled\n"
        "c = compile_forward(FwdConfig(tile_n=96, num_stages=3), 'fp16', 64, 64, False, 'H200')\n"
        f"export_compiled(c, {str(path)!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    assert path.stat().st_size > 0 and not list(tmp_path.glob(".export-*")), (
        "no stray temporary files"
    )
    key = compile_key(config, "fp16", 64, 64, False, get_target("H200"))
    _CACHE.pop(key, None)
    loaded = load_compiled(path, config, "fp16", 64, 64, False, "H200")
    try:
        assert loaded.kernel is None and loaded.compile_seconds < 1.0
        assert compile_forward(config, "fp16", 64, 64, False, "H200") is loaded, (
            "the compile cache serves it"
        )
        names = list(loaded.function.execution_args.signature.parameters)
        # The ragged inputs' index tensors come after the stream (None for batch-shaped ones),
        # then the in-kernel combine's O and LSE (None without it).
        assert names[:5] == ["mQ", "mK", "mV", "mO", "mLSE"] and names[8] == "stream"
        ragged = ["mCuSeqlensQ", "mCuSeqlensK", "mSeqUsedK", "mPageTable"]
        assert names[9:] == [*ragged, "mOFinal", "mLSEFinal"]
    finally:
        _CACHE.pop(key, None)
