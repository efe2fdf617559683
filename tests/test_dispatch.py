"""fa4tune.attention on the CPU: every unsupported input gets an error naming it (CPU and meta
tensors stand in for CUDA ones), `explain` finds the tuned config of a DB, and the launch's packed
arguments are byte for byte what the CuTe DSL itself passes to the compiled kernel; with the kernel
played by the CPU, repeated calls on one shape launch with each call's tensors, scale and
causality."""

import ctypes
import math
from types import SimpleNamespace

import pytest
import torch

import fa4tune
from fa4tune.kernels import get_kernel
from fa4tune.problem import Problem
from fa4tune.runtime.dispatch import UnsupportedInput, explain


def qkv(b=2, sq=256, sk=256, hq=4, hkv=2, d=128, dv=None, dtype=torch.bfloat16, device="meta"):
    dv = d if dv is None else dv
    return (
        torch.empty(b, sq, hq, d, dtype=dtype, device=device),
        torch.empty(b, sk, hkv, d, dtype=dtype, device=device),
        torch.empty(b, sk, hkv, dv, dtype=dtype, device=device),
    )


def test_attention_runs_the_dispatcher_when_nothing_traces(monkeypatch):
    """fa4tune.attention calls the eager path directly, not through torch's op dispatcher, unless
    torch.compile or torch.export traces (test_ops.py)."""
    from fa4tune.runtime import dispatch, ops

    seen = []
    monkeypatch.setattr(dispatch, "attention", lambda *args: seen.append(args) or "eager")
    q, k, v = qkv()
    assert fa4tune.attention is ops.attention
    assert fa4tune.attention(q, k, v, True, 0.5) == "eager" and seen == [(q, k, v, True, 0.5)]


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: qkv(dtype=torch.float32), "bfloat16 or float16 tensors; q is torch.float32"),
        (lambda: qkv(d=80), "head_dim of q and k is 80; the kernel supports head dims 64, 96, 128"),
        (lambda: qkv(dv=72), "head_dim of v is 72"),
        (lambda: (qkv()[0], qkv()[1], qkv(sk=128)[2]), "k and v must agree"),
        (lambda: (qkv(b=3)[0], *qkv()[1:]), "same batch size"),
        (lambda: qkv(hq=3, hkv=2), "must be a multiple of the heads of k and v"),
        (lambda: (qkv()[0], qkv(d=64)[1], qkv()[2]), "same head_dim"),
        (
            lambda: (
                torch.empty(2, 256, 4, 256, dtype=torch.bfloat16)[..., ::2],
                *qkv(device="cpu")[1:],
            ),
            "contiguous in its last dimension",
        ),
        (
            lambda: (
                torch.empty(2, 256, 4, 132, dtype=torch.bfloat16)[..., :128],
                *qkv(device="cpu")[1:],
            ),
            "multiples of 8 elements",
        ),
        (lambda: (qkv()[0][0], *qkv()[1:]), "4-D tensors"),
        (lambda: ([1, 2], *qkv()[1:]), "torch tensors; q is a list"),
        (lambda: (qkv()[0], qkv()[1].half(), qkv()[2]), "one dtype"),
        (lambda: qkv(device="cpu"), "needs CUDA tensors; q is on cpu"),
        (lambda: qkv(device="meta"), "needs CUDA tensors; q is on meta"),
        (lambda: (qkv(hq=0)[0], *qkv()[1:]), "need at least one head"),
        (lambda: (qkv()[0], *qkv(hkv=0)[1:]), "need at least one head"),
        (
            lambda: qkv(sk=0, device="cpu"),
            "needs CUDA tensors; q is on cpu",
        ),  # empty, but on no GPU either
        # torch calls this contiguous (.contiguous() returns it as it is), but the TMA needs every
        # stride aligned.
        (
            lambda: (
                torch.empty(2, 256, 1, 128, dtype=torch.bfloat16).as_strided(
                    (2, 256, 1, 128), (32768, 128, 1, 1)
                ),
                *qkv(hkv=1, device="cpu")[1:],
            ),
            r"size-1 dims too; use q.clone\(memory_format=torch.contiguous_format\)",
        ),
        # An expanded view: the DSL took the zero stride as a constant and read the descriptor
        # wrong.
        (
            lambda: (
                qkv()[0],
                *(t[:, :, :1].expand(2, 256, 4, 128) for t in qkv(hkv=1, device="cpu")[1:]),
            ),
            r"k has a zero stride .* \(an expanded view\?\); "
            r"pass k.clone\(memory_format=torch.contiguous_format\)",
        ),
        # A size-1 dim with stride 0: torch calls it contiguous (.contiguous() returns it
        # unchanged).
        (
            lambda: (
                torch.empty_strided((2, 1, 4, 128), (512, 0, 128, 1), dtype=torch.bfloat16),
                *qkv(sk=1, device="cpu")[1:],
            ),
            r"q has a zero stride \(512, 0, 128, 1\)",
        ),
        (
            lambda: (
                torch.nested.nested_tensor([torch.zeros(256, 4, 128, dtype=torch.bfloat16)] * 2),
                *qkv()[1:],
            ),
            "dense tensors; q is nested",
        ),
        (
            lambda: (qkv(device="cpu")[0].to_sparse(), *qkv()[1:]),
            "dense tensors; q is torch.sparse_coo",
        ),
    ],
)
def test_unsupported_inputs_are_named(make, match):
    q, k, v = make()
    with pytest.raises(UnsupportedInput, match=match):
        fa4tune.attention(q, k, v)


