"""Ragged inputs (fa4tune.attention_varlen: flash-attn-4's varlen and paged calls) on the CPU: the
problem keys and token mixes, every refusal of bad input, the feasibility rules, the dispatcher and
its prepared launches with the kernel played by the CPU from the packed descriptors, the
measurement case and its check, and (marked `compile`) the kernels built for sm_90a without spills
and launched with exactly the arguments the DSL would pass."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from dataclasses import replace
from itertools import accumulate
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fa4tune
from fa4tune.errors import UnsupportedInput
from fa4tune.kernels.common.launch import _DESCRIPTORS
from fa4tune.kernels.common.reference import attention_reference
from fa4tune.kernels.common.varlen import Ragged, check_varlen_inputs, make_problem
from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig, ragged_default
from fa4tune.mixes import sequence_lengths
from fa4tune.problem import InputLayout, Problem, ProblemError
from fa4tune.target import get_target

H200 = get_target("H200")
BF16 = torch.bfloat16


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


# ---- problem keys and token mixes ---------------------------------------------------------------
def test_a_batch_shaped_problem_keeps_its_key_and_stored_fields():
    p = Problem(seqlen_q=1, seqlen_k=4096, batch=64, nheads_q=32, nheads_kv=8)
    assert p.key() == "bf16-d128x128-full-q1-k4096-b64-h32x8"
    assert set(p.to_dict()) == {
        "dtype",
        "head_dim",
        "head_dim_v",
        "causal",
        "seqlen_q",
        "seqlen_k",
        "batch",
        "nheads_q",
        "nheads_kv",
    }
    assert not p.layout.ragged and p.bucket().key() == "bf16-d128x128-full-q1-k4096-bh2048-g4"


def test_ragged_problems_key_their_layout_and_round_trip():
    p = Problem(
        seqlen_q=1024,
        seqlen_k=4096,
        batch=8,
        nheads_q=32,
        nheads_kv=8,
        total_q=5000,
        page_size=16,
        seqused_k=True,
        causal=True,
    )
    assert p.key() == "bf16-d128x128-causal-q1024-k4096-b8-h32x8-tq5000-pg16-su"
    assert p.layout == InputLayout(varlen_q=True, page_size=16, seqused_k=True)
    assert p.bucket().key().endswith("-tq8192-vq-pg16-su")
    assert Problem.from_dict(p.to_dict()) == p
    dense = Problem(seqlen_q=1024, seqlen_k=4096, batch=8, nheads_q=32, nheads_kv=8, causal=True)
    varlen = replace(p, page_size=None, seqused_k=False, total_k=5000)
    # Same family; another layout lends, farther than the same layout, but a paged cache and
    # contiguous K/V never lend to each other.
    assert p.bucket().family() == dense.bucket().family()
    assert math.isinf(p.distance(dense)) and math.isinf(p.bucket().distance(dense.bucket()))
    assert p.distance(p) < varlen.distance(dense) < math.inf


def test_a_paged_problem_takes_its_default_over_dense_tables():
    """A table of dense decode entries only: a paged decode problem gets the family's default (pages
    tile its blocks), not a config some farther dense problem was tuned with. The shipped serving
    table holds the paged problem itself."""
    from fa4tune.runtime.lookup import PACKAGE_TABLES, Lookup

    paged = Problem(seqlen_q=1, seqlen_k=131072, nheads_q=32, nheads_kv=8, page_size=128,
                    seqused_k=True)  # fmt: skip
    dense_table = Lookup(Path(PACKAGE_TABLES) / "h200-bf16-decode.yaml")
    found = dense_table(paged, "H200")
    assert found.source == "default"
    assert found.config == FAMILY.default_config(paged, get_target("H200"))
    dense = replace(paged, page_size=None, seqused_k=False)
    assert dense_table(dense, "H200").source == "exact"
    assert Lookup(PACKAGE_TABLES)(paged, "H200").source == "exact"


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"total_q": 10, "seqlen_q": 20, "batch": 4}, "total_q"),
        ({"total_q": 100, "seqlen_q": 20, "batch": 4}, "batch x seqlen_q"),
        ({"total_k": 5, "seqlen_k": 20}, "total_k"),
        ({"page_size": 24}, "unsupported page_size"),
        ({"page_size": 16, "total_k": 4096}, "not both"),
        ({"seqused_k": 1}, "seqused_k"),
        ({"total_q": 2.5}, "integer"),
    ],
)
def test_a_ragged_problem_that_cannot_be_is_refused(fields, match):
    with pytest.raises(ProblemError, match=match):
        Problem(**fields)


def test_token_mixes_hit_the_key_and_are_the_same_every_time():
    p = Problem(
        seqlen_q=8192,
        seqlen_k=8192,
        total_q=83000,
        total_k=83000,
        batch=32,
        nheads_q=32,
        nheads_kv=8,
        causal=True,
    )
    q_lens, k_lens = sequence_lengths(p)
    assert sum(q_lens) == 83000 and max(q_lens) == 8192 and len(q_lens) == 32
    assert k_lens == q_lens  # packed self-attention: the keys are the queries' sequences
    assert sequence_lengths(p) == (q_lens, k_lens)
    decode = Problem(
        seqlen_q=1, seqlen_k=4096, batch=64, nheads_q=32, nheads_kv=8, page_size=16, seqused_k=True
    )
    q_lens, k_lens = sequence_lengths(decode)
    assert q_lens == [1] * 64 and max(k_lens) == 4096 and min(k_lens) >= 2048
    every_page = Problem(seqlen_q=1, seqlen_k=100, batch=2, page_size=16)
    assert sequence_lengths(every_page)[1] == [112, 112]  # the whole table, 7 pages
    # FLOPs and bytes are the mix's.
    assert p.flops == pytest.approx(
        4 * 32 * 128 * sum(q * (q + 1) // 2 for q in sequence_lengths(p)[0])
    )


# ---- bad input ----------------------------------------------------------------------------------
def varlen_call(**change):
    """A good varlen + paged call (3 sequences, 16-token pages), with `change` applied."""
    call = dict(
        q=torch.empty(50, 8, 64, dtype=BF16),
        k=torch.empty(12, 16, 2, 64, dtype=BF16),
        v=torch.empty(12, 16, 2, 64, dtype=BF16),
        cu_seqlens_q=int32([0, 10, 30, 50]),
        seqused_k=int32([20, 40, 5]),
        page_table=int32([[0, 1, 2, 3]] * 3),
        max_seqlen_q=20,
        causal=True,
    )
    call.update(change)
    return call


def check(call):
    ragged = Ragged(
        call.get("cu_seqlens_q"),
        call.get("cu_seqlens_k"),
        call.get("seqused_k"),
        call.get("page_table"),
        call.get("max_seqlen_q"),
        call.get("max_seqlen_k"),
    )
    return check_varlen_inputs(call["q"], call["k"], call["v"], ragged, call["causal"]), ragged


@pytest.mark.parametrize(
    "change, match",
    [
        ({"cu_seqlens_q": torch.tensor([0, 10, 30, 50])}, "cu_seqlens_q must be torch.int32"),
        ({"cu_seqlens_q": int32([[0, 10, 30, 50]])}, r"cu_seqlens_q must have shape \(batch \+ 1"),
        ({"seqused_k": int32([20, 40])}, r"seqused_k must have shape \(3,\)"),
        ({"page_table": int32([[0, 1]] * 2)}, r"page_table must have shape \(3, 'any'\)"),
        ({"page_table": torch.zeros(3, 4, dtype=torch.int16)}, "page_table must be torch.int32"),
        ({"page_table": int32([[0, 1, 2, 3]] * 3).t().contiguous().t()}, "contiguous"),
        ({"cu_seqlens_k": int32([0, 1, 2, 3])}, "not both"),
        (
            {
                "k": torch.empty(12, 24, 2, 64, dtype=BF16),
                "v": torch.empty(12, 24, 2, 64, dtype=BF16),
            },
            "page size 24",
        ),
        ({"q": torch.empty(2, 25, 8, 64, dtype=BF16)}, r"q must be \(total_q"),
        ({"k": torch.empty(12 * 16, 2, 64, dtype=BF16)}, r"k must be \(num_pages, page_size"),
        ({"q": torch.empty(50, 8, 64)}, "bfloat16 or float16"),
        ({"q": torch.empty(50, 5, 64, dtype=BF16)}, "multiple of the heads"),
        ({"q": torch.empty(50, 8, 80, dtype=BF16)}, "head dims"),
        ({"max_seqlen_q": torch.tensor(20)}, "max_seqlen_q must be a non-negative Python int"),
        ({"max_seqlen_q": -1}, "max_seqlen_q"),
        ({"causal": 1}, "causal must be True or False"),
        (
            {"k": torch.empty(24, 16, 2, 64, dtype=BF16)[::2]},
            r"pages of k must be whole rows",
        ),
    ],
)
def test_bad_ragged_input_is_named(change, match):
    with pytest.raises(UnsupportedInput, match=match):
        check(varlen_call(**change))


def test_seqused_with_batch_shaped_kv_needs_whole_batches_of_rows():
    k = torch.empty(3, 64, 2, 64, dtype=BF16)
    call = varlen_call(k=k[:, :32], v=k[:, :32].clone(), page_table=None)
    with pytest.raises(UnsupportedInput, match="batches of k must be whole rows"):
        check(call)
    assert check(varlen_call(k=k, v=k.clone(), page_table=None))[0] is False


def test_calls_with_nothing_to_compute_are_empty_without_checking_strides():
    no_sequence = varlen_call(
        q=torch.empty(0, 8, 64, dtype=BF16),
        cu_seqlens_q=int32([0]),
        seqused_k=int32([]),
        page_table=torch.zeros(0, 4, dtype=torch.int32),
    )
    assert check(no_sequence)[0]
    assert check(varlen_call(page_table=torch.zeros(3, 0, dtype=torch.int32)))[0]
    assert not check(varlen_call())[0]


def test_the_key_is_formed_without_reading_the_device():
    empty, ragged = check(varlen_call())
    p = make_problem(*(varlen_call()[n] for n in "qkv"), ragged, True)
    # max_seqlen_q 20 -> 32 (a power of two), within [ceil(50 / 3), 50]; the keys: 4 pages.
    assert (p.seqlen_q, p.total_q, p.batch, p.seqlen_k, p.page_size, p.seqused_k) == (
        32,
        50,
        3,
        64,
        16,
        True,
    )
    _, ragged = check(varlen_call(max_seqlen_q=None))
    assert make_problem(*(varlen_call()[n] for n in "qkv"), ragged, True).seqlen_q == 50
    q = torch.empty(4, 1, 8, 64, dtype=BF16)
    call = varlen_call(q=q, cu_seqlens_q=None, seqused_k=int32([1, 2, 3, 4]))
    call["page_table"] = int32([[0, 1, 2, 3]] * 4)
    _, ragged = check(call)
    p = make_problem(q, call["k"], call["v"], ragged, False)
    assert p.key() == "bf16-d64x64-full-q1-k64-b4-h8x2-pg16-su" and p.regime == "decode"


# ---- feasibility and defaults -------------------------------------------------------------------
def test_ragged_inputs_refuse_persistent_ctas_and_pages_that_do_not_tile():
    paged = Problem(seqlen_q=1, seqlen_k=4096, batch=8, nheads_q=32, nheads_kv=8, page_size=32)
    reasons = FAMILY.infeasible_reasons(paged, FwdConfig(persistent=True, tile_n=80), H200)
    assert any("persistent=True with ragged inputs" in r for r in reasons)
    assert any("tile_n=80 with 32-row pages" in r for r in reasons)
    assert not FAMILY.infeasible_reasons(paged, FwdConfig(tile_n=64), H200)
    assert not FAMILY.infeasible_reasons(
        replace_layout(paged, page_size=256), FwdConfig(tile_n=128), H200
    )


def replace_layout(problem, **fields):
    from dataclasses import replace

    return replace(problem, **fields)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("page_size", [None, 8, 16, 32, 64, 256])
@pytest.mark.parametrize("seqlen_q", [1, 4, 2048])
def test_every_ragged_default_is_feasible(head_dim, page_size, seqlen_q):
    p = Problem(
        head_dim=head_dim,
        seqlen_q=seqlen_q,
        seqlen_k=8192,
        batch=16,
        nheads_q=32,
        nheads_kv=8,
        total_q=seqlen_q * 8,
        page_size=page_size,
        seqused_k=page_size is not None,
        causal=True,
    )
    config = FAMILY.default_config(p, H200)
    assert not FAMILY.infeasible_reasons(p, config, H200), config.short()


def test_ragged_default_keeps_the_widest_block_pages_allow():
    p = Problem(seqlen_q=2048, seqlen_k=8192, batch=4, page_size=32)
    assert ragged_default(FwdConfig(tile_n=112, persistent=True), p).tile_n == 96
    assert not ragged_default(FwdConfig(persistent=True, wg_epilogue=True), p).persistent


# ---- the dispatcher, the kernel played by the CPU ------------------------------------------------
def described(address: int, dtype, rank: int):
    """The CPU tensor a packed descriptor of `rank` names (fa4tune.kernels.common.launch)."""
    layout = _DESCRIPTORS[rank]
    pointer, *fields = layout.unpack(ctypes.string_at(address, layout.size))
    shape, strides = fields[:rank], (*fields[rank:], 1)
    elements = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    memory = (ctypes.c_char * (elements * dtype.itemsize)).from_address(pointer)
    return torch.frombuffer(memory, dtype=dtype).as_strided(shape, strides)


class CpuVarlenKernel:
    """The compiled ragged kernel as the CPU plays it: reads every argument descriptor as the kernel
    does (q, k, v, O, LSE, the counter, scale, L2 group, stream, then the index tensors of the
    layout), computes each sequence's attention with the fp32 reference and writes O and LSE."""

    def __init__(self, dtype, causal, layout: InputLayout, launches: list) -> None:
        self.dtype = {"bf16": BF16, "fp16": torch.float16}[dtype]
        self.causal, self.layout, self.launches = causal, layout, launches
        self.function = SimpleNamespace(to=lambda device_index: self)

    def launch(self, arguments: list[int]) -> int:
        lay = self.layout
        q_rank, kv_rank = (3 if lay.varlen_q else 4), (3 if lay.varlen_k else 4)
        q = described(arguments[0], self.dtype, q_rank)
        k, v = (described(arguments[i], self.dtype, kv_rank) for i in (1, 2))
        out = described(arguments[3], self.dtype, q_rank)
        lse = described(arguments[4], torch.float32, q_rank - 1)
        scale = ctypes.c_float.from_address(arguments[6]).value / math.log2(math.e)
        index = iter(arguments[9:])
        cu_q = described(next(index), torch.int32, 1) if lay.varlen_q else None
        cu_k = described(next(index), torch.int32, 1) if lay.varlen_k else None
        used = described(next(index), torch.int32, 1) if lay.seqused_k else None
        table = described(next(index), torch.int32, 2) if lay.paged else None
        batch = len(cu_q) - 1 if cu_q is not None else q.shape[0]
        for b in range(batch):
            if cu_q is not None:
                rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
                qb, ob, lb = q[rows][None], out[rows], lse[:, rows]
            else:
                qb, ob, lb = q[b : b + 1], out[b], lse[b]
            if cu_k is not None:
                kb, vb = (t[int(cu_k[b]) : int(cu_k[b + 1])] for t in (k, v))
            elif table is not None:
                kb, vb = (t[table[b].long()].flatten(0, 1) for t in (k, v))
            else:
                kb, vb = k[b], v[b]
            if used is not None:
                kb, vb = kb[: int(used[b])], vb[: int(used[b])]
            if qb.shape[1] == 0:
                continue
            ref_o, ref_lse = attention_reference(qb, kb[None], vb[None], self.causal, scale)
            ob.copy_(ref_o[0])
            lb.copy_(ref_lse[0])
        self.launches.append(
            SimpleNamespace(
                pointers=tuple(t.data_ptr() for t in (q, k, v, out, lse)),
                index=tuple(t.data_ptr() for t in (cu_q, cu_k, used, table) if t is not None),
                stream=ctypes.c_void_p.from_address(arguments[8]).value,
            )
        )
        return 0


