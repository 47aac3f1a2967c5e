"""`python -m stages.worker CONFIG.json`: run the gpu-worker stage (the launcher writes the config). On
CUDA the device's primary context is made on a thread first, while the stage's modules (torch among
them) import: seconds of the start-up that would otherwise follow each other. What the imports made is
then frozen out of the garbage collector's scans.

`python -m stages.worker --prestarted DEVICE`: the same, started by `lorapipe serve` before it checks its
arguments (`runtime.base.prestart`); once imported, it takes its config file, stage environment and
output file from one line on stdin (end-of-file: the launcher is gone or gave up, and it exits)."""

import gc
import json
import os
import sys
import time
from pathlib import Path


def _device(argv: list[str]) -> str:
    """The runner's device named in the config file ("" where it cannot tell: stage_main then reports
    what is wrong with the file)."""
    try:
        return str(json.loads(Path(argv[1]).read_bytes())["runner"]["device"])
    except (IndexError, OSError, ValueError, KeyError, TypeError):
        return ""


def _take_hand_over() -> list[str]:
    """The config's path from the launcher's line, its environment applied and the output redirected
    (what the launcher gives a stage it spawns itself); exits where none comes."""
    from runtime.base.actor import EXIT_PARENT_DIED
    from runtime.base.prestart import read_hand_over
    from stages.worker import startup

    start = time.perf_counter()
    order = read_hand_over(sys.stdin.buffer)
    startup.config_wait_s = time.perf_counter() - start  # the start-up line's "waiting for its config"
    if order is None:
        sys.exit(EXIT_PARENT_DIED)
    os.environ.update(order["env"])  # read when used (Triton's cache directory), not at import
    if order["output"]:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(order["output"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    return [order["config"]]


if __name__ == "__main__":
    from runtime.base.prestart import PRESTARTED
    from runtime.common.cuda_driver import start_primary_context

    prestarted = sys.argv[1:2] == [PRESTARTED]
    start_primary_context(sys.argv[2] if prestarted and len(sys.argv) > 2 else _device(sys.argv))
    from runtime.base.actor import stage_main
    from stages.worker.actor import WorkerActor
    from stages.worker.config import WorkerConfig

    argv = _take_hand_over() if prestarted else None
    # What the imports made lives as long as the process: frozen now, it is left out of the collection
    # that follows setup (runtime/base/gc_pauses.py), which then scans only what the start-up made, while
    # WorkerStarted waits for it. Thawed with the rest when the stage ends.
    gc.freeze()
    stage_main(WorkerActor, WorkerConfig, argv)
