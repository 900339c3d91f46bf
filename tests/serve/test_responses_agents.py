"""The OpenAI Agents SDK with its default model class (`OpenAIResponsesModel`) and nothing but the server's base URL
runs an agent with a function tool at world 1, whole and streamed, in Kimi-K2's chat format and in K3's (its
thinking off: `reasoning.effort` none; a small K3 model, and the 0.4B K3 twin in the slow tier): the tool is called
with arguments of its schema, its output goes back to the model in the next request, and the run ends with a final
output; an agent with an `output_type` gets one. Every body the SDK sends is recorded and held to the route's
declared schema. And the store's bounds, live: a server keeping 4 responses and 24 KiB of them evicts the oldest
past either bound, answers 404 naming an evicted id, and keeps nothing larger than itself.

The weights are random: the grammar holds the first turn to a call of the tool (`tool_choice="required"`), and a
logit bias on the end-of-text token against a bias on one word's token, worn down by a frequency penalty, ends the
last turn after a few of those words."""

import asyncio
import json
from typing import Literal

import httpx
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI
from openai.types.shared import Reasoning
from pydantic import BaseModel, Field

from k3dist.serve.routes import ROUTES
from tests.support.server import Server

ENTRIES, STORE_BYTES = 4, 24 * 2**10


@pytest.fixture(scope="module")
def roomy(serve_dir, tmp_path_factory):
    """Room for an agent's prompts (its tools' declarations); a small store."""
    overrides = ("generate.batch=2", "cache.cap=2048", "generate.prefill_chunk=64")
    store = (f"serve.store_responses={ENTRIES}", f"serve.store_bytes={STORE_BYTES}")
    server = Server(tmp_path_factory.mktemp("agents"), f"model.path={serve_dir}", *overrides, *store)
    yield server
    server.stop()


@function_tool
def get_weather(city: Literal["Paris", "Oslo"]) -> str:
    """Return the weather for a city."""
    return f"sunny in {city}"


