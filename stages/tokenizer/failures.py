"""How the tokenizer fails requests wholesale, so that no client waits for an answer that will never
come: when one of its handlers fails on a message (the requests and the op it named end with
`stage_failed` and leave the scheduler), and when the server shuts down (every open request)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proto.client import ErrorReply, GenerateRequest
from proto.pipeline import TokenBatch

if TYPE_CHECKING:
    from stages.tokenizer.actor import TokenizerActor


async def fail_dependents(actor: TokenizerActor, queue: str, item: Any, exc: Exception) -> None:
    identity, msg = item if queue == "client_requests" else (None, item)
    text = f"the tokenizer failed on {type(msg).__name__}: {type(exc).__name__}: {exc}"
    if (op_id := getattr(msg, "op_id", None)) is not None:
        await actor._answer_op(op_id, lambda r: ErrorReply(request_id=r, kind="stage_failed", message=text))
    rids = [i.request_id for i in msg.items] if isinstance(msg, TokenBatch) else []
    rids += [msg.request_id] if hasattr(msg, "request_id") else []
    for rid in rids:
        req = actor.requests.get(rid)
        if req is not None:
            await actor._abort(rid, outcome="failed_stage_failed")
            await actor._error(req.identity, rid, "stage_failed", text)
        elif identity is not None and isinstance(msg, GenerateRequest):
            await actor._error(identity, rid, "stage_failed", text)


async def fail_open(actor: TokenizerActor) -> None:
    """Fail every request still being tokenized or running with the shutdown message."""
    failed = list(actor.tokenizing.drain())
    for rid in list(actor.requests.by_id):
        failed.append((rid, actor.requests.by_id[rid].identity))
        actor._drop(rid, outcome="shutdown")
    for rid, identity in failed:
        await actor._error(identity, rid, "server_error", actor._shutdown_message())