@pytest.fixture
def cpu_device(monkeypatch):
    """fa4tune.attention_varlen on CPU tensors, all of it real but the device, the lookup (a
    non-persistent, unsplit config) and the kernel (CpuVarlenKernel)."""
    from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch
    from fa4tune.runtime import dispatch

    device = SimpleNamespace(launches=[], compiles=[], problems=[])

    def compile_forward(
        config, dtype, head_dim, head_dim_v, causal, target, pack_group=1, layout=None
    ):
        device.compiles.append((config, layout))
        return CpuVarlenKernel(dtype, causal, layout or InputLayout(), device.launches)

    def lookup(problem, target, kernel=None):
        device.problems.append(problem)
        return SimpleNamespace(config=FwdConfig(tile_m=128, tile_n=64, lazy_max=False))

    monkeypatch.setattr(dispatch, "_LAUNCHES", dispatch.PreparedLaunches())
    monkeypatch.setattr(dispatch, "check_varlen_device", lambda *a, **k: None)
    monkeypatch.setattr(dispatch, "device_target", lambda device: (H200, FAMILY))
    monkeypatch.setattr(dispatch, "lookup", lookup)
    monkeypatch.setattr(fwd_launch, "current_device_getter", lambda: lambda: 0)
    monkeypatch.setattr(fwd_launch, "raw_stream_getter", lambda: lambda device_index: 0x5EED)
    monkeypatch.setattr(
        fwd_launch,
        "direct_call",
        lambda executor, arguments: ((lambda: executor.launch(arguments)), None),
    )
    monkeypatch.setattr(fwd_launch, "compile_forward", compile_forward)
    monkeypatch.setattr(fwd_launch, "unused_counter", lambda d: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return device


def paged_cache(lengths, page_size, heads, dim, seed, width=None):
    """K, V pages of the sequences' keys in shuffled pages, the page table (unused entries -1) and
    the keys as packed rows, for the reference."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // page_size) for n in lengths]
    width = width or max(needed)
    order = torch.randperm(sum(needed) + 2, generator=g).tolist()
    k = torch.randn(len(order), page_size, heads, dim, generator=g).to(BF16)
    v = torch.randn(len(order), page_size, heads, dim, generator=g).to(BF16)
    table, at = [], 0
    for n in needed:
        table.append(order[at : at + n] + [-1] * (width - n))
        at += n
    return k, v, int32(table)


def varlen_reference(q, cu_q, k_rows, v_rows, cu_k, causal):
    out = torch.empty(q.shape[0], q.shape[1], v_rows[0].shape[-1])
    lse = torch.empty(q.shape[1], q.shape[0])
    for b in range(len(cu_q) - 1):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        o, s = attention_reference(q[rows][None], k_rows[b][None], v_rows[b][None], causal)
        out[rows], lse[:, rows] = o[0], s[0]
    return out, lse


def test_varlen_calls_run_each_sequence_with_its_own_keys(cpu_device):
    g = torch.Generator().manual_seed(0)
    q_lens, k_lens = [7, 0, 33, 1], [40, 5, 12, 1]  # an empty sequence; fewer keys than queries
    cu_q, cu_k = int32([0, *accumulate(q_lens)]), int32([0, *accumulate(k_lens)])
    q = torch.randn(sum(q_lens), 8, 64, generator=g).to(BF16)
    k = torch.randn(sum(k_lens), 2, 64, generator=g).to(BF16)
    v = torch.randn(sum(k_lens), 2, 64, generator=g).to(BF16)
    out, lse = fa4tune.attention_varlen(q, k, v, cu_q, cu_k, 33, 40, causal=True)
    assert out.shape == (41, 8, 64) and lse.shape == (8, 41)
    k_rows = [k[int(cu_k[b]) : int(cu_k[b + 1])] for b in range(4)]
    v_rows = [v[int(cu_k[b]) : int(cu_k[b + 1])] for b in range(4)]
    ref_o, ref_lse = varlen_reference(q, cu_q, k_rows, v_rows, cu_k, True)
    assert (out.float() - ref_o).norm() / ref_o.norm() < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and (lse - ref_lse)[finite].abs().max() < 1e-3
    [launch] = cpu_device.launches
    assert launch.index == (cu_q.data_ptr(), cu_k.data_ptr())
    [problem] = cpu_device.problems
    assert (problem.total_q, problem.total_k, problem.batch) == (41, 58, 4)
    # 33 and 40 round up to 64, then down to the totals.
    assert (problem.seqlen_q, problem.seqlen_k) == (41, 58)


def test_a_paged_decode_batch_reuses_its_launch_with_new_pages_and_lengths(cpu_device):
    """A serving engine's decode step: the same shapes every step, new page ids and lengths in the
    same tensors (what a CUDA graph replays) or in new ones: one prepared launch, each call's
    pointers, each call's values."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 1, 8, 64, generator=g).to(BF16)
    for step, lengths in enumerate([[20, 64, 3], [21, 64, 4], [50, 1, 17]]):
        k, v, table = paged_cache(lengths, 16, 2, 64, seed=step, width=4)
        used = int32(lengths)
        out, lse = fa4tune.attention_varlen(
            q, k, v, seqused_k=used, page_table=table, max_seqlen_k=64
        )
        for b, n in enumerate(lengths):
            pages = table[b, : -(-n // 16)].long()
            kb, vb = (t[pages].flatten(0, 1)[:n][None] for t in (k, v))
            ref_o, ref_lse = attention_reference(q[b : b + 1], kb, vb)
            assert (out[b : b + 1].float() - ref_o).norm() / ref_o.norm() < 1e-2
            assert (lse[b] - ref_lse[0]).abs().max() < 1e-3
        assert cpu_device.launches[-1].index == (used.data_ptr(), table.data_ptr())
    assert len(cpu_device.launches) == 3 and len(cpu_device.compiles) == 1
    assert len(cpu_device.problems) == 1  # looked up once: max_seqlen_k keys it, not the values


def test_a_decode_step_that_raises_max_seqlen_k_within_its_power_of_two_keeps_the_launch(
    cpu_device,
):
    q = torch.randn(2, 1, 8, 64).to(BF16)
    k, v, table = paged_cache([100, 90], 16, 2, 64, seed=0, width=8)
    for max_k in (65, 100, 128):
        fa4tune.attention_varlen(
            q, k, v, seqused_k=int32([100, 90]), page_table=table, max_seqlen_k=max_k
        )
    assert len(cpu_device.problems) == 1
    fa4tune.attention_varlen(
        q, k, v, seqused_k=int32([100, 90]), page_table=table, max_seqlen_k=129
    )
    assert len(cpu_device.problems) == 2


def test_the_prepared_launches_drop_the_least_recently_used(cpu_device, monkeypatch):
    from fa4tune.runtime import dispatch

    monkeypatch.setattr(dispatch, "_LAUNCHES", dispatch.PreparedLaunches(capacity=2))
    qs = [torch.randn(n, 1, 8, 64).to(BF16) for n in (1, 2, 3)]
    kv = {n: paged_cache([16] * n, 16, 2, 64, seed=n) for n in (1, 2, 3)}

    def call(q):
        k, v, table = kv[q.shape[0]]
        fa4tune.attention_varlen(q, k, v, page_table=table)

    call(qs[0]), call(qs[1]), call(qs[0])  # batch 1 used last
    call(qs[2])  # drops batch 2, the least recently used
    assert len(dispatch._LAUNCHES) == 2 and len(cpu_device.problems) == 3
    call(qs[0])
    assert len(cpu_device.problems) == 3  # still kept
    call(qs[1])
    assert len(cpu_device.problems) == 4  # prepared again


def test_an_empty_varlen_call_returns_zeros_and_minus_inf_without_a_launch(cpu_device):
    q = torch.empty(0, 8, 64, dtype=BF16)
    k = torch.empty(0, 2, 64, dtype=BF16)
    out, lse = fa4tune.attention_varlen(q, k, k, int32([0, 0]), int32([0, 0]))
    assert out.shape == (0, 8, 64) and lse.shape == (8, 0) and not cpu_device.launches
    q = torch.ones(4, 8, 64, dtype=BF16)
    out, lse = fa4tune.attention_varlen(q, k, k, int32([0, 4]), int32([0, 0]))
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())


def test_packed_calls_whose_totals_share_a_power_of_two_share_a_launch(cpu_device):
    """A prefill server's calls rarely repeat their token totals: the launch prepared for one
    total serves the others of its power of two (each call's extents repacked, its result right);
    a total past it prepares another."""
    g = torch.Generator().manual_seed(3)
    for q_lens, k_lens in ([[40, 30], [40, 30]], [[9, 60], [33, 40]], [[1, 70], [8, 60]]):
        cu_q, cu_k = int32([0, *accumulate(q_lens)]), int32([0, *accumulate(k_lens)])
        q = torch.randn(sum(q_lens), 8, 64, generator=g).to(BF16)
        k, v = (torch.randn(sum(k_lens), 2, 64, generator=g).to(BF16) for _ in "kv")
        out, lse = fa4tune.attention_varlen(q, k, v, cu_q, cu_k, 128, 64, causal=True)
        assert out.shape == (sum(q_lens), 8, 64) and lse.shape == (8, sum(q_lens))
        k_rows = [k[int(cu_k[b]) : int(cu_k[b + 1])] for b in range(2)]
        v_rows = [v[int(cu_k[b]) : int(cu_k[b + 1])] for b in range(2)]
        ref_o, ref_lse = varlen_reference(q, cu_q, k_rows, v_rows, cu_k, True)
        assert (out.float() - ref_o).norm() / ref_o.norm() < 1e-2
        finite = torch.isfinite(ref_lse)  # causal rows above a shorter sequence's keys: -inf
        assert torch.equal(finite, torch.isfinite(lse))
        assert (lse - ref_lse)[finite].abs().max() < 1e-3
    # totals q 70, 69, 71 and k 70, 73, 68: one power of two (128 rows) each
    assert len(cpu_device.problems) == 1 and len(cpu_device.launches) == 3
    q = torch.randn(130, 8, 64).to(BF16)  # 130 query rows: the next power of two
    fa4tune.attention_varlen(q, k, v, int32([0, 65, 130]), cu_k, 128, 64, causal=True)
    assert len(cpu_device.problems) == 2
    # an empty call keeps each call's shapes too
    empty_k = torch.empty(0, 2, 64, dtype=BF16)
    for rows in (5, 7):
        out, lse = fa4tune.attention_varlen(
            torch.ones(rows, 8, 64, dtype=BF16), empty_k, empty_k, int32([0, rows]), int32([0, 0])
        )
        assert out.shape == (rows, 8, 64) and lse.shape == (8, rows)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_launch_refitted_to_other_totals_packs_what_a_new_one_would(monkeypatch, splits):
    from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch

    monkeypatch.setattr(fwd_launch, "unused_counter", lambda d: torch.zeros(1, dtype=torch.int32))
    config = FwdConfig(tile_m=64, num_splits=splits, pack_gqa=False)

    def prepared(total_q, total_k):
        q = torch.empty(total_q, 8, 64, dtype=BF16)
        k = v = torch.empty(total_k, 2, 64, dtype=BF16)
        ragged = Ragged(int32([0, 2, total_q]), int32([0, 3, total_k]), None, None, 64, 256)
        problem = make_problem(q, k, v, ragged, False)
        return fwd_launch.PreparedLaunch(problem, config, H200, q, k, v, None, ragged)

    def packed(launch):
        return (
            [bytes(d) for d in launch.descriptors + launch.combine_descriptors],
            launch.out_shape,
            launch.lse_shape,
            launch.partial_shapes,
        )

    refitted = prepared(100, 300)
    assert len(refitted.combine_descriptors) == (4 if splits > 1 else 0)
    refitted._fit((120, 290))
    assert packed(refitted) == packed(prepared(120, 290))


def test_explain_varlen_names_the_problem_and_its_config():
    call = varlen_call()
    result = fa4tune.explain_varlen(
        call["q"],
        call["k"],
        call["v"],
        call["cu_seqlens_q"],
        None,
        20,
        seqused_k=call["seqused_k"],
        page_table=call["page_table"],
        causal=True,
        target="H200",
    )
    assert not result.config.persistent


# ---- the measurement case -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {"seqlen_q": 24, "total_q": 60, "seqlen_k": 24, "total_k": 60, "causal": True},
        {"seqlen_q": 1, "seqlen_k": 40, "page_size": 8, "seqused_k": True},
        {
            "seqlen_q": 16,
            "total_q": 30,
            "seqlen_k": 64,
            "page_size": 16,
            "seqused_k": True,
            "causal": True,
        },
        {"seqlen_q": 3, "seqlen_k": 50, "seqused_k": True},
        {"seqlen_q": 1, "seqlen_k": 48, "total_k": 100, "seqused_k": True},
    ],
)
def test_the_measurement_case_checks_a_right_kernel_and_catches_wrong_ones(fields):
    """On the CPU: a kernel that computes each sequence right passes the family's check; the NaN
    in the K/V rows no sequence uses never reaches it; a row written wrong, or left unwritten,
    fails."""
    from fa4tune.kernels.common import measure

    problem = Problem(head_dim=64, batch=4, nheads_q=4, nheads_kv=2, **fields)
    case = measure.attention_case(problem, "cpu")
    measure.randomize(case, seed=3)
    if case.unused_k is not None:
        assert case.unused_k.any()
    refs = measure.reference(case)
    measure.poison(case)
    right_kernel(case)
    assert FAMILY.compare(case, refs).verdict(FAMILY.tolerance(problem)) is None
    b = max(range(4), key=lambda i: case.q_lens[i])  # a checked sequence
    _, out, _ = measure.sequence_out(case, b)
    out[0, -1] += 1.0
    assert FAMILY.compare(case, refs).verdict(FAMILY.tolerance(problem))
    out[0, -1] = float("nan")
    assert "NaN" in FAMILY.compare(case, refs).verdict(FAMILY.tolerance(problem))


