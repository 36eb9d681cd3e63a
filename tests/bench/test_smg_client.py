"""The benchmark's SMG client (bench/_contenders.SmgContender) against a real HTTP server on a
real socket that closes a kept-alive connection after each response, as SMG closes one left
idle: the request is sent again on a new connection, once, and counted."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench._contenders import SmgContender


class _ClosesAfterEachResponse(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless told otherwise: the client keeps the connection

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        body = json.dumps({"tokens": [len(prompt)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()  # no "Connection: close": the client cannot know
        self.wfile.write(body)
        self.close_connection = True  # then the socket is closed, as an idle timeout would

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _client_of(handler: type[http.server.BaseHTTPRequestHandler], tmp_path: Path) -> Iterator[SmgContender]:
    """The benchmark's SMG client, connected to a real server on a loopback port running ``handler``."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    smg = SmgContender(tmp_path, tmp_path)
    smg.port = srv.server_address[1]
    smg._connect()
    try:
        yield smg
    finally:
        smg._drop_conn()
        srv.shutdown()
        srv.server_close()


def test_a_connection_the_server_closed_is_opened_again_once_and_counted(tmp_path: Path) -> None:
    with _client_of(_ClosesAfterEachResponse, tmp_path) as smg:
        assert smg.encode("abc") == [3] and smg.reconnects == 0
        for n in range(1, 4):  # every later call finds its connection closed
            assert smg.encode("x" * n) == [n]
            assert smg.reconnects == n


def test_an_http_error_is_not_retried(tmp_path: Path) -> None:
    """A refused request (HTTP status) is the server's answer, not a dropped connection."""

    class Refuses(_ClosesAfterEachResponse):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(413)
            self.send_header("Content-Length", "0")
            self.end_headers()

    with _client_of(Refuses, tmp_path) as smg:
        with pytest.raises(RuntimeError, match="HTTP 413"):
            smg.encode("abc")
        assert smg.reconnects == 0
