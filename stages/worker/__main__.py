"""`python -m stages.worker CONFIG.json`: run the gpu-worker stage (the launcher writes the config)."""

from runtime.base.actor import stage_main
from stages.worker.actor import WorkerActor
from stages.worker.config import WorkerConfig

if __name__ == "__main__":
    stage_main(WorkerActor, WorkerConfig)
