"""Launcher ⇄ stage control messages (stage DEALER → launcher ROUTER, identity = stage name): the
startup handshake with its protocol-version check, shutdown, the fatal-error sentinel and metrics."""

from __future__ import annotations

from proto.base import PROTOCOL_VERSION, Message, edge


class ProtocolMismatch(Exception):
    """A peer speaks another PROTOCOL_VERSION: refuse it at the handshake."""


class Ready(Message):
    """A stage bound its sockets and is serving. Never changes shape (the version check reads it)."""

    stage: str
    pid: int
    protocol_version: int


class FatalError(Message):
    """Sent by a stage right before it exits on an unrecoverable error."""

    stage: str
    message: str


class MetricsReport(Message):
    query_id: int
    stage: str
    text: str  # Prometheus text exposition of the stage's registry


class Draining(Message):
    """The stage got Shutdown/SIGTERM and stops taking new work; it exits once drained."""

    stage: str


class Shutdown(Message):
    """Drain, then exit 0 (the same as SIGTERM). `reason` is set when the pipeline is going down
    because a stage failed: the tokenizer then fails open requests at once, naming it."""

    deadline_s: float = 10.0
    reason: str = ""


class MetricsQuery(Message):
    query_id: int


class MergedMetricsQuery(Message):
    """A stage asks for every stage's metrics merged into one exposition (the tokenizer serves them on
    its HTTP port); the launcher answers MergedMetrics with the same query_id."""

    query_id: int


class MergedMetrics(Message):
    query_id: int
    text: str  # the same text the launcher's own /metrics serves


def check_ready(msg: Ready, expected_version: int = PROTOCOL_VERSION) -> None:
    """The launcher's half of the handshake: refuse a stage built against another protocol."""
    if msg.protocol_version != expected_version:
        raise ProtocolMismatch(
            f"stage {msg.stage!r} (pid {msg.pid}) speaks protocol {msg.protocol_version}, "
            f"launcher speaks {expected_version}"
        )


StageToLauncher = edge("stage_to_launcher", Ready, FatalError, MetricsReport, Draining, MergedMetricsQuery)
LauncherToStage = edge("launcher_to_stage", Shutdown, MetricsQuery, MergedMetrics)
