"""The Responses API's stored responses (`store`, `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`), in
rank 0's memory: at most `serve.store_responses` of them and `serve.store_bytes` in all, the oldest evicted first to
make room for a new one. The byte bound is what the memory plan counts for them (rank 0's runtime `stored` term), so
a server's lifetime of stored responses is planned before the load.

An entry is one response and the conversation that led to it (chat messages, without the request's instructions:
a response continued with `previous_response_id` does not inherit them, as OpenAI's), kept as its JSON bytes, so its
size is what it holds: the bytes and ENTRY_BYTES for the key and the bookkeeping. Each entry holds its whole
conversation rather than a link to the one before, so evicting an old response never breaks a newer one that
continued it (a conversation is bounded by `cache.cap` tokens anyway). A response larger than `serve.store_bytes`
is not stored."""

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger("k3dist")
ENTRY_BYTES = 512  # an entry's room beside its JSON: the bytes object, its key string, the ordered dict's node


@dataclass(frozen=True)
class Stored:
    response: dict  # the Response object as it was answered
    messages: list[dict]  # the conversation that led to it and its output, as chat messages


class ResponseStore:
    def __init__(self, entries: int, max_bytes: int):
        self.entries, self.max_bytes = entries, max_bytes
        self._kept: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.held = 0  # bytes counted: each entry's JSON and ENTRY_BYTES
        self.evicted = 0

    @property
    def on(self) -> bool:
        return self.entries > 0 and self.max_bytes > 0

    def put(self, response_id: str, stored: Stored) -> bool:
        """Keep a response (replacing one of the same id), evicting the oldest until it fits; False when it is larger
        than the whole store (then it is not kept)."""
        blob = json.dumps({"response": stored.response, "messages": stored.messages}, ensure_ascii=False).encode()
        size = len(blob) + ENTRY_BYTES
        with self._lock:
            self._drop(response_id)
            if not self.on:
                return False
            if size > self.max_bytes:
                log.warning(
                    "k3_response_not_stored id=%s bytes=%d (serve.store_bytes=%d)", response_id, size, self.max_bytes
                )
                return False
            while self._kept and (len(self._kept) >= self.entries or self.held + size > self.max_bytes):
                oldest = next(iter(self._kept))
                self._drop(oldest)
                self.evicted += 1
            self._kept[response_id] = blob
            self.held += size
        return True

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            blob = self._kept.get(response_id)
        if blob is None:
            return None
        raw = json.loads(blob)
        return Stored(raw["response"], raw["messages"])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def __len__(self) -> int:
        return len(self._kept)

    def _drop(self, response_id: str) -> bool:
        blob = self._kept.pop(response_id, None)
        if blob is not None:
            self.held -= len(blob) + ENTRY_BYTES
        return blob is not None
