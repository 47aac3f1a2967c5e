"""A minimal stage for the actor tests: TokenBatch in on a bound PULL, echoed out on a PUSH. The first
item's request_id is a command: "echo", "slow" (echo after delay_s), "wait:N" (echo once N more
messages wait in the inbox), "boom" (handler error), "fatal" (StageFatal)."""

from __future__ import annotations

import asyncio

from proto.pipeline import TokenBatch, WorkerToTokenizer
from runtime.base.actor import Actor, StageConfig, StageFatal, stage_main
from runtime.base.sockets import PullSocket, PushSocket


class EchoConfig(StageConfig, frozen=True, kw_only=True):
    inbound: str
    outbound: str
    delay_s: float = 0.02


class EchoActor(Actor[EchoConfig]):
    stage = "echo"

    async def setup(self) -> None:
        pull = self.socket(PullSocket(self.config.inbound, WorkerToTokenizer))
        push = self.socket(PushSocket(self.config.outbound, WorkerToTokenizer))
        self.inbox = self.mailbox("batches", 64)
        self.outbox = self.mailbox("echoes", 64)
        self.echoed = self.metrics.counter("lorapipe_echoed", "Messages echoed")
        self.add_receiver("in", pull, self.inbox)
        self.add_handler("batches", self.inbox, self.handle)
        self.add_sender("out", self.outbox, push.send)

    async def handle(self, msg: TokenBatch) -> None:
        match msg.items[0].request_id.split(":"):
            case ["wait", n]:
                while self.inbox.qsize() < int(n):
                    await asyncio.sleep(0.005)
            case ["slow"]:
                await asyncio.sleep(self.config.delay_s)
            case ["boom"]:
                raise ValueError("boom")
            case ["fatal"]:
                raise StageFatal("fatal command")
        self.echoed.inc()
        await self.outbox.put(msg)


if __name__ == "__main__":
    stage_main(EchoActor, EchoConfig)
