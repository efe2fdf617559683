"""torch.ops.fa4tune.attention on the CPU: its schema, its fake implementation (shapes, dtypes and
strides; the same refusals as the eager path) and what torch.export captures, on fake CUDA
tensors. The op's real runs, torch.compile and opcheck are in test_ops_gpu.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.export import Dim  # noqa: E402

import fa4tune  # noqa: E402
from fa4tune.errors import UnsupportedInput  # noqa: E402
from fa4tune.runtime import ops  # noqa: E402

OP = torch.ops.fa4tune.attention.default


def fake_inputs(
    batch=2,
    seqlen_q=100,
    seqlen_k=300,
    nheads_q=8,
    nheads_kv=2,
    dim=128,
    dim_v=128,
    dtype=torch.bfloat16,
    device="cuda",
):
    """q, k, v as fake tensors (no memory, no GPU), and their mode."""
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(batch, seqlen_q, nheads_q, dim, dtype=dtype, device=device)
        k = torch.empty(batch, seqlen_k, nheads_kv, dim, dtype=dtype, device=device)
        v = torch.empty(batch, seqlen_k, nheads_kv, dim_v, dtype=dtype, device=device)
    return mode, (q, k, v)


def test_the_op_has_the_schema_of_fa4tune_attention():
    assert str(OP._schema) == (
        "fa4tune::attention(Tensor q, Tensor k, Tensor v, bool causal=False, "
        "float? softmax_scale=None) -> (Tensor, Tensor)"
    )
    assert fa4tune.attention is ops.attention


@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # GQA 8/2, seqlen_q < seqlen_k
        dict(nheads_q=4, nheads_kv=4, dim=64, dim_v=64, dtype=torch.float16),
        dict(nheads_kv=1, dim=192, dim_v=128),  # MQA, head_dim_v below head_dim
        dict(batch=0),  # nothing to compute: outputs of the same shapes
    ],
)
def test_the_fake_gives_the_eager_paths_shapes_dtypes_and_strides(shape):
    mode, (q, k, v) = fake_inputs(**shape)
    with mode:
        out, lse = OP(q, k, v, True, None)
    b, sq, hq, _ = q.shape
    assert out.shape == (b, sq, hq, v.shape[3]) and out.dtype == q.dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()  # as torch.empty gives them in eager
    assert out.device == lse.device == q.device


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(dtype=torch.float32), "bfloat16 or float16"),
        (dict(dim=80, dim_v=80), "head dims"),
        (dict(nheads_q=6, nheads_kv=4), "multiple of the heads"),
        (dict(device="cpu"), "CUDA tensors"),
    ],
)
def test_the_fake_refuses_what_the_eager_path_refuses(change, words):
    mode, (q, k, v) = fake_inputs(**change)
    with mode, pytest.raises(UnsupportedInput, match=words):
        OP(q, k, v, False, None)


def test_the_fake_refuses_a_bad_scale_and_tensors_on_two_devices():
    mode, (q, k, v) = fake_inputs()
    with mode, pytest.raises(UnsupportedInput, match="softmax_scale"):
        OP(q, k, v, False, -1.0)
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        return  # a fake tensor on a GPU the host lacks fails in torch (it opens the GPU's context)
    with mode:
        k1 = torch.empty(k.shape, dtype=k.dtype, device="cuda:1")
    with mode, pytest.raises(UnsupportedInput, match="one device"):
        OP(q, k1, v, False, None)


class Attend(torch.nn.Module):
    def __init__(self, causal=True, softmax_scale=None):
        super().__init__()
        self.causal, self.softmax_scale = causal, softmax_scale

    def forward(self, q, k, v):
        out, lse = fa4tune.attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale)
        return out * 2, lse


@pytest.mark.parametrize("strict", [True, False], ids=["dynamo", "non-strict"])
def test_export_captures_one_op_with_symbolic_batch_and_seqlens(strict):
    _, (q, k, v) = fake_inputs()
    batch, seqlen_q, seqlen_k = Dim("batch"), Dim("seqlen_q"), Dim("seqlen_k")
    kv = {0: batch, 1: seqlen_k}
    program = torch.export.export(
        Attend(softmax_scale=0.125),
        (q, k, v),
        strict=strict,
        dynamic_shapes=({0: batch, 1: seqlen_q}, kv, kv),
    )
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    [attention] = [n for n in calls if n.target is OP]
    assert attention.args[3:] == (True, 0.125)
    out, lse = attention.meta["val"]
    q_val = next(n for n in program.graph.nodes if n.name == "q").meta["val"]
    b, sq = q_val.shape[0], q_val.shape[1]
    assert not isinstance(b, int) and not isinstance(sq, int), "the dims were specialised"
    assert tuple(out.shape) == (b, sq, 8, 128) and tuple(lse.shape) == (b, 8, sq)


def test_tracing_refuses_by_name_what_the_schema_and_autograd_cannot_take():
    _, (q, k, v) = fake_inputs()
    with pytest.raises(Exception, match="causal must be True or False"):
        torch.export.export(Attend(causal=1), (q, k, v), strict=False)
    with pytest.raises(Exception, match="softmax_scale must be"):
        torch.export.export(Attend(softmax_scale=float("inf")), (q, k, v), strict=False)
    _, odd = fake_inputs(dim=80, dim_v=80)
    with pytest.raises(Exception, match="head dims"):
        torch.export.export(Attend(), odd, strict=False)


def test_inputs_that_require_grad_record_the_op_and_its_backward(monkeypatch):
    """With autograd recording, fa4tune.attention goes through the op, whose autograd saves q, k,
    v, O and LSE and calls fa4tune::attention_backward (with the LSE's gradient when the LSE is
    used). On the CPU the kernels are played by the fp32 reference, the rest is real. (Tracing it
    needs CUDA: torch without CUDA aborts on an autograd node of fake CUDA tensors;
    tests/test_ops_gpu.py compiles forward and backward.)"""
    from fa4tune.kernels.common.reference import attention_grads_reference, attention_reference
    from fa4tune.runtime import dispatch

    calls = []

    def forward(q, k, v, causal=False, softmax_scale=None):
        out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
        return out.to(q.dtype), lse

    def backward(dout, q, k, v, out, lse, dlse=None, causal=False, softmax_scale=None):
        calls.append((causal, softmax_scale, dlse is not None))
        grads = attention_grads_reference(q, k, v, dout, causal, softmax_scale, dlse)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))

    monkeypatch.setattr(dispatch, "attention", forward)
    monkeypatch.setattr(dispatch, "attention_backward", backward)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 40, h, 64, generator=g).to(torch.bfloat16).requires_grad_()
        for h in (4, 2, 2)
    )
    dout = torch.randn(2, 40, 4, 64, generator=g).to(torch.bfloat16)
    out, lse = fa4tune.attention(q, k, v, causal=True, softmax_scale=0.1)
    assert out.grad_fn is not None
    out.backward(dout)
    want = attention_grads_reference(q, k, v, dout, True, 0.1)
    for t, ref in zip((q, k, v), want):
        assert ((t.grad.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert calls == [(True, 0.1, False)]  # the LSE unused: no gradient of it
    for t in (q, k, v):
        t.grad = None
    out, lse = fa4tune.attention(q, k, v)
    (out.float().sum() + lse.sum()).backward()
    assert calls[-1] == (False, None, True)
    with torch.no_grad():  # nothing records: the direct path
        assert fa4tune.attention(q, k, v)[0].grad_fn is None
    with pytest.raises(UnsupportedInput, match="causal must be True or False"):
        fa4tune.attention(q, k, v, causal=1)


# ---- fa4tune::attention_varlen -----------------------------------------------------------------
VARLEN_OP = torch.ops.fa4tune.attention_varlen.default


def fake_ragged(paged=False, total_q=300, batch=3, dim=128, dim_v=128, device="cuda", index=None):
    """q packed (total_q, 8, dim); k and v packed (1000, 2, ·) with cu_seqlens_k, or pages of 16
    rows with a (batch, 20) page_table; fake tensors, and their mode."""
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(total_q, 8, dim, dtype=torch.bfloat16, device=device)
        kv_rows = (64, 16) if paged else (1000,)
        k = torch.empty(*kv_rows, 2, dim, dtype=torch.bfloat16, device=device)
        v = torch.empty(*kv_rows, 2, dim_v, dtype=torch.bfloat16, device=device)
        idx = index or torch.int32
        cu_q = torch.empty(batch + 1, dtype=idx, device=device)
        cu_k = None if paged else torch.empty(batch + 1, dtype=idx, device=device)
        table = torch.empty(batch, 20, dtype=idx, device=device) if paged else None
        used = torch.empty(batch, dtype=idx, device=device) if paged else None
    return mode, (q, k, v, cu_q, cu_k, used, table)


def test_the_varlen_op_has_flash_attn_4s_argument_names():
    assert str(VARLEN_OP._schema) == (
        "fa4tune::attention_varlen(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, "
        "Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, Tensor? seqused_k, "
        "Tensor? page_table, bool causal=False, float? softmax_scale=None) -> (Tensor, Tensor)"
    )
    assert fa4tune.attention_varlen is ops.attention_varlen


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
@pytest.mark.parametrize("total_q", [300, 0], ids=["rows", "empty"])
def test_the_varlen_fake_gives_flash_attn_4s_output_shapes(paged, total_q):
    mode, (q, k, v, cu_q, cu_k, used, table) = fake_ragged(paged, total_q, dim_v=64)
    with mode:
        out, lse = VARLEN_OP(q, k, v, cu_q, cu_k, 128, None, used, table, True, None)
    assert out.shape == (total_q, 8, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (8, total_q) and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous() and out.device == q.device


def test_the_varlen_fake_gives_batch_shaped_decode_its_shapes():
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(4, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
        cache = torch.empty(64, 128, 2, 128, dtype=torch.bfloat16, device="cuda")
        table = torch.empty(4, 16, dtype=torch.int32, device="cuda")
        used = torch.empty(4, dtype=torch.int32, device="cuda")
        out, lse = VARLEN_OP(q, cache, cache, None, None, None, 2048, used, table, False, 0.1)
    assert out.shape == (4, 1, 8, 128) and lse.shape == (4, 8, 1)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(index=torch.int64), "must be torch.int32"),
        (dict(dim=80, dim_v=80), "head dims"),
        (dict(device="cpu"), "CUDA tensors"),
    ],
)
def test_the_varlen_fake_refuses_what_the_eager_path_refuses(change, words):
    mode, args = fake_ragged(**change)
    q, k, v, cu_q, cu_k, used, table = args
    with mode, pytest.raises(UnsupportedInput, match=words):
        VARLEN_OP(q, k, v, cu_q, cu_k, None, None, used, table, False, None)
    mode, (q, k, v, cu_q, cu_k, used, table) = fake_ragged(paged=True)
    with mode:
        odd_pages = torch.empty(64, 12, 2, 128, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(UnsupportedInput, match="page size 12"):
            VARLEN_OP(q, odd_pages, odd_pages, cu_q, None, None, None, used, table, False, None)
        with pytest.raises(UnsupportedInput, match="not both"):
            VARLEN_OP(q, k, v, cu_q, cu_q, None, None, used, table, False, None)


class AttendVarlen(torch.nn.Module):
    def __init__(self, max_seqlen_q=None, causal=True):
        super().__init__()
        self.max_seqlen_q, self.causal = max_seqlen_q, causal

    def forward(self, q, k, v, cu_q, cu_k):
        out, lse = fa4tune.attention_varlen(
            q, k, v, cu_q, cu_k, self.max_seqlen_q, 512, causal=self.causal, softmax_scale=0.125
        )
        return out + 1, lse


@pytest.mark.parametrize("strict", [True, False], ids=["dynamo", "non-strict"])
def test_export_captures_one_varlen_op_with_symbolic_totals(strict):
    _, (q, k, v, cu_q, cu_k, _, _) = fake_ragged()
    total_q, total_k, batch1 = Dim("total_q", min=2), Dim("total_k", min=2), Dim("batch1", min=2)
    program = torch.export.export(
        AttendVarlen(max_seqlen_q=256),
        (q, k, v, cu_q, cu_k),
        strict=strict,
        dynamic_shapes=({0: total_q}, {0: total_k}, {0: total_k}, {0: batch1}, {0: batch1}),
    )
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    [attention] = [n for n in calls if n.target is VARLEN_OP]
    assert attention.args[5:7] == (256, 512) and attention.args[9:] == (True, 0.125)
    out, lse = attention.meta["val"]
    tq = next(n for n in program.graph.nodes if n.name == "q").meta["val"].shape[0]
    assert not isinstance(tq, int), "total_q was specialised"
    assert tuple(out.shape) == (tq, 8, 128) and tuple(lse.shape) == (8, tq)


def test_tracing_refuses_bad_varlen_arguments_by_name():
    _, (q, k, v, cu_q, cu_k, _, _) = fake_ragged()
    args = (q, k, v, cu_q, cu_k)
    with pytest.raises(Exception, match="max_seqlen_q must be a non-negative Python int"):
        torch.export.export(AttendVarlen(max_seqlen_q=-3), args, strict=False)
    with pytest.raises(Exception, match="causal must be True or False"):
        torch.export.export(AttendVarlen(causal="yes"), args, strict=False)


def test_attention_varlen_outside_tracing_takes_the_eager_path(monkeypatch):
    """Outside tracing fa4tune.attention_varlen calls the dispatcher directly (no op dispatch on
    the serving path), with every argument where the dispatcher takes it."""
    from fa4tune.runtime import dispatch

    seen = []
    monkeypatch.setattr(dispatch, "attention_varlen", lambda *a, **kw: seen.append((a, kw)))
    fa4tune.attention_varlen(1, 2, 3, 4, 5, 6, 7, seqused_k=8, page_table=9, causal=True)
    assert seen == [
        (
            (1, 2, 3, 4, 5, 6, 7),
            dict(seqused_k=8, page_table=9, causal=True, softmax_scale=None),
        )
    ]
    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    monkeypatch.undo()
    with pytest.raises(UnsupportedInput, match="CUDA tensors"):
        fa4tune.attention_varlen(q, q, q, cu, cu, 10, 10)


def test_attention_varlen_names_itself_when_inputs_require_grad():
    """attention_varlen has no backward: inputs that autograd would record are refused with its
    name (not fa4tune.attention's, which has one), on the eager path and from the dispatcher;
    under no_grad the call goes on to the device check."""
    from fa4tune.runtime import dispatch

    cu = torch.tensor([0, 10], dtype=torch.int32)
    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    k = q.clone().requires_grad_()
    with pytest.raises(UnsupportedInput, match=r"^fa4tune.attention_varlen has no backward"):
        fa4tune.attention_varlen(q, k, q, cu, cu, 10, 10)
    with pytest.raises(UnsupportedInput, match=r"^fa4tune.attention_varlen has no backward"):
        dispatch.attention_varlen(q, k, q, cu, cu, 10, 10)
    with torch.no_grad(), pytest.raises(UnsupportedInput, match="CUDA tensors"):
        fa4tune.attention_varlen(q, k, q, cu, cu, 10, 10)
