"""KV-cache events in vLLM's schema (`--kv-events-config`): rank 0 publishes, over a ZMQ PUB socket, which prefixes
a request can resume from, for a router that routes on them (docs/serving.md: KV events).

The wire is vLLM's: multipart `[topic, sequence (8 bytes, big-endian, from 0, one per batch), payload]`, the payload
one msgpack `EventBatch` `[ts, events, data_parallel_rank]` whose events are maps tagged by `type`: `BlockStored`
(`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`), `BlockRemoved`
(`block_hashes`, `medium`), `AllBlocksCleared` (first, and whenever a subscriber joins: `KVEvents`). The endpoint is
bound when it holds `*` or `::` or is `ipc://` or `inproc://`, else connected to (a consumer that binds), as vLLM
decides.

What a block means here. vLLM's blocks are fixed-size runs of tokens chained from position 0, each boundary a point
where a request sharing the tokens before it resumes. k3dist resumes only where a prefix snapshot is (MLA rows and
KDA state both saved, engine/prefix.py), and snapshots fall at prompt ends, branch points and every `prefix.every`
tokens. So the block size is `prefix.every`, and a block [kB - B, kB) is published only while snapshots of that
prompt's prefix exist at B, 2B, ..., kB: every boundary a consumer may credit is a snapshot k3dist restores. A
snapshot off the grid (a prompt's end, a branch point, a finished chat turn) is never published: a consumer sees
a lower bound of what k3dist can resume, never more. A grid snapshot whose chain has a gap is published once the gap
is filled; one dropped from the pool (not one moved to host memory: that one is still restored) is removed with
every block published after it. A block's hash is the digest the index keys its snapshot by (64 bits of blake2b
over the prefix's ids), so it names the whole prefix, as vLLM's chained hashes do; `token_ids` are the block's own.
"""

import time

import msgspec
import zmq

from ..base.errors import K3Error
from ..engine.prefix import PrefixIndex

HWM = 100_000  # vLLM's default: batches a slow subscriber may fall behind before the socket drops them


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport is bound; any other endpoint is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEvents:
    """The publisher: its socket is bound (or connected) before the load (server.listen), so a taken endpoint is
    refused up front; `attach` gives it the prefix index once the engine exists; `flush`, after every window and
    idle heartbeat, publishes what the index journaled.

    PUB/SUB keeps no state for a subscriber that joins late, so the socket is an XPUB, which hears every
    subscription: the sequence starts at 0 when the first subscriber is there (nothing is sent into the void
    before), and whenever a subscriber joins, the batch is `AllBlocksCleared` and every block published so far, so
    each consumer holds what one connected from the start holds (a late one also sees its first sequence number
    past 0: no replay endpoint is served)."""

    def __init__(self, endpoint: str, topic: str = ""):
        self.endpoint, self.topic = endpoint, topic.encode()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only a topic's first
        self.socket.setsockopt(zmq.SNDHWM, HWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            (self.socket.bind if binds(endpoint) else self.socket.connect)(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            how = "bind" if binds(endpoint) else "connect"
            raise K3Error(f"serve.kv_events={endpoint}: cannot {how} ({exc})") from None
        self.encoder = msgspec.msgpack.Encoder()
        self.seq = 0
        self.index: PrefixIndex | None = None
        self.block = 0
        # (length, digest) -> (the prefix's ids, its parent block's digest or None)
        self.published: dict[tuple[int, int], tuple[tuple[int, ...], int | None]] = {}

    @property
    def bound(self) -> str:
        """The endpoint as bound (a wildcard port resolved: tcp://127.0.0.1:* binds a free one), or as connected."""
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT) if binds(self.endpoint) else self.endpoint

    def attach(self, index: PrefixIndex, block: int) -> None:
        """Journal `index`'s snapshots from now on; blocks are `block` tokens (prefix.every)."""
        self.index, self.block = index, block
        index.journal = []

    def flush(self) -> int:
        """Publish, as one batch, what changed since the last flush (the whole state when a subscriber joined);
        returns the events sent."""
        if self.index is None:
            return 0
        joined = self._joined()
        journal, self.index.journal = self.index.journal, []
        events = []
        for what, entry in journal:
            if len(entry.ids) % self.block:
                continue
            if what == "stored":
                events += self._stored(entry.ids, entry.digest)
            else:
                events += self._removed(entry.ids, entry.digest)
        if joined:
            events = [AllBlocksCleared(), *self._everything()]
        if events and (joined or self.seq):  # no batch before the first subscriber
            self._send(events)
        return len(events) if joined or self.seq else 0

    def _joined(self) -> bool:
        """Whether a subscriber joined since the last look (XPUB hands over b"\x01" + topic per subscription)."""
        joined = False
        while True:
            try:
                message = self.socket.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return joined
            joined |= message[:1] == b"\x01"

    def _block(self, ids: tuple[int, ...], digest: int, parent: int | None) -> BlockStored:
        return BlockStored([digest], parent, list(ids[-self.block :]), self.block, None, None, None)

    def _everything(self) -> list:
        """Every published block, each after its parent."""
        return [self._block(ids, key[1], parent) for key, (ids, parent) in sorted(self.published.items())]

    def _stored(self, ids: tuple[int, ...], digest: int) -> list:
        """The block ending at this grid snapshot when its chain is whole, then those it makes whole after it."""
        length, b = len(ids), self.block
        parent = None
        if length > b:
            parent = (length - b, PrefixIndex.digests(ids, [length - b])[length - b])
            if parent not in self.published:
                return []
        if (length, digest) in self.published:
            return []
        self.published[(length, digest)] = (ids, parent and parent[1])
        return [self._block(ids, digest, parent and parent[1]), *self._children(ids)]

    def _children(self, ids: tuple[int, ...]) -> list:
        """Grid snapshots one block past `ids` that were waiting for it (their chain had this gap)."""
        out, length = [], len(ids) + self.block
        for tier in self.index.tiers.values():
            for entry in list(tier.values()):
                if entry.ready and len(entry.ids) == length and entry.ids[: len(ids)] == ids:
                    out += self._stored(entry.ids, entry.digest)
        return out

    def _removed(self, ids: tuple[int, ...], digest: int) -> list:
        """A dropped grid snapshot's block and every published block after it (their chains lost this boundary)."""
        if (len(ids), digest) not in self.published:
            return []
        gone = [key for key, (held, _) in self.published.items() if key[0] >= len(ids) and held[: len(ids)] == ids]
        for key in gone:
            del self.published[key]
        return [BlockRemoved([key[1] for key in sorted(gone)], None)]

    def _send(self, events: list) -> None:
        payload = self.encoder.encode(EventBatch(time.time(), events, 0))
        self.socket.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.seq += 1

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
