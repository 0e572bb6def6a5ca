"""Raw HTTP/1.1 over a socket, for what an HTTP client library will not send: a head that never ends, a body
that stops, a Content-Length the body never matches."""

from __future__ import annotations

import json
import select
import socket
from typing import Any
from urllib.parse import urlsplit

import attrs

CLIENT_TIMEOUT_S = 30.0  # generous: the server's own timeouts under test are a second or two


@attrs.frozen
class Reply:
    """What came back before the server closed the connection."""

    raw: bytes

    @property
    def status(self) -> int:
        """The status code of the first response."""
        return int(self.raw.split(b" ", 2)[1])

    @property
    def headers(self) -> dict[str, str]:
        """The first response's headers, names lowercased."""
        head = self.raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
        return {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in head)}

    @property
    def json(self) -> Any:
        """The first response's body as JSON."""
        return json.loads(self.raw.split(b"\r\n\r\n", 1)[1])


def connect(base_url: str) -> socket.socket:
    """A connection to the server at `base_url`."""
    parts = urlsplit(base_url)
    return socket.create_connection((parts.hostname, parts.port), timeout=CLIENT_TIMEOUT_S)


def read_to_close(sock: socket.socket) -> Reply:
    """Everything the server sends until it closes the connection."""
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    return Reply(data)


def read_response(sock: socket.socket) -> Reply:
    """One response with a Content-Length: its head, then as many body bytes as it declares."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the server closed the connection before a whole response head: {data!r}")
        data += chunk
    reply = Reply(data)
    length = int(reply.headers["content-length"])
    while len(data.split(b"\r\n\r\n", 1)[1]) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the server closed the connection within a response: {data!r}")
        data += chunk
    return Reply(data)


def send_and_read(base_url: str, data: bytes) -> Reply:
    """Send `data` as is, then read one response."""
    with connect(base_url) as sock:
        sock.sendall(data)
        return read_response(sock)


def trickle(base_url: str, start: bytes, byte: bytes = b"a", every_s: float = 0.2, most: int = 100) -> Reply:
    """Send `start`, then one byte every `every_s` (at most `most`), until the server answers or closes."""
    sock = connect(base_url)
    sock.sendall(start)
    for _ in range(most):
        readable, _, _ = select.select([sock], [], [], every_s)
        if readable:
            break
        try:
            sock.send(byte)
        except (BrokenPipeError, ConnectionResetError):
            break
    else:
        sock.close()
        raise AssertionError(f"the server held a trickling connection through {most} bytes")
    return read_to_close(sock)


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    """A request line and headers, with the blank line that ends them."""
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


def chunked(body: bytes, size: int = 1000) -> bytes:
    """`body` in the chunked transfer coding, `size` bytes a chunk."""
    pieces = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(pieces) + b"0\r\n\r\n"


def wait_closed(sock: socket.socket) -> bytes:
    """Read a connection until the server closes it (what it sent first, if anything); a server that keeps it
    past the client's timeout fails the test with socket.timeout."""
    return read_to_close(sock).raw
