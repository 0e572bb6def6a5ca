"""fuzz_http.send_once against a real socket server that sends its status line and headers, then its body later:
a case that hangs up before any answer is judged by the status alone when the body is late (the body read shares
the hang-up's short timeout), a 5xx still fails it, and a case that reads its answer waits for the body."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tensorfold.testing.fuzz import Case
from tensorfold.testing.fuzz_http import HANG_UP_S, send_once

LATE_S = 20 * HANG_UP_S
ENVELOPE = json.dumps({"error": {"message": "stream_options must be an object", "type": "invalid_request_error",
                                 "param": "stream_options", "code": None}}).encode()


def serve(listener: socket.socket, status: str) -> None:
    """Each connection: read the request, send the head now and the body LATE_S later, close."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            conn.sendall(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(ENVELOPE)}\r\n"
                         "connection: close\r\n\r\n".encode())
            time.sleep(LATE_S)
            try:
                conn.sendall(ENVELOPE)
            except OSError:
                pass


@pytest.fixture(params=["400 Bad Request", "500 Internal Server Error"])
def late_body_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    listener = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=serve, args=(listener, request.param), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", int(request.param.split()[0])
    listener.close()


def case(hang_up_after: int | None) -> Case:
    return Case(index=0, kind="number", path="/v1/completions", body=b'{"stream": true, "stream_options": 5e-324}',
                hang_up_after=hang_up_after)


def test_a_hang_up_case_with_a_late_body_is_judged_by_its_status(late_body_url: tuple[str, int]) -> None:
    url, status = late_body_url
    with httpx.Client() as client:
        outcome = send_once(client, url, case(0), timeout_s=30.0)
    assert outcome.status == status
    assert (outcome.problem is None) == (status < 500)


def test_a_case_that_reads_waits_for_the_late_body(late_body_url: tuple[str, int]) -> None:
    url, status = late_body_url
    with httpx.Client() as client:
        outcome = send_once(client, url, case(None), timeout_s=30.0)
    assert outcome.status == status
    assert (outcome.problem is None) == (status < 500)
    assert status < 500 or "stream_options must be an object" in outcome.problem
