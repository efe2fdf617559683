"""The gpu backend: compile, verify and time candidates on the GPU, in worker processes.

The search's process never touches the GPU. A persistent measuring worker (worker.py, running
gpu_worker.py) owns it; a candidate that crashes the worker (segfault, illegal address, trap,
os._exit) or hangs past its timeout is stored as `failed` with the reason, the worker is replaced
and the search goes on. With `compile_workers` > 0, compile workers (pool.py) compile the next
candidates while the GPU times the current one, and hand over object files.

Per candidate (mode "search"): correctness gate on fresh random inputs (verify.py), a cheap timing
that the search's pruner may stop (status `stopped`), the full timing, then one more run on
poisoned outputs, checked again.
At the end of a problem the best few are timed again, interleaved round by round (`confirm`), and
only then is one stored as the best config."""

from __future__ import annotations

import math
import os
import statistics
import zlib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from ..errors import BackendError, BackendUnavailable
from ..problem import Problem
from ..target import get_target, partial_gpu
from .base import Backend, Measurement
from .gpu_worker import ROLE_VARIABLE
from .pool import CompilePool
from .pruner import make_pruner
from .timing import round_order
from .worker import Reply, WorkerProcess, WorkerUnavailable

DEFAULT_WORKER_MODULE = "fa4tune.measure.gpu_worker"


