"""Who is calling, and what they sent: API keys, tenants, admin rights, JSON bodies.

Keys come from the app args or the environment (``PREFIX_CACHE_API_KEYS``:
``key=tenant,...``; ``PREFIX_CACHE_ADMIN_KEYS``: comma-separated), never from
the repository. Each key's tenant is its cache namespace. Bodies must be JSON
(``Content-Type: application/json``), which also keeps cross-site form and
``text/plain`` POSTs out, and must arrive within ``Limits.body_timeout_s``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Callable

from fastapi import Request

from serve_app.errors import APIError
from serve_app.parse import Limits, parse_json


def key_tenant(key: str) -> str:
    """The tenant of a key configured without one: derived from the whole key
    (never a prefix, which two keys may share), and not reversible to it."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def parse_keys(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """``"key1=tenantA,key2=tenantB"`` or a mapping -> {key: tenant}; a key
    without ``=tenant`` gets a namespace of its own (``key_tenant``)."""
    if not spec:
        return {}
    if isinstance(spec, Mapping):
        return {str(k): str(v) for k, v in spec.items()}
    out = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, _, tenant = part.partition("=")
        out[key.strip()] = tenant.strip() or key_tenant(key.strip())
    return out


class Auth:
    """The configured keys and the check every endpoint runs first."""

    def __init__(self, api_keys: str | Mapping[str, str] | None = None, admin_keys: str | list[str] | None = None,
                 admin_without_keys: bool = False):
        self.api_keys = parse_keys(api_keys or os.environ.get("PREFIX_CACHE_API_KEYS"))
        admin = admin_keys if admin_keys is not None else os.environ.get("PREFIX_CACHE_ADMIN_KEYS", "")
        self.admin_keys = set(admin if isinstance(admin, list) else [k for k in admin.split(",") if k])
        # Admin endpoints (flush, policy, stats) with no key configured at all: off unless
        # explicitly enabled (a local demo), so a cross-site POST cannot flush the cache.
        self.admin_without_keys = bool(admin_without_keys) or \
            os.environ.get("PREFIX_CACHE_ADMIN_WITHOUT_KEYS", "").lower() in ("1", "true", "yes")

    def authenticate(self, request: Request, admin: bool = False) -> str | None:
        """The caller's tenant (None when auth is off); raises 401/403."""
        if not self.api_keys and not self.admin_keys:
            if admin and not self.admin_without_keys:
                raise APIError(403, "admin endpoints are disabled: configure admin_keys (or, on a trusted "
                                    "local setup, set admin_without_keys)", type_="permission_error",
                               code="admin_disabled")
            return None
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        if admin:
            if any(hmac.compare_digest(key, k) for k in self.admin_keys):
                return "admin"
            if key and any(hmac.compare_digest(key, k) for k in self.api_keys):
                raise APIError(403, "this endpoint needs an admin key", type_="permission_error",
                               code="admin_required")
            raise APIError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")
        for k, tenant in self.api_keys.items():
            if key and hmac.compare_digest(key, k):
                return tenant
        if key and any(hmac.compare_digest(key, k) for k in self.admin_keys):
            return "admin"
        raise APIError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")


async def read_json_body(request: Request, limits: Limits, empty_ok: bool = False,
                         on_bytes: Callable[[], None] | None = None) -> dict:
    """The JSON object of a request body (``{}`` for an empty one when ``empty_ok``);
    ``on_bytes()`` runs once the bytes are in, before they are parsed."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        # Also what keeps a cross-site form or text/plain POST from reaching an endpoint.
        raise APIError(415, f"the request body must be JSON with Content-Type: application/json, "
                            f"got {media_type or 'none'!r}", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of "
                            f"{limits.max_body_bytes}", code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                chunks.append(chunk)
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise APIError(413, f"request body exceeds the limit of {limits.max_body_bytes} "
                                        f"bytes", code="request_too_large")
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s} s",
                       code="request_timeout") from None
    raw = b"".join(chunks)
    if on_bytes is not None:
        on_bytes()
    return {} if empty_ok and not raw.strip() else parse_json(raw, limits)
