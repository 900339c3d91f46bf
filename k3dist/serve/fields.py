"""The request fields that shape the output beyond its text: sampling and the logit processors (temperature, top_p,
top_k, seed, logit_bias, the penalties, min_tokens), stop_token_ids, ignore_eos, structured outputs and tool calls,
checked together and turned into what the engine takes per choice: one SamplingParams (built by its checked
constructor, engine/sampling.py) and the Prompt's other fields; and the known fields this server does not serve, each
refused with a 400 naming it unless it asks for nothing (schema.py's UNSERVED).

A known field is honoured or refused, never dropped: docs/serving.md has the table. Conflicts are refused too: a
grammar decides where its output ends, so it does not go with min_tokens or ignore_eos.
"""

from dataclasses import dataclass, replace
from typing import Any

from ..engine.sampling import MAX_HELD, BadValue, SamplingParams
from .errors import bad
from .protocol import draw_seed
from .schema import HTTP_NAMES, NOT_SERVED, UNSERVED, ChatRequest, Sampling
from .structured import Ask, Grammars
from .tools import ToolCalls, ToolFormat, ToolPlan, chat_format, tool_plan


@dataclass(frozen=True)
class CheckedFields:
    """What one request asks of the engine beyond its prompt: its sampling, more Prompt fields (`engine`), and its
    tool calls; for a chat, its format (`form`), where its prompt leaves the answer (`opened`) and the grammar that
    waits on that (`pending`, Forms.bind)."""

    sampling: SamplingParams
    engine: dict
    tools: ToolPlan | None
    form: ToolFormat | None = None
    opened: str = "response"
    pending: Ask | None = None

    def tool_calls(self, choices: int) -> ToolCalls | None:
        """How each choice's text turns into content, reasoning and tool calls; None when it is taken as it is."""
        return ToolCalls.of(self.form, self.tools, choices, self.opened)


class Forms:
    """The checkpoint's part in this: its tokenizer (eos ids), its chat format (tools.py, from the tokenizer's
    special tokens and the template's text) and its grammar compiler."""

    def __init__(self, tokenizer, vocab: int, template: str | None = None):
        self.tokenizer, self.vocab = tokenizer, vocab
        self.form = chat_format(tokenizer, template)
        self.grammars = Grammars(tokenizer, vocab, self.form)

    def plan(self, req: Sampling) -> CheckedFields:
        """Check the output-shaping fields of a parsed request (a 400 naming the first bad one); may compile a grammar
        (call it off the event loop). A chat's grammar that depends on where its prompt leaves the answer (K3's) is
        compiled by `bind`."""
        refuse_unserved(req)
        chat = isinstance(req, ChatRequest)
        form = self.form if chat else None
        tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, form) if chat else None
        ask = self.grammars.ask(req.response_format, req.structured_outputs, tools)
        later = ask is not None and form is not None and form.always
        grammar = None if ask is None or later else self.grammars.compile(ask, form)
        if ask is not None and (req.min_tokens or req.ignore_eos):
            field = "min_tokens" if req.min_tokens else "ignore_eos"
            raise bad(f"{field} does not go with a grammar (response_format, structured_outputs, tools)", field)
        stop_ids = self._ids(req.stop_token_ids or [], "stop_token_ids")
        bias = [(t, v) for t, v in self._bias(req.logit_bias).items()]
        if tools is not None and not tools.calls:  # tool_choice none: no tool token can start a call
            bias += [(t, float("-inf")) for t in form.refused]
        if req.budget is not None and req.min_tokens > req.budget:
            raise bad(f"min_tokens={req.min_tokens} is more than max_tokens={req.budget}", "min_tokens")
        held = tuple(dict.fromkeys((() if req.ignore_eos else self.tokenizer.eos_ids) + tuple(stop_ids)))
        try:
            sampling = SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=max(req.top_k, 0),
                seed=draw_seed(req),
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                min_tokens=req.min_tokens,
                logit_bias=tuple(bias),
                held=held[:MAX_HELD] if req.min_tokens else (),
                grammar=ask is not None,
            )
        except BadValue as exc:  # the schema's bounds are the constructor's or tighter: a slip of this front
            raise bad(f"{exc.named(HTTP_NAMES.get(exc.field, exc.field))}", HTTP_NAMES.get(exc.field)) from None
        engine = {"stop_ids": tuple(stop_ids), "ignore_eos": req.ignore_eos, "grammar": grammar}
        engine |= {"skip_special": req.skip_special_tokens, "spaced_special": req.spaces_between_special_tokens}
        return CheckedFields(sampling=sampling, engine=engine, tools=tools, form=form, pending=ask if later else None)

    def bind(self, plan: CheckedFields, prompt_ids) -> CheckedFields:
        """A chat's plan once its prompt is tokenized: where the prompt leaves the answer, and the grammar that
        waited on it compiled (a 400 naming its field when it cannot be)."""
        if plan.form is None:
            return plan
        opened = plan.form.opening(self.tokenizer, prompt_ids)
        engine = plan.engine
        if plan.pending is not None:
            engine = engine | {"grammar": self.grammars.compile(plan.pending, plan.form, opened)}
        return replace(plan, engine=engine, opened=opened, pending=None)

    def _ids(self, ids: list[int], field: str) -> list[int]:
        if out := [t for t in ids if not 0 <= t < self.vocab]:
            raise bad(f"{field}: token ids {out[:5]} are outside the vocabulary (0..{self.vocab - 1})", field)
        return ids

    def _bias(self, bias: dict | None) -> dict[int, float]:
        """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (the schema holds the keys to ASCII digits, the
        values to the range and the entries to 300): here the ids to the vocabulary."""
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            if int(key) >= self.vocab:
                raise bad(
                    f"logit_bias key {key!r:.40} is not a token id of the vocabulary (0..{self.vocab - 1})",
                    "logit_bias",
                )
            out[int(key)] = out.get(int(key), 0.0) + value
        return out


def refuse_unserved(req) -> None:
    """Known fields this server does not serve, set to something that asks for them: a 400 naming the field."""
    unserved = {name for name, f in type(req).model_fields.items() if f.annotation is Any} & UNSERVED.keys()
    given = req.model_dump(include=unserved & req.model_fields_set)  # a route may honour a name another does not
    for name, value in given.items():
        nothing, why = UNSERVED[name]
        if not any(value == v and type(value) is type(v) for v in nothing):
            raise bad(f"{name}={value!r:.60}: {why}", name)
    options = req.stream_options if isinstance(req, Sampling) else None
    if options is not None and options.include_obfuscation:
        raise bad("stream_options.include_obfuscation " + NOT_SERVED, "stream_options")
    if options is not None and options.continuous_usage_stats:
        raise bad(
            "stream_options.continuous_usage_stats " + NOT_SERVED + ": include_usage gives it at the end",
            "stream_options",
        )
