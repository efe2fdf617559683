"""Ragged inputs on the GPU: varlen prefill, paged decode, chunked prefill over pages and
batch-shaped caches with seqused_k, against the fp32 reference with poisoned outputs (the family's
own measurement case and check, as the search runs them: K/V rows no sequence uses hold NaN, unused
page-table entries hold -1, pages are shuffled), through the dispatcher, and as CUDA graphs replayed
with new page tables and lengths."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from fa4tune.kernels.common import measure  # noqa: E402
from fa4tune.kernels.fa4_fwd_sm90 import FAMILY  # noqa: E402
from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig  # noqa: E402
from fa4tune.problem import Problem  # noqa: E402
from fa4tune.target import get_target  # noqa: E402

H200 = get_target("H200")
DECODE = dict(tile_m=64, tile_n=128, num_stages=3, rescale_threshold=8.0, lazy_max=True)
PREFILL = dict(tile_m=128, tile_n=128, num_stages=2, rescale_threshold=8.0, lazy_max=True)


def run_case(problem: Problem, config: FwdConfig | None, lengths=None, seed: int = 5):
    """The family's measurement case of the problem (or of `lengths`), one poisoned run of the
    config (None: the default), checked: the verdict (None when right) and the check."""
    case = measure.ragged_case(problem, "cuda", lengths)
    config = config or FAMILY.default_config(problem, H200)
    FAMILY.randomize(case, seed)
    refs = FAMILY.reference(case)
    FAMILY.poison(case)
    FAMILY.launcher(case, config, H200)()
    torch.cuda.synchronize()
    result = FAMILY.compare(case, refs)
    return result.verdict(FAMILY.tolerance(problem)), result


def varlen(batch, seqlen_q, total_q, seqlen_k=None, total_k=None, **fields) -> Problem:
    return Problem(
        batch=batch,
        seqlen_q=seqlen_q,
        total_q=total_q,
        seqlen_k=seqlen_k or seqlen_q,
        total_k=total_k or total_q,
        **fields,
    )


CASES = [
    # (problem, config knobs or None for the default, explicit lengths or None for the mix)
    # Varlen prefill, the mix: causal and not, packed GQA heads unpacked.
    (varlen(8, 1024, 4000, nheads_q=16, nheads_kv=4, causal=True), None, None),
    (varlen(8, 1024, 4000, nheads_q=16, nheads_kv=4), None, None),
    # Zero-length sequences, and fewer keys than queries (causal, bottom-right: top rows see none).
    (
        varlen(5, 300, 520, 300, 420, nheads_q=8, nheads_kv=2, causal=True),
        PREFILL,
        ([0, 300, 7, 213, 0], [0, 100, 20, 0, 300]),
    ),
    (
        varlen(5, 300, 520, 300, 420, nheads_q=8, nheads_kv=2, head_dim=64),
        {**PREFILL, "tile_m": 192},
        ([0, 300, 7, 213, 0], [0, 100, 20, 0, 300]),
    ),
    # Split-KV over packed sequences: more splits than some sequences' blocks.
    (varlen(4, 2000, 3000, nheads_q=16, nheads_kv=2), {**PREFILL, "num_splits": 4}, None),
    # Varlen decode: packed GQA of 8, one token per sequence, keys packed.
    (
        varlen(6, 1, 6, 3000, 9000, nheads_q=32, nheads_kv=4),
        {**DECODE, "pack_gqa": True, "num_splits": 8},
        ([1] * 6, [3000, 1, 2999, 1500, 0, 1000]),
    ),
    # Packed queries over batch-shaped keys and values (one batch per sequence).
    (Problem(batch=3, seqlen_q=100, total_q=200, seqlen_k=300, nheads_q=8, nheads_kv=2,
             causal=True), None, None),
    # Head dims past 128 and below.
    (varlen(3, 500, 1000, nheads_q=4, head_dim=256, causal=True), None, None),
    (varlen(3, 500, 1000, nheads_q=4, head_dim=96, head_dim_v=96), None, None),
    # Paged decode, every page size, shuffled pages, seqused_k below the capacity.
    *[
        (
            Problem(batch=8, seqlen_q=1, seqlen_k=3000, nheads_q=32, nheads_kv=8, page_size=size,
                    seqused_k=True),
            {**DECODE, "tile_n": min(128, max(64, size)), "pack_gqa": True, "num_splits": splits},
            None,
        )
        for size, splits in ((8, 1), (16, 4), (32, 1), (64, 2), (128, 1), (256, 3), (1024, 2))
    ],
    # Paged without seqused_k (every page of the table used), MQA.
    (Problem(batch=4, seqlen_q=1, seqlen_k=1024, nheads_q=32, nheads_kv=1, page_size=64),
     {**DECODE, "pack_gqa": True, "num_splits": 2}, None),
    # Chunked prefill: varlen queries over a paged cache, causal.
    (
        Problem(batch=4, seqlen_q=256, total_q=600, seqlen_k=2048, nheads_q=16, nheads_kv=4,
                page_size=16, seqused_k=True, causal=True),
        None,
        ([256, 100, 0, 244], [2048, 100, 17, 500]),
    ),
    (
        Problem(batch=4, seqlen_q=16, total_q=40, seqlen_k=2048, nheads_q=32, nheads_kv=8,
                page_size=128, seqused_k=True, causal=True),
        {**DECODE, "pack_gqa": True, "num_splits": 4},
        None,
    ),
    # Batch-shaped K and V with seqused_k (a static cache): decode and a causal draft of 4.
    (Problem(batch=6, seqlen_q=1, seqlen_k=4096, nheads_q=32, nheads_kv=8, seqused_k=True),
     None, None),
    (Problem(batch=6, seqlen_q=4, seqlen_k=4096, nheads_q=32, nheads_kv=8, seqused_k=True,
             causal=True), {**DECODE, "pack_gqa": True, "num_splits": 6}, None),
]  # fmt: skip


@pytest.mark.parametrize("problem,knobs,lengths", CASES, ids=lambda v: getattr(v, "key", str)())
def test_ragged_inputs_match_the_reference(problem, knobs, lengths):
    config = FwdConfig(**knobs) if knobs else None
    verdict, result = run_case(problem, config, lengths)
    assert verdict is None, (verdict, result)


def test_attention_varlen_runs_the_looked_up_config_on_fresh_tensors():
    """Through fa4tune.attention_varlen twice, with new tensors of the same shapes: the second call
    reuses the prepared launch and writes its own tensors' results."""
    import fa4tune
    from fa4tune.kernels.common.reference import attention_reference

    gen = torch.Generator(device="cuda")
    lengths = [100, 0, 517, 64]
    cu = torch.tensor([0, 100, 100, 617, 681], dtype=torch.int32, device="cuda")
    for seed in (1, 2):
        gen.manual_seed(seed)
        q, k, v = (
            torch.randn(681, h, 128, generator=gen, device="cuda").to(torch.bfloat16)
            for h in (16, 4, 4)
        )
        out, lse = fa4tune.attention_varlen(q, k, v, cu, cu, 517, 517, causal=True)
        for b, n in enumerate(lengths):
            rows = slice(int(cu[b]), int(cu[b]) + n)
            if not n:
                continue
            ref_o, ref_lse = attention_reference(
                q[rows][None], k[rows][None], v[rows][None], causal=True
            )
            err = (out[rows][None].float() - ref_o).norm() / ref_o.norm()
            assert err < 1e-2 and (lse[:, rows] - ref_lse[0]).abs().max() < 1e-3


