"""Many search workers on one host: `fa4tune search JOB --workers N` or `--gpus 0,1,...`.

The search process (the coordinator) creates or joins the run, then starts one worker process per
GPU (spawned; CUDA_VISIBLE_DEVICES names the worker's GPU; with the model backend they are plain CPU
processes). Each worker runs the search loop of search.py over all problems against the same Optuna
studies and results DB; search.py says how they share a study. The coordinator watches them: a
worker that dies (a crash, SIGKILL) has its trials handed back at once and is started again (at most
MAX_RESTARTS times per GPU); one that stops on bad input or an unusable GPU is not restarted. When
all are done, the coordinator reports each problem from the results DB. Several hosts run one
coordinator each (`--resume` joins the job's run, see README)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import wait

import yaml

from .. import interrupts
from ..db import ResultsDB
from ..errors import BackendError, BackendUnavailable, Fa4tuneError, is_user_error
from ..measure.base import cuda_available, make_backend
from ..measure.gpu import GpuOptions
from ..measure.worker import describe_exit, exit_with_parent
from ..space import compose
from ..target import get_target, partial_gpu, target_for_device_name
from .job import parse_job
from .loop import WorkerLoop
from .provenance import best_provenance, run_gpu_fields, versions
from .run import ResultsReport
from .sharing import SharedStudy
from .studies import open_storage, quiet_optuna, worker_name, worker_seed

# torch and Optuna are imported where they are used: torch only to count and name GPUs, and
# nothing imported at the top of this module touches CUDA, which a worker process may use only
# once it has set CUDA_VISIBLE_DEVICES (_worker_main). Optuna is imported as in studies.py.

MAX_RESTARTS = 3  # per worker slot
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNAVAILABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
STOP_GRACE_S = 30  # how long interrupted workers get to store and settle their trials
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # what interrupts a worker (see _worker_main)


# ---- planning -----------------------------------------------------------------------------------
def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries for the workers."""
    if not cuda_available():
        return []
    import torch

    count = torch.cuda.device_count()
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def plan_workers(
    workers: int | None, gpus: list[int] | None, backend_name: str
) -> list[str | None] | None:
    """One entry per worker: the CUDA_VISIBLE_DEVICES value it gets (None: a CPU worker of the model
    backend); None for no worker processes (search in this process)."""
    if workers is None and gpus is None:
        return None
    if workers is not None and gpus is not None:
        raise Fa4tuneError("give either --workers N or --gpus LIST, not both")
    if workers is not None and workers < 1:
        raise Fa4tuneError(
            f"--workers must be at least 1 (one worker process per GPU, or per CPU worker of "
            f"the model backend); got {workers}"
        )
    if backend_name == "model":
        if gpus is not None:
            raise Fa4tuneError(
                f"--gpus {','.join(map(str, gpus))}: this search runs on the model "
                "backend (no CUDA GPU here, or backend: model), which uses no GPU; give "
                "--workers N for N CPU worker processes"
            )
        return [None] * workers
    visible = visible_gpus()
    wanted = gpus if gpus is not None else list(range(workers))
    if len(set(wanted)) != len(wanted):
        raise Fa4tuneError(
            f"--gpus {','.join(map(str, wanted))} names a GPU twice; one worker per GPU"
        )
    missing = [g for g in wanted if not 0 <= g < len(visible)]
    if missing:
        have = f"GPUs 0..{len(visible) - 1}" if visible else "no GPU"
        what = "--workers" if gpus is None else "--gpus"
        raise Fa4tuneError(
            f"{what}: GPU {', '.join(map(str, missing))} does not exist; this host has {have} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    return [visible[g] for g in wanted]


def gpu_target(plan: list[str | None], wanted):
    """The target of the workers' GPUs, which must all be one model that fa4tune knows."""
    import torch

    visible = visible_gpus()
    models = {
        (props.name, props.multi_processor_count)
        for props in (torch.cuda.get_device_properties(visible.index(device)) for device in plan)
    }
    if len(models) != 1:
        shown = ", ".join(sorted(f"{name} ({sms} SMs)" for name, sms in models))
        raise BackendError(
            f"the workers' GPUs are of different models ({shown}); pick "
            "GPUs of one model with --gpus"
        )
    name, sm_count = models.pop()
    detected = target_for_device_name(name, sm_count)
    partial = (
        partial_gpu(detected, f"each of the workers' GPUs ({name})")
        if detected is not None
        else None
    )
    if partial:
        raise BackendError(partial)
    if detected is None:
        raise BackendError(
            f"the gpu backend needs a GPU fa4tune knows (H100, H200, B200); this host has {name}. "
            "Use backend: model for estimates."
        )
    if wanted is not None and get_target(wanted).name != detected.name:
        raise BackendError(
            f"the job targets {get_target(wanted).name} but the GPUs are {detected.name} ({name}); "
            "drop `target:` or use the model backend"
        )
    return detected


# ---- the worker process -------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to join the run (everything picklable)."""

    index: int
    device: str | None  # CUDA_VISIBLE_DEVICES for it
    workers: int  # how many workers this host runs (they share its CPUs)
    job_text: str
    job_path: str | None
    job_name: str
    db: str
    storage: str
    run: object  # run.RunRef without the job (it is parsed again from job_text)
    backend: str


class _StopOnce:
    """A worker's handler of STOP_SIGNALS: the first interrupts the search (never inside a critical
    section, see fa4tune.interrupts) and the trial in flight is settled; any later one (Ctrl-C
    reaches the whole process group, then the coordinator's SIGTERM follows) is ignored, and so is
    every one once `done`. Ignored here, in Python: a handler that set SIG_IGN raced with a signal
    already received, which Python then reported with a traceback ("Signal 15 ignored due to race
    condition")."""

    def __init__(self) -> None:
        self.done = False

    def __call__(self, signum, frame) -> None:
        if self.done:
            return
        self.done = True
        interrupts.handler(signum, frame)


def _worker_main(spec: WorkerSpec, conn) -> None:
    """Entry of a worker process: search the run's problems, send a report, exit with a status.
    It starts with STOP_SIGNALS blocked (_Slot.start): one that came while its interpreter started
    is delivered once its handler is in place, inside the `try` that turns it into a status."""
    stop = _StopOnce()
    report: dict = {"results": {}, "error": None}
    try:
        try:
            for signum in STOP_SIGNALS:
                signal.signal(signum, stop)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            if spec.device is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = spec.device
            exit_with_parent()  # a SIGKILLed coordinator leaves no worker behind
            report["results"] = _work(spec)
            code = EXIT_OK
        except BackendUnavailable as exc:
            report["error"], code = str(exc), EXIT_UNAVAILABLE
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which decides
            report["error"] = str(exc) if is_user_error(exc) else f"{type(exc).__name__}: {exc}"
            code = EXIT_BAD_INPUT if is_user_error(exc) else EXIT_FAILED
        finally:
            stop.done = True  # the report is sent whatever comes now
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    try:
        conn.send(report)
        conn.close()
    except OSError:
        pass
    sys.exit(code)


def _work(spec: WorkerSpec) -> dict:
    quiet_optuna()
    job = parse_job(
        yaml.safe_load(spec.job_text),
        source=spec.job_path or "<job>",
        text=spec.job_text,
        default_name=spec.job_name,
    )
    run = dataclasses.replace(spec.run, job=job)
    measure = dict(job.measure)
    if spec.backend == "gpu":
        if (
            measure.get("compile_workers", "auto") == "auto"
        ):  # this host's CPUs are shared by its workers
            measure["compile_workers"] = GpuOptions.auto_compile_workers(spec.workers)
        backend = make_backend("gpu", job.kernel, run.target.name, **measure)
    else:
        backend = make_backend(spec.backend, job.kernel, run.target)
    try:
        db = ResultsDB.open(spec.db, create=False)
        provenance = {**backend.provenance(), **versions()}
        db.fill_run(run.run_id, run_gpu_fields(provenance))
        loop = WorkerLoop(
            run,
            compose(job.kernel, job.spaces),
            backend,
            db,
            open_storage(spec.storage),
            best_provenance(provenance, spec.backend, run.run_id, run.l2_flush),
            progress=False,
            say=lambda message: print(f"[worker {spec.index}] {message}", flush=True),
            worker_seed=worker_seed(spec.index),
            summarise=False,
        )
        results = loop.tune_all()
        db.close()
    finally:
        backend.close()
    return {r.problem.key(): {"stopped": r.stopped, "repeats": r.repeats} for r in results}


# ---- the coordinator ----------------------------------------------------------------------------
class _Slot:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.restarts = 0
        self.process = None
        self.conn = None
        self.report: dict | None = None
        self.worker: str | None = None  # its worker name (host:pid:identity), once started

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        receive, send = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_worker_main,
            args=(self.spec, send),
            name=f"fa4tune-search-worker-{self.spec.index}",
        )
        # An interrupt waits until the worker is started and known (to _stop). The worker inherits
        # this thread's signal mask through fork and exec: it starts with STOP_SIGNALS blocked, so
        # that none cuts into its interpreter's start-up (a traceback, and no report) before its
        # handler is in place. multiprocessing's resource tracker, started with the first process,
        # unblocks them when it has started: so it is started first.
        with interrupts.critical():
            resource_tracker.ensure_running()
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                self.process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            send.close()
            self.conn, self.report = receive, None
            # Read while it lives: its identity is in the name.
            self.worker = worker_name(self.process.pid)

    def collect(self) -> None:
        try:
            while self.conn.poll():
                self.report = self.conn.recv()
        except (EOFError, OSError):
            pass


