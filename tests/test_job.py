import pytest

from fa4tune.errors import JobError
from fa4tune.problem import Problem
from fa4tune.tune.job import parse_job


def test_problem_grid_with_tokens_and_hidden():
    job = parse_job(
        {
            "problems": [
                {
                    "head_dim": [64, 128],
                    "causal": [False, True],
                    "seqlen_q": [1024, 16384],
                    "tokens": 16384,
                    "hidden": 2048,
                },
                {"head_dim": 128, "seqlen_q": 8192, "nheads_q": 32, "nheads_kv": 8},
            ]
        },
        source="j.yaml",
    )
    assert len(job.problems) == 9
    assert Problem(head_dim=64, seqlen_q=1024, batch=16, nheads_q=32) in job.problems
    assert Problem(head_dim=128, seqlen_q=16384, batch=1, nheads_q=16, causal=True) in job.problems
    assert job.problems[-1].qheads_per_kvhead == 4
    assert (
        job.kernel.name == "fa4_fwd_sm90" and job.sampler.name == "tpe" and job.budget.trials == 30
    )
    assert set(job.spaces) == {"tiles", "pipeline", "exp2", "softmax"}


@pytest.mark.parametrize(
    "problem, fragment",
    [
        (
            {"seqlen_q": 3000, "tokens": 16384},
            "tokens (16384) must be a multiple of seqlen_q (3000)",
        ),
        ({"head_dim": 96, "hidden": 1000}, "hidden (1000) must be a multiple of head_dim (96)"),
        ({"tokens": 4096, "batch": 2}, "either tokens or batch"),
        ({"head_dim": []}, "problems[0].head_dim: an empty list"),
    ],
)
def test_problem_shorthand_errors(problem, fragment):
    with pytest.raises(JobError, match="^j.yaml: ") as info:
        parse_job({"problems": [problem]}, source="j.yaml")
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "fields, where",
    [
        # NaN compares false with every elapsed time: the problem's search never ran out of time.
        ({"budget": {"seconds": float("nan")}}, "budget.seconds"),
        ({"budget": {"seconds": float("inf")}}, "budget.seconds"),
        # Read as not given: no table exported, no word said.
        ({"export": ""}, "export"),
        ({"db": " "}, "db"),
        ({"storage": ""}, "storage"),
    ],
)
def test_values_that_would_be_ignored_are_refused(fields, where):
    with pytest.raises(JobError, match=f"^j.yaml: {where}: "):
        parse_job({"problems": [{}], **fields}, source="j.yaml")


def test_budget_forms():
    assert parse_job({"problems": [{}], "budget": 5}).budget.trials == 5
    seconds_only = parse_job({"problems": [{}], "budget": {"seconds": 2}}).budget
    assert seconds_only.trials is None and seconds_only.seconds == 2
    with pytest.raises(JobError, match="budget.wall"):
        parse_job({"problems": [{}], "budget": {"wall": 1}})
    with pytest.raises(JobError, match="problems: a non-empty list"):
        parse_job({"problems": []})
    with pytest.raises(JobError, match="a job is a YAML mapping"):
        parse_job(["not", "a", "mapping"])