def test_inputs_with_nothing_to_compute_are_told_apart_and_answered_without_a_kernel():
    """No batch, no query rows or no keys: nothing to compute (and nothing read, so strides do not
    matter); the answer is O zero and LSE -inf, as flash-attn gives. A missing head is an error."""
    from fa4tune.kernels.common.inputs import check_inputs, empty_outputs

    assert not check_inputs(*qkv(), False)
    for shape in ({"b": 0}, {"sq": 0}, {"sk": 0}):
        q, k, v = qkv(**shape, device="cpu")
        assert check_inputs(q, k, v, True)
        assert check_inputs(
            q, k[..., ::2].as_strided(k.shape, (3, 5, 7, 1)), v, False
        )  # odd strides: not read
        out, lse = empty_outputs(q, v)
        assert (
            out.shape == (q.shape[0], q.shape[1], 4, 128)
            and out.dtype == q.dtype
            and torch.all(out == 0)
        )
        assert lse.shape == (q.shape[0], 4, q.shape[1]) and lse.dtype == torch.float32
        assert torch.all(lse == -math.inf)
        given = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
        assert (
            empty_outputs(q, v, *given) == given
            and torch.all(given[0] == 0)
            and torch.all(given[1] == -math.inf)
        )
        with pytest.raises(UnsupportedInput, match="empty inputs .* have nothing to look up"):
            explain(q, k, v)
    with pytest.raises(UnsupportedInput, match=r"out must be \(2, 0, 4, 128\)"):
        empty_outputs(
            *qkv(sq=0, device="cpu")[::2], out=torch.zeros(2, 1, 4, 128, dtype=torch.bfloat16)
        )
    with pytest.raises(UnsupportedInput, match="causal must be True or False"):
        check_inputs(*qkv(sk=0), 1)


def test_outputs_a_caller_passes_are_checked_for_the_tma_store():
    """launch_outputs, which the batch-shaped and the ragged launches both run on a caller's out and
    lse: shapes, dtypes, and out's strides multiples of 8 elements (its TMA store); it keeps what
    was passed and allocates what was not."""
    from fa4tune.kernels.common.inputs import launch_outputs

    q = torch.zeros(2, 16, 4, 64, dtype=torch.bfloat16)
    shapes = ((2, 16, 4, 64), (2, 4, 16))
    out, lse = torch.empty(shapes[0], dtype=q.dtype), torch.empty(shapes[1])
    got = launch_outputs(q, out, lse, shapes)
    assert got[0] is out and got[1] is lse
    new_out, new_lse = launch_outputs(q, None, None, shapes)  # the launch allocates them
    assert (new_out.shape, new_out.dtype) == (shapes[0], q.dtype)
    assert (new_lse.shape, new_lse.dtype) == (shapes[1], torch.float32)
    odd = torch.empty(2, 16, 4, 68, dtype=q.dtype)[..., :64]  # rows of 68 elements
    with pytest.raises(UnsupportedInput, match=r"multiples of 8 elements \(TMA store\)"):
        launch_outputs(q, odd, None, shapes)
    with pytest.raises(UnsupportedInput, match=r"lse must be \(2, 4, 16\)"):
        launch_outputs(q, None, torch.empty(2, 16, 4), shapes)
    with pytest.raises(UnsupportedInput, match="out must be"):
        launch_outputs(q, out.float(), None, shapes)


