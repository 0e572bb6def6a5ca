"""Stub: the two URL helpers the load client calls, without the runtime's network module (zmq, psutil)."""

from __future__ import annotations


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def resolve_base_url(base_url: str | None, host: str, port: int) -> str:
    """`base_url` when given, else http://host:port (an IPv6 host in brackets)."""
    return base_url or f"http://{_host(host)}:{port}"


def resolve_host_port(base_url: str | None, host: str, port: int) -> str:
    """`base_url` when given, else host:port without a scheme."""
    return base_url or f"{_host(host)}:{port}"
