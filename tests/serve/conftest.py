"""Servers shared by the serve tests: a small fp32 checkpoint with the twin's tokenizer and chat template, served at
world 1 and world 2 (gloo) by the real command line; a small Kimi K3 model in K3's chat format (`server_k3`); and
the 0.4B K3 twin, MXFP4 experts packed, at world 2 (`server_k3_twin`). Each is started once per session and stopped
at its end."""

import pytest

from k3dist.twin.checkpoint import write_checkpoint
from k3dist.twin.tokenizer import KIMI_K3
from tests.support.configs import small_config, small_k3
from tests.support.server import Server

SLOTS, CAP = 4, 256


@pytest.fixture(scope="session")
def serve_dir(tmp_path_factory):
    return write_checkpoint(small_config(), tmp_path_factory.mktemp("serveckpt") / "m", seed=9, dtype="float32")


def _server(tmp, serve_dir, *extra, cap: int = CAP):
    args = (f"model.path={serve_dir}", f"generate.batch={SLOTS}", f"cache.cap={cap}", "generate.prefill_chunk=16")
    server = Server(tmp, *args, *extra)
    server.model_dir, server.chat_format = serve_dir, "kimi_k2"
    server.chat_extra, server.responses_extra = {}, {}  # what requests add in this server's format
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


@pytest.fixture(scope="session")
def serve_dir_k3(tmp_path_factory):
    """A small Kimi K3 model (every K3 part, MXFP4 experts) with the K3 twin's tokenizer and chat template
    (twin/tokenizer.py's kimi_k3, chosen by its variant)."""
    out = tmp_path_factory.mktemp("serveckpt3") / "m"
    return write_checkpoint(small_k3(moe_intermediate_size=64), out, seed=9, dtype="float32")


@pytest.fixture(scope="session")
def server_k3(serve_dir_k3, tmp_path_factory):
    """World 1 in K3's format, with room for its longer prompts (its tags spelled in the 512-token vocabulary's
    bytes, an agent's tools declared). Its requests turn thinking off (`chat_extra`, `responses_extra`): random
    weights never close a think tag, and a grammar starts after it."""
    server = _server(tmp_path_factory.mktemp("k3"), serve_dir_k3, "decode.sync_every=4", cap=8 * CAP)
    server.chat_format = KIMI_K3
    server.chat_extra = {"chat_template_kwargs": {"thinking": False}}
    server.responses_extra = {"reasoning": {"effort": "none"}}
    yield server
    server.stop()


@pytest.fixture(scope="session")
def server_k3_twin(k3_cache, tmp_path_factory):
    """The 0.4B K3 twin as its config packages it (bf16, MXFP4 experts kept packed) at world 2, with room for the
    agent frameworks' prompts; thinking off as in `server_k3`."""
    from k3dist.twin.checkpoint import ensure_twin
    from tests.support.configs import CONFIGS

    model = ensure_twin(CONFIGS / "Kimi-K3-twin-0.4B-config.json", root=k3_cache)
    twin = ("dist.nproc=2", "dist.check_tokens=true", "generate.prefill_chunk=64")
    server = _server(tmp_path_factory.mktemp("k3twin"), model, *twin, cap=4 * CAP)
    server.chat_format = KIMI_K3
    server.chat_extra = {"chat_template_kwargs": {"thinking": False}}
    yield server
    server.stop()