def test_bad_causal_and_scale():
    with pytest.raises(UnsupportedInput, match="causal must be True or False"):
        fa4tune.attention(*qkv(), causal="yes")
    for bad in (-0.1, True, float("nan"), torch.tensor(0.1), "0.1"):
        with pytest.raises(
            UnsupportedInput, match="softmax_scale must be a positive finite number"
        ):
            fa4tune.attention(*qkv(device="cpu"), softmax_scale=bad)
    numpy = pytest.importorskip("numpy")
    with pytest.raises(
        UnsupportedInput, match="needs CUDA tensors"
    ):  # a numpy float is a number: on to the device
        fa4tune.attention(*qkv(device="cpu"), softmax_scale=numpy.float32(0.1))


def test_inputs_that_require_grad_go_through_autograd_and_the_kernel_call_refuses_them():
    """fa4tune.attention records through its op (test_ops.py), on to the same checks; the kernel
    family's own attention_forward has no backward, and refuses inputs that autograd would record
    (outputs without a grad_fn would leave q, k and v without gradients, silently)."""
    q, k, v = qkv(device="cpu")
    k.requires_grad_(True)
    with pytest.raises(UnsupportedInput, match="needs CUDA tensors"):
        fa4tune.attention(q, k, v)
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    with pytest.raises(
        UnsupportedInput, match=r"^attention_forward has no backward.*or call fa4tune.attention$"
    ):
        attention_forward(q, k, v, get_kernel().default_config(Problem(), None))


def test_explain_uses_the_tuned_config_of_the_db(workdir, monkeypatch):
    from fa4tune.db import ResultsDB
    from fa4tune.kernels import get_kernel
    from fa4tune.measure.base import Measurement

    kernel = get_kernel()
    problem = Problem(
        head_dim=128, causal=True, seqlen_q=256, seqlen_k=256, batch=2, nheads_q=4, nheads_kv=2
    )
    tuned = {**kernel.default_config(problem, None).to_dict(), "tile_n": 96, "num_stages": 3}
    with ResultsDB.open("tuned.db") as db:
        run = db.start_run(
            job_name="j",
            kernel=kernel.name,
            kernel_hash=kernel.source_hash(),
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
            kernel=kernel.name,
            kernel_hash=kernel.source_hash(),
            target="H200",
            problem=problem,
            config=tuned,
            measurement=Measurement.ok(problem, 0.1),
            source="sampler",
            provenance={},
        )
    monkeypatch.setenv("FA4TUNE_DB", str(workdir / "tuned.db"))
    fa4tune.runtime.reset()
    found = explain(*qkv(), causal=True, target="H200")
    assert found.source == "exact" and found.config.to_dict() == tuned
    other = explain(*qkv(), causal=False, target="H200")  # not tuned: the default
    assert other.source == "default"


