"""The Responses API's output (serve/responses_output.py) from engine events, without a server: every event and the
Response valid for the `openai` client's own types, sequence numbers in order, deltas adding up to the whole answer
whatever the events' split, a message then one function_call item per tool call (Kimi-K2's format; K3's with a
reasoning item first), an empty answer still a message, an answer cut by its budget `incomplete`, and the error event
that ends a failed stream."""

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from k3dist.engine.sequences import Event
from k3dist.serve.errors import APIError
from k3dist.serve.protocol import parse_body
from k3dist.serve.responses_output import Output, response_object
from k3dist.serve.responses_schema import ResponsesRequest
from k3dist.serve.tools import ToolCalls
from k3dist.serve.tools_k2 import CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, K2Format, ToolTokens
from k3dist.serve.tools_k3 import K3Format

EVENT = TypeAdapter(ResponseStreamEvent)
CALL = f'{SECTION_BEGIN}{CALL_BEGIN}functions.f:0<|tool_call_argument_begin|>{{"a": "x"}}{CALL_END}'
CALL += f"{CALL_BEGIN}functions.g:1<|tool_call_argument_begin|>{{}}{CALL_END}{SECTION_END}"
K3_CALLS = '<|open|>tools<|sep|><|open|>call tool="f" index="0"<|sep|><|open|>argument key="a" type="string"<|sep|>x'
K3_CALLS += '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="g" index="1"<|sep|><|close|>call<|sep|>'
K3_CALLS += "<|close|>tools<|sep|><|close|>message<|sep|>"
KINDS = ("reasoning_text", "output_text")
FORMATS = {"kimi_k2": K2Format(ToolTokens(1, 2, 3, 4, 5)), "kimi_k3": K3Format(frozenset({6, 7, 8}), 9)}  # any ids:
# the parsers read text


def _output(tools: str | None, opened: str = "response") -> Output:
    req = parse_body(json.dumps({"input": "Hi", "metadata": {"k": "v"}}).encode(), ResponsesRequest)
    calls = ToolCalls(FORMATS[tools], 1, True, True, opened) if tools else None
    return Output(response_object(req, "resp_1", "m", True), tools=calls)


def _run(output: Output, pieces: list[str], finish: str) -> list[dict]:
    events = output.start()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        events += output.feed(Event("r-0", [7], piece, finish_reason=finish if last else None), prompt_len=5)
    for event in events:
        EVENT.validate_python(event)
    Response.model_validate(output.response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


@pytest.mark.parametrize("split", [1, 3, 1000])
def test_text_then_calls_whatever_the_split(split):
    text = "Sure. " + CALL
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    output = _output(tools="kimi_k2")
    events = _run(output, pieces, "stop")
    kinds = [e["type"] for e in events]
    message, first, second = output.response["output"]
    assert message["content"][0]["text"] == "Sure. " == "".join(e["delta"] for e in events if "text.delta" in e["type"])
    assert (first["name"], first["arguments"], first["call_id"]) == ("f", '{"a": "x"}', "functions.f:0")
    assert (second["name"], second["call_id"], second["status"]) == ("g", "functions.g:1", "completed")
    assert kinds[-1] == "response.completed" and kinds.count("response.output_item.done") == 3
    assert output.response["usage"]["output_tokens"] == len(pieces) and output.response["metadata"] == {"k": "v"}
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2]


@pytest.mark.parametrize("split", [1, 7, 1000])
def test_k3_reasoning_then_text_then_calls_whatever_the_split(split):
    """K3's answer after its generation prompt opened the think tag: a reasoning item, the message, the calls."""
    text = "Plan it.<|close|>think<|sep|><|open|>response<|sep|>Sure. <|close|>response<|sep|>" + K3_CALLS
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    output = _output(tools="kimi_k3", opened="think")
    events = _run(output, pieces, "stop")
    reasoning, message, first, second = output.response["output"]
    assert (reasoning["type"], reasoning["content"][0]["text"], reasoning["status"]) == (
        "reasoning",
        "Plan it.",
        "completed",
    )
    deltas = {kind: "".join(e["delta"] for e in events if e["type"] == f"response.{kind}.delta") for kind in KINDS}
    assert (
        deltas == {"reasoning_text": "Plan it.", "output_text": "Sure. "} and message["content"][0]["text"] == "Sure. "
    )
    assert (first["name"], first["arguments"], first["call_id"]) == ("f", '{"a": "x"}', "functions.f:0")
    assert (second["name"], second["arguments"], second["call_id"]) == ("g", "{}", "functions.g:1")
    usage = output.response["usage"]  # an event's tokens are reasoning ones when all its text was reasoning
    reasoned = usage["output_tokens_details"]["reasoning_tokens"]
    assert 0 < reasoned < usage["output_tokens"] if split < 1000 else reasoned == 0


def test_an_empty_answer_is_a_message_and_a_cut_one_is_incomplete():
    empty = _output(tools=None)
    _run(empty, [""], "stop")
    assert [o["type"] for o in empty.response["output"]] == ["message"] and empty.response["status"] == "completed"
    cut = _output(tools=None)
    events = _run(cut, ["ab", "c"], "length")
    assert events[-1]["type"] == "response.incomplete" and cut.response["output"][0]["status"] == "incomplete"
    assert cut.response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_failed_stream_ends_with_an_error_event():
    output = _output(tools=None)
    output.start()
    event = output.error(APIError(500, "the engine failed", code="engine_failed"))
    EVENT.validate_python(event)
    assert event["type"] == "error" and event["code"] == "engine_failed" and event["sequence_number"] == 2
