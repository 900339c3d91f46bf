"""Two world-1 replicas behind the SGLang Model Gateway (`smg`, started from its wheel on 127.0.0.1, round robin,
retries off so that only its health checks route around a dead replica): it registers them as SGLang-protocol
workers with no fallback warning and reads their loads; greedy requests through it come back as a replica answers
them alone; a replica killed with its whole group fails its stream in flight, is marked down by the gateway's health
check, every later request succeeds on the other, no process of its group is left, and restarted on its port it
joins again."""

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.gateway import QUICK, Gateway
from tests.support.server import Server

NAME = "k3-replica"  # not "Kimi...": smg gives such names its Kimi sampling profile (docs/serving.md)
ARGS = ("generate.batch=4", "cache.cap=256", "generate.prefill_chunk=16", f"serve.model_name={NAME}")
MARKED_S = 1 + 1 + 8  # from a kill to its mark-down: health interval + its timeout (QUICK), room for a loaded CPU
ASKS = [
    ("chat", {"messages": [{"role": "user", "content": "Say something about lighthouses."}], "max_tokens": 12}),
    ("completions", {"prompt": "The pier at the end of the", "max_tokens": 12}),
]


def _start(serve_dir, tmp, index: int, port: int = 0) -> Server:
    return Server(tmp / f"replica{index}-{time.monotonic_ns()}", f"model.path={serve_dir}", *ARGS, port=port)


@pytest.fixture(scope="module")
def replicas(serve_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda i: _start(serve_dir, tmp, i), range(2)))
    yield servers  # the failover test replaces the one it kills
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def gateway(replicas, tmp_path_factory):
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    extra = QUICK + ("--disable-retries", "--load-monitor-interval", "1")
    gw = Gateway([r.base for r in replicas], log, extra=extra)
    gw.ready()
    yield gw
    gw.stop()


