"""Text in, text out through the command line: a prompts file keeps every slot busy without changing any request's
tokens (and they are transformers' greedy tokens), stops end exactly where they should, streaming prints the final
text, and bad input is one `error:` line on every rank with nothing half-written."""

import json
import shutil
import time

import pytest
import torch

from k3dist.twin.checkpoint import write_checkpoint
from tests.support.cli_run import error_lines, run_cli
from tests.support.configs import small_config

TEXTS = [
    "The lighthouse keeper",
    "中文English混合 and more",
    "a",
    "Numbers 1234567 and CamelCaseWords go here, with a longer tail of text to prefill.",
    "Short one.",
    "Where does the river go when it reaches the sea at night?",
    "x y z",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small fp32 checkpoint with the twin's trained tokenizer (bytes + Kimi's special block) and chat template."""
    return write_checkpoint(small_config(), tmp_path_factory.mktemp("textckpt") / "m", seed=9, dtype="float32")


def write_requests(path, rows) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(path)


def outputs(tmp) -> list[dict]:
    return [json.loads(line) for line in (tmp / "outputs.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def batched(model_dir, tmp_path_factory):
    """The same 7-request file at batch 3 (world 1 and 2) and at batch 1."""
    runs = {}
    for name, extra in [("b3w1", ["generate.batch=3"]), ("b3w2", ["generate.batch=3", "dist.nproc=2"]), ("b1", [])]:
        tmp = tmp_path_factory.mktemp(name)
        reqs = write_requests(
            tmp / "req.jsonl", [{"prompt": t, "max_new_tokens": 6 + 3 * i} for i, t in enumerate(TEXTS)]
        )
        rc, text, result = run_cli(
            tmp, f"model.path={model_dir}", "model.dtype=float32", f"generate.prompts={reqs}", "cache.cap=160", *extra
        )
        assert rc == 0, text
        runs[name] = (outputs(tmp), result)
    return runs


def test_batching_changes_no_request(batched):
    alone, _ = batched["b1"]
    assert [o["id"] for o in alone] == [f"req-{i}" for i in range(7)]
    for name in ("b3w1", "b3w2"):
        assert [o["tokens"] for o in batched[name][0]] == [o["tokens"] for o in alone], name
        assert [o["text"] for o in batched[name][0]] == [o["text"] for o in alone], name
    lengths = [o["prompt_tokens"] for o in alone]
    assert len(set(lengths)) > 4  # the requests really differ in length
    assert all(o["finish_reason"] in ("stop", "length") for o in alone)
    result = batched["b3w2"][1]
    assert [len(p) for p in result["prompt"]] == lengths and result["text"] == [o["text"] for o in alone]


def test_batched_tokens_are_transformers_greedy_tokens(batched, model_dir):
    from transformers import KimiLinearForCausalLM

    from k3dist.text.tokenizer import load_tokenizer

    eos = set(load_tokenizer(model_dir).eos_ids)
    model = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs, result = batched["b3w1"]
    for prompt, out in zip(result["prompt"], outs, strict=True):
        ids = torch.tensor([prompt + out["tokens"]])
        with torch.no_grad():
            greedy = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        assert greedy == out["tokens"]  # every token is transformers' argmax after the ones before it
        stopped_at_eos = out["tokens"][-1] in eos
        assert (out["finish_reason"] == "stop") == stopped_at_eos


def test_stops_end_exactly_where_they_should(batched, model_dir, tmp_path):
    alone, _ = batched["b1"]
    long = next(o for o in alone if o["finish_reason"] == "length" and len(o["text"]) > 6)
    index = alone.index(long)
    stop = long["text"][3:5]  # a string the request's text contains
    rows = [
        {"prompt": TEXTS[index], "max_new_tokens": len(long["tokens"]), "stop": [stop, "\u2603never"]},
        {"prompt": TEXTS[index], "max_new_tokens": 2},
        {"prompt": TEXTS[index], "max_new_tokens": 0},
    ]
    reqs = write_requests(tmp_path / "req.jsonl", rows)
    rc, text, _ = run_cli(tmp_path, f"model.path={model_dir}", "model.dtype=float32", f"generate.prompts={reqs}")
    assert rc == 0, text
    cut, short, none = outputs(tmp_path)
    assert none["text"] == "" and none["tokens"] == [] and none["finish_reason"] == "length"  # a string, as any text
    assert cut["finish_reason"] == "stop" and cut["text"] == long["text"][: long["text"].index(stop)]
    assert cut["tokens"] == long["tokens"][: len(cut["tokens"])] and len(cut["tokens"]) < len(long["tokens"])
    from k3dist.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    assert stop in tok.decode(cut["tokens"]) and stop not in tok.decode(
        cut["tokens"][:-1]
    )  # the last token completes it
    assert short["finish_reason"] == "length" and short["tokens"] == long["tokens"][:2]


def test_streamed_text_equals_the_final_text(model_dir, tmp_path):
    rc, text, result = run_cli(
        tmp_path,
        f"model.path={model_dir}",
        "generate.prompt=Tell me a story",
        "generate.stream=on",
        "generate.max_new_tokens=24",
        "generate.chat=true",
        "generate.system=Be brief.",
    )
    assert rc == 0, text
    streamed = text.split("k3dist: world")[0]  # stdout: the stream, then the summary
    assert result["text"][0] and streamed.endswith(result["text"][0] + "\n")


def test_chat_prompt_renders_the_checkpoint_template(model_dir, tmp_path):
    rc, text, result = run_cli(
        tmp_path,
        f"model.path={model_dir}",
        "generate.prompt=hi",
        "generate.chat=true",
        "generate.system=sys",
        "generate.max_new_tokens=1",
    )
    assert rc == 0, text
    from k3dist.text.tokenizer import load_tokenizer

    rendered = load_tokenizer(model_dir).decode(result["prompt"][0])
    assert rendered == (
        "<|im_system|>system<|im_middle|>sys<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


# ---------------------------------------------------------------------------------------------- bad input


def _bad_cases(model_dir, tmp):
    no_tok = tmp / "no-tokenizer"
    shutil.copytree(model_dir, no_tok)
    for f in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        (no_tok / f).unlink()
    broken = tmp / "broken-template"
    shutil.copytree(model_dir, broken)
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}")
    huge = tmp / "huge-template"  # a gigabyte of text in a fraction of a second, unless the sandbox bounds it
    shutil.copytree(model_dir, huge)
    (huge / "chat_template.jinja").write_text("{{ 'x' * 10**9 }}")
    (tmp / "not-json.jsonl").write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    (tmp / "not-utf8.jsonl").write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    write_requests(tmp / "role.jsonl", [{"messages": [{"role": "user<|im_end|>", "content": "hi"}]}])
    write_requests(tmp / "long.jsonl", [{"ids": [7] * 40, "max_new_tokens": 30}])
    return [
        ("not JSON", [f"generate.prompts={tmp / 'not-json.jsonl'}"], "not-json.jsonl:2:"),
        ("not UTF-8", [f"generate.prompts={tmp / 'not-utf8.jsonl'}"], "not-utf8.jsonl:2:"),
        ("unknown role", [f"generate.prompts={tmp / 'role.jsonl'}"], "role.jsonl:1"),
        ("no tokenizer", [f"model.path={no_tok}", "generate.prompt=hello"], "has no tokenizer"),
        ("too long", [f"generate.prompts={tmp / 'long.jsonl'}", "cache.cap=64"], "exceeds cache.cap=64"),
        ("template fails", [f"model.path={broken}", "generate.prompt=hi", "generate.chat=true"], "chat_template.jinja"),
        ("huge render", [f"model.path={huge}", "generate.prompt=hi", "generate.chat=true"], "1000000000 characters"),
    ]


DEFAULT_BAD = ("not JSON", "too long", "huge render")  # a prompts file, the cache, a template: the rest are slow


@pytest.mark.parametrize("tier", ["default", pytest.param("slow", marks=pytest.mark.slow)])
def test_bad_input_is_one_error_line_on_every_rank(model_dir, tmp_path, tier):
    for name, overrides, says in _bad_cases(model_dir, tmp_path):
        if (name in DEFAULT_BAD) != (tier == "default"):
            continue
        run = tmp_path / name.replace(" ", "-")
        args = [f"model.path={model_dir}", "dist.nproc=2", *overrides]
        started = time.monotonic()
        rc, text, _ = run_cli(run, *args)
        assert time.monotonic() - started < 60, (name, text)  # the huge render ends at once, not after minutes
        lines = error_lines(text)
        assert rc != 0 and len(lines) == 2 and lines[0] == lines[1], (name, text)
        assert says in lines[0], (name, lines[0])
        assert "Traceback" not in text, (name, text)
        assert not (run / "outputs.jsonl").exists() and not (run / "result.json").exists(), name
