"""The kernel's FMA-pipe exp2, run on the GPU, against its float32 model on the CPU, bit for bit.

(No `from __future__ import annotations` here: the CuTe DSL reads the kernels' annotations.)"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def _run_device_exp2(xs: np.ndarray, degree: int) -> np.ndarray:
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import from_dlpack

    from fa4tune.kernels.sm90.exp2 import exp2_emulated

    @cute.kernel
    def apply(x: cute.Tensor, y: cute.Tensor, n: cutlass.Int32):
        i = cute.arch.block_idx()[0] * 256 + cute.arch.thread_idx()[0]
        if i < n:
            y[i] = exp2_emulated(x[i], degree)

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, n: cutlass.Int32, stream: cuda.CUstream):
        apply(x, y, n).launch(grid=[(n + 255) // 256, 1, 1], block=[256, 1, 1], stream=stream)

    x = torch.from_numpy(xs).cuda()
    y = torch.full_like(x, float("nan"))
    launch(
        from_dlpack(x),
        from_dlpack(y),
        cutlass.Int32(x.numel()),
        cuda.CUstream(torch.cuda.current_stream().cuda_stream),
    )
    torch.cuda.synchronize()
    return y.cpu().numpy()


@pytest.mark.parametrize("degree", [2, 3, 5])
def test_device_exp2_matches_cpu_model_bit_for_bit(degree):
    from fa4tune.kernels.sm90 import exp2_poly

    rng = np.random.default_rng(degree)
    xs = np.concatenate(
        [
            rng.uniform(-130, 9, 1 << 18),
            np.linspace(-2, 0, 1 << 16),
            [0.0, -0.0, -1.0, -126.0, -127.0, -1e30, -np.inf, 8.0, 7.99999],
        ]
    ).astype(np.float32)
    device_bits = _run_device_exp2(xs, degree).view(np.uint32)
    model_bits = exp2_poly.emulate_exp2_f32(xs, degree).view(np.uint32)
    mismatch = np.flatnonzero(device_bits != model_bits)
    assert mismatch.size == 0, f"{mismatch.size} differ, e.g. x={xs[mismatch[:5]]}"
