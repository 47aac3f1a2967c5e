"""`python -m stages.loader CONFIG.json`: run the adapter-loader stage (the launcher writes the config)."""

from runtime.base.actor import stage_main
from stages.loader.actor import LoaderActor
from stages.loader.config import LoaderConfig
from stages.loader.process import tune_for_loads

if __name__ == "__main__":
    tune_for_loads()
    stage_main(LoaderActor, LoaderConfig)
