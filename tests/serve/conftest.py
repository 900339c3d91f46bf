"""Servers shared by the serve tests: a small fp32 checkpoint with the twin's tokenizer and chat template, served at
world 1 and world 2 (gloo) by the real command line. Each is started once per session and stopped at its end."""

import pytest

from k3dist.twin.checkpoint import write_checkpoint
from tests.support.configs import small_config
from tests.support.server import Server

SLOTS, CAP = 4, 256


@pytest.fixture(scope="session")
def serve_dir(tmp_path_factory):
    return write_checkpoint(small_config(), tmp_path_factory.mktemp("serveckpt") / "m", seed=9, dtype="float32")


def _server(tmp, serve_dir, *extra):
    args = (f"model.path={serve_dir}", f"generate.batch={SLOTS}", f"cache.cap={CAP}", "generate.prefill_chunk=16")
    server = Server(tmp, *args, *extra)
    server.model_dir = serve_dir
    return server


@pytest.fixture(scope="session")
def server1(serve_dir, tmp_path_factory):
    server = _server(tmp_path_factory.mktemp("w1"), serve_dir, "decode.sync_every=4")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def server2(serve_dir, tmp_path_factory):
    server = _server(tmp_path_factory.mktemp("w2"), serve_dir, "dist.nproc=2", "dist.check_tokens=true")
    yield server
    server.stop()


@pytest.fixture(params=[1, 2], ids=["world1", "world2"])
def server(request):
    return request.getfixturevalue(f"server{request.param}")
