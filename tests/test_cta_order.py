"""benchmarks/cta_order.py: the backward's CTA order under the list-scheduling model."""

from __future__ import annotations

import pytest

from benchmarks.cta_order import efficiency, finish_time, main, walk_steps
from fa4tune.kernels.fa4_bwd_sm90.config import BwdConfig
from fa4tune.problem import Problem
from fa4tune.target import get_target


def test_finish_time_is_list_scheduling_in_order():
    # two SMs: 3 and 1 start, 1 ends and the 3-step CTA takes its SM at 1, ending at 4
    assert finish_time([3, 1, 3], sms=2) == 4
    assert finish_time([3, 3, 1], sms=2) == 4
    assert finish_time([1, 1, 3, 3], sms=2) == 4


def test_causal_walks_shrink_with_the_k_block():
    problem = Problem(
        batch=1, seqlen_q=1024, seqlen_k=1024, nheads_q=8, nheads_kv=2, head_dim=128, causal=True
    )
    config = BwdConfig(tile_m=64, tile_n=128)
    # 16 Q blocks of 64, each K block of 128 keys seen from Q block 2 n on, 4 query heads each
    assert [walk_steps(problem, config, n) for n in range(8)] == [64 - 8 * n for n in range(8)]


def test_sections_put_the_gqa_causal_backward_near_the_ideal():
    """GQA 4:1 causal at 4k (the training grid's worst problem against flash-attn-4): the plain
    order leaves the last heads' longest CTAs to run alone; four heads a section do not."""
    problem = Problem(
        batch=4, seqlen_q=4096, seqlen_k=4096, nheads_q=16, nheads_kv=4, head_dim=128, causal=True
    )
    config = BwdConfig(tile_m=64, tile_n=128)
    plain = efficiency(problem, config, 1, get_target("H200"), fixed=2.0)
    sections = efficiency(problem, config, 4, get_target("H200"), fixed=2.0)
    assert plain == pytest.approx(0.783, abs=0.01) and sections > 0.98


def test_the_table_covers_the_train_jobs_causal_problems(capsys):
    assert main([]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "-causal-" in line]
    assert len(rows) == 8 and all(float(r.split("|")[6]) >= 1.0 for r in rows)
