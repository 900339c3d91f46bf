"""Rank 0's memory of recent prompts (engine/branches.py) and where the prefix index snapshots a prompt: the longest
prefix shared with any remembered sequence, within a byte budget, and a branch point only where it is worth one."""

import random

from k3dist.engine.branches import ENTRY_OVERHEAD, BranchMemory, common_prefix
from k3dist.engine.prefix import MIN_BRANCH_GAP, PrefixIndex


def brute(remembered, ids) -> int:
    return max((common_prefix(ids, r) for r in remembered), default=0)


def test_the_shared_prefix_is_the_longest_with_any_remembered_sequence():
    rng = random.Random(5)
    memory, remembered = BranchMemory(10**9), []
    for _ in range(300):
        base = rng.choice(remembered) if remembered and rng.random() < 0.7 else []
        ids = tuple(base[: rng.randrange(len(base) + 1)]) + tuple(rng.randrange(3) * 70000 for _ in range(5))
        query = tuple(base[: rng.randrange(len(base) + 1)]) + (rng.randrange(3) * 70000,)
        assert memory.shared(query) == brute(remembered, query)
        memory.remember(ids)
        remembered.append(ids)
    assert memory.shared(()) == 0 and common_prefix((1, 2, 3), (1, 2)) == 2 and common_prefix((), (5,)) == 0


def test_the_memory_keeps_within_its_bytes_and_forgets_the_oldest():
    memory = BranchMemory(3 * (40 + ENTRY_OVERHEAD))  # three 10-token sequences
    for k in range(5):
        memory.remember(tuple(range(k * 100, k * 100 + 10)))
    assert len(memory) == 3 and memory.held <= memory.budget
    assert memory.shared(tuple(range(0, 10))) == 0 and memory.shared(tuple(range(400, 410))) == 10
    memory.remember(tuple(range(400, 405)))  # a prefix of a remembered sequence adds nothing
    assert len(memory) == 3
    memory.remember(tuple(range(400, 420)))  # an extension replaces what it extends; it is longer: the oldest goes
    assert len(memory) == 2 and memory.shared(tuple(range(400, 420))) == 20 and memory.held <= memory.budget
    assert memory.shared(tuple(range(200, 210))) == 0 and memory.shared(tuple(range(300, 310))) == 10
    memory.remember(tuple(range(10**4)))  # past the whole budget: not kept, nothing forgotten
    assert len(memory) == 2


def test_a_branch_point_is_snapshotted_only_where_it_saves_enough():
    idx = PrefixIndex(10**9, 0, 64, lambda n: n)
    assert idx.boundaries(100, 0) == [64, 100]
    assert idx.boundaries(100, 0, 50) == [50, 64, 100]  # inside a chunk, before the grid
    assert idx.boundaries(100, 0, 64 + MIN_BRANCH_GAP - 1) == [64, 100]  # too close past the grid point
    assert idx.boundaries(130, 64, 64 + MIN_BRANCH_GAP) == [64 + MIN_BRANCH_GAP, 128, 130]
    assert idx.boundaries(100, 40, 50) == [64, 100]  # too close past the snapshot it starts from
    assert idx.boundaries(50, 0, 50) == [50]  # the whole prompt: its end snapshot is the branch point's
    assert idx.boundaries(50, 0, 0) == [50]
    idx.remember((1, 2, 3, 4))
    assert idx.branch_point((1, 2, 3, 9)) == 3 and idx.branch_point((1, 2, 9), [(1, 2, 9, 9)]) == 3
