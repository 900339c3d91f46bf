"""The request fields that shape the output, beyond sampling: logit processors (logit_bias, the penalties, min_tokens,
stop_token_ids, ignore_eos), structured outputs and tool calls, checked together and turned into what the engine
takes per choice; and the known fields this server does not serve, each refused with a 400 naming it.

A known field is honoured or refused, never dropped: docs/serving.md has the table. Fields nobody declared stay
ignored and logged once (app.py). Conflicts are refused too: a grammar decides where its output ends, so it does not
go with min_tokens or ignore_eos.
"""

from dataclasses import dataclass

from ..engine.logits import MAX_HELD, Processing
from .errors import bad
from .structured import Grammars
from .tools import ToolCalls, ToolPlan, ToolTokens, tool_plan

MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_STOP_IDS = 16
NOT_SERVED = "is not served here"
# field -> (values that ask for nothing, what to do instead); any other value is refused
UNSERVED = {
    "audio": ((None,), "audio output " + NOT_SERVED),
    "modalities": ((None, ["text"]), "only text output is served"),
    "prediction": ((None,), "predicted outputs are " + NOT_SERVED),
    "reasoning_effort": ((None,), "reasoning_effort " + NOT_SERVED),
    "verbosity": ((None,), "verbosity " + NOT_SERVED),
    "web_search_options": ((None,), "web search " + NOT_SERVED),
    "functions": ((None,), "functions are not served: use tools"),
    "function_call": ((None,), "function_call is not served: use tool_choice"),
    "store": ((None, False), "nothing is stored here (store)"),
    "metadata": ((None,), "metadata goes with stored completions, and nothing is stored here"),
    "service_tier": ((None, "auto", "default"), "one service tier is served (auto/default)"),
    "moderation": ((None,), "moderation " + NOT_SERVED),
    "prompt_cache_retention": ((None, "in_memory"), "prompt caches live in memory only (prefix.*)"),
    "prompt_cache_options": ((None,), "prompt_cache_options " + NOT_SERVED + " (the prefix cache is automatic)"),
    "suffix": ((None, ""), "suffix (insertion) " + NOT_SERVED),
    "best_of": ((None, 1), "best_of " + NOT_SERVED + ": use n"),
    "use_beam_search": ((None, False), "beam search " + NOT_SERVED),
    "length_penalty": ((None, 1, 1.0), "length_penalty goes with beam search, which " + NOT_SERVED),
    "min_p": ((None, 0, 0.0), "min_p " + NOT_SERVED + ": use top_p or top_k"),
    "allowed_token_ids": ((None,), "allowed_token_ids " + NOT_SERVED + ": use structured_outputs or logit_bias"),
    "bad_words": ((None, []), "bad_words " + NOT_SERVED + ": use logit_bias"),
    "include_stop_str_in_output": ((None, False), "stop strings are always cut from the output"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated here"),
    **{
        f"guided_{kind}": ((None,), f"guided_{kind} " + NOT_SERVED + ": use structured_outputs")
        for kind in ("json", "regex", "choice", "grammar", "json_object", "decoding_backend", "whitespace_pattern")
    },
}


@dataclass(frozen=True)
class Plan:
    """What one request asks of the engine beyond its sampling (`engine`: Prompt fields), and its tool calls."""

    engine: dict
    tools: ToolPlan | None

    def tool_calls(self, choices: int) -> ToolCalls | None:
        """How each choice's text turns into tool calls; None when calls are neither asked nor possible."""
        return ToolCalls(choices, self.tools.parallel) if self.tools is not None and self.tools.calls else None


class Forms:
    """The checkpoint's part in this: its tokenizer (eos ids, tool tokens) and its grammar compiler."""

    def __init__(self, tokenizer, vocab: int):
        self.tokenizer, self.vocab = tokenizer, vocab
        self.tool_tokens = ToolTokens.find(tokenizer)
        self.grammars = Grammars(tokenizer, vocab, self.tool_tokens)

    def plan(self, req) -> Plan:
        """Check the output-shaping fields of a parsed request (a 400 naming the first bad one); may compile a grammar
        (call it off the event loop)."""
        refuse_unserved(req)
        tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_tokens) if _chat(req) else None
        grammar = self.grammars.for_request(req, tools)
        if grammar is not None and (req.min_tokens or req.ignore_eos):
            field = "min_tokens" if req.min_tokens else "ignore_eos"
            raise bad(f"{field} does not go with a grammar (response_format, structured_outputs, tools)", field)
        stop_ids = self._ids(req.stop_token_ids or [], "stop_token_ids", MAX_STOP_IDS)
        bias = [(t, v) for t, v in self._bias(req.logit_bias).items()]
        if tools is not None and not tools.calls:  # tool_choice none: no tool token can start a call
            bias += [(t, float("-inf")) for t in self.tool_tokens.ids]
        budget = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if budget is not None and req.min_tokens > budget:
            raise bad(f"min_tokens={req.min_tokens} is more than max_tokens={budget}", "min_tokens")
        held = tuple(dict.fromkeys((() if req.ignore_eos else self.tokenizer.eos_ids) + tuple(stop_ids)))
        processing = Processing(
            bias=tuple(bias),
            presence=req.presence_penalty,
            frequency=req.frequency_penalty,
            repetition=req.repetition_penalty,
            min_tokens=req.min_tokens,
            held=held[:MAX_HELD] if req.min_tokens else (),
            grammar=grammar is not None,
        )
        engine = {"stop_ids": tuple(stop_ids), "ignore_eos": req.ignore_eos, "grammar": grammar}
        engine["processing"] = None if processing == Processing() else processing
        return Plan(engine, tools)

    def _ids(self, ids: list[int], field: str, most: int) -> list[int]:
        if len(ids) > most:
            raise bad(f"{field} takes at most {most} token ids, got {len(ids)}", field)
        if out := [t for t in ids if not 0 <= t < self.vocab]:
            raise bad(f"{field}: token ids {out[:5]} are outside the vocabulary (0..{self.vocab - 1})", field)
        return ids

    def _bias(self, bias: dict | None) -> dict[int, float]:
        """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, at most MAX_LOGIT_BIAS entries."""
        if not bias:
            return {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
        out: dict[int, float] = {}
        for key, value in bias.items():
            if not key.isdigit() or int(key) >= self.vocab:
                raise bad(
                    f"logit_bias key {key!r:.40} is not a token id of the vocabulary (0..{self.vocab - 1})",
                    "logit_bias",
                )
            if not -100 <= value <= 100:
                raise bad(f"logit_bias[{key!r}] = {value} is outside [-100, 100]", "logit_bias")
            out[int(key)] = out.get(int(key), 0.0) + float(value)
        return out


def _chat(req) -> bool:
    return hasattr(req, "messages")


def refuse_unserved(req) -> None:
    """Known fields this server does not serve, set to something that asks for them: a 400 naming the field."""
    extra = req.model_extra or {}
    for name, (nothing, why) in UNSERVED.items():
        if name in extra and not any(extra[name] == v and type(extra[name]) is type(v) for v in nothing):
            raise bad(f"{name}={extra[name]!r:.60}: {why}", name)
    options = req.stream_options.model_extra if req.stream_options is not None else None
    if options and options.get("include_obfuscation"):
        raise bad("stream_options.include_obfuscation " + NOT_SERVED, "stream_options")