def run_workers(
    run,
    plan: list[str | None],
    backend_name: str,
    db_location: str,
    storage_location: str,
    results_db,
    storage,
    space,
    is_estimate: bool,
    say,
) -> list:
    """Run the job's problems in len(plan) worker processes; the per-problem results."""
    job = run.job
    if job.text is None:
        raise Fa4tuneError(
            "worker processes need the job as a file (its text is parsed again in each worker)"
        )
    shared_run = _without_job(run)
    slots = [
        _Slot(
            WorkerSpec(
                index=i,
                device=device,
                workers=len(plan),
                job_text=job.text,
                job_path=job.path,
                job_name=job.name,
                db=db_location,
                storage=storage_location,
                run=shared_run,
                backend=backend_name,
            )
        )
        for i, device in enumerate(plan)
    ]
    # The coordinator's view of the run: it hands back dead workers' trials and reports the
    # problems.
    coordinator = worker_name()
    if plan[0] is None:
        say(
            f"fa4tune: {len(plan)} CPU worker "
            f"process{'es' if len(plan) > 1 else ''} share run {run.run_id}"
        )
    else:
        say(
            f"fa4tune: {len(plan)} worker process{'es' if len(plan) > 1 else ''} share run "
            f"{run.run_id}, one per GPU (CUDA_VISIBLE_DEVICES {', '.join(plan)})"
        )
    failures: list[str] = []
    interrupted = False
    try:
        for slot in slots:
            slot.start()
        running = list(slots)
        while running:
            # A signal whose KeyboardInterrupt was swallowed (see fa4tune.interrupts).
            interrupts.checkpoint()
            wait([slot.process.sentinel for slot in running], timeout=1.0)
            for slot in list(running):
                slot.collect()
                if slot.process.is_alive():
                    continue
                slot.process.join()
                slot.collect()
                running.remove(slot)
                code = slot.process.exitcode
                index = slot.spec.index
                if code == EXIT_OK:
                    continue
                if code == EXIT_INTERRUPTED:  # a signal for this worker alone: not restarted
                    interrupted = True
                    say(f"fa4tune: worker {index} was interrupted")
                    continue
                error = (slot.report or {}).get("error")
                if code == EXIT_BAD_INPUT:
                    _stop(running)
                    raise Fa4tuneError(error or f"worker {index} stopped on bad input")
                if code == EXIT_UNAVAILABLE:
                    failures.append(f"worker {index} stopped: {error}")
                    say(f"fa4tune: worker {index} stopped: {error}")
                    continue
                _hand_back(run, space, results_db, storage, coordinator, frozenset({slot.worker}))
                reason = error or describe_exit(code)
                if slot.restarts >= MAX_RESTARTS:
                    failures.append(
                        f"worker {index} died {slot.restarts + 1} times (last: {reason})"
                    )
                    say(f"fa4tune: worker {index} died again ({reason}); not restarted")
                    continue
                slot.restarts += 1
                say(
                    f"fa4tune: worker {index} died ({reason}); its trials were "
                    "handed back; restarting it"
                )
                slot.start()
                running.append(slot)
    except KeyboardInterrupt:
        _stop([slot for slot in slots if slot.process is not None and slot.process.is_alive()])
        raise
    results = _results(run, space, results_db, slots, is_estimate, say)
    incomplete = [r for r in results if not r.stopped]
    if interrupted and incomplete:
        raise KeyboardInterrupt
    if failures and incomplete:
        raise BackendUnavailable(
            "; ".join(failures) + f". {len(incomplete)} problems are unfinished: continue "
            "with --resume"
        )
    return results