@dataclass(frozen=True)
class GpuOptions:
    """Options of the gpu backend (a job's `measure:` mapping)."""

    compile_workers: int | str = (
        "auto"  # processes compiling ahead; auto: min(8, CPUs - 2), 0 below 4 CPUs
    )
    compile_timeout: float = 120.0  # seconds per candidate: compile (or load) the kernel
    run_timeout: float = 60.0  # seconds per candidate: verify and time it
    start_timeout: float = 300.0  # seconds for a worker to import torch and the DSL and see the GPU
    prune_margin: float | None = (
        0.10  # stop a candidate whose cheap timing is this much above the best
    )
    prune_after: int = 3  # completed candidates before the pruner may stop any
    confirm_top: int = 3  # re-time this many of the best at the end of each problem
    confirm_rounds: int = 5  # interleaved rounds of that re-timing
    min_gain: float = (
        0.003  # the best replaces the default only when this much faster, and in every round
    )
    max_worker_deaths: int = 5  # consecutive deaths (crash, hang), then a known-good config decides
    worker_module: str = DEFAULT_WORKER_MODULE  # what the workers run (tests plant their own)
    cache_dir: str | None = (
        None  # exported kernels; default $FA4TUNE_KERNEL_CACHE, $XDG_CACHE_HOME/fa4tune/kernels
    )
    # or ~/.cache/fa4tune/kernels

    @classmethod
    def parse(cls, data: dict | None, where: str = "measure") -> GpuOptions:
        """Options from a mapping; ValueError naming the field for anything wrong."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{where}.{unknown[0]}: unknown option; known: {', '.join(sorted(known))}"
            )
        positive = ("compile_timeout", "run_timeout", "start_timeout")
        counts = ("prune_after", "confirm_top", "confirm_rounds", "max_worker_deaths")
        for name, value in data.items():
            if name in positive and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
            ):
                raise ValueError(f"{where}.{name}: a positive number of seconds, got {value!r}")
            if name in counts and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{where}.{name}: a positive integer, got {value!r}")
        workers = data.get("compile_workers", "auto")
        if workers != "auto" and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 0
        ):
            raise ValueError(
                f"{where}.compile_workers: auto or a non-negative integer, got {workers!r}"
            )
        gain = data.get("min_gain", cls.min_gain)
        if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 <= gain < 1:
            raise ValueError(
                f"{where}.min_gain: a fraction from 0 to below 1 (0.01 = 1% faster), got {gain!r}"
            )
        margin = data.get("prune_margin", cls.prune_margin)
        if margin is not None and (
            isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 0
        ):
            raise ValueError(
                f"{where}.prune_margin: a non-negative number (0.1 = 10% slower), or null "
                f"to measure every candidate fully; got {margin!r}"
            )
        for name in ("worker_module", "cache_dir"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise ValueError(f"{where}.{name}: a string, got {data[name]!r}")
        return cls(**data)

    def workers(self) -> int:
        if self.compile_workers != "auto":
            return int(self.compile_workers)
        return self.auto_compile_workers()

    @staticmethod
    def auto_compile_workers(search_workers: int = 1) -> int:
        """min(8, CPUs - 2) compile workers for one search worker; with several on the host (one per
        GPU), each gets its share of the CPUs left after their own two (search and measuring
        worker)."""
        spare = (os.cpu_count() or 1) - 2 * search_workers
        # Below 2 spare CPUs per search worker the compile workers would steal the measuring
        # worker's CPU.
        return 0 if spare < 2 * search_workers else min(8, spare // search_workers)

    def kernel_cache(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        if os.environ.get("FA4TUNE_KERNEL_CACHE"):
            return Path(os.environ["FA4TUNE_KERNEL_CACHE"]).expanduser()
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return base / "fa4tune" / "kernels"


POOL_FAILURES_TO_GIVE_UP = 3
# What each trial records of the worker's GPU and software (the worker's describe()).
DEVICE_FIELDS = (
    "gpu_name",
    "sm_count",
    "pci_bus",
    "nvidia_driver",
    "cuda_driver",
    "cuda_version",
    "torch_version",
    "dsl_version",
)


class GpuBackend(Backend):
    name = "gpu"
    is_estimate = False
    confirms_best = True
    multi_fidelity = True

    def __init__(self, kernel, target=None, **options) -> None:
        try:
            self.options = GpuOptions.parse(options)
        except ValueError as exc:
            raise BackendError(f"gpu backend options: {exc}") from exc
        self.worker = WorkerProcess(
            self.options.worker_module,
            env={ROLE_VARIABLE: "measure"},
            start_timeout=self.options.start_timeout,
            name="fa4tune-gpu-worker",
        )
        self.pool = None
        try:
            info = self.worker.start()
            super().__init__(kernel, _worker_target(info, target))
        except WorkerUnavailable as exc:
            self.worker.kill()
            raise BackendUnavailable(f"the gpu backend cannot start its worker: {exc}") from None
        except BaseException:
            self.worker.kill()
            raise
        self.device = info
        self.clock_samples = [info["clocks"]] if info.get("clocks") else []
        self.deaths = 0
        self.last_death: str | None = None
        # problem key -> (problem, config, artifact) of its last ok measurement in this session; the
        # key of the last problem measured ok (for a request that names no problem: clocks)
        self.known_good: dict[str, tuple] = {}
        self.last_good: str | None = None
        # problem key -> (problem, config, None) that the results DB holds as measured ok: the
        # health check's fallback when this session has measured none of the problem ok
        self.stored_good: dict[str, tuple] = {}
        self.pool_failures = 0  # jobs in a row the compile pool could not take
        self.lookahead = self.options.workers()
        if self.lookahead:
            self.pool = CompilePool(
                self.options.worker_module,
                self.lookahead,
                self.options.compile_timeout,
                env={ROLE_VARIABLE: "compile"},
                start_timeout=self.options.start_timeout,
            )
        self._artifact_dir = artifact_dir(
            self.options.kernel_cache(), info.get("dsl_version"), kernel
        )

    # ---- the Backend interface ----------------------------------------------------------------
    def measure(self, problem, config, should_stop=None) -> Measurement:
        artifact, compile_s, failure = self._compiled(problem, config)
        if failure:
            return Measurement(status="failed", reason=failure, compile_s=compile_s)

        notes = []

        def on_ask(payload):
            if should_stop is None:
                return None
            try:
                return should_stop(payload["cheap_ms"])
            except Exception as exc:  # noqa: BLE001 - the verdict is an optimisation; without it, no stop
                notes.append(f"no early-stop verdict ({type(exc).__name__}: {exc})"[:300])
                return None

        request = self._request(problem, config, "search", artifact)
        reply = self._ask_worker(request, on_ask)
        measurement = self._measurement(problem, reply, compile_s)
        if notes and reply.ok:
            measurement.details["notes"] = notes
        self._note_good(problem, config, artifact, measurement)
        return measurement

    def _note_good(self, problem, config, artifact: str | None, measurement: Measurement) -> None:
        """Remember a config that measured ok (as stored: within tolerance) for the health check."""
        if measurement.status == "ok":
            self.known_good[problem.key()] = (problem, config, artifact)
            self.last_good = problem.key()

    def note_stored_good(self, problem, config) -> None:
        # No artifact yet: the health check asks the compile pool (whose cache may hold it), else
        # the measuring worker compiles it.
        self.stored_good[problem.key()] = (problem, self.kernel.config(config), None)

    def prefetch(self, problem, config) -> None:
        """Start compiling a candidate the search will measure soon."""
        if self.pool is not None:
            path = self._artifact_path(problem, config)
            self.pool.submit(str(path), self._compile_request(problem, config, path))

    def discard(self, problem, config) -> None:
        """Drop a prefetched compile that no one will wait for: queued, it never runs (it would
        delay the next problem's compiles); done, it is forgotten (a failure is not reused)."""
        if self.pool is not None:
            self.pool.discard(str(self._artifact_path(problem, config)))

    def confirm(self, problem, configs: list) -> list[Measurement]:
        """Time `configs` again, interleaved: round r times each of them once, so that a slow spell
        of the GPU hits one round of every candidate rather than every round of one. Each result is
        the median over rounds (their times in `details["rounds_ms"]`, in round order); its spread
        the larger of the rounds' own and the spread across rounds."""
        rounds: list[list[Measurement]] = [[] for _ in configs]
        failed: dict[int, Measurement] = {}
        artifacts = {}
        for index, config in enumerate(configs):
            artifact, compile_s, failure = self._compiled(problem, config)
            if failure:
                failed[index] = Measurement(status="failed", reason=failure, compile_s=compile_s)
            artifacts[index] = artifact
        for round_index in range(self.options.confirm_rounds):
            for index in round_order(
                len(configs), round_index
            ):  # paired rounds: policy.beats_default
                config = configs[index]
                if index in failed:
                    continue
                request = self._request(
                    problem, config, "retime", artifacts[index], salt=round_index
                )
                measurement = self._measurement(problem, self._ask_worker(request, None), None)
                self._note_good(problem, config, artifacts[index], measurement)
                if measurement.status != "ok":
                    failed[index] = measurement
                else:
                    rounds[index].append(measurement)
        clocks = self.sample_clocks()
        results = []
        for index in range(len(configs)):
            if index in failed:
                results.append(failed[index])
                continue
            times = [m.time_ms for m in rounds[index]]
            median = statistics.median(times)
            across = (max(times) - min(times)) / median
            within = statistics.median((m.spread_ms or 0.0) / m.time_ms for m in rounds[index])
            results.append(
                Measurement.ok(
                    problem,
                    median,
                    flops=self.kernel.work_flops(problem),
                    spread_ms=max(across, within) * median,
                    max_error=max(m.max_error or 0.0 for m in rounds[index]),
                    details={
                        "rounds_ms": times,
                        "spread_across_rounds": across,
                        "clocks": clocks,
                        "confirm_rounds": self.options.confirm_rounds,
                    },
                )
            )
        return results

    def make_pruner(self):
        if self.options.prune_margin is None:
            return None
        return make_pruner(self.options.prune_margin, self.options.prune_after)

    @property
    def confirm_count(self) -> int:
        return self.options.confirm_top

    @property
    def min_gain(self) -> float:
        return self.options.min_gain

    def provenance(self) -> dict:
        d = self.device
        return {
            "gpu_name": d.get("gpu_name"),
            "sm_count": d.get("sm_count"),
            "cuda_driver": d.get("cuda_driver"),
            "nvidia_driver": d.get("nvidia_driver"),
            "cuda_version": d.get("cuda_version"),
            "clocks": {"start": d.get("clocks")},
            "compute_capability": d.get("compute_capability"),
        }

    def sample_clocks(self) -> dict | None:
        """The GPU's clocks now (after a measurement they are the clocks it ran at)."""
        reply = self._ask_worker(
            {"op": "clocks"}, None, timeouts={"compile": self.options.run_timeout}
        )
        sample = (reply.result or {}).get("clocks") if reply.ok else None
        if sample:
            self.clock_samples.append(sample)
        return sample

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.worker.close()

    # ---- helpers ------------------------------------------------------------------------------
    # The worker processes get plain data: the family by name, the problem, config and target as
    # dicts.
    def _request(self, problem, config, mode: str, artifact: str | None, salt: int = 0) -> dict:
        values = config.to_dict()
        key = f"{problem.key()}|{sorted(values.items())}|{salt}"
        return {
            "op": "measure",
            "mode": mode,
            "kernel": self.kernel.name,
            "problem": problem.to_dict(),
            "config": values,
            "target": self.target.to_dict(),
            "artifact": artifact,
            "seed": zlib.crc32(key.encode()),
            "tolerance": asdict(self.kernel.tolerance(problem)),
        }

    def _artifact_path(self, problem, config) -> Path:
        return artifact_path(self._artifact_dir, self.kernel, config, problem, self.target)

    def _compile_request(self, problem, config, path: Path) -> dict:
        return {
            "op": "compile",
            "kernel": self.kernel.name,
            "problem": problem.to_dict(),
            "config": config.to_dict(),
            "target": self.target.to_dict(),
            "artifact": str(path),
        }

    def _compiled(self, problem, config) -> tuple[str | None, float | None, str | None]:
        """(object file, compile seconds, failure reason) from the compile pool; all None
        without one."""
        if self.pool is None:
            return None, None, None
        path = self._artifact_path(problem, config)
        key = str(path)
        self.pool.submit(key, self._compile_request(problem, config, path))
        reply = self.pool.result(key)
        self.pool.forget(key)
        if reply.unserved:
            # The pool could not take the job (no compile worker starts, the pool stopped): not the
            # candidate's failure. The measuring worker compiles it, under its own compile timeout;
            # after a few such in a row, the pool is given up.
            self.pool_failures += 1
            if self.pool_failures >= POOL_FAILURES_TO_GIVE_UP:
                self.pool.close()
                self.pool = None
                self.lookahead = 0  # nothing compiles ahead now: the search asks one at a time
            return None, None, None
        self.pool_failures = 0
        if not reply.ok:
            return None, reply.seconds, f"compile failed: {reply.reason}"
        return reply.result["artifact"], reply.result.get("compile_s"), None

    def _ask_worker(self, request: dict, on_ask, timeouts: dict | None = None) -> Reply:
        if self.deaths >= self.options.max_worker_deaths:
            # Checked on the request after the last death, so that the death's own candidate was
            # stored as failed (raised with it, its outcome was lost and a resume ran it again).
            # Deaths in a row may be a bad stretch of the space, not a bad GPU: a config of this
            # problem that measured ok before is measured again, and only if it fails too (or there
            # is none: the problem itself may be what kills the worker) does the search stop.
            key = (
                Problem.from_dict(request["problem"]).key()
                if "problem" in request
                else self.last_good
            )
            unhealthy = self._health_check(key)
            if unhealthy:
                raise BackendUnavailable(
                    f"the gpu worker died {self.deaths} times in a row (last: "
                    f"{self.last_death}), {unhealthy}; the GPU may be unusable. Check "
                    "`nvidia-smi`, then resume the search with --resume."
                )
            self.deaths = 0
        try:
            reply = self.worker.request(request, timeouts or self._timeouts(), on_ask)
        except WorkerUnavailable as exc:
            raise BackendUnavailable(f"the gpu worker cannot be restarted: {exc}") from None
        self.deaths = self.deaths + 1 if reply.restarted else 0
        self.last_death = reply.reason if reply.restarted else self.last_death
        return reply

    def _timeouts(self) -> dict:
        """A measurement's timeouts, per phase."""
        return {"compile": self.options.compile_timeout, "run": self.options.run_timeout}

    def _health_check(self, problem_key: str | None) -> str | None:
        """None when a config of the problem that measured ok (in this session, else as the results
        DB holds) measures ok again; else what failed."""
        good = self.known_good.get(problem_key) or self.stored_good.get(problem_key)
        if good is None:
            return (
                "and no config of this problem has measured ok in this session or in the "
                "results DB to check the GPU with"
            )
        problem, config, artifact = good
        short = config.short()
        failed_too = f"and a config of this problem that measured ok before ({short}) failed too"
        if artifact is None:
            # A config from the results DB: the compile pool has its object file in the kernel cache
            # when an earlier session compiled it there, and keeps it for the next check.
            artifact, _, failure = self._compiled(problem, config)
            if failure is not None:
                return f"{failed_too}: {failure}"
        try:
            reply = self.worker.request(
                self._request(problem, config, "retime", artifact), self._timeouts(), None
            )
        except WorkerUnavailable as exc:
            return f"and the worker cannot be restarted: {exc}"
        measurement = self._measurement(problem, reply, None)
        if measurement.status == "ok":
            return None
        return f"{failed_too}: {measurement.status}, {measurement.reason}"

    def _measurement(self, problem, reply: Reply, pool_compile_s: float | None) -> Measurement:
        """A Measurement from the worker's reply. The tolerance is enforced here as well: a result
        that says ok with errors above tolerance (or none) is stored as wrong."""
        details = {
            "phase_seconds": {k: round(v, 3) for k, v in reply.phase_seconds.items()},
            # Where it ran, with every trial: a resumed run (or another host joining it) keeps
            # the run's first provenance, which need not be this one's.
            "device": {
                k: self.device.get(k) for k in DEVICE_FIELDS if self.device.get(k) is not None
            },
        }
        if not reply.ok:
            replaced = "; worker replaced" if reply.restarted else ""
            return Measurement(
                status="failed",
                reason=f"{reply.reason}{replaced}",
                compile_s=pool_compile_s,
                details=details,
            )
        result = dict(reply.result)
        status = result.pop("status", None)
        compile_s = pool_compile_s if pool_compile_s is not None else result.get("compile_s")
        out_error, lse_error = result.get("out_error"), result.get("lse_error")
        details.update(
            {k: v for k, v in result.items() if k not in ("time_ms", "spread", "reason")}
        )
        common = {"compile_s": compile_s, "max_error": out_error, "details": details}
        if status == "wrong":
            return Measurement(
                status="wrong", reason=result.get("reason") or "above tolerance", **common
            )
        if status == "stopped":
            time_ms = result["time_ms"]
            return Measurement(
                status="stopped",
                reason=result.get("reason") or "stopped early",
                time_ms=time_ms,
                spread_ms=result.get("spread", 0.0) * time_ms,
                **common,
            )
        if status != "ok":
            return Measurement(
                status="failed", reason=f"the worker answered status {status!r}", **common
            )
        tolerance = self.kernel.tolerance(problem)
        for name, value, limit in (
            ("output", out_error, tolerance.out),
            ("LSE", lse_error, tolerance.lse),
        ):
            if value is None or not math.isfinite(value) or value > limit:
                return Measurement(
                    status="wrong",
                    reason=f"{name} error {value!r} is not within {limit:g}",
                    **common,
                )
        time_ms = result.get("time_ms")
        if not isinstance(time_ms, (int, float)) or not time_ms > 0:
            return Measurement(
                status="failed",
                reason=f"the worker reported no usable time ({time_ms!r})",
                **common,
            )
        return Measurement.ok(
            problem,
            time_ms,
            flops=self.kernel.work_flops(problem),
            spread_ms=result.get("spread", 0.0) * time_ms,
            **common,
        )


def artifact_dir(cache: Path, dsl_version: str | None, kernel) -> Path:
    """Where the exported kernels of this kernel version and DSL version live under `cache`."""
    return Path(cache) / f"dsl-{dsl_version}" / kernel.source_hash()[:16]


def artifact_path(directory: Path, kernel, config, problem, target) -> Path:
    """The object file of `config` of kernel family `kernel` for `problem` in an `artifact_dir`: one
    per compile key, so problems that differ only in sizes share it."""
    return (
        Path(directory) / f"{kernel.artifact_name(kernel.compile_key(problem, config, target))}.o"
    )


def _worker_target(info: dict, wanted):
    """The target of the GPU the worker sees; an error when fa4tune does not know it, or when the
    job asked for another."""

    if not info.get("target"):
        raise BackendError(
            f"the gpu backend needs a GPU fa4tune knows (H100, H200, B200); the worker sees "
            f"{info.get('gpu_name') or 'no GPU'}. Use backend: model for estimates."
        )
    detected = get_target(info["target"])
    if info.get("sm_count"):
        partial = partial_gpu(
            replace(detected, sm_count=int(info["sm_count"])), f"this GPU ({info.get('gpu_name')})"
        )
        if partial:
            raise BackendError(partial)
    if wanted is not None and get_target(wanted).name != detected.name:
        raise BackendError(
            f"the job targets {get_target(wanted).name} but this GPU is {detected.name} "
            f"({info.get('gpu_name')}); drop `target:` or use the model backend"
        )
    return detected
