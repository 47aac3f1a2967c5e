"""A stand-in stage for the launcher tests: `python -m tests.integration.fake_stage CONFIG.json` plays
the stage named by the config file (loader.json → "loader"), binds that stage's inputs and swallows
what arrives. LORAPIPE_FAKE_<STAGE> picks a behaviour: "" serve, "exit:N" exit N before Ready,
"fatal" fail in setup (FatalError), "hang" ignore Shutdown and SIGTERM once asked to stop."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from proto.loader import LoaderToScheduler, SchedulerToLoader
from proto.pipeline import TokenizerToScheduler
from proto.plan import SchedulerToWorker, WorkerToScheduler
from runtime.base.actor import Actor, StageConfig, stage_main
from runtime.base.endpoints import Endpoints
from runtime.base.sockets import PullSocket


class FakeConfig(StageConfig, frozen=True, kw_only=True):
    endpoints: Endpoints  # the real stage config's other fields are ignored when decoding


INPUTS: dict[str, list[tuple[str, Any]]] = {
    "scheduler": [
        ("tokenizer_to_scheduler", TokenizerToScheduler),
        ("worker_to_scheduler", WorkerToScheduler),
        ("loader_to_scheduler", LoaderToScheduler),
    ],
    "worker": [("scheduler_to_worker", SchedulerToWorker)],
    "loader": [("scheduler_to_loader", SchedulerToLoader)],
    "tokenizer": [],
}


class FakeActor(Actor[FakeConfig]):
    behaviour = ""

    async def setup(self) -> None:
        match self.behaviour.split(":"):
            case ["exit", code]:
                os._exit(int(code))
            case ["fatal"]:
                raise RuntimeError(f"fake {self.stage} failed on purpose")
            case ["hang"]:
                self.add_loop("hang", self._hang)
        swallowed = self.mailbox("swallowed")
        for field, msg_type in INPUTS[self.stage]:
            sock = self.socket(PullSocket(getattr(self.config.endpoints, field), msg_type))
            self.add_receiver(field, sock, swallowed)
        self.add_handler("swallowed", swallowed, self._swallow)

    async def _swallow(self, item: Any) -> None:
        pass

    async def _hang(self) -> None:
        await self._stop_requested.wait()
        self.log.info("hanging on purpose")
        while True:
            time.sleep(3600)  # blocks the loop: neither Shutdown nor SIGTERM gets through


def make(config: FakeConfig) -> FakeActor:
    stage = Path(sys.argv[1]).stem
    behaviour = os.environ.get(f"LORAPIPE_FAKE_{stage.upper()}", "")
    cls = type(f"Fake{stage.title()}", (FakeActor,), {"stage": stage, "behaviour": behaviour})
    return cls(config)


if __name__ == "__main__":
    stage_main(make, FakeConfig)
