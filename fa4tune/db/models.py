"""ORM tables of the results database. Bump SCHEMA_VERSION on any change to them: an fa4tune that
finds another version refuses the file instead of misreading it, unless store.py knows how to
upgrade it (UPGRADES: columns added since that version; tables and indexes added since are created
whenever they are missing)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 3
# Version 2 added the provenance of GPU runs: NVIDIA driver, CUDA version, clocks seen. Version 3
# added the locks table and the one-search-trial-per-config index (many workers sharing a study).
UPGRADES = {1: {"runs": ("nvidia_driver", "cuda_version", "clocks")}, 2: {}}
CONFIRM_SOURCE = "confirm"  # trials of the re-timing before a best is stored; not search trials


class Base(DeclarativeBase):
    pass


class SchemaInfo(Base):
    __tablename__ = "fa4tune_schema"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class Run(Base):
    """One invocation of a search job (a resumed search continues its run)."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_name: Mapped[str] = mapped_column(String(256), index=True)
    job_path: Mapped[str | None] = mapped_column(Text)
    job_text: Mapped[str | None] = mapped_column(Text)
    kernel: Mapped[str] = mapped_column(String(64))
    kernel_hash: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(64))
    backend: Mapped[str] = mapped_column(String(32))
    is_estimate: Mapped[bool] = mapped_column(Boolean)
    gpu_name: Mapped[str | None] = mapped_column(String(128))
    sm_count: Mapped[int | None] = mapped_column(Integer)
    cuda_driver: Mapped[str | None] = mapped_column(String(64))  # CUDA driver API version
    nvidia_driver: Mapped[str | None] = mapped_column(String(64))  # the NVIDIA driver's version
    cuda_version: Mapped[str | None] = mapped_column(
        String(64)
    )  # the CUDA runtime torch was built with
    clocks: Mapped[dict | None] = mapped_column(JSON)  # clocks seen: at start, after each problem
    dsl_version: Mapped[str | None] = mapped_column(String(64))
    torch_version: Mapped[str | None] = mapped_column(String(64))
    fa4tune_version: Mapped[str] = mapped_column(String(32))
    storage_url: Mapped[str | None] = mapped_column(Text)
    study_prefix: Mapped[str] = mapped_column(String(256))
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16))  # running, finished, interrupted, failed
    started_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)


class ProblemConfigColumns:
    """What a trial and a best config both record: which kernel version, on which target, for which
    problem, with which config."""

    kernel: Mapped[str] = mapped_column(String(64))
    kernel_hash: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(64))
    problem_key: Mapped[str] = mapped_column(String(256))
    bucket_key: Mapped[str] = mapped_column(String(256))
    problem: Mapped[dict] = mapped_column(JSON)
    config: Mapped[dict] = mapped_column(JSON)


class Trial(ProblemConfigColumns, Base):
    """Every config the search tried: measured, failed, wrong, or pruned with its reason."""

    __tablename__ = "trials"
    __table_args__ = (
        Index("ix_trials_study_number", "study_name", "optuna_number"),
        Index("ix_trials_problem", "kernel", "target", "problem_key"),
        # A study stores each config once (its re-timings apart): two workers that measured the same
        # config cannot both store it. A partial index, so only where the database has them.
        Index(
            "uq_trials_study_config",
            "study_name",
            "config_key",
            unique=True,
            sqlite_where=text(f"source != '{CONFIRM_SOURCE}'"),
            postgresql_where=text(f"source != '{CONFIRM_SOURCE}'"),
        ).ddl_if(dialect=("sqlite", "postgresql")),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    study_name: Mapped[str] = mapped_column(String(512))
    optuna_number: Mapped[int | None] = mapped_column(Integer)
    config_key: Mapped[str] = mapped_column(Text)
    # default, warm-start, probe, sampler; or confirm: the re-timing of the best few before one is
    # stored best
    source: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # ok, failed, wrong, pruned, stopped
    reason: Mapped[str | None] = mapped_column(Text)
    time_ms: Mapped[float | None] = mapped_column(Float)
    spread_ms: Mapped[float | None] = mapped_column(Float)
    tflops: Mapped[float | None] = mapped_column(Float)
    max_error: Mapped[float | None] = mapped_column(Float)
    compile_s: Mapped[float | None] = mapped_column(Float)
    is_estimate: Mapped[bool] = mapped_column(Boolean)
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class BestConfig(ProblemConfigColumns, Base):
    """The best config known for one problem of one kernel version on one target. Rows are per
    problem (not per bucket) so that an exact lookup is exact; the bucket key is indexed for the
    bucket step of the lookup."""

    __tablename__ = "best_configs"
    __table_args__ = (
        UniqueConstraint("kernel", "kernel_hash", "target", "problem_key", name="uq_best_problem"),
        Index("ix_best_bucket", "kernel", "target", "bucket_key"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    time_ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float] = mapped_column(Float)
    is_estimate: Mapped[bool] = mapped_column(Boolean)
    provenance: Mapped[dict] = mapped_column(JSON)  # backend, gpu, versions of the measuring run
    source: Mapped[str] = mapped_column(String(512))  # "run N" or "import FILE"
    trial_id: Mapped[int | None] = mapped_column(ForeignKey("trials.id"))
    updated_at: Mapped[datetime] = mapped_column(DateTime)


class Lock(Base):
    """One row per study (or job) that workers serialise on: a transaction that updates the row
    holds it until it ends (a row lock in PostgreSQL; SQLite's write lock). `confirming` names the
    worker that re-times the study's best few, so that one worker does it."""

    __tablename__ = "locks"
    name: Mapped[str] = mapped_column(String(512), primary_key=True)
    confirming: Mapped[str | None] = mapped_column(String(256))
    updated_at: Mapped[datetime] = mapped_column(DateTime)
