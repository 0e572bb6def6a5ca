"""The front door on real servers: API keys (Bearer, x-api-key, a key file, TF_API_KEY; /health and, with
--metrics-open, /metrics open), the Host check against DNS rebinding, and JSON-only content types."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from raw_http import connect

from tensorfold.testing.process import serving

KEYS = ("alpha-key", "beta-key", "gamma-key")  # --api-key, --api-key-file, TF_API_KEY
ALLOWED = "api.example.test"
CONNECTIONS = 4
JSON_POSTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
          "/v1/completions": {"prompt": "Hi", "max_tokens": 2}, "/tokenize": {"prompt": "Hi"},
          "/detokenize": {"tokens": [67, 68]}}


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint, tmp_path_factory) -> Iterator[str]:
    """A server asking for keys, from each source; /metrics open; one more Host name allowed."""
    root = tmp_path_factory.mktemp("keyed")
    key_file = root / "keys.txt"
    key_file.write_text(f"# the operators' keys\n\n{KEYS[1]}\n")
    args = ["--family", "example", "--model", str(tiny_checkpoint), "--api-key", KEYS[0], "--api-key-file",
            str(key_file), "--metrics-open", "--allowed-hosts", ALLOWED, "--max-connections", str(CONNECTIONS)]
    with serving(args, root / "server.log", env={"TF_API_KEY": KEYS[2]}) as url:
        yield url


def error_of(reply: httpx.Response) -> dict:
    """The envelope's error object."""
    return reply.json()["error"]


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/memory"), ("GET", "/v1/models/x"),
                                          *(("POST", p) for p in JSON_POSTS)])
def test_no_key_is_401(keyed, method, path):
    reply = httpx.request(method, keyed + path, json=BODIES.get(path))
    assert reply.status_code == 401
    assert reply.headers["www-authenticate"] == "Bearer"
    assert error_of(reply) == {"message": error_of(reply)["message"], "type": "invalid_request_error",
                               "param": "Authorization", "code": "invalid_api_key"}
    assert error_of(reply)["message"].startswith("You didn't provide an API key")


@pytest.mark.parametrize("headers, param", [
    ({"Authorization": "Bearer wrong-key"}, "Authorization"), ({"x-api-key": "wrong-key"}, "x-api-key"),
    ({"Authorization": f"Basic {KEYS[0]}"}, "Authorization"), ({"Authorization": f"Bearer {KEYS[0][:-1]}"},
                                                               "Authorization"),
    ({"Authorization": f"Bearer {KEYS[0]}x"}, "Authorization"),
])
def test_a_wrong_key_is_401(keyed, headers, param):
    reply = httpx.get(keyed + "/v1/models", headers=headers)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert error_of(reply)["code"] == "invalid_api_key" and error_of(reply)["param"] == param


@pytest.mark.parametrize("headers", [
    {"Authorization": f"Bearer {KEYS[0]}"}, {"authorization": f"bearer {KEYS[1]}"}, {"x-api-key": KEYS[2]},
    {"x-api-key": KEYS[0], "Authorization": "Basic dXNlcg=="},
])
def test_each_key_opens_the_api(keyed, headers):
    assert httpx.get(keyed + "/v1/models", headers=headers).status_code == 200
    reply = httpx.post(keyed + "/tokenize", headers=headers, json={"prompt": "Hi"})
    assert reply.status_code == 200 and reply.json()["count"] > 0


def test_health_and_open_metrics_need_no_key(keyed):
    assert httpx.get(keyed + "/health").json() == {"status": "ok"}
    metrics = httpx.get(keyed + "/metrics")
    assert metrics.status_code == 200 and "tensorfold_model_info" in metrics.text


def test_the_openai_client_sends_its_key(keyed):
    with openai.OpenAI(base_url=keyed + "/v1", api_key=KEYS[1], max_retries=0, timeout=30) as client:
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2)
    assert reply.usage.completion_tokens == 2
    with openai.OpenAI(base_url=keyed + "/v1", api_key="sk-wrong", max_retries=0, timeout=30) as wrong, \
            pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_past_max_connections_is_503_in_the_envelope(keyed):
    held = [connect(keyed) for _ in range(CONNECTIONS - 1)]
    try:
        reply = httpx.get(keyed + "/health")
    finally:
        for sock in held:
            sock.close()
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert error_of(reply) == {"message": f"the server is busy: it serves at most {CONNECTIONS} connections at once "
                                          "(--max-connections); retry later", "type": "service_unavailable_error",
                               "param": None, "code": None}


def test_an_allowed_host_is_answered(keyed):
    key = {"Authorization": f"Bearer {KEYS[0]}"}
    assert httpx.get(keyed + "/v1/models", headers={**key, "Host": ALLOWED}).status_code == 200
    assert httpx.get(keyed + "/v1/models", headers={**key, "Host": f"{ALLOWED}:443"}).status_code == 200
    refused = httpx.get(keyed + "/v1/models", headers={**key, "Host": "evil.example"})
    assert refused.status_code == 403 and error_of(refused)["code"] == "host_not_allowed"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "localhost.evil.example", "10.1.2.3"])
@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_a_foreign_host_is_refused_on_loopback(server, host, path):
    reply = httpx.get(server.base_url + path, headers={"Host": host})
    assert reply.status_code == 403
    assert error_of(reply) == {"message": f"this server does not answer to the Host '{host}'; its operator can "
                                          "allow it with --allowed-hosts", "type": "invalid_request_error",
                               "param": "Host", "code": "host_not_allowed"}


def test_loopback_hosts_are_answered(server):
    port = urlsplit(server.base_url).port
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LocalHost."):
        assert httpx.get(server.base_url + "/v1/models", headers={"Host": host}).status_code == 200, host


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=utf-16",
                                          "text/json"])
@pytest.mark.parametrize("path", JSON_POSTS)
def test_json_routes_take_only_json(server, path, content_type):
    headers = {"content-type": content_type} if content_type is not None else {}
    reply = httpx.post(server.base_url + path, content=httpx.Request("POST", "/", json=BODIES[path]).content,
                       headers=headers)
    assert reply.status_code == 415
    assert error_of(reply)["param"] == "content-type" and error_of(reply)["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.tensorfold+json"])
def test_json_content_types_are_taken(server, content_type):
    reply = httpx.post(server.base_url + "/tokenize", content=b'{"prompt": "Hi"}',
                       headers={"content-type": content_type})
    assert reply.status_code == 200 and reply.json()["count"] > 0