def paged_step(seed: int, batch=8, width=128, page=16, pages=1100, hq=32, hk=8, d=128):
    """One decode step's tensors: q (batch, 1, hq, d); a cache of `pages` pages in which each
    sequence's pages are drawn at random; lengths up to width x page; the page table, -1 past
    each sequence's pages."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(1, width * page + 1, (batch,), generator=gen, device="cuda")
    order = torch.randperm(pages, generator=gen, device="cuda")
    table = torch.full((batch, width), -1, dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(lengths.tolist()):
        used = -(-n // page)
        table[b, :used] = order[at : at + used].int()
        at += used
    assert at <= pages

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    return (
        rnd(batch, 1, hq, d),
        rnd(pages, page, hk, d),
        rnd(pages, page, hk, d),
        (
            lengths.int(),
            table,
        ),
    )


def paged_reference(q, k, v, lengths, table):
    from fa4tune.kernels.common.reference import attention_reference

    outs, lses = [], []
    for b, n in enumerate(lengths.tolist()):
        ids = table[b, : -(-n // k.shape[1])].long()
        kb, vb = (t[ids].flatten(0, 1)[:n][None] for t in (k, v))
        o, s_ = attention_reference(q[b : b + 1], kb, vb)
        outs.append(o)
        lses.append(s_)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("knobs", [DECODE, {**DECODE, "pack_gqa": True, "num_splits": 8}])
def test_paged_decode_replays_in_a_cuda_graph_with_new_pages_and_lengths(knobs):
    """A decode step captured once; each replay gets new page ids, lengths and q/K/V contents
    copied into the captured tensors (a serving engine's decode graph), and matches the reference
    for them."""
    from fa4tune.kernels.common.varlen import Ragged
    from fa4tune.kernels.fa4_fwd_sm90.launch import prepare_launch

    problem = Problem(batch=8, seqlen_q=1, seqlen_k=2048, nheads_q=32, nheads_kv=8,
                      page_size=16, seqused_k=True)  # fmt: skip
    q, k, v, (lengths, table) = paged_step(0)
    ragged = Ragged(None, None, lengths, table, 1, 2048)
    launch = prepare_launch(problem, FwdConfig(**knobs), H200, q, k, v, None, ragged)
    launch(q, k, v, lengths, table)  # compiled and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = launch(q, k, v, lengths, table)
    for seed in (1, 2, 3):
        *step, (new_lengths, new_table) = paged_step(seed)
        for buffer, value in zip((q, k, v, lengths, table), (*step, new_lengths, new_table)):
            buffer.copy_(value)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = paged_reference(q, k, v, lengths, table)
        err = ((out.float() - ref_o).norm() / ref_o.norm()).item()
        assert err < 1e-2, (seed, err)
        assert (lse - ref_lse).abs().max().item() < 1e-3, seed


@pytest.mark.parametrize(
    "knobs,q_lens,k_lens",
    [
        # prefill: totals 881, 831, 1023 (one power of two), zero- and one-token sequences
        (PREFILL, [[300, 0, 517, 64], [100, 650, 80, 1], [513, 200, 160, 150]], None),
        # decode-like packed queries over packed keys, split-KV: totals 10, 12 and 8700, 8600
        ({**DECODE, "num_splits": 3}, [[1, 4, 2, 3], [4, 4, 3, 1]],
         [[3000, 1500, 4000, 200], [2500, 3000, 3000, 100]]),
    ],
)  # fmt: skip
def test_one_prepared_launch_serves_other_packed_totals_of_its_power_of_two(knobs, q_lens, k_lens):
    """What fa4tune.attention_varlen does with calls whose token totals share a power of two: one
    prepared launch, each call's extents repacked (split-KV partials too), each call right, on
    output memory the allocator last held as NaN."""
    from itertools import accumulate

    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.common.varlen import Ragged
    from fa4tune.kernels.common.varlen import make_problem as make_varlen_problem
    from fa4tune.kernels.fa4_fwd_sm90.launch import prepare_launch

    def tensors(seed, qs, ks):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        cu_q, cu_k = (
            torch.tensor([0, *accumulate(n)], dtype=torch.int32, device="cuda") for n in (qs, ks)
        )
        q, k, v = (
            torch.randn(sum(n), h, 128, generator=gen, device="cuda").to(torch.bfloat16)
            for n, h in ((qs, 16), (ks, 4), (ks, 4))
        )
        return q, k, v, cu_q, cu_k

    launch = None
    for step, qs in enumerate(q_lens):
        ks = k_lens[step] if k_lens else qs
        q, k, v, cu_q, cu_k = tensors(step, qs, ks)
        if launch is None:
            ragged = Ragged(cu_q, cu_k, None, None, 1024, 4096)
            problem = make_varlen_problem(q, k, v, ragged, True)
            launch = prepare_launch(problem, FwdConfig(**knobs), H200, q, k, v, None, ragged)
        for shape in (launch.out_shape, (16, sum(qs)), (sum(qs), 16, 128)):
            torch.full(shape, float("nan"), device="cuda")  # freed: the next outputs reuse it
        out, lse = launch(q, k, v, cu_q, cu_k)
        torch.cuda.synchronize()
        assert out.shape == (sum(qs), 16, 128) and lse.shape == (16, sum(qs))
        for b, (nq, nk) in enumerate(zip(qs, ks)):
            if not nq:
                continue
            rows, keys = (
                slice(int(cu_q[b]), int(cu_q[b]) + nq),
                slice(int(cu_k[b]), int(cu_k[b]) + nk),
            )
            ref_o, ref_lse = attention_reference(
                q[rows][None], k[keys][None], v[keys][None], causal=True
            )
            err = ((out[rows][None].float() - ref_o).norm() / ref_o.norm()).item()
            assert err < 1e-2, (step, b, err)
            assert (lse[:, rows] - ref_lse[0]).abs().max().item() < 1e-3, (step, b)
