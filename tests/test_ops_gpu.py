"""torch.ops.fa4tune.attention on the GPU: torch.library.opcheck, torch.compile(fullgraph=True)
with static and dynamic shapes, torch.export (run, saved and loaded), CUDA graphs through
torch.compile's reduce-overhead mode, each against the fp32 reference with poisoned outputs where
the outputs come from the op itself."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from conftest import poisoned_attention  # noqa: E402

import fa4tune  # noqa: E402
from fa4tune.kernels.common.reference import attention_reference  # noqa: E402
from fa4tune.runtime import ops  # noqa: E402, F401  (registers the op)

OP = torch.ops.fa4tune.attention.default
OUT_TOL = 1e-2  # relative Frobenius error of O, bf16
LSE_TOL = 1e-3


def inputs(batch=2, seqlen_q=300, seqlen_k=300, nheads_q=8, nheads_kv=2, dim=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    q = rnd(batch, seqlen_q, nheads_q, dim)
    k, v = rnd(batch, seqlen_k, nheads_kv, dim), rnd(batch, seqlen_k, nheads_kv, dim)
    return q, k, v


def assert_matches_reference(q, k, v, causal, scale, out, lse):
    torch.cuda.synchronize()
    ref_out, ref_lse = attention_reference(q, k, v, causal, scale)
    err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
    assert err < OUT_TOL, err
    assert (lse - ref_lse).abs().max().item() < LSE_TOL


@pytest.mark.parametrize(
    "shape, causal, scale",
    [
        (dict(), True, None),
        (dict(seqlen_q=1, seqlen_k=777, nheads_kv=1), False, 0.05),  # decode-like, MQA
        (dict(seqlen_q=130, seqlen_k=1000, dim=64, nheads_kv=8), True, None),
    ],
)
def test_opcheck(shape, causal, scale):
    q, k, v = inputs(**shape)
    torch.library.opcheck(OP, (q, k, v, causal, scale))


def test_fullgraph_compile_runs_the_op_with_poisoned_outputs():
    q, k, v = inputs()
    compiled = torch.compile(fa4tune.attention, fullgraph=True)
    for causal, scale in ((True, None), (False, 0.07)):
        out, lse = poisoned_attention(q, k, v, causal, scale, call=compiled)
        assert_matches_reference(q, k, v, causal, scale, out, lse)


def test_fullgraph_compile_with_dynamic_shapes_compiles_once_for_new_seqlens():
    from torch._dynamo.testing import CompileCounterWithBackend

    def block(q, k, v):
        out, lse = fa4tune.attention(q, k, v, causal=True)
        return out.float() * 2, lse

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    # Distinct sizes above 1 (torch specialises size 1 and gives equal sizes one symbol)
    for seed, (seqlen_q, seqlen_k) in enumerate(((300, 513), (129, 1000), (64, 700))):
        q, k, v = inputs(seqlen_q=seqlen_q, seqlen_k=seqlen_k, seed=seed)
        out, lse = compiled(q, k, v)
        assert out.shape == (2, seqlen_q, 8, 128)
        assert_matches_reference(q, k, v, True, None, out / 2, lse)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


class Attend(torch.nn.Module):
    def forward(self, q, k, v):
        out, lse = fa4tune.attention(q, k, v, causal=True, softmax_scale=0.1)
        return out, lse


def test_an_exported_program_runs_new_shapes_and_survives_save_and_load(tmp_path):
    from torch.export import Dim

    q, k, v = inputs()
    batch, seqlen_q, seqlen_k = Dim("batch"), Dim("seqlen_q"), Dim("seqlen_k")
    kv = {0: batch, 1: seqlen_k}
    program = torch.export.export(
        Attend(), (q, k, v), dynamic_shapes=({0: batch, 1: seqlen_q}, kv, kv)
    )
    path = tmp_path / "attend.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path)
    for seed, run in enumerate((program.module(), loaded.module())):
        q, k, v = inputs(batch=3, seqlen_q=200, seqlen_k=513, seed=seed + 1)
        out, lse = poisoned_attention(q, k, v, call=lambda q, k, v, run=run, **_: run(q, k, v))
        assert_matches_reference(q, k, v, True, 0.1, out, lse)


def test_reduce_overhead_captures_a_cuda_graph_that_replays_new_inputs():
    """torch.compile's reduce-overhead mode records the op in a CUDA graph (no host sync or
    allocation that depends on data in the kernel's path) and replays it on new inputs."""
    compiled = torch.compile(
        lambda q, k, v: fa4tune.attention(q, k, v, causal=True), mode="reduce-overhead"
    )
    for seed in range(4):  # warm-up, record, then replays
        q, k, v = inputs(seed=seed)
        out, lse = compiled(q, k, v)
        assert_matches_reference(q, k, v, True, None, out.clone(), lse.clone())


