"""Counting host synchronisation without a GPU: the Python reads of tensor values (item, tolist, bool(), .cpu(), ...)
and the aten ops whose result needs the values on the host (a scalar read, a data-dependent shape). On CUDA each of
them is a device sync; counted on the CPU, they show where a code path would sync before a GPU runs it."""

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = {"item", "tolist", "__bool__", "cpu", "numpy", "__int__", "__float__", "__index__"}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "unique", "_unique2", "unique_dim", "_to_copy_cpu"}


class HostReads(TorchFunctionMode):
    """Counts Python-level reads of tensor values on the host (Tensor.item, tolist, bool(), .cpu(), ...)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


class SyncOps(TorchDispatchMode):
    """Counts aten ops that need the values on the host (a scalar read, data-dependent shapes)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname in SYNC_OPS:
            self.seen.append(func._opname)
        return func(*args, **(kwargs or {}))
