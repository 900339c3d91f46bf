"""Conversations rendered by Kimi K3's own chat template, kept as tests/data/k3_template/renders.json.

K3's template (`models/templates/Kimi-K3.jinja` in the llama.cpp tree llama-cpp-python 0.3.36 vendors) is not part
of this repository, so its renders of these conversations are recorded once, by transformers' own chat-template
renderer (the reference k3dist's sandbox follows), and the tests compare against the record: the twin's K3 template
renders the same text, K3's parser reads the recorded assistant turns back, and where a tree is at hand
(`$LLAMA_CPP`) k3dist's sandbox renders the real template to the same text.

    python -m tests.support.k3_template_cases --llama-cpp /path/to/llama.cpp   # rewrites the record
"""

import argparse
import hashlib
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "tests" / "data" / "k3_template" / "renders.json"
TEMPLATE = Path("models") / "templates" / "Kimi-K3.jinja"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather — and tomorrow's",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "Days": {"type": "integer"}, "alerts": {"type": "boolean"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {"name": "search.web", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}
TOOLS = [WEATHER, SEARCH]
ARGS = {"city": "Zürich", "Days": 2, "ratio": 0.5, "alerts": True, "none": None, "tags": ["a", 1], "opt": {"k": [1]}}
CALLS = [
    {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
    {"id": "call_b", "type": "function", "function": {"name": "search.web", "arguments": '{"q": "rain \\"now\\""}'}},
]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"}]

CASES = [
    {"name": "plain", "messages": ASK},
    {
        "name": "tools-required-no-thinking",
        "messages": ASK,
        "tools": TOOLS,
        "variables": {"thinking": False, "tool_choice": "required"},
    },
    {
        "name": "tool-turn-results-by-id",
        "messages": [
            *ASK,
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Tools first.", "tool_calls": CALLS},
            {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
            {"role": "tool", "tool_call_id": "call_a", "content": "12 C"},
        ],
        "tools": TOOLS,
        "variables": {"thinking_effort": "high"},
    },
    {
        "name": "results-by-order-no-prompt",
        "messages": [
            {"role": "user", "name": 'ann "a" & b', "content": "Both, please."},
            {
                "role": "assistant",
                "name": "kimi",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "search.web", "arguments": {"q": "x"}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": "  "}},
                    {"type": "function", "function": {"name": "get_weather"}},
                ],
            },
            {"role": "tool", "content": "first"},
            {"role": "tool", "name": "named_tool", "content": "second"},
            {"role": "tool", "tool_call_id": "nowhere", "content": "third"},
            {"role": "assistant", "content": "Done."},
        ],
        "tools": TOOLS,
        "variables": {"thinking": False},
        "add_generation_prompt": False,
    },
    {
        "name": "json-schema-tool-choice-none-parts",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Give "}, {"type": "text", "text": "JSON."}]},
        ],
        "tools": [WEATHER],
        "variables": {
            "thinking": False,
            "tool_choice": "none",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": {"type": "object", "properties": {"b": {}, "A": {}}}},
            },
        },
    },
    {
        "name": "json-object-lazy-tools-two-turns",
        "messages": [
            {"role": "system", "content": "ignored", "tools": [SEARCH]},
            {"role": "user", "content": "Go."},
            {"role": "assistant", "reasoning": "Plan.", "content": "", "tool_calls": [CALLS[1]]},
            {"role": "tool", "tool_call_id": "call_b", "content": "sun"},
            {"role": "assistant", "content": "Sun.", "tool_calls": [dict(CALLS[0], id="call_c")]},
            {"role": "tool", "tool_call_id": "call_c", "content": [{"type": "text", "text": "ok"}]},
        ],
        "variables": {"thinking_effort": "low", "response_format": {"type": "json_object"}},
    },
]


def render(template: str, case: dict) -> str:
    """A case rendered by transformers' chat-template renderer (as apply_chat_template renders it)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        [case["messages"]],
        tools=case.get("tools"),
        chat_template=template,
        add_generation_prompt=case.get("add_generation_prompt", True),
        **case.get("variables", {}),
    )
    return rendered[0]


def template_of(tree: Path) -> str:
    return (tree / TEMPLATE).read_text(encoding="utf-8")


def tree() -> Path | None:
    """The llama.cpp tree `$LLAMA_CPP` names, when it holds K3's template."""
    path = os.environ.get("LLAMA_CPP")
    return Path(path) if path and (Path(path) / TEMPLATE).is_file() else None


def load() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp tree with " + str(TEMPLATE))
    args = parser.parse_args()
    template = template_of(args.llama_cpp)
    record = {
        "template": str(TEMPLATE),
        "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "renderer": "transformers.utils.chat_template_utils.render_jinja_template",
        "renders": {case["name"]: render(template, case) for case in CASES},
    }
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(CASES)} renders -> {RECORD}")


if __name__ == "__main__":
    main()
