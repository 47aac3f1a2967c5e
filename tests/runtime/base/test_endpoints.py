"""Endpoints: ipc paths in the run dir, a loopback client endpoint by default, frozen and serialisable;
free ports for servers started next."""

from __future__ import annotations

import socket

import msgspec
import pytest

from runtime.base import endpoints
from runtime.base.endpoints import DEFAULT_CLIENT_PORT, Endpoints, make_run_dir


def test_in_run_dir(tmp_path):
    ep = Endpoints.in_run_dir(tmp_path)
    assert ep.client == f"tcp://127.0.0.1:{DEFAULT_CLIENT_PORT}"
    paths = ep.ipc_paths()
    assert len(paths) == 8 and len(set(paths)) == 8
    assert all(p.parent == tmp_path.resolve() for p in paths)
    assert Endpoints.in_run_dir(tmp_path, client=9000).client == "tcp://127.0.0.1:9000"
    assert Endpoints.in_run_dir(tmp_path, client="tcp://0.0.0.0:1").client == "tcp://0.0.0.0:1"
    assert msgspec.json.decode(msgspec.json.encode(ep), type=Endpoints) == ep
    with pytest.raises(AttributeError):
        ep.client = "x"  # type: ignore[misc]


def test_rejects_missing_dir_and_too_long_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        Endpoints.in_run_dir(tmp_path / "nope")
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    with pytest.raises(ValueError, match="too long"):
        Endpoints.in_run_dir(deep)


def test_make_run_dir_is_private():
    d = make_run_dir()
    try:
        assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700
    finally:
        d.rmdir()


def test_free_ports_differ_bind_and_stay_out_of_the_ephemeral_range():
    ports = [endpoints.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)  # one server's ports never coincide
    low = endpoints._ephemeral_low()
    if low is not None and low > 2048:  # an outgoing connection's local port never takes one
        assert all(1024 <= p < low for p in ports), (low, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free
