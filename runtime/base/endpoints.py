"""Every address of a pipeline, in one frozen object the launcher builds and hands to each stage: ipc://
sockets in a private run directory, the client endpoint on loopback tcp unless told otherwise; and why
an address does not answer (`unreachable_reason`)."""

from __future__ import annotations

import os
import random
import socket
import tempfile
from pathlib import Path

import msgspec

DEFAULT_CLIENT_PORT = 7450
DEFAULT_ENDPOINT = f"tcp://127.0.0.1:{DEFAULT_CLIENT_PORT}"  # where `serve` listens and clients connect
_MAX_IPC_PATH = 107  # sockaddr_un.sun_path minus the terminating NUL on Linux


class Endpoints(msgspec.Struct, frozen=True, kw_only=True):
    """One address per socket edge. Receivers bind (so a restarted stage re-binds its own inputs and
    its peers' PUSH sockets reconnect by themselves); senders connect. Control: the launcher binds."""

    run_dir: str  # private directory holding the ipc socket files ("" when none are ipc)
    client: str  # tokenizer ROUTER ⇄ client DEALERs
    control: str  # launcher ROUTER ⇄ every stage's DEALER (Ready, Shutdown, metrics)
    tokenizer_to_scheduler: str  # bound by the scheduler
    scheduler_to_tokenizer: str  # bound by the tokenizer
    scheduler_to_worker: str  # bound by the worker
    worker_to_scheduler: str  # bound by the scheduler
    worker_to_tokenizer: str  # bound by the tokenizer
    scheduler_to_loader: str  # bound by the loader
    loader_to_scheduler: str  # bound by the scheduler

    @classmethod
    def in_run_dir(cls, path: str | os.PathLike[str], client: str | int | None = None) -> Endpoints:
        """ipc:// endpoints inside `path` (which must exist and be private to this run); `client` is a
        full address, a loopback port, or None for tcp://127.0.0.1:DEFAULT_CLIENT_PORT."""
        run_dir = Path(path).resolve()
        if not run_dir.is_dir():
            raise FileNotFoundError(f"run directory {run_dir} does not exist")
        names = {f: f"ipc://{run_dir / (f + '.sock')}" for f in _EDGE_FIELDS}
        for addr in names.values():
            if len(addr) - len("ipc://") > _MAX_IPC_PATH:
                raise ValueError(f"ipc path {addr!r} is too long for a unix socket; use a shorter run dir")
        if client is None:
            client = DEFAULT_ENDPOINT
        elif isinstance(client, int):
            client = f"tcp://127.0.0.1:{client}"
        return cls(run_dir=str(run_dir), client=client, **names)

    def ipc_paths(self) -> list[Path]:
        """Socket files this pipeline may create (for cleanup checks after shutdown)."""
        return [Path(a[len("ipc://") :]) for a in self.addresses().values() if a.startswith("ipc://")]

    def addresses(self) -> dict[str, str]:
        return {f: getattr(self, f) for f in ("client", *_EDGE_FIELDS)}


_EDGE_FIELDS = tuple(f for f in Endpoints.__struct_fields__ if f not in ("run_dir", "client"))


def make_run_dir(prefix: str = "lorapipe-") -> Path:
    """A fresh private (0700) directory for one run's ipc sockets; the launcher removes it on exit.
    Short base dir: unix socket paths are limited to 107 bytes."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def unreachable_reason(endpoint: str) -> str:
    """Why a handshake got no answer, from a plain connection attempt to the same address."""
    kind, _, where = endpoint.partition("://")
    try:
        if kind == "tcp":
            host, _, port = where.rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                pass
        elif kind == "ipc":
            if not os.path.exists(where):
                return f"there is no socket file {where}"
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(1.0)
                s.connect(where)
        else:
            return "the address is neither tcp:// nor ipc://"
    except ConnectionRefusedError:
        return "nothing listens there (connection refused)"
    except (OSError, ValueError) as exc:
        return f"it cannot be reached ({exc})"
    return "something accepted the connection but did not answer the lorapipe handshake"


_HANDED_OUT: set[int] = set()  # free_port's answers in this process, never given twice


def _ephemeral_low() -> int | None:
    """The first port of the OS's ephemeral range (Linux), or None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a server started next. Taken below the OS's ephemeral range
    where it is known: a port from inside it (the OS's own pick) can become the local port of any
    outgoing connection before the server binds it. Never one this process handed out before, so the
    ports of one server differ."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12000), low) if low is not None and low > 2048 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free TCP port on {host}")