def _ask(base: str, route: str, body: dict, stream: bool = False) -> str:
    """Greedy text of `body` at `base` (a replica or the gateway), whole or streamed."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    api = client.chat.completions if route == "chat" else client.completions
    out = api.create(model=NAME, temperature=0, stream=stream, **body)
    if not stream:
        return out.choices[0].message.content if route == "chat" else out.choices[0].text
    pieces = (c.choices[0].delta.content if route == "chat" else c.choices[0].text for c in out if c.choices)
    return "".join(p or "" for p in pieces)


def _long_stream(base: str):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    body = {"prompt": [5, 6, 7], "max_tokens": 100, "extra_body": {"ignore_eos": True}}
    return iter(client.completions.create(model=NAME, temperature=0, stream=True, **body))


def _drain(stream) -> str:
    """How a stream ended: its last finish reason, or "error" when it broke off."""
    finish = None
    try:
        for chunk in stream:
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    except openai.APIError:
        return "error"
    return finish


def _served(server: Server) -> float:
    return server.metrics()["k3dist_e2e_request_latency_seconds_count"]


def test_the_gateway_knows_the_replicas_and_forwards_their_greedy_text(replicas, gateway, serve_dir):
    direct = {route: _ask(replicas[0].base, route, body) for route, body in ASKS}
    before = [_served(r) for r in replicas]
    for route, body in ASKS:
        for stream in (False, False, True, True):  # round robin: each replica answers each form
            assert _ask(gateway.base, route, body, stream) == direct[route], (route, stream)
    assert [_served(r) - b for r, b in zip(replicas, before, strict=True)] == [4, 4]

    gateway.wait_loads(timeout=15)  # polled every second (--load-monitor-interval 1)
    for worker in gateway.status().values():
        assert worker["runtime_type"] == "sglang" and worker["is_healthy"], worker
        labels = worker["labels"]
        assert (labels["served_model_name"], labels["tp_size"], labels["dp_size"]) == (NAME, "1", "1"), labels
        assert (labels["context_length"], labels["max_running_requests"], labels["max_total_tokens"]) == (
            "256",
            "4",
            "1024",
        )
        assert labels["version"].startswith("k3dist ") and labels["is_generation"] == "true", labels
        assert labels["model_path"] == str(serve_dir), labels
        (load,) = worker["engine_load"]["loads"]
        assert (load["max_total_num_tokens"], load["max_running_requests"]) == (1024, 4), load
    assert gateway.warnings() == [], "\n".join(gateway.warnings())  # no fallback, no unknown engine


def test_the_worker_info_routes_answer_as_sglang_names_them(replicas):
    base = replicas[0].base
    info = httpx.get(f"{base}/server_info").json()
    assert info == httpx.get(f"{base}/get_server_info").json()
    assert (info["served_model_name"], info["context_length"], info["max_running_requests"]) == (NAME, 256, 4)
    assert (info["tp_size"], info["dp_size"], info["max_total_tokens"]) == (1, 1, 1024), info
    model = httpx.get(f"{base}/model_info").json()
    assert model == httpx.get(f"{base}/get_model_info").json()
    assert model["is_generation"] and model["model_type"] == "kimi_linear" and model["architectures"], model
    assert httpx.get(f"{base}/version").status_code == 404  # a 2xx there means vLLM to the gateway
    other = httpx.get(f"{base}/loads", params={"model": "other"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model", other.text


def test_the_loads_are_the_servers_own(replicas):
    """Five streams on four slots: four running, one waiting, their tokens held, as /metrics counts them too."""
    server, prompt = replicas[0], [5, 6, 7, 8, 9, 10, 11, 12]
    client = server.client()
    streams = [
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in range(5)
    ]
    try:
        for s in streams[:4]:
            next(s)
        deadline = time.monotonic() + 15
        while (load := httpx.get(f"{server.base}/v1/loads").json()["loads"][0])["num_waiting_reqs"] != 1:
            assert time.monotonic() < deadline, load
            time.sleep(0.05)
        assert (load["num_running_reqs"], load["num_total_reqs"], load["max_total_num_tokens"]) == (4, 5, 1024), load
        assert 4 * len(prompt) < load["num_used_tokens"] <= 4 * 208, load  # prompts and what they generated so far
        assert load["token_usage"] == round(load["num_used_tokens"] / 1024, 4), load
        assert load["num_waiting_uncached_tokens"] == len(prompt), load  # the waiting prompt, whole
        assert load["gen_throughput"] > 0, load  # tokens per second of its decode steps
        assert httpx.get(f"{server.base}/loads", params={"model": NAME}).json()["loads"][0]["num_running_reqs"] == 4
    finally:
        for s in streams:
            s.close()
    deadline = time.monotonic() + 15
    while httpx.get(f"{server.base}/v1/loads").json()["loads"][0]["num_running_reqs"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.metrics()["k3dist_requests_running"] == 0


def test_the_bodies_the_gateway_forwards_are_served_with_the_default(replicas):
    """smg 1.13 parses a body and writes it again with defaults of its own; for a model named "Kimi..." it also
    writes its Kimi sampling profile. Both, exactly as smg forwarded them to a recording proxy, are served with
    serve.unknown_fields at its default (refuse)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "model": NAME, "logprobs": False, "max_tokens": 2}
    kimi = {"frequency_penalty": 0.0, "n": 1, "presence_penalty": 0.0, "temperature": 1.0, "top_p": 0.95}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    completion = {"model": NAME, "prompt": "Hi", "echo": False, "max_tokens": 2, "stream": False}
    for path, body in [
        ("chat/completions", chat | {"stream": False}),
        ("chat/completions", chat | kimi | {"stream": False}),
        ("chat/completions", chat | kimi | usage),
        ("completions", completion),
    ]:
        reply = httpx.post(f"{replicas[0].url}/{path}", json=body, timeout=60)
        assert reply.status_code == 200, (body, reply.text)
        if body["stream"]:
            assert '"usage": {"prompt_tokens"' in reply.text and reply.text.endswith("data: [DONE]\n\n"), reply.text


def test_a_killed_replica_is_routed_around_and_joins_again_restarted(replicas, gateway, serve_dir, tmp_path):
    route, body = ASKS[0]
    expected = _ask(replicas[0].base, route, body)
    dead = replicas[1]
    port = int(dead.base.rsplit(":", 1)[1])
    streams = [_long_stream(gateway.base) for _ in range(2)]  # round robin: one on each replica
    for s in streams:
        next(s)
    dead.signal(signal.SIGKILL, group=True)  # the whole group, as an OOM killer or a lost node would
    rc, _, left = dead.finish(timeout=30)
    assert rc == -signal.SIGKILL and not left, (rc, left)  # no process of its group outlives it
    ends = [_drain(s) for s in streams]
    assert sorted(ends) == ["error", "length"], ends  # the stream on the killed replica fails, the other ends

    took = gateway.wait_health(dead.base, healthy=False, timeout=dead.signalled_at + MARKED_S - time.monotonic())
    before = _served(replicas[0])
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: _ask(gateway.base, route, body), range(6)))
    assert answers == [expected] * 6, (answers, took)  # retries are off: only the health check routed around it
    assert _served(replicas[0]) - before == 6

    replicas[1] = _start(serve_dir, tmp_path, 1, port=port)
    gateway.wait_health(replicas[1].base, healthy=True, timeout=MARKED_S)
    for _ in range(4):
        assert _ask(gateway.base, route, body) == expected
    assert _served(replicas[1]) > 0, gateway.status()
