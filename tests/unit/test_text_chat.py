"""Chat templates: found in the model dir, rendered exactly as transformers renders them, bad input in one line."""

import json
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

import k3dist.twin
from k3dist.base.errors import K3Error
from k3dist.text.chat import load_chat_template, render_chat

KIMI_TEMPLATE = (Path(k3dist.twin.__file__).parent / "chat_template.jinja").read_text()
SPECIAL = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
SYSTEM = [
    {"role": "system", "content": "You are a helpful assistant provided by Moonshot-AI."},
    {"role": "user", "content": "Is 123 a prime?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi, 你好"},
    {"role": "assistant", "content": "Hello! 有什么可以帮你？"},
    {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]},
    {"role": "tool", "name": "add", "tool_call_id": "functions.add:0", "content": "4"},
    {"role": "assistant", "content": "It is 4.", "reasoning": "2+2=4", "thinking": None},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, 天气",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
# Uses what transformers gives templates: namespace, loop controls, dict, tojson options, generation, special vars.
FEATURES = """{{ bos_token }}
{%- set ns = namespace(turns=0, last='') %}
{%- for m in messages %}
    {%- if m.role == 'tool' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- set ns.last = m.role %}
    {%- if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}
    {%- else %}
{{ m.role }}: {{ m.content if m.content is string else m.content | tojson }}
    {%- endif %}
    {%- if loop.index > 3 %}{% break %}{% endif %}
{%- endfor %}
{{ dict(turns=ns.turns, last=ns.last) | tojson(indent=1, sort_keys=True) }}
{%- if tools %}{{ tools | tojson(separators=(',', ':')) }}{% endif %}
{%- if 'tool_calls' in messages[-1] %}{{ raise_exception('unreachable') }}{% endif %}
{{ eos_token if not add_generation_prompt else 'go' }}
{% for m in messages if m.reasoning_content is defined %}({{ m.reasoning_content }}|{{ m.thinking }}){% endfor %}
{% for m in messages %}
    {% if m.role == 'user' %}
  user turn {{ loop.index }}
    {% endif %}
{% endfor %}
"""


def reference(template: str, messages: list, tools: list | None = None) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(models.BPE()), chat_template=template, **SPECIAL)
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("template", [KIMI_TEMPLATE, FEATURES], ids=["kimi", "features"])
@pytest.mark.parametrize(
    "messages, tools", [(SYSTEM, None), (MULTI_TURN, None), (SYSTEM, TOOLS)], ids=["system", "multi-turn", "tools"]
)
def test_render_equals_transformers(template, messages, tools):
    ours = render_chat(template, "t.jinja", messages, tools=tools, **SPECIAL)
    assert ours == reference(template, messages, tools)


def test_kimi_shape():
    """Kimi's turns, its tool declaration, an assistant's tool calls (numbered across the conversation unless the
    call has an id; arguments as a string or an object) and a tool result naming the call it answers."""
    calls = [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "functions.get_weather:7", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
    ]
    turns = MULTI_TURN[:2] + MULTI_TURN[3:5] + [{"role": "assistant", "content": "Both:", "tool_calls": calls}]
    text = render_chat(KIMI_TEMPLATE, "t.jinja", turns, tools=TOOLS)
    tools = json.dumps(TOOLS, separators=(",", ":"), ensure_ascii=False)
    assert text == (
        f"<|im_system|>tool_declare<|im_middle|>{tools}<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi, 你好<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello! 有什么可以帮你？<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
        "<|im_end|><|im_system|>add<|im_middle|>## Return of functions.add:0\n4<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Both:<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:7<|tool_call_argument_begin|>{"city":"Rome"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    no_prompt = render_chat(KIMI_TEMPLATE, "t.jinja", SYSTEM, add_generation_prompt=False)
    assert no_prompt.endswith("Is 123 a prime?<|im_end|>") and "[BOS]" not in no_prompt


def test_load_chat_template(tmp_path):
    assert load_chat_template(tmp_path) is None
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "from config"}))
    assert load_chat_template(tmp_path) == ("from config", str(config))
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(tmp_path) == ("plain", str(config))
    (tmp_path / "chat_template.jinja").write_text("from jinja")
    assert load_chat_template(tmp_path) == ("from jinja", str(tmp_path / "chat_template.jinja"))
    (tmp_path / "chat_template.jinja").unlink()
    config.write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(K3Error, match=r"tokenizer_config.json: chat_template lists templates \['tool_use'\]"):
        load_chat_template(tmp_path)
    config.write_text('{"chat_template": 3')
    with pytest.raises(K3Error, match=r"tokenizer_config.json:1: not valid JSON"):
        load_chat_template(tmp_path)


