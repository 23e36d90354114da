"""The Responses API's store: responses kept in memory for ``GET``/``DELETE
/v1/responses/{id}`` and ``previous_response_id``, bounded by count."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024


@dataclass
class StoredResponse:
    """A finished response and the conversation it ended (chat-template messages: its
    input, then its output), which a follow-up with ``previous_response_id`` continues."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """Responses by id, least recently stored or read first out. Invariants: at most
    ``max_responses`` entries; ``get`` of an id never stored, deleted or evicted is None."""

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

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
