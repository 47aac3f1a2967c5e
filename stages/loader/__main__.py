"""`python -m stages.loader CONFIG.json`: run the adapter-loader stage (the launcher writes the config)."""

import gc

import torch

from runtime.base.actor import stage_main
from stages.loader.actor import LoaderActor
from stages.loader.config import LoaderConfig

if __name__ == "__main__":
    # Loads run in parallel on the stage's own threads: torch's intra-op threads would only oversubscribe.
    torch.set_num_threads(1)
    gc.freeze()  # start-up objects (torch's) leave the collector's scans: a full scan stalls a load for ms
    stage_main(LoaderActor, LoaderConfig)