@pytest.mark.compile
def test_packed_arguments_match_what_the_dsl_passes():
    """The launch writes argument descriptors itself; they must equal the DSL's own, byte for byte,
    for the exact compiled signature (a change of the kernel's arguments fails here, not on a
    GPU)."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is first imported
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
    from fa4tune.kernels.fa4_fwd_sm90.compile import compile_forward
    from fa4tune.kernels.fa4_fwd_sm90.launch import PreparedLaunch, heads_per_l2_group
    from fa4tune.target import get_target

    target = get_target("H200")
    base = torch.empty(2, 320, 8, 128, dtype=torch.bfloat16)
    q = base[:, :300, :, :]  # a strided view: batch stride is not seqlen * heads * d
    k = torch.empty(2, 200, 2, 128, dtype=torch.bfloat16)
    v = torch.empty(2, 200, 2, 128, dtype=torch.bfloat16)
    problem = fa4tune.runtime.dispatch.problem_of(q, k, v, True)
    config = FAMILY.default_config(problem, target)
    compiled = compile_forward(config, "bf16", 128, 128, True, target)
    launch = PreparedLaunch(problem, config, target, q, k, v, softmax_scale=0.07)
    out = torch.empty(launch.out_shape, dtype=torch.bfloat16)
    lse = torch.empty(launch.lse_shape, dtype=torch.float32)
    stream_handle = 0x7F00DEAD
    counter = torch.zeros(1, dtype=torch.int32)
    for pointer, t in zip(launch.pointers, (q, k, v, out, lse, counter), strict=True):
        pointer.value = t.data_ptr()
    launch.stream.value = stream_handle

    tensors = [
        from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=3) for t in (q, k, v, out)
    ]
    tensors.append(from_dlpack(lse, assumed_align=4).mark_layout_dynamic(leading_dim=2))
    tensors.append(from_dlpack(counter, assumed_align=4))
    reference_args, _ = compiled.function.generate_execution_args(
        *tensors,
        Float32(0.07 * math.log2(math.e)),
        Int32(heads_per_l2_group(problem, target)),
        cuda.CUstream(stream_handle),
    )
    sizes = [48, 48, 48, 48, 40, 8, 4, 4, 8]
    assert len(reference_args) == len(launch.arguments) == len(sizes)
    for index, (theirs, ours, size) in enumerate(zip(reference_args, launch.arguments, sizes)):
        theirs = theirs.value if isinstance(theirs, ctypes.c_void_p) else theirs
        assert ctypes.string_at(theirs, size) == ctypes.string_at(ours, size), (
            f"argument {index} differs"
        )


@pytest.mark.compile
def test_packed_arguments_of_the_in_kernel_combine_match_the_dsl():
    """With combine_in_kernel the kernel takes the partials, the tiles' split counts (a (tiles,)
    tensor of dynamic layout where the tile counter was), and O and LSE after the four absent
    ragged index tensors: the prepared launch's descriptors must be the DSL's own, byte for byte,
    and no combine kernel's arguments are packed."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is first imported
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    from fa4tune.kernels.fa4_fwd_sm90.compile import compile_forward
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig, tile_count
    from fa4tune.kernels.fa4_fwd_sm90.launch import PreparedLaunch, heads_per_l2_group
    from fa4tune.target import get_target

    target = get_target("H200")
    q = torch.empty(2, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16)
    v = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16)
    problem = fa4tune.runtime.dispatch.problem_of(q, k, v, False)
    config = FwdConfig(tile_m=64, num_stages=3, pack_gqa=True, num_splits=4, combine_in_kernel=True)
    compiled = compile_forward(config, "bf16", 128, 128, False, target, pack_group=4)
    launch = PreparedLaunch(problem, config, target, q, k, v, softmax_scale=0.07)
    assert launch.combine_descriptors == [] and launch.tiles == tile_count(config, problem) == 16
    out = torch.empty(launch.out_shape, dtype=torch.bfloat16)
    lse = torch.empty(launch.lse_shape, dtype=torch.float32)
    o_shape, l_shape = launch.partial_shapes
    o_part = torch.empty(o_shape, dtype=torch.float32)
    lse_part = torch.empty(l_shape, dtype=torch.float32)
    counts = torch.zeros(launch.tiles, dtype=torch.int32)
    for pointer, t in zip(
        launch.pointers + launch.final_pointers,
        (q, k, v, o_part, lse_part, counts, out, lse),
        strict=True,
    ):
        pointer.value = t.data_ptr()
    launch.stream.value = 0x7F00DEAD

    def dynamic(t, align):
        return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    # Held here: the DSL's descriptors live in these objects.
    tensors = [dynamic(t, 16) for t in (q, k, v, o_part)] + [dynamic(lse_part, 4)]
    tensors.append(dynamic(counts, 4))
    final = [dynamic(out, 16), dynamic(lse, 4)]
    reference_args, _ = compiled.function.generate_execution_args(
        *tensors,
        Float32(0.07 * math.log2(math.e)),
        Int32(heads_per_l2_group(problem, target)),
        cuda.CUstream(0x7F00DEAD),
        None,
        None,
        None,
        None,
        *final,
    )
    sizes = [48, 48, 48, 64, 48, 16, 4, 4, 8, 48, 40]
    assert len(reference_args) == len(launch.arguments) == len(sizes)
    for index, (theirs, ours, size) in enumerate(zip(reference_args, launch.arguments, sizes)):
        theirs = theirs.value if isinstance(theirs, ctypes.c_void_p) else theirs
        assert ctypes.string_at(theirs, size) == ctypes.string_at(ours, size), (
            f"argument {index} differs"
        )


class _RecordingHostFunction:
    """Stands in for a compiled host function: records the pointer array it is called with and
    writes `code` into the error slot that the array names after the arguments."""

    restype = ctypes.c_int32  # what the DSL reads to decide that the function reports an error code

    def __init__(self, n_arguments: int) -> None:
        self.n_arguments, self.calls, self.code = n_arguments, [], 0

    def __call__(self, packed) -> None:
        self.calls.append(list(packed))
        ctypes.c_int32.from_address(packed[self.n_arguments]).value = self.code


