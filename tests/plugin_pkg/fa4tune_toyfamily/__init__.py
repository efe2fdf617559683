"""A third-party kernel family, registered only through entry points (the tests write a dist-info
for it): a blocked matrix multiply "kernel" that never compiles or runs, with its own problem kind,
config type, feasibility rule, search space and cost model. It exists to show that a family goes
through search, results DB, export and lookup with no change to fa4tune's own files."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from fa4tune.kernels import KernelFamily, Rule
from fa4tune.space import SearchSpace


class ToyConfigError(ValueError):
    pass


KNOBS = {"block": (16, 32, 64, 128), "split": (1, 2, 4)}


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True, order=True)
class ToyBucket:
    m: int
    n: int
    k: int

    def key(self) -> str:
        return f"mm-bm{self.m}-n{self.n}-k{self.k}"

    def family(self) -> tuple:
        return ()

    def distance(self, other: ToyBucket) -> float:
        return sum(
            abs(math.log2(a) - math.log2(b))
            for a, b in ((self.m, other.m), (self.n, other.n), (self.k, other.k))
        )


@dataclass(frozen=True)
class MatmulProblem:
    """C (m, n) = A (m, k) B (k, n)."""

    m: int = 1024
    n: int = 1024
    k: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MatmulProblem:
        return cls(**data)

    def key(self) -> str:
        return f"mm-m{self.m}-n{self.n}-k{self.k}"

    def bucket(self) -> ToyBucket:
        return ToyBucket(_pow2_ceil(self.m), _pow2_ceil(self.n), _pow2_ceil(self.k))

    def distance(self, other: MatmulProblem) -> float:
        return ToyBucket(self.m, self.n, self.k).distance(ToyBucket(other.m, other.n, other.k))

    def lent_to(self, problem: MatmulProblem):
        return self, False


@dataclass(frozen=True)
class ToyConfig:
    block: int = 32
    split: int = 1

    def __post_init__(self) -> None:
        bad = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) not in KNOBS[f.name]
        ]
        if bad:
            raise ToyConfigError("illegal knob value(s): " + "; ".join(bad))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ToyConfig:
        unknown = sorted(set(data) - set(KNOBS))
        if unknown:
            raise ToyConfigError(f"unknown knob(s) {', '.join(unknown)}")
        return replace(cls(), **data)

    def canonical(self) -> ToyConfig:
        return self

    def short(self) -> str:
        return f"b{self.block}s{self.split}"


BLOCK_RULE = "a block of rows larger than m"


def block_fits(problem, config, target) -> list[str]:
    if config.block > problem.m:
        return [f"{BLOCK_RULE} ({config.block} > {problem.m})"]
    return []


class ToyCostModel:
    """Fastest where block is m/16 (capped) and split is k/512: a landscape with one known
    optimum."""

    def __init__(self, target) -> None:
        self.target = target

    def time_s(self, config, problem) -> tuple[float, dict]:
        best_block = min(128, max(16, problem.m // 16))
        best_split = min(4, max(1, problem.k // 512))
        penalty = (
            1
            + abs(math.log2(config.block / best_block)) * 0.2
            + abs(math.log2(config.split / best_split)) * 0.1
        )
        return problem.flops / 5e14 * penalty, {"penalty": penalty}

    def provenance(self) -> dict:
        return {"model": "toy"}


class ToyMatmul(KernelFamily):
    name = "toy_matmul"
    arch = "sm_90a"
    description = "a toy blocked matmul (tests only)"
    problem_type = MatmulProblem
    config_type = ToyConfig
    config_error = ToyConfigError
    knobs = KNOBS
    default_spaces = ("toy_blocks",)
    rules = (Rule("block fits", block_fits),)
    source_root = Path(__file__).resolve().parent
    source_globs = ("__init__.py",)

    def default_config(self, problem, target=None) -> ToyConfig:
        return ToyConfig()

    def cost_model(self, target, assumptions=None):
        return ToyCostModel(target)


class ToyBlocks(SearchSpace):
    name = "toy_blocks"
    knobs = ("block", "split")


FAMILY = ToyMatmul()
