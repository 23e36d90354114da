"""Bearer-key authentication, one implementation for HTTP and gRPC, and the HTTP access
policy that keeps admin routes apart from inference."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from radixserve.api.tenants import KeyEntry, KeysFileError, load_keys_file

log = logging.getLogger("radixserve.api")

# one more admin key for ``serve``, from its environment (read once, then removed: the
# process list shows flags to every local user, an environment only to its owner)
ADMIN_KEY_ENV = "RADIXSERVE_ADMIN_API_KEY"


class ApiKeys:
    """The keys a server accepts: ``--api-key`` ones (tenant ``default``) and those of the
    keys file (each naming its tenant; ``replace_file_entries`` swaps them on a reload).
    Invariants: with no keys every request is allowed; otherwise a request is allowed
    exactly when its ``authorization`` value is ``Bearer <one of the keys>``, compared in
    constant time per key with every key checked (the time does not tell which key came
    close)."""

    def __init__(self, keys: Iterable[str], entries: Iterable[KeyEntry] = ()) -> None:
        self._flag_entries = [KeyEntry(key.encode()) for key in keys]
        self._entries = [*self._flag_entries, *entries]

    def replace_file_entries(self, entries: Iterable[KeyEntry]) -> None:
        """The keys file's entries are now ``entries`` (one assignment: a request sees
        the old set or the new one)."""
        self._entries = [*self._flag_entries, *entries]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def identify(self, authorization: str | None, api_key: str | None = None) -> KeyEntry | None:
        """The entry of the key an ``authorization`` header (or gRPC metadata) value carries,
        or of ``api_key`` (Anthropic's ``x-api-key`` header); None if neither is a key."""
        header = authorization or ""
        if header.lower().startswith("bearer "):
            token = header[7:].encode()
        else:
            token = (api_key or "").encode()
        found = None
        for entry in self._entries:  # every key checked
            if hmac.compare_digest(token, entry.key):
                found = entry
        return found

    def allows(self, authorization: str | None, api_key: str | None = None) -> bool:
        """Whether an ``authorization`` header (or gRPC metadata) value carries a key, or
        ``api_key`` (Anthropic's ``x-api-key`` header) is one."""
        if not self._entries:
            return True
        return self.identify(authorization, api_key) is not None


def reload_keys_file(keys: ApiKeys, path: str) -> bool:
    """Read the keys file at ``path`` again into ``keys`` (SIGHUP). A file that cannot be
    used leaves the keys as they were and logs why; returns whether the new ones are in
    use."""
    try:
        entries = load_keys_file(path)
    except KeysFileError as exc:
        log.error("keys file not reloaded, the previous keys stay in use: %s", exc)
        return False
    keys.replace_file_entries(entries)
    log.warning("keys file %s reloaded: %d keys", path, len(entries))
    return True


MISSING_KEY_MESSAGE = "invalid or missing API key"


@dataclass(frozen=True)
class Denied:
    """Why a request may not go on: an HTTP status, an error type and a message."""

    status: int
    type: str
    message: str


class AccessPolicy:
    """Who may call which HTTP route.

    Invariants: inference routes (``protected``) need an inference key when keys are
    configured; admin routes (``admin``: metrics, engine views, debug) need an admin key
    when admin keys are configured (an inference key is not enough), and without any they
    are served only on a loopback listener (there guarded like inference routes); the
    inference routes under ``admin_too`` (what the server stores for tenants) take an
    admin key as well, which sees every tenant's (``is_admin``); other users' prompts
    (``may_read_prompts``) are visible with an admin key, or on a single-user server
    (loopback, no keys at all).
    """

    def __init__(
        self,
        keys: ApiKeys,
        admin_keys: ApiKeys,
        loopback_only: bool,
        protected: tuple[tuple[str, ...], frozenset[str]],
        admin: tuple[tuple[str, ...], frozenset[str]],
        admin_too: tuple[str, ...] = (),
    ) -> None:
        self.keys, self.admin_keys, self.loopback_only = keys, admin_keys, loopback_only
        self.protected, self.admin, self.admin_too = protected, admin, admin_too

    def is_admin(self, headers: Mapping[str, str]) -> bool:
        """Whether the request carries an admin key (False when none is configured)."""
        return bool(self.admin_keys) and self.admin_keys.allows(
            headers.get("authorization"), headers.get("x-api-key")
        )

    @staticmethod
    def _matches(path: str, rule: tuple[tuple[str, ...], frozenset[str]]) -> bool:
        prefixes, paths = rule
        return path.startswith(prefixes) or path in paths

    def may_read_prompts(self, headers: Mapping[str, str]) -> bool:
        if not self.admin_keys:
            return self.loopback_only and not self.keys
        return self.is_admin(headers)

    def check(self, path: str, headers: Mapping[str, str]) -> Denied | None:
        """None if the request may go on, else why not."""
        if self._matches(path, self.admin):
            if self.admin_keys:
                if self.may_read_prompts(headers):
                    return None
                return Denied(401, "authentication_error", "this route needs the admin API key")
            if not self.loopback_only:
                return Denied(
                    403,
                    "permission_error",
                    "admin routes are off on a server reachable beyond loopback: start it "
                    "with --admin-api-key",
                )
        if not self._matches(path, self.protected):
            return None
        if self.keys.allows(headers.get("authorization"), headers.get("x-api-key")):
            return None
        if path.startswith(self.admin_too) and self.is_admin(headers):
            return None
        return Denied(401, "authentication_error", MISSING_KEY_MESSAGE)
