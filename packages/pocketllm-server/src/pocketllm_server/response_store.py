"""The Responses API's stored responses: what ``previous_response_id`` continues and ``GET /v1/responses/{id}``
returns, in memory, least recently used first out, bounded by count and by bytes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from pocketllm_server.protocol import ChatMessage
from pocketllm_server.responses_protocol import ResponseObject

DEFAULT_MAX_STORED_RESPONSES = 1000
DEFAULT_MAX_STORED_RESPONSE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: ResponseObject
    # The conversation through this response's output, its instructions left out: a response that continues it
    # gives its own (as OpenAI's: "instructions from a previous response will not be carried over").
    conversation: list[ChatMessage]
    size: int  # bytes, as JSON: what the byte bound counts


class ResponseStore:
    def __init__(self, max_count: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES) -> None:
        if max_count < 0 or max_bytes < 0:
            raise ValueError(f"the response store's bounds must not be negative, got {max_count} and {max_bytes}")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, conversation: list[ChatMessage]) -> bool:
        """Keep ``response``, dropping the least recently used ones until it fits. One larger than the whole byte
        bound is not kept (False): a later ``previous_response_id`` naming it is a 404, as for an evicted one."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
        if self.max_count == 0 or size > self.max_bytes:
            return False
        self.delete(response.id)
        while self._entries and (len(self._entries) >= self.max_count or self.bytes + size > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        self._entries[response.id] = StoredResponse(response, conversation, size)
        self.bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
