"""The Responses API's store: responses kept in memory for ``GET``/``DELETE
/v1/responses/{id}`` and ``previous_response_id``, bounded by count, each owned by the
tenant that created it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024

# The reader that sees every tenant's responses (the admin key). Tenant names are
# 1-64 of ``A-Z a-z 0-9 _ . -`` (``NAME/SUB`` for sub-tenants), so no tenant is called this.
ANY_TENANT = "\x00admin"


@dataclass
class StoredResponse:
    """A finished response and the conversation it ended (chat-template messages: its
    input, then its output), which a follow-up with ``previous_response_id`` continues;
    ``owner`` is the name of the tenant whose request created it."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    owner: str


class ResponseStore:
    """Responses by id, at most ``max_responses`` in all; over that, the least recently
    stored or read response of the tenant holding the most goes first.

    Invariants: ``get`` and ``delete`` of an id never stored, deleted or evicted, or stored
    by another tenant than ``reader`` (unless the reader is ``ANY_TENANT``), answer alike
    (None, False) and change nothing: a tenant cannot tell another's id from one that never
    existed. A response is evicted only while its tenant holds at least as many as any
    other, so one tenant storing many pushes out its own, not everyone's."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be >= 1, got {max_responses}")
        self.max_responses = max_responses
        self._owner_of: dict[str, str] = {}
        self._by_owner: dict[str, OrderedDict[str, StoredResponse]] = {}

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._remove(response_id)
        self._owner_of[response_id] = item.owner
        self._by_owner.setdefault(item.owner, OrderedDict())[response_id] = item
        while len(self._owner_of) > self.max_responses:
            biggest = max(self._by_owner.values(), key=len)  # (O(tenants) per eviction)
            self._remove(next(iter(biggest)))

    def _remove(self, response_id: str) -> None:
        owner = self._owner_of.pop(response_id, None)
        if owner is None:
            return
        items = self._by_owner[owner]
        del items[response_id]
        if not items:
            del self._by_owner[owner]

    def _visible(self, response_id: str, reader: str) -> StoredResponse | None:
        owner = self._owner_of.get(response_id)
        if owner is None or (reader != ANY_TENANT and owner != reader):
            return None
        return self._by_owner[owner][response_id]

    def get(self, response_id: str, reader: str) -> StoredResponse | None:
        """The response ``reader`` (a tenant's name, or ``ANY_TENANT``) may see, else None."""
        item = self._visible(response_id, reader)
        if item is not None:
            self._by_owner[item.owner].move_to_end(response_id)
        return item

    def delete(self, response_id: str, reader: str) -> bool:
        """Delete a response ``reader`` may see; False (nothing deleted) otherwise."""
        if self._visible(response_id, reader) is None:
            return False
        self._remove(response_id)
        return True

    def __len__(self) -> int:
        return len(self._owner_of)
