"""Best-config entries as the results DB, the exported tables and the lookup share them. Plain data:
the lookup reads tables without importing SQLAlchemy."""

from __future__ import annotations

import json
from dataclasses import dataclass


def config_key(config: dict) -> str:
    """A canonical text form of a config: equal configs, equal keys."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class BestEntry:
    """One best config as the export, the import and the lookup see it."""

    kernel: str
    kernel_hash: str
    target: str
    problem: dict
    problem_key: str
    bucket_key: str
    config: dict
    time_ms: float
    tflops: float
    is_estimate: bool
    provenance: dict
    source: str

    def beats(self, other: "BestEntry") -> bool:
        """A measurement beats an estimate; otherwise the faster one wins."""
        if self.is_estimate != other.is_estimate:
            return not self.is_estimate
        return self.time_ms < other.time_ms


@dataclass(frozen=True)
class MergeReport:
    added: list[str]
    replaced: list[str]  # imported entry was better
    kept: list[str]  # the DB's entry was better or equal
    conflicts: list[str]  # human-readable lines for differing configs
