"""Who may use the API, as pure functions of a request's headers: the Host it names (against DNS rebinding), the
key it presents (compared in constant time) and the content type of its body (against cross-site form posts)."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence

LOOPBACK_NAMES = {"localhost"}
ANY_HOST = "*"
JSON_TYPE = "application/json"
UTF8 = {"utf-8", "utf8"}


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is this machine only: localhost, 127.0.0.0/8, ::1."""
    name = host.strip().strip("[]").rstrip(".").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, str | None] | None:
    """A Host header as (name, port or None), the name lowercased without a trailing dot; None when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:
        name, port = value, None
    if not name or (port is not None and not port.isdigit()):
        return None
    return name.rstrip("."), port


def host_allowed(value: str | None, bound_loopback: bool, allowed: Sequence[str]) -> bool:
    """Whether to answer a request naming this Host: loopback names always; on a loopback bind nothing else
    unless allowed (a rebinding page names its own domain); on another bind anything, unless `allowed` lists the
    names to take. An entry of `allowed` matches the name, or name:port; * matches any. No Host (HTTP/1.0) is no
    browser's request and passes."""
    if value is None or ANY_HOST in allowed:
        return True
    parts = split_host(value)
    if parts is None:
        return False
    name, port = parts
    if is_loopback(name):
        return True
    if not allowed:
        return not bound_loopback
    wanted = {entry.strip().lower().rstrip(".") for entry in allowed}
    return name in wanted or (port is not None and f"{name}:{port}" in wanted)


def presented_keys(authorization: str | None, x_api_key: str | None) -> list[str]:
    """The keys a request presents: `Authorization: Bearer KEY` (OpenAI's clients) and `x-api-key: KEY`
    (Anthropic's)."""
    found = []
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            found.append(token.strip())
    if x_api_key and x_api_key.strip():
        found.append(x_api_key.strip())
    return found


def matching_key(presented: Sequence[bytes], digests: Sequence[bytes]) -> int | None:
    """The index of the key whose digest one presented digest equals; every pair is compared (hmac.compare_digest
    over equal-length digests), so the time taken tells nothing of which key, or how much of one, matched."""
    found = None
    for given in presented:
        for i, digest in enumerate(digests):
            if hmac.compare_digest(given, digest) and found is None:
                found = i
    return found


def json_content_type(value: str | None) -> str | None:
    """Why a content type is not JSON (None when it is): application/json or application/*+json, in UTF-8 if a
    charset is given. What a web page may send across sites without a preflight (text/plain, forms) is not."""
    if value is None or not value.strip():
        return "no content-type was given"
    media, *params = (part.strip() for part in value.split(";"))
    media = media.lower()
    kind, slash, sub = media.partition("/")
    if media != JSON_TYPE and not (kind == "application" and slash and sub.endswith("+json") and sub != "+json"):
        return f"content-type {value.strip()!r} is not application/json"
    for param in params:
        name, _, charset = param.partition("=")
        if name.strip().lower() == "charset" and charset.strip().strip('"').lower() not in UTF8:
            return f"content-type {value.strip()!r} names a charset other than utf-8, which JSON is written in"
    return None
