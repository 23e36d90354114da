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
    """Responses by id, least recently stored or read first out.

    Invariants: at most ``max_responses`` entries; ``get`` and ``delete`` of an id never
    stored, deleted or evicted, or stored by another tenant than ``reader`` (unless the
    reader is ``ANY_TENANT``), answer alike (None, False) and change nothing: a tenant
    cannot tell another's id from one that never existed."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be >= 1, got {max_responses}")
        self.max_responses = max_responses
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)

    def _visible(self, response_id: str, reader: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is None or (reader != ANY_TENANT and item.owner != reader):
            return None
        return item

    def get(self, response_id: str, reader: str) -> StoredResponse | None:
        """The response ``reader`` (a tenant's name, or ``ANY_TENANT``) may see, else None."""
        item = self._visible(response_id, reader)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str, reader: str) -> bool:
        """Delete a response ``reader`` may see; False (nothing deleted) otherwise."""
        if self._visible(response_id, reader) is None:
            return False
        del self._items[response_id]
        return True

    def __len__(self) -> int:
        return len(self._items)
