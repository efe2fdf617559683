"""Best-config entries as the results DB, the exported tables and the lookup share them (which one
wins is fa4tune.policy's to say). Plain data: the lookup reads tables without importing
SQLAlchemy."""

from __future__ import annotations

import json
from dataclasses import dataclass


def config_values(config) -> dict:
    """A config's knob values: a config value (a family's config type) as its dict, a dict as is."""
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def config_key(config) -> str:
    """A canonical text form of a config (a config value or its knob values): equal configs, equal
    keys."""
    return json.dumps(config_values(config), sort_keys=True, separators=(",", ":"))


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


@dataclass(frozen=True)
class MergeReport:
    added: list[str]
    replaced: list[str]  # imported entry was better
    kept: list[str]  # the DB's entry was better or equal
    conflicts: list[str]  # human-readable lines for differing configs
