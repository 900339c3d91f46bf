"""The C++ CPU ops build wherever a compiler and ninja are: a compile error on some CPU's flags must fail here, not
turn every CPU-op test into a skip and the runtime into the torch references without a word."""

import pytest

from k3dist.kernels import cpu_ops


@pytest.mark.skipif(not cpu_ops.buildable(), reason="no C++ compiler or ninja on PATH")
def test_the_ops_build_for_this_cpu():
    assert cpu_ops.build_error() is None, f"the CPU ops failed to build for this CPU's flags: {cpu_ops.build_error()}"