@pytest.mark.compile
def test_direct_call_packs_the_arguments_as_the_dsl_does():
    """fa4tune.attention calls the compiled host function with a pointer array it built once; it
    must be the array the DSL's own executor builds (arguments, error slot, kernel handles), with an
    error slot of its own, and a non-zero error code must come back. A DSL that changes the layout
    fails here."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cutlass.base_dsl.jit_executor import JitExecutor

    from fa4tune.kernels.common.launch import direct_call, launch_error

    buffers = [ctypes.create_string_buffer(16) for _ in range(9)]
    arguments = [ctypes.addressof(b) for b in buffers]
    host = _RecordingHostFunction(len(arguments))
    kernels = [ctypes.c_void_p(0x7000), ctypes.c_void_p(0x7100)]
    executor = JitExecutor(
        SimpleNamespace(capi_func=host), SimpleNamespace(kernel_functions_ptrs=kernels), False
    )
    theirs = list(executor._get_invoke_packed_args(arguments))

    run, result = direct_call(executor, arguments)
    assert run() == 0
    host.code = 700
    assert run() == 700 and result.value == 700
    assert executor.cuda_result.value == 0  # the executor's own slot is not shared with the launch
    ours = host.calls[0]
    assert host.calls[1] == ours  # built once
    n = len(arguments)
    assert ours[:n] == theirs[:n] == arguments
    assert theirs[n] == executor._cuda_result_addr and ours[n] == ctypes.addressof(result)
    assert ours[n + 1 :] == theirs[n + 1 :] == [0x7000, 0x7100]
    assert "cudaErrorIllegalAddress (700)" in str(launch_error(700))

    # The CUDA-dialect executor (what cute.compile gives here) has no execution context and no
    # kernel handles: the array is the arguments and the error slot.
    host = _RecordingHostFunction(len(arguments))
    executor = JitExecutor(SimpleNamespace(capi_func=host), None, False)
    theirs = list(executor._get_invoke_packed_args(arguments))
    run, result = direct_call(executor, arguments)
    assert run() == 0 and len(host.calls[0]) == len(theirs) == n + 1
    assert host.calls[0][:n] == theirs[:n] and host.calls[0][n] == ctypes.addressof(result)


def test_direct_call_falls_back_to_the_dsl_call():
    """An executor without the compiled function's internals is called through
    run_compiled_program."""
    from fa4tune.kernels.common.launch import direct_call

    seen = []
    executor = SimpleNamespace(run_compiled_program=seen.append)
    run, result = direct_call(executor, [1, 2, 3])
    assert run() == 0 and result is None and seen == [[1, 2, 3]]


def test_a_config_whose_launch_grid_cannot_hold_the_problem_is_infeasible():
    """One CTA per tile, non-causal: (m blocks, heads, batch) grid, y and z at most 65535;
    persistent and causal launches are flat."""
    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.target import get_target

    big = Problem(head_dim=128, seqlen_q=128, batch=65536, nheads_q=1)
    one_per_tile = FwdConfig(persistent=False)
    assert any(
        "batch 65536 > 65535" in r
        for r in FAMILY.infeasible_reasons(big, one_per_tile, get_target("H200"))
    )
    causal = Problem(**{**big.to_dict(), "causal": True})
    for config, problem in (
        (FwdConfig(persistent=True), big),
        (one_per_tile, causal),
        (one_per_tile, Problem(head_dim=128, seqlen_q=128, batch=65535, nheads_q=1)),
    ):
        assert not FAMILY.infeasible_reasons(problem, config, get_target("H200")), (config, problem)


def test_outputs_passed_in_are_checked():
    from fa4tune.kernels.common.inputs import check_output

    good = torch.empty(2, 4, 8)
    check_output("lse", good, (2, 4, 8), torch.float32, good.device)
    check_output(
        "lse", torch.empty(2, 8, 8)[:, :4], (2, 4, 8), torch.float32, good.device
    )  # strided, apart
    check_output(
        "out", torch.empty(1, 1, 4, 8), (1, 1, 4, 8), torch.float32, good.device
    )  # size-1 dims
    for t, match in (
        (torch.empty(2, 4, 9), "lse must be"),
        (good.half(), "lse must be"),
        (torch.empty(2, 4, 1).expand(2, 4, 8), "without zero strides"),
        (torch.empty(64).as_strided((2, 4, 8), (32, 4, 1)), "elements that share memory"),
        (torch.empty(2, 8, 4).transpose(1, 2), "contiguous in its last dimension"),
        ([1], "dense torch"),
    ):
        with pytest.raises(UnsupportedInput, match=match):
            check_output("lse", t, (2, 4, 8), torch.float32, good.device)


# ---- repeated calls on one shape, the kernel played by the CPU -----------------------------------
class CpuKernel:
    """What `compile_forward` returns in these tests: its `function.to(device)` is an executor whose
    launch (through `direct_call`, patched to `launch`) reads the argument descriptors the way the
    compiled kernel does (pointer, extents, strides), computes the attention on the CPU from the
    memory they point at, writes O and the LSE where they point, and records what it was given."""

    def __init__(self, dtype: str, causal: bool, launches: list) -> None:
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.causal, self.launches = causal, launches
        self.function = SimpleNamespace(to=lambda device_index: self)

    def launch(self, arguments: list[int]) -> int:
        from fa4tune.kernels.common.reference import attention_reference

        q, k, v, out = (described_tensor(arguments[i], self.dtype, rank=4) for i in range(4))
        lse = described_tensor(arguments[4], torch.float32, rank=3)
        scale = ctypes.c_float.from_address(arguments[6]).value / math.log2(math.e)
        ref_out, ref_lse = attention_reference(q, k, v, causal=self.causal, softmax_scale=scale)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        self.launches.append(
            SimpleNamespace(
                pointers=tuple(t.data_ptr() for t in (q, k, v, out, lse)),
                scale=scale,
                causal=self.causal,
                counter=ctypes.c_uint64.from_address(arguments[5]).value,
                stream=ctypes.c_void_p.from_address(arguments[8]).value,
            )
        )
        return 0


def described_tensor(address: int, dtype, rank: int):
    """The CPU tensor that the packed descriptor of this rank at `address`
    (fa4tune.kernels.common.launch.DESCRIPTOR_4D and the others) names."""
    from fa4tune.kernels.common.launch import _DESCRIPTORS

    layout = _DESCRIPTORS[rank]
    pointer, *fields = layout.unpack(ctypes.string_at(address, layout.size))
    shape, strides = fields[:rank], (*fields[rank:], 1)
    elements = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    memory = (ctypes.c_char * (elements * dtype.itemsize)).from_address(pointer)
    return torch.frombuffer(memory, dtype=dtype).as_strided(shape, strides)


CPU_STREAM = 0x5EED
TILE_COUNTER = torch.zeros(1, dtype=torch.int32)
UNUSED_COUNTER = torch.zeros(1, dtype=torch.int32)


@pytest.fixture
def cpu_device(monkeypatch):
    """fa4tune.attention on CPU tensors, all of it real but the device (its checks and target, the
    current device and stream, the tile counters), the lookup (a persistent config: its causal
    kernel takes the tile counter) and the kernel (CpuKernel): `launches` in order, `compiles`."""
    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
    from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.runtime import dispatch
    from fa4tune.target import get_target

    device = SimpleNamespace(launches=[], compiles=[])

    def compile_forward(
        config, dtype, head_dim, head_dim_v, causal, target, pack_group=1, layout=None
    ):
        device.compiles.append((dtype, head_dim, head_dim_v, causal))
        return CpuKernel(dtype, causal, device.launches)

    monkeypatch.setattr(dispatch, "_LAUNCHES", dispatch.PreparedLaunches())
    monkeypatch.setattr(dispatch, "check_device", lambda q, k, v, aligned=True: None)
    monkeypatch.setattr(dispatch, "device_target", lambda device: (get_target("H200"), FAMILY))
    monkeypatch.setattr(
        dispatch,
        "lookup",
        lambda problem, target, kernel=None: SimpleNamespace(config=FwdConfig(persistent=True)),
    )
    monkeypatch.setattr(fwd_launch, "current_device_getter", lambda: lambda: 0)
    monkeypatch.setattr(fwd_launch, "raw_stream_getter", lambda: lambda device_index: CPU_STREAM)
    monkeypatch.setattr(
        fwd_launch,
        "direct_call",
        lambda executor, arguments: ((lambda: executor.launch(arguments)), None),
    )
    monkeypatch.setattr(fwd_launch, "compile_forward", compile_forward)
    monkeypatch.setattr(fwd_launch, "current_tile_counter", lambda device: TILE_COUNTER)
    monkeypatch.setattr(fwd_launch, "unused_counter", lambda device: UNUSED_COUNTER)
    return device


def attention_checked(device, q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """fa4tune.attention through the CPU device: one launch, given this call's tensors, scale and
    causality, whose O and LSE match the fp32 reference of this call; (out, lse)."""
    from fa4tune.kernels.common.reference import attention_reference

    before = len(device.launches)
    out, lse = fa4tune.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert len(device.launches) == before + 1
    launch = device.launches[-1]
    assert launch.pointers == tuple(t.data_ptr() for t in (q, k, v, out, lse)), "stale pointers"
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[3])
    assert launch.scale == pytest.approx(scale, rel=1e-6) and launch.causal == causal
    assert launch.stream == CPU_STREAM
    assert launch.counter == (TILE_COUNTER if causal else UNUSED_COUNTER).data_ptr()
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert ((out.float() - ref_out).norm() / ref_out.norm()).item() < 1e-2
    assert (lse - ref_lse).abs().max().item() < 1e-3
    return out, lse


def cpu_qkv(seed: int, b=2, sq=64, sk=96, hq=4, hkv=2, d=64):
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b, s, h, d, generator=generator).to(torch.bfloat16)
        for s, h in ((sq, hq), (sk, hkv), (sk, hkv))
    )


@pytest.mark.parametrize("causal", [False, True])
def test_a_prepared_launch_takes_each_calls_new_tensors(cpu_device, causal):
    """One shape, new q, k, v every call (the earlier ones kept, so that no new tensor reuses their
    memory): every launch reads this call's inputs and writes this call's outputs."""
    held = []
    for seed in range(3):
        q, k, v = cpu_qkv(seed)
        held.append((q, k, v, *attention_checked(cpu_device, q, k, v, causal=causal)))
    assert len({t.data_ptr() for call in held for t in call}) == 5 * len(held)
    assert len(cpu_device.compiles) == 1 and len(fa4tune.runtime.dispatch._LAUNCHES) == 1


def test_another_softmax_scale_on_the_same_tensors_launches_with_that_scale(cpu_device):
    q, k, v = cpu_qkv(0)
    outputs = [
        attention_checked(cpu_device, q, k, v, softmax_scale=scale)[0]
        for scale in (None, 0.05, 0.3, None)
    ]
    assert not torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[3])
    assert len(fa4tune.runtime.dispatch._LAUNCHES) == 3  # one prepared launch per scale


def test_causal_and_not_causal_in_turn_on_the_same_tensors(cpu_device):
    q, k, v = cpu_qkv(0)
    for causal in (True, False, True, False):
        attention_checked(cpu_device, q, k, v, causal=causal)
    assert [c[-1] for c in cpu_device.compiles] == [True, False]  # one prepared launch for each


# ---- split-KV launches, the kernel and the combine played by the CPU -----------------------------
def merge_partials(o_part, lse_part):
    """O (batch, seqlen_q, heads, dv) and LSE (batch, heads, seqlen_q) from the fp32 partials, as
    the combine kernel merges them."""
    lse = torch.logsumexp(lse_part, dim=0)  # (batch, heads, seqlen_q); -inf if every split is
    weights = torch.exp(lse_part - lse.clamp_min(torch.finfo(torch.float32).min))
    return (weights.permute(0, 1, 3, 2)[..., None] * o_part).sum(0), lse


class CpuSplitKernel:
    """The split kernel's launch as the CPU plays it: the keys cut into `num_splits` ranges of
    whole 128-key blocks (the later ones empty when there are fewer blocks than splits), each
    split's O and LSE written into the partials where their descriptors point, and with the
    in-kernel combine O and LSE too (after the four absent index tensors)."""

    def __init__(self, dtype: str, in_kernel: bool, launches: list) -> None:
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.in_kernel, self.launches = in_kernel, launches
        self.function = SimpleNamespace(to=lambda device_index: self)

    def launch(self, arguments: list[int]) -> int:
        from fa4tune.kernels.common.reference import attention_reference

        q, k, v = (described_tensor(arguments[i], self.dtype, rank=4) for i in range(3))
        o_part = described_tensor(arguments[3], torch.float32, rank=5)
        lse_part = described_tensor(arguments[4], torch.float32, rank=4)
        scale = ctypes.c_float.from_address(arguments[6]).value / math.log2(math.e)
        splits, seqlen_k = o_part.shape[0], k.shape[1]
        blocks = -(-seqlen_k // 128)
        per_split = -(-blocks // splits) * 128
        for s in range(splits):
            keys = slice(s * per_split, min(seqlen_k, (s + 1) * per_split))
            if keys.start >= seqlen_k:
                o_part[s], lse_part[s] = 0.0, -math.inf
                continue
            o_part[s], lse_part[s] = attention_reference(
                q, k[:, keys], v[:, keys], softmax_scale=scale
            )
        record = SimpleNamespace(partials=(o_part.data_ptr(), lse_part.data_ptr()), split=splits)
        if self.in_kernel:
            out = described_tensor(arguments[9], self.dtype, rank=4)
            lse = described_tensor(arguments[10], torch.float32, rank=3)
            merged_out, merged_lse = merge_partials(o_part, lse_part)
            out.copy_(merged_out)
            lse.copy_(merged_lse)
            record.outputs = (out.data_ptr(), lse.data_ptr())
        self.launches.append(record)
        return 0


class CpuCombine:
    """The combine kernel's launch as the CPU plays it: the partials merged into O and LSE."""

    def __init__(self, dtype: str, launches: list) -> None:
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.launches = launches

    def to(self, device_index):
        return self

    def launch(self, arguments: list[int]) -> int:
        o_part = described_tensor(arguments[0], torch.float32, rank=5)
        lse_part = described_tensor(arguments[1], torch.float32, rank=4)
        out = described_tensor(arguments[2], self.dtype, rank=4)
        lse = described_tensor(arguments[3], torch.float32, rank=3)
        merged_out, merged_lse = merge_partials(o_part, lse_part)
        out.copy_(merged_out)
        lse.copy_(merged_lse)
        self.launches.append(
            SimpleNamespace(
                partials=(o_part.data_ptr(), lse_part.data_ptr()),
                outputs=(out.data_ptr(), lse.data_ptr()),
            )
        )
        return 0


