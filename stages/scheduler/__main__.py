"""`python -m stages.scheduler CONFIG.json`: run the scheduler stage (the launcher writes the config)."""

from runtime.base.actor import stage_main
from stages.scheduler.actor import SchedulerActor
from stages.scheduler.config import SchedulerConfig

if __name__ == "__main__":
    stage_main(SchedulerActor, SchedulerConfig)