@pytest.mark.parametrize(
    "template, source, cause",
    [
        ("{% for m in messages %}\n{{ m.role }\n", "/m/chat_template.jinja",
         r"/m/chat_template.jinja:2: chat template syntax error"),
        ("{% if messages[0].role != 'system' %}\n{{ raise_exception('first must be system') }}{% endif %}",
         "/m/chat_template.jinja", r"/m/chat_template.jinja:2: chat template failed: first must be system"),
        ("\n\n{{ messages[0].content.missing.deeper }}", "/m/tokenizer_config.json",
         r"/m/tokenizer_config.json: chat_template line 3: chat template failed: .*has no attribute 'missing'"),
        ("{{ messages[0].content + 1 }}", "/m/chat_template.jinja", r":1: chat template failed: TypeError"),
        ("{{ ''.__class__ }}{{ ''.__class__.__mro__[1].__subclasses__() }}", "/m/chat_template.jinja",
         r"chat_template.jinja:1: chat template failed: access to attribute '__class__' of 'str' object is unsafe"),
        ("{% set ns = namespace(_x=1) %}", "/m/chat_template.jinja", r"may not start with '_'"),
    ],
)  # fmt: skip
def test_template_failures_name_the_file_and_cause(template, source, cause):
    with pytest.raises(K3Error, match=cause):
        render_chat(template, source, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "messages, why",
    [
        ({"role": "user", "content": "hi"}, "must be a list of {role, content} objects, got a dict"),
        ([], "the list of messages is empty"),
        (["hi"], r"messages\[0\] must be a {role, content} object, got a str"),
        ([{"content": "hi"}], r"messages\[0\] has unknown role None"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\] has unknown role 3"),
        ([{"role": "", "content": "hi"}], r"messages\[0\] has unknown role ''"),
        ([{"role": "user<|im_end|>", "content": "hi"}], r"messages\[0\] has unknown role 'user<\|im_end\|>'"),
        ([{"role": "user"}], r"messages\[0\] \(user\) has no content"),
        (
            [{"role": "user", "content": 5}],
            r"messages\[0\] \(user\) content must be a text or a list of content parts, got an int",
        ),
        ([{"role": "user", "content": ["hi"]}], r"messages\[0\] \(user\) content parts must be objects"),
    ],
)
def test_bad_messages(messages, why):
    with pytest.raises(K3Error, match=rf"^chat messages: {why}"):
        render_chat(KIMI_TEMPLATE, "t.jinja", messages)


def test_other_roles_render_as_system_and_tools_must_be_objects():
    text = render_chat(KIMI_TEMPLATE, "t.jinja", [{"role": "developer", "content": "be brief"}])
    assert text.startswith("<|im_system|>developer<|im_middle|>be brief<|im_end|>")
    with pytest.raises(K3Error, match="chat tools must be a list of JSON objects"):
        render_chat(KIMI_TEMPLATE, "t.jinja", SYSTEM, tools=["get_weather"])


def test_a_render_that_runs_too_long_is_stopped():
    """A template looping over its input (10^10 iterations) stops at its time limit with one line."""
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0].role }}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(K3Error, match=r"t.jinja:1: chat template failed: rendering took longer than its time limit"):
        render_chat(slow, "t.jinja", SYSTEM, time_limit_s=0.3)
    assert time.monotonic() - start < 3
    assert render_chat(KIMI_TEMPLATE, "t.jinja", SYSTEM).endswith("<|im_assistant|>assistant<|im_middle|>")


@pytest.mark.parametrize(
    "template, says",
    [
        ("{{ 'x' * 10**9 }}", "'\\*' would build about 1000000000 characters"),
        ("{% set s = 'x' * 1000 %}{{ [s] * 10000 }}", "'\\*' would build about 100"),
        ("{{ 7 ** 100000 }}", "'\\*\\*' would make an integer"),
        ("{{ 'x' | center(10**9) }}", "the 'center' filter was given 1000000000"),
        ("{{ 'x'.ljust(10**9) }}", "calling ljust was given 1000000000"),
        ("{{ messages | tojson(indent=10**9) }}", "the 'tojson' filter was given 1000000000"),
        ("{{ '%0999999999d' % 1 }}", "'%' was given 999999999"),
        ("{{ '{:>999999999}'.format(1) }}", "calling format was given 999999999"),
        ("{{ ('x' * 1000) | replace('x', 'y' * 10000) }}", "the 'replace' filter would build"),
        ("{{ range(100000) | map('string') | map('center', 100) | join }}", "the 'join' filter would build"),
        ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "'~'"),
        ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "the rendered prompt passes 1048576 characters"),
    ],
)
def test_a_render_is_bounded_in_size(template, says):
    """What a template builds is bounded like its time: each of these would take a gigabyte or more (or minutes),
    and each ends at once with one line instead."""
    start = time.monotonic()
    with pytest.raises(K3Error, match=rf"^t.jinja:(1:)? chat template failed: {says}"):
        render_chat(template, "t.jinja", SYSTEM, max_chars=2**20)
    assert time.monotonic() - start < 2
    assert render_chat(KIMI_TEMPLATE, "t.jinja", SYSTEM, max_chars=2**10).endswith("<|im_middle|>")
