"""Bearer-key authentication, one implementation for HTTP and gRPC."""

from __future__ import annotations

import hmac
from collections.abc import Iterable


class ApiKeys:
    """The keys a server accepts (``--api-key``, repeatable). Invariants: with no keys
    every request is allowed; otherwise a request is allowed exactly when its
    ``authorization`` value is ``Bearer <one of the keys>``, compared in constant time per
    key with every key checked (the time does not tell which key came close)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None, api_key: str | None = None) -> bool:
        """Whether an ``authorization`` header (or gRPC metadata) value carries a key, or
        ``api_key`` (Anthropic's ``x-api-key`` header) is one."""
        if not self._keys:
            return True
        header = authorization or ""
        if header.lower().startswith("bearer "):
            token = header[7:].encode()
        else:
            token = (api_key or "").encode()
        ok = False
        for key in self._keys:  # every key checked
            ok |= hmac.compare_digest(token, key)
        return ok


MISSING_KEY_MESSAGE = "invalid or missing API key"