def right_kernel(case):
    from fa4tune.kernels.common import measure

    for b in range(len(case.q_lens)):
        q, out, lse = measure.sequence_out(case, b)
        if q.shape[1] == 0:
            continue
        k, v = measure.sequence_kv(case, b)
        o, s = attention_reference(q, k, v, case.problem.causal)
        out.copy_(o)
        lse.copy_(s)


# ---- compiled for sm_90a (slow) -----------------------------------------------------------------
# (knobs, layout, head_dim, pack group, causal): varlen prefill, paged decode with pages below and
# above the tile, split-KV over pages, batch-shaped K with seqused_k.
RAGGED_SPREAD = [
    ({}, {"varlen_q": True, "varlen_k": True}, 128, 1, True),
    ({"tile_m": 192, "tile_n": 128}, {"varlen_q": True, "varlen_k": True}, 64, 1, False),
    (
        {"tile_m": 64, "num_stages": 3, "pack_gqa": True},
        {"page_size": 16, "seqused_k": True},
        128,
        4,
        False,
    ),
    (
        {"tile_m": 64, "num_stages": 3, "pack_gqa": True, "num_splits": 8},
        {"varlen_q": True, "page_size": 256, "seqused_k": True},
        128,
        8,
        True,
    ),
    ({"tile_m": 128, "num_stages": 2}, {"varlen_q": True, "page_size": 8}, 128, 1, True),
    ({"tile_m": 64, "num_stages": 4, "pack_gqa": True}, {"seqused_k": True}, 64, 8, False),
    ({"tile_m": 192, "tile_n": 96}, {"varlen_q": True, "page_size": 32}, 64, 1, True),
    ({"tile_m": 128, "pack_gqa": True, "num_splits": 2}, {"varlen_q": True}, 128, 4, True),
]