def _without_job(run):
    return dataclasses.replace(run, job=None)


def _hand_back(run, space, results_db, storage, coordinator: str, dead: frozenset) -> None:
    """Hand back the trials the dead workers left in any of the job's studies."""
    import optuna

    for problem in run.job.problems:
        name = run.study_name(space, problem)
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            continue  # not started yet
        SharedStudy(run, results_db, name, study, coordinator).recover(dead)


def _stop(slots) -> None:
    """Interrupt workers (SIGTERM: they store and settle their trials), kill those that linger."""
    for slot in slots:
        if slot.process.is_alive():
            slot.process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for slot in slots:
        slot.process.join(max(0.0, deadline - time.monotonic()))
        if slot.process.is_alive():
            slot.process.kill()
            slot.process.join()


def _results(run, space, results_db, slots, is_estimate: bool, say) -> list:
    """Each problem as the results DB has it, with the workers' stop reasons and repeats."""
    report = ResultsReport(run, space, results_db)
    results = []
    for problem in run.job.problems:
        result = report.counts(problem, run.study_name(space, problem))
        reasons = [
            s.report["results"][problem.key()]
            for s in slots
            if s.report and problem.key() in s.report.get("results", {})
        ]
        result.repeats = sum(r["repeats"] for r in reasons)
        stops = sorted({r["stopped"] for r in reasons if r["stopped"]})
        result.stopped = "; ".join(stops)
        say(report.summary_line(problem, result, is_estimate))
        results.append(result)
    return results
