"""`fa4tune search` as if this host had FA4TUNE_SIM_GPUS H200s (default 8): for
`benchmarks/multi_gpu.py --simulate`, with a job whose `measure.worker_module` is
`simulated_gpu_worker` (the worker processes then never touch a GPU).

    python benchmarks/simulated_gpus.py search JOB.yaml --gpus 0,1 [...]

Only the search process's GPU discovery is replaced; the worker processes, studies, compile pool and
confirmation are the real ones."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def simulate_gpus() -> None:
    import fa4tune.tune.workers as workers
    from fa4tune.target import get_target

    count = int(os.environ.get("FA4TUNE_SIM_GPUS", "8"))
    workers.visible_gpus = lambda: [str(i) for i in range(count)]
    workers.gpu_target = lambda plan, wanted: get_target("H200")


if (
    __name__ == "__main__"
):  # the workers are spawned: they import this file without running a search
    simulate_gpus()
    from fa4tune.cli import main

    sys.exit(main(sys.argv[1:]))