def test_the_op_called_directly_runs_and_its_backward_gives_the_reference_gradients():
    from fa4tune.kernels.common.reference import attention_grads_reference

    q, k, v = inputs()
    out, lse = poisoned_attention(
        q,
        k,
        v,
        causal=True,
        call=lambda q, k, v, causal, softmax_scale: OP(q, k, v, causal, softmax_scale),
    )
    assert_matches_reference(q, k, v, True, None, out, lse)
    for t in (q, k, v):
        t.requires_grad_()
    out, _ = OP(q, k, v, True, None)
    dout = torch.randn_like(out)
    out.backward(dout)
    for t, want in zip((q, k, v), attention_grads_reference(q, k, v, dout, causal=True)):
        assert ((t.grad.float() - want).norm() / want.norm()).item() < 2e-2


def test_torch_compile_traces_forward_and_backward_in_one_graph():
    """fullgraph: the forward op and, in the backward graph, fa4tune::attention_backward; the
    gradients are the reference's."""
    from fa4tune.kernels.common.reference import attention_grads_reference

    q, k, v = (t.requires_grad_() for t in inputs())

    @torch.compile(fullgraph=True)
    def step(q, k, v):
        out, lse = fa4tune.attention(q, k, v, causal=True)
        return (out.float() * out.float()).sum() + lse.sum()

    step(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with torch.no_grad():
        out, lse = fa4tune.attention(q, k, v, causal=True)
    dout = (2 * out.float()).to(out.dtype)
    want = attention_grads_reference(q, k, v, dout, True, None, torch.ones_like(lse))
    for got, ref in zip(grads, want):
        assert ((got.float() - ref).norm() / ref.norm()).item() < 2e-2


def varlen_inputs(lengths=(100, 0, 517, 64), seed=0):
    """Packed q, k, v (16 query / 4 KV heads) of sequences of `lengths`, and their cu_seqlens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, h, 128, generator=gen, device="cuda").to(torch.bfloat16)
        for h in (16, 4, 4)
    )
    ends = [0]
    for n in lengths:
        ends.append(ends[-1] + n)
    return q, k, v, torch.tensor(ends, dtype=torch.int32, device="cuda")


def assert_varlen_matches_reference(q, k, v, cu, out, lse, causal=True):
    torch.cuda.synchronize()
    for b in range(cu.numel() - 1):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.start == rows.stop:
            continue
        ref_o, ref_lse = attention_reference(
            q[rows][None], k[rows][None], v[rows][None], causal=causal
        )
        err = ((out[rows][None].float() - ref_o).norm() / ref_o.norm()).item()
        assert err < OUT_TOL, (b, err)
        assert (lse[:, rows] - ref_lse[0]).abs().max().item() < LSE_TOL


def test_varlen_opcheck():
    q, k, v, cu = varlen_inputs()
    torch.library.opcheck(
        torch.ops.fa4tune.attention_varlen.default,
        (q, k, v, cu, cu, 517, 517, None, None, True, None),
    )


def test_fullgraph_compile_runs_the_varlen_op_on_new_mixes_without_recompiling():
    """A varlen call inside torch.compile(fullgraph=True, dynamic=True): one graph for mixes of new
    totals, batches and maximums, each checked per sequence against the fp32 reference (the
    kernel's runs on poisoned outputs are test_varlen_gpu.py's)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def block(q, k, v, cu, longest):
        out, lse = fa4tune.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)
        return out * 1, lse

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for seed, lengths in enumerate(((100, 0, 517, 64), (300, 40, 9), (1000, 3, 250, 77, 12))):
        q, k, v, cu = varlen_inputs(lengths, seed)
        torch.cuda.synchronize()
        out, lse = compiled(q, k, v, cu, max(lengths))
        assert out.shape == q.shape and lse.shape == (16, q.shape[0])
        assert_varlen_matches_reference(q, k, v, cu, out, lse)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
