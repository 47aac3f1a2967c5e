"""`python -m stages.worker CONFIG.json`: run the gpu-worker stage (the launcher writes the config). On
CUDA the device's primary context is made on a thread first, while the stage's modules (torch among
them) import: seconds of the start-up that would otherwise follow each other."""

import json
import sys
from pathlib import Path


def _device(argv: list[str]) -> str:
    """The runner's device named in the config file ("" where it cannot tell: stage_main then reports
    what is wrong with the file)."""
    try:
        return str(json.loads(Path(argv[1]).read_bytes())["runner"]["device"])
    except (IndexError, OSError, ValueError, KeyError, TypeError):
        return ""


if __name__ == "__main__":
    from runtime.common.cuda_driver import start_primary_context

    start_primary_context(_device(sys.argv))
    from runtime.base.actor import stage_main
    from stages.worker.actor import WorkerActor
    from stages.worker.config import WorkerConfig

    stage_main(WorkerActor, WorkerConfig)