@pytest.mark.parametrize("in_kernel", [False, True])
@pytest.mark.parametrize("splits,seqlen_k", [(3, 1000), (8, 300)])
def test_split_launches_put_both_partials_in_one_allocation(
    cpu_device, monkeypatch, in_kernel, splits, seqlen_k
):
    """Split-KV through fa4tune.attention: the kernel writes the partials, the combine (a second
    launch, or the kernel's last CTA) merges them into O and LSE equal to the unsplit reference.
    Both partials lie in one allocation, the LSE's 16-byte aligned right after O's, and the combine
    reads where the kernel wrote; more splits than key blocks (8 for 3) leave some empty."""
    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.runtime import dispatch

    config = FwdConfig(tile_m=64, pack_gqa=True, num_splits=splits, combine_in_kernel=in_kernel)
    combines = []
    counts = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setattr(
        dispatch, "lookup", lambda problem, target, kernel=None: SimpleNamespace(config=config)
    )
    monkeypatch.setattr(
        fwd_launch,
        "compile_forward",
        lambda *a, **k: CpuSplitKernel("bf16", in_kernel, cpu_device.launches),
    )
    monkeypatch.setattr(fwd_launch, "compile_combine", lambda *a, **k: CpuCombine("bf16", combines))
    monkeypatch.setattr(fwd_launch, "current_split_counts", lambda device, count: counts[:count])
    held = []
    for seed in range(2):
        q, k, v = cpu_qkv(seed, b=2, sq=1, sk=seqlen_k, hq=8, hkv=2, d=64)
        out, lse = fa4tune.attention(q, k, v)
        launch = cpu_device.launches[-1]
        assert len(cpu_device.launches) == seed + 1 and launch.split == splits
        o_ptr, lse_ptr = launch.partials
        assert lse_ptr == o_ptr + 4 * (splits * 2 * 1 * 8 * 64) and lse_ptr % 16 == 0
        if in_kernel:
            assert combines == [] and launch.outputs[0] == out.data_ptr()
        else:
            assert len(combines) == seed + 1 and combines[-1].partials == launch.partials
            assert combines[-1].outputs[0] == out.data_ptr()
        ref_out, ref_lse = attention_reference(q, k, v)
        assert ((out.float() - ref_out).norm() / ref_out.norm()).item() < 1e-2
        assert (lse - ref_lse).abs().max().item() < 1e-4
        prepared = next(iter(dispatch._LAUNCHES.values()))
        held.append((q, k, v, out))
        assert prepared.partial_span[1] == splits * 2 * 8 * (64 + 1)
    assert len(fa4tune.runtime.dispatch._LAUNCHES) == 1
