"""free_port: below the kernel's ephemeral range, free, and never handed out twice by one process."""

from __future__ import annotations

import socket
from pathlib import Path

from tensorfold.ports import LOWEST, bindable, ephemeral_low, free_port


def test_the_range_start_is_read_from_the_system_file(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert ephemeral_low(ranges) == 32768
    assert ephemeral_low(tmp_path / "absent") is None
    (tmp_path / "garbled").write_text("wide\n")
    assert ephemeral_low(tmp_path / "garbled") is None


def test_ports_lie_below_the_ephemeral_range_and_differ() -> None:
    below = ephemeral_low() or 32768
    ports = [free_port(below=below) for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(LOWEST <= port < below for port in ports)
    for port in ports[:5]:
        with socket.socket() as server:        # a server can take it: bind and listen, then a client connects
            server.bind(("127.0.0.1", port))
            server.listen()
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass


def test_a_listening_port_is_not_bindable() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert not bindable(server.getsockname()[1])


def test_no_room_below_the_range_falls_back_to_a_kernel_port() -> None:
    port = free_port(below=LOWEST)
    assert bindable(port)
    assert free_port(below=LOWEST) != port
