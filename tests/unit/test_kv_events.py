"""serve/kv_events.py over a real PrefixIndex and a real ZMQ socket pair: a grid snapshot is published only when its
chain from position 0 is whole (and then the ones it completes), a snapshot off the grid never, a drop removes the
block with every block published after it, a move to host memory removes nothing."""

import time

import msgspec
import pytest
import zmq

from k3dist.base.errors import K3Error
from k3dist.engine.prefix import Moves, PrefixIndex
from k3dist.serve.kv_events import KVEvents, binds

B = 4
IDS = tuple(range(100, 120))


@pytest.fixture
def wire(tmp_path):
    """(index, publisher, read): `read()` gives the events published since the last call."""
    index = PrefixIndex(device_bytes=1000, host_bytes=0, every=B, nbytes=lambda n: 100)
    events = KVEvents(f"ipc://{tmp_path}/kv")
    context = zmq.Context()
    events.attach(index, B)
    sub = _subscriber(context, events)

    def read() -> list[dict]:
        return _read(sub)

    yield index, events, read
    sub.close(linger=0)
    context.term()
    events.close()


def _subscriber(context, events: KVEvents):
    sub = context.socket(zmq.SUB)
    sub.connect(events.bound)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)  # the subscription reaches the publisher
    return sub


def _read(sub) -> list[dict]:
    out = []
    while sub.poll(300):
        _, _, payload = sub.recv_multipart()
        out += msgspec.msgpack.decode(payload)[1]
    return out


def _made(index: PrefixIndex, length: int, moves: Moves | None = None) -> int:
    snap = index.plan(IDS[:length], moves or Moves(), set())
    index.made(snap)
    return snap


def test_a_block_waits_for_its_chain_and_a_drop_removes_what_follows(wire):
    index, events, read = wire
    events.flush()  # the subscriber is there: the sequence starts
    assert [e["type"] for e in read()] == ["AllBlocksCleared"] and events.seq == 1
    _made(index, 8)  # a grid snapshot whose boundary at 4 has none yet: not a resume point a router may credit
    _made(index, 6)  # off the grid: never published
    events.flush()
    assert read() == []
    _made(index, 4)  # the gap is filled: 4, then 8 after it
    events.flush()
    stored = read()
    assert [(e["type"], e["token_ids"]) for e in stored] == [
        ("BlockStored", list(IDS[:4])),
        ("BlockStored", list(IDS[4:8])),
    ]
    h4, h8 = (e["block_hashes"][0] for e in stored)
    assert stored[0]["parent_block_hash"] is None and stored[1]["parent_block_hash"] == h4
    assert h4 == PrefixIndex.digests(IDS, [4])[4] and h8 == PrefixIndex.digests(IDS, [8])[8]

    _made(index, 12)
    events.flush()
    assert [e["parent_block_hash"] for e in read()] == [h8]
    moves = Moves()
    for n in range(7):  # other prompts' snapshots fill the pool (10 of 100 bytes): the oldest, at 8, is dropped
        index.made(index.plan((7, n), moves, set()))
    assert len(moves.drop) == 1
    events.flush()
    removed = read()
    assert [e["type"] for e in removed] == ["BlockRemoved"] and removed[0]["block_hashes"][0] == h8
    assert len(removed[0]["block_hashes"]) == 2  # 8 and 12 after it; 4 stays


def test_nothing_is_sent_before_a_subscriber_and_one_that_joins_gets_every_block(wire):
    index, events, read = wire
    _made(index, 4)
    _made(index, 8)
    assert events.flush() == 3 and events.seq == 1  # the first subscriber joined: cleared, then the state
    assert [(e["type"], len(e.get("token_ids", ()))) for e in read()] == [("AllBlocksCleared", 0)] + [
        ("BlockStored", B)
    ] * 2
    late = zmq.Context()
    sub = _subscriber(late, events)
    events.flush()  # every subscriber gets it: the state again, each block after its parent
    for got in (read(), _read(sub)):
        assert [e["type"] for e in got] == ["AllBlocksCleared", "BlockStored", "BlockStored"]
        assert got[2]["parent_block_hash"] == got[1]["block_hashes"][0]
    sub.close(linger=0)
    late.term()
    lonely = KVEvents("tcp://127.0.0.1:*")
    lonely.attach(PrefixIndex(1000, 0, B, lambda n: 100), B)
    _made(lonely.index, 4)
    assert lonely.flush() == 0 and lonely.seq == 0  # no subscriber: nothing sent, the sequence waits
    lonely.close()


def test_a_snapshot_moved_to_host_memory_stays_published(tmp_path):
    index = PrefixIndex(device_bytes=200, host_bytes=1000, every=B, nbytes=lambda n: 100)
    events = KVEvents(f"ipc://{tmp_path}/kv")
    events.attach(index, B)
    _made(index, 4)
    events.flush()
    moves = Moves()
    for n in range(3):
        index.made(index.plan((7, n), moves, set()))
    assert moves.demote and not moves.drop
    assert events.flush() == 0 and len(events.published) == 1
    events.close()


def test_the_endpoint_is_bound_or_connected_as_vllm_decides_and_a_taken_one_is_refused():
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and binds("tcp://[::]:5557")
    assert not binds("tcp://127.0.0.1:5557")
    first = KVEvents("tcp://127.0.0.1:*")
    port = first.bound.rsplit(":", 1)[1]
    with pytest.raises(K3Error, match=rf"^serve.kv_events=tcp://\*:{port}: cannot bind \(Address already in use"):
        KVEvents(f"tcp://*:{port}").close()
    first.close()
