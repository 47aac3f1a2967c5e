"""Every message that crosses a process (frozen tagged msgspec Structs), one union per socket edge, the
protocol version and the frame codec. Imports no torch; nothing here is pickled."""

from proto.base import EDGES, PROTOCOL_VERSION, Buffer, Message, Record, TokenIds
from proto.client import ClientReply, ClientRequest
from proto.codec import Codec, ProtocolError
from proto.control import LauncherToStage, ProtocolMismatch, StageToLauncher, check_ready
from proto.loader import LoaderToScheduler, SchedulerToLoader
from proto.loader_parts import LoaderToWriter, WriterToLoader
from proto.pipeline import SchedulerToTokenizer, TokenizerToScheduler, WorkerToTokenizer
from proto.plan import SchedulerToWorker, WorkerToScheduler
from proto.sampling import SamplingParams
from proto.tensor_parallel import RankZeroToRanks

__all__ = [
    "EDGES",
    "PROTOCOL_VERSION",
    "Buffer",
    "ClientReply",
    "ClientRequest",
    "Codec",
    "LauncherToStage",
    "LoaderToScheduler",
    "LoaderToWriter",
    "Message",
    "ProtocolError",
    "ProtocolMismatch",
    "RankZeroToRanks",
    "Record",
    "SamplingParams",
    "SchedulerToLoader",
    "SchedulerToTokenizer",
    "SchedulerToWorker",
    "StageToLauncher",
    "TokenIds",
    "TokenizerToScheduler",
    "WorkerToScheduler",
    "WorkerToTokenizer",
    "WriterToLoader",
    "check_ready",
]
