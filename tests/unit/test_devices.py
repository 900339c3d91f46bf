"""Device choice per rank (torch.cuda's device count replaced): one rank per GPU."""

import pytest
import torch

from k3dist.base import dist


@pytest.mark.parametrize(
    "local_rank, visible, index",
    [
        (0, 1, 0),  # one GPU per process (CUDA_VISIBLE_DEVICES per rank): always cuda:0
        (5, 1, 0),
        (0, 8, 0),  # all GPUs visible: cuda:LOCAL_RANK
        (5, 8, 5),
        (7, 8, 7),
        (1, 2, 1),
        (2, 2, None),  # LOCAL_RANK without a GPU
        (7, 4, None),
    ],
)
def test_device_choice(monkeypatch, local_rank, visible, index):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(visible))))
    device, refusal = dist.pick_device("cuda", 3, local_rank)
    if index is None:
        assert refusal == (
            f"rank 3: LOCAL_RANK={local_rank} has no GPU: this process sees {visible} (cuda:0..{visible - 1}, "
            f"CUDA_VISIBLE_DEVICES={','.join(map(str, range(visible)))}); start at most one rank per GPU on each "
            "machine"
        )
    else:
        assert refusal is None and device == torch.device("cuda", index)


def test_cpu_is_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert dist.pick_device("cpu", 0, 5) == (torch.device("cpu"), None)
