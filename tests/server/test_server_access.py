"""The front door's pure rules: which Host names are answered, which keys a request presents and which it matches,
which content types are JSON; and the settings they are read from."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.responses import JSONResponse
from starlette.testclient import TestClient

from tensorfold.server.access import (
    host_allowed,
    is_loopback,
    json_content_type,
    matching_key,
    presented_keys,
    split_host,
)
from tensorfold.server.door import FrontDoor, key_digest
from tensorfold.server.guard import Guard
from tensorfold.server.isolation import key_id
from tensorfold.server.limits import HEAD_BYTES, uvicorn_options
from tensorfold.server.protocol import GuardedH11Protocol
from tensorfold.settings import Settings


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST.", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("example.com", False),
    ("localhost.evil.example", False), ("", False),
])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("value, parts", [
    ("localhost:8080", ("localhost", "8080")), ("Example.COM.", ("example.com", None)),
    ("[::1]:80", ("::1", "80")), ("[::1]", ("::1", None)), ("127.0.0.1", ("127.0.0.1", None)),
    ("host:port", None), ("[::1", None), ("[::1]x", None), (":80", None), ("", None),
])
def test_split_host(value, parts):
    assert split_host(value) == parts


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "127.0.0.1:8080", "127.9.9.9", "[::1]:8080",
                                  None])
def test_loopback_hosts_always_answered(host):
    assert host_allowed(host, True, ())
    assert host_allowed(host, False, ("api.example.test",))


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "10.0.0.5", "localhost.evil.example",
                                  "bad host", "[::1"])
def test_other_hosts_refused_on_loopback(host):
    assert not host_allowed(host, True, ())


def test_allowed_hosts_by_name_or_name_and_port():
    allowed = ("api.example.test", "other.example.test:9000")
    assert host_allowed("API.example.test:443", True, allowed)
    assert host_allowed("other.example.test:9000", True, allowed)
    assert not host_allowed("other.example.test:9001", True, allowed)
    assert not host_allowed("evil.example", True, allowed)
    assert host_allowed("evil.example", True, ("*",))


def test_any_host_on_a_public_bind_unless_listed():
    assert host_allowed("evil.example", False, ())
    assert not host_allowed("evil.example", False, ("api.example.test",))


@pytest.mark.parametrize("authorization, x_api_key, keys", [
    ("Bearer k1", None, ["k1"]), ("bearer  k1 ", None, ["k1"]), (None, "k2", ["k2"]), ("Bearer k1", "k2", ["k1", "k2"]),
    ("Basic dXNlcg==", None, []), ("Bearer", None, []), ("", " ", []), (None, None, []),
])
def test_presented_keys(authorization, x_api_key, keys):
    assert presented_keys(authorization, x_api_key) == keys


def test_matching_key_names_the_key_index():
    digests = [key_digest("alpha"), key_digest("beta")]
    assert matching_key([key_digest("beta")], digests) == 1
    assert matching_key([key_digest("wrong"), key_digest("alpha")], digests) == 0
    assert matching_key([key_digest("alph")], digests) is None
    assert matching_key([], digests) is None


@pytest.mark.parametrize("value", ["application/json", "Application/JSON", "application/json; charset=utf-8",
                                   "application/json;charset=\"UTF-8\"", "application/vnd.api+json"])
def test_json_content_types(value):
    assert json_content_type(value) is None


@pytest.mark.parametrize("value, why", [
    (None, "no content-type"), ("", "no content-type"), ("text/plain", "is not application/json"),
    ("application/x-www-form-urlencoded", "is not application/json"),
    ("multipart/form-data; boundary=x", "is not application/json"), ("application/+json", "is not application"),
    ("application/json, text/plain", "is not application/json"), ("text/json", "is not application/json"),
    ("application/json; charset=utf-16", "charset other than utf-8"),
])
def test_other_content_types(value, why):
    assert why in json_content_type(value)


def test_front_door_from_settings():
    settings = Settings(host="::1", context=32768, api_keys=("k",), metrics_open=True, allowed_hosts=("a.test",),
                        special_tokens_in_content=False, body_timeout_s=3.0, cache_dir=Path("/nonexistent"))
    door = FrontDoor.from_settings(settings)
    assert (door.request_bytes, door.api_keys, door.metrics_open, door.allowed_hosts, door.bound_loopback,
            door.body_timeout_s, door.specials_in_content) == (64 * 32768, ("k",), True, ("a.test",), True, 3.0,
                                                               False)
    assert door.parse_slots >= 1
    assert not FrontDoor.from_settings(Settings(host="0.0.0.0", cache_dir=Path("/nonexistent"))).bound_loopback


def test_uvicorn_options():
    options = uvicorn_options(Settings(header_timeout_s=2.5, max_connections=7, cache_dir=Path("/nonexistent")))
    assert options["limit_concurrency"] == 7
    assert options["h11_max_incomplete_event_size"] == HEAD_BYTES
    assert issubclass(options["http"], GuardedH11Protocol) and options["http"].header_timeout_s == 2.5


def test_the_guard_hands_on_the_key_id_never_the_key():
    seen = []

    async def probe(scope, receive, send):  # the app behind the guard: records what reaches it
        seen.append(dict(scope.get("state", {})))
        await JSONResponse({})(scope, receive, send)

    door = FrontDoor(api_keys=("alpha", "beta"))
    http = TestClient(Guard(probe, door, frozenset()))  # no lifespan: the probe answers HTTP only
    assert http.get("/x", headers={"x-api-key": "beta"}).status_code == 200
    assert http.get("/x", headers={"x-api-key": "gamma"}).status_code == 401
    assert seen == [{"api_key_id": key_id("beta")}]
