"""The test helper that starts real redis-server processes (``tests/redis_servers.py``): a node
whose cluster bus port was taken before it could bind it starts on another port, unless its
port was given (then the start fails, saying why)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.redis_servers import PortTaken, RedisServer

CLUSTER = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000")


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_node_whose_bus_port_is_taken_starts_on_another(tmp_path: Path) -> None:
    node = RedisServer(tmp_path / "picked", None, *CLUSTER, bus=True)
    first = node.port
    with _hold(first + 10000):  # what an outgoing connection's ephemeral port did in `make test`
        try:
            node.start()
            assert node.port != first
            assert node.cmd("PING").strip() == "PONG"
        finally:
            node.stop()
        given = RedisServer(tmp_path / "given", first, *CLUSTER, bus=True)
        with pytest.raises(PortTaken, match="Address already in use"):
            given.start()
        assert given.port == first
