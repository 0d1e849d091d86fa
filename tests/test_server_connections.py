"""Connections a client closes are closed by the server at once, not after the keep-alive timeout.

The server keeps an idle keep-alive connection open for `--timeout-keep-alive` (75 s by default, longer than client
pools keep theirs; api/cli.py). hypercorn 0.18 also held a connection whose client had already closed it until that
timer ran out: its socket sat in CLOSE_WAIT with an open file descriptor, a connection task and its buffers for
75 s. Under a load whose clients close connections (a pool expiring idle ones after 5 s, a cancelled request, a
client without keep-alive) they piled up: ~300 sockets and ~1,000 tasks in the soak test, the API server's RSS
creep, and at a few tens of new connections a second a process's 1,024 descriptors. api/cli.py's
`close_connections_at_peer_eof` ends that timer once the client's side is closed.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from asyncengine.api.cli import DEFAULT_TIMEOUT_KEEP_ALIVE
from asyncengine.config import default_model_path
from test_server_harness import ServerThread, host_port, wait_until

PROMPT_CLOSE_S = 5.0  # far below the 75 s keep-alive timeout, far above a busy 2-core machine's scheduling delays


def get_health(conn: socket.socket) -> bytes:
    """One keep-alive GET /health on `conn`; the whole response (headers and Content-Length bytes of body)."""
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"the server closed the connection mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += conn.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head
    return data


def assert_server_closes_within(conn: socket.socket, timeout: float) -> None:
    """Half-close our side (the server reads EOF, as from a client that closed); the server must close its own
    side (our recv returns b"") within `timeout` seconds."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(timeout)
    try:
        assert conn.recv(1) == b"", "the server sent data after the response"
    except socket.timeout:
        pytest.fail(f"the server kept a connection its client had closed for over {timeout:.0f} s")


def open_connections(server: ServerThread) -> int:
    """hypercorn's connection tasks still alive on the server's loop (its per-connection `_server_callback`)."""
    return server.on_loop(lambda: sum("_server_callback" in task.get_coro().__qualname__
                                      for task in asyncio.all_tasks()))


@pytest.fixture(scope="module")
def server():
    with ServerThread(default_model_path(), max_model_len=64) as running:
        yield running


def test_keep_alive_timeout_is_long(server):
    """The fix must not shorten the keep-alive timeout that client pools rely on."""
    assert DEFAULT_TIMEOUT_KEEP_ALIVE >= 60
    with socket.create_connection(host_port(server.url)) as conn:
        get_health(conn)
        time.sleep(1.0)
        get_health(conn)  # the idle connection is still served: the server did not close it


def test_server_closes_an_idle_connection_its_client_closed(server):
    with socket.create_connection(host_port(server.url)) as conn:
        get_health(conn)
        assert_server_closes_within(conn, PROMPT_CLOSE_S)


def test_closed_connections_leave_nothing_behind(server):
    baseline = open_connections(server)
    for _ in range(30):
        with socket.create_connection(host_port(server.url)) as conn:
            get_health(conn)
    wait_until(lambda: open_connections(server) <= baseline, PROMPT_CLOSE_S)