@pytest.mark.compile
@pytest.mark.parametrize("knobs,layout,head_dim,pack_group,causal", RAGGED_SPREAD)
def test_ragged_kernels_compile_without_spills(
    knobs, layout, head_dim, pack_group, causal, capfd, tmp_path
):
    from test_kernel_compile import _compile_with_report, _serialized_wgmma, _spill_report

    config = FwdConfig.from_dict({"rescale_threshold": 8.0, "lazy_max": True, **knobs})
    layout = InputLayout(**layout)
    _, text = _compile_with_report(
        config, "bf16", head_dim, head_dim, causal, capfd, tmp_path, pack_group=pack_group,
        layout=layout,
    )  # fmt: skip
    report = _spill_report(text)
    assert all(r == (0, 0, 0) for r in report), f"{config.short()} {layout} spills: {report}"
    assert not _serialized_wgmma(text), f"{config.short()}: {_serialized_wgmma(text)}"


@pytest.mark.compile
@pytest.mark.parametrize(
    "make",
    [
        lambda: varlen_call(),  # varlen q, paged, seqused_k
        lambda: dict(  # packed self-attention, split-KV
            q=torch.empty(300, 8, 64, dtype=BF16),
            k=torch.empty(300, 2, 64, dtype=BF16),
            v=torch.empty(300, 2, 64, dtype=BF16),
            cu_seqlens_q=int32([0, 100, 300]),
            cu_seqlens_k=int32([0, 100, 300]),
            causal=False,
            splits=4,
        ),
        lambda: dict(  # batch-shaped decode on batch-shaped K with seqused_k
            q=torch.empty(4, 1, 8, 64, dtype=BF16),
            k=torch.empty(4, 256, 2, 64, dtype=BF16),
            v=torch.empty(4, 256, 2, 64, dtype=BF16),
            seqused_k=int32([1, 2, 3, 4]),
            causal=False,
            splits=2,
        ),
    ],
)
def test_ragged_launches_pass_what_the_dsl_passes(make, monkeypatch):
    """The prepared launch's argument descriptors for ragged calls, byte for byte the DSL's own for
    the compiled signature (the index tensors after the stream, of rank 1 and 2; varlen split
    partials one batch of all rows)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch
    from fa4tune.kernels.fa4_fwd_sm90.compile import compile_forward, layout_of, pack_group_of

    call = make()
    splits = call.pop("splits", 1)
    empty, ragged = check(call)
    assert not empty
    q, k, v = call["q"], call["k"], call["v"]
    problem = make_problem(q, k, v, ragged, call["causal"])
    config = FwdConfig(tile_m=64, num_stages=2, pack_gqa=True, num_splits=splits)
    compiled = compile_forward(
        config,
        "bf16",
        64,
        64,
        call["causal"],
        H200,
        pack_group=pack_group_of(config, problem),
        layout=layout_of(problem),
    )
    monkeypatch.setattr(fwd_launch, "unused_counter", lambda d: torch.zeros(1, dtype=torch.int32))
    launch = fwd_launch.PreparedLaunch(problem, config, H200, q, k, v, 0.07, ragged)
    if config.split:
        out, lse = (torch.empty(s) for s in launch.partial_shapes)
    else:
        out, lse = torch.empty(launch.out_shape, dtype=BF16), torch.empty(launch.lse_shape)
    counter = torch.zeros(1, dtype=torch.int32)
    for pointer, t in zip(launch.pointers, (q, k, v, out, lse, counter), strict=True):
        pointer.value = t.data_ptr()
    for pointer, t in zip(launch.index_pointers, ragged.tensors(), strict=True):
        pointer.value = t.data_ptr()
    launch.stream.value = 0x7F00DEAD

    def dynamic(t, align):
        return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    tensors = [dynamic(t, 16) for t in (q, k, v, out)] + [dynamic(lse, 4)]
    tensors.append(from_dlpack(counter, assumed_align=4))
    index = [dynamic(t, 4) for t in ragged.tensors()]
    theirs, _ = compiled.function.generate_execution_args(
        *tensors,
        Float32(0.07 * math.log2(math.e)),
        Int32(fwd_launch.heads_per_l2_group(problem, H200)),
        cuda.CUstream(0x7F00DEAD),
        *index,
    )
    assert len(theirs) == len(launch.arguments)
    sizes = [_DESCRIPTORS[t.dim()].size for t in (q, k, v, out, lse)] + [8, 4, 4, 8]
    sizes += [12 if t.dim() == 1 else _DESCRIPTORS[2].size for t in ragged.tensors()]
    for position, (a, b, size) in enumerate(zip(theirs, launch.arguments, sizes, strict=True)):
        a = a.value if isinstance(a, ctypes.c_void_p) else a
        assert ctypes.string_at(a, size) == ctypes.string_at(b, size), f"argument {position}"


# ---- the serving job and the benchmark's report, without a GPU ---------------------------------
REPO = Path(__file__).resolve().parent.parent


def test_the_serving_job_holds_varlen_prefill_paged_decode_and_chunked_prefill():
    from fa4tune.tune.job import load_job

    job = load_job(REPO / "tuning_configs" / "h200-bf16-serving.yaml")
    layouts = {(p.layout.varlen_q, p.layout.varlen_k, p.layout.page_size) for p in job.problems}
    assert {(True, True, 0), (False, False, 16), (False, False, 128), (True, False, 16)} <= layouts
    for p in job.problems:  # every default fits, and the mixes can be drawn
        assert not FAMILY.infeasible_reasons(p, FAMILY.default_config(p, H200), H200), p.key()
        assert len(sequence_lengths(p)[0]) == p.batch


def test_the_varlen_report_renders_rates_ratios_and_errors(tmp_path, capsys, monkeypatch):
    import importlib.util
    import json

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its shared helpers, as a script sees
    spec = importlib.util.spec_from_file_location("varlen", REPO / "benchmarks" / "varlen.py")
    varlen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(varlen)

    def cell(ms, tflops, tbs, error):
        return {"ms": ms, "tflops": tflops, "tbs": tbs, "out_error": error, "round_spread": 0.01}

    rows = [
        {
            "key": "prefill-key",
            "regime": "prefill",
            "tokens_q": 83000,
            "tokens_k": 83000,
            "kv_bytes": 1,
            "tuned_config": "128x128",
            "tuned_source": "exact",
            "default_config": "128x128",
            "cells": {
                "tuned": cell(1.0, 600.0, 0.1, 2e-3),
                "default": cell(1.1, 545.0, 0.1, 2e-3),
                "flash-attn-4": cell(1.05, 571.0, 0.1, 2e-3),
            },
        },
        {
            "key": "decode-key",
            "regime": "decode",
            "tokens_q": 64,
            "tokens_k": 200000,
            "kv_bytes": 1,
            "tuned_config": "64x128",
            "tuned_source": "default",
            "default_config": "64x128",
            "cells": {
                "tuned": cell(0.1, 1.0, 4.0, 2e-3),
                "default": cell(0.1, 1.0, 4.0, 2e-3),
                "flash-attn-4": "error: RuntimeError: no",
            },
        },
    ]
    header = {
        "date": "d",
        "gpu": "NVIDIA H200",
        "torch": "2.11",
        "dsl": "4.8.1",
        "fa4": "4.0.0b36",
        "kernel_hash": "abcdef012345",
        "rounds": 3,
        "job": "j.yaml",
    }
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"header": header, "rows": rows}))
    assert varlen.main(["--render", str(saved)]) == 0
    text = capsys.readouterr().out
    assert "| prefill-key | 83000 / 83000 | 128x128 (exact) | 128x128 | 600 | 545 | 571 |" in text
    assert (
        "| decode-key | 64 / 200000 |" in text and "4.00 | 4.00 | error: RuntimeError: no" in text
    )
    assert "Prefill (TFLOP/s): tuned against flash-attn-4, lowest **1.051x**" in text


@pytest.mark.compile
def test_a_ragged_kernel_is_keyed_exported_and_loaded_with_its_layout(tmp_path):
    """What the gpu backend's compile workers do: the family compiles a ragged problem's kernel
    under a key of its own (not the batch-shaped problem's), exports it, and another compile cache
    loads it under the same key."""
    from fa4tune.kernels.fa4_fwd_sm90 import compile as fwd_compile

    paged = Problem(seqlen_q=1, seqlen_k=4096, batch=8, nheads_q=32, nheads_kv=8, page_size=16,
                    seqused_k=True)  # fmt: skip
    dense = Problem(seqlen_q=1, seqlen_k=4096, batch=8, nheads_q=32, nheads_kv=8)
    config = FAMILY.default_config(paged, H200)
    assert FAMILY.compile_key(paged, config, H200) != FAMILY.compile_key(dense, config, H200)
    compiled = FAMILY.compile(paged, config, H200, use_cache=False)
    assert compiled.key == FAMILY.compile_key(paged, config, H200)
    path = FAMILY.export(compiled, tmp_path / "paged.o")
    fwd_compile._CACHE.pop(compiled.key, None)
    try:
        loaded = FAMILY.load(path, paged, config, H200)
        assert loaded.key == compiled.key and loaded.kernel is None
        assert FAMILY.compile(paged, config, H200) is loaded  # the cache serves it
    finally:
        fwd_compile._CACHE.pop(compiled.key, None)