class Recorder:
    """An async httpx client that keeps every JSON body it sends."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.client = httpx.AsyncClient(event_hooks={"request": [self._keep]}, timeout=300)

    async def _keep(self, request: httpx.Request) -> None:
        assert request.url.path.endswith("/v1/responses"), request.url
        self.bodies.append(json.loads(await request.aread()))


def _ending(roomy, *closers: str) -> dict:
    """Extra body fields that end a free answer after a few words on any weights: a word's token pushed up by 100,
    worn down by 2 each time it is chosen, the end-of-text token by 95, and so the first token of each of `closers`
    (what the format's grammar wants before the end)."""

    def first(text: str) -> str:
        return str(httpx.post(f"{roomy.base}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"][0])

    eos = httpx.get(f"{roomy.base}/tokenizer_info", timeout=30).json()["eos_token"]
    return {"logit_bias": {first("sunny"): 100} | {first(t): 95 for t in (eos, *closers)}, "frequency_penalty": 2.0}


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_an_agent_with_a_function_tool_runs_on_the_default_model(roomy, streamed):
    _weather_agent(roomy, streamed)


def test_an_agent_with_a_function_tool_runs_in_k3s_format(server_k3):
    _weather_agent(server_k3, streamed=True, reasoning=Reasoning(effort="none"))


@pytest.mark.slow
def test_an_agent_with_a_function_tool_runs_on_the_k3_twin(server_k3_twin):
    """The 0.4B K3 twin at world 2. Its vocabulary holds K3's tags as single tokens, and with tools declared K3's
    grammar ends an answer only after it closes the response tag: that tag's token gets the end's bias too."""
    _weather_agent(server_k3_twin, streamed=True, closers=("<|close|>",), reasoning=Reasoning(effort="none"))


def _weather_agent(roomy, streamed: bool, closers: tuple[str, ...] = (), **more) -> None:
    set_tracing_disabled(True)
    rec = Recorder()
    client = AsyncOpenAI(base_url=roomy.url, api_key="none", http_client=rec.client, max_retries=0)
    ending = _ending(roomy, *closers)
    settings = ModelSettings(
        tool_choice="required", parallel_tool_calls=False, temperature=0, extra_body=ending, **more
    )
    agent = Agent(
        name="weather",
        instructions="Answer with the tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=roomy.model, openai_client=client),
        model_settings=settings,
    )

    async def run():
        if not streamed:
            return await Runner.run(agent, "What's the weather in Paris?", max_turns=3)
        result = Runner.run_streamed(agent, "What's the weather in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert isinstance(result.final_output, str) and result.final_output, result.final_output
    assert len(rec.bodies) == 2 and all(b.get("stream", False) is streamed for b in rec.bodies)
    first, second = rec.bodies
    assert first["tool_choice"] == "required" and first["include"] == [] and first["tools"][0]["strict"] is True
    (call,) = [i for i in second["input"] if i.get("type") == "function_call"]
    (fed,) = [i for i in second["input"] if i.get("type") == "function_call_output"]
    assert call["name"] == "get_weather" and fed["call_id"] == call["call_id"]
    assert fed["output"] == f"sunny in {json.loads(call['arguments'])['city']}"  # the tool ran on the model's call
    names = set(ROUTES["/v1/responses"].model_fields)
    assert all(set(body) <= names for body in rec.bodies), [set(b) - names for b in rec.bodies]


class Trip(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


def test_an_agent_with_an_output_type_gets_it(roomy):
    """`output_type`: the SDK sends text.format json_schema, and the grammar holds the answer to it."""
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=roomy.url, api_key="none", max_retries=0, timeout=300)
    model = OpenAIResponsesModel(model=roomy.model, openai_client=client)
    agent = Agent(name="planner", output_type=Trip, model=model, model_settings=ModelSettings(temperature=0))
    trip = Runner.run_sync(agent, "Plan a trip", max_turns=1).final_output
    assert isinstance(trip, Trip) and 1 <= trip.days <= 7


@pytest.mark.slow
def test_the_sdk_through_its_provider_with_a_model_name(roomy):
    """`Agent(model="<name>")` with the SDK's provider (the Responses API by default): a plain agent answers."""
    from agents import OpenAIProvider

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=roomy.url, api_key="none", max_retries=0, timeout=300)
    settings = ModelSettings(temperature=0, extra_body=_ending(roomy))
    agent = Agent(name="plain", model=roomy.model, model_settings=settings)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))
    result = Runner.run_sync(agent, "Hi", run_config=config, max_turns=1)
    assert isinstance(result.final_output, str) and result.final_output


def _create(roomy, **body) -> dict:
    body = {"model": roomy.model, "max_output_tokens": 2} | body
    reply = httpx.post(f"{roomy.url}/responses", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _stored(roomy, response_id: str) -> bool:
    reply = httpx.get(f"{roomy.url}/responses/{response_id}", timeout=30)
    assert reply.status_code in (200, 404), reply.text
    assert reply.status_code == 200 or response_id in reply.json()["error"]["message"]
    return reply.status_code == 200


def test_the_store_evicts_the_oldest_past_either_bound(roomy):
    small = [_create(roomy, input=f"Hi {i}")["id"] for i in range(ENTRIES + 1)]
    assert [_stored(roomy, i) for i in small] == [False] + [True] * ENTRIES  # by entries
    gone = httpx.post(f"{roomy.url}/responses", json={"previous_response_id": small[0], "input": "x"}, timeout=60)
    assert gone.status_code == 404 and small[0] in gone.json()["error"]["message"]
    assert gone.json()["error"]["param"] == "previous_response_id"
    heavy = {str(k): "v" * 512 for k in range(16)}  # 8 KiB of metadata, kept with each response
    large = [_create(roomy, input=f"Big {i}", metadata=heavy)["id"] for i in range(3)]
    assert [_stored(roomy, i) for i in small + large] == [False] * (ENTRIES + 2) + [True, True]  # by bytes
    assert _create(roomy, previous_response_id=large[-1], input="on")["previous_response_id"] == large[-1]
    scored = {
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 20,
        "max_output_tokens": 40,
        "ignore_eos": True,
    }
    huge = _create(roomy, input="x", **scored)  # 20 log-probabilities a token: over 1 KiB a token
    assert len(json.dumps(huge)) > STORE_BYTES and not _stored(roomy, huge["id"])  # larger than the store: not kept
