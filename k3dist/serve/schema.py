"""The request body of every route, declared once: each field with its type and its bounds (integers are integers, a
float is refused, not truncated; numbers are finite; strings, lists and counts have maxima). A field a route does not
declare is unknown: refused with a 400 naming it, as OpenAI's API does (`serve.unknown_fields=ignore` drops it and
logs its name once instead: protocol.py). docs/serving.md lists every field: honoured, accepted without effect, or
refused, and why.

Two tables say what the models cannot: INERT, the fields accepted without effect (any value), and UNSERVED, known
fields this server does not serve, accepted only with a value that asks for nothing and otherwise refused naming the
field (fields.py). The sampling fields are marked (`sampling`), and engine/sampling.py's DOORS names them.
"""

from typing import Annotated, Any, Literal

from annotated_types import Len
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ..engine.decode_step import WIDEST
from ..engine.sampling import DOORS

MAX_STOPS, MAX_STOP_CHARS = 16, 256  # per request (OpenAI allows 4)
MAX_N = 16
TOP_LOGPROBS = WIDEST  # the most log-probabilities per token a request may ask for (OpenAI's and vLLM's 20)
INT64 = 2**63
MAX_COUNT = 2**31 - 1  # a token count's bound (cache.cap bounds a request's budget further)
MAX_NAME = 256  # identifiers: model, user, request_id, a role, a tool call's id
MAX_LIST = 4096  # messages, tools, documents, stop_token_ids, ...: items of one list
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_STOP_IDS = 16

# an engine field (SamplingParams', Prompt's) -> the request field it comes from: a BadValue is refused naming it
HTTP_NAMES = {field: doors["http"] for field, doors in DOORS.items() if "http" in doors}
HTTP_NAMES |= {"ids": "prompt", "max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids", "held": "stop_token_ids"}
HTTP_NAMES |= {"prompt_logprobs": "logprobs", "skip_special": "skip_special_tokens", "grammar": "response_format"}
HTTP_NAMES |= {"spaced_special": "spaces_between_special_tokens"}

Name = Annotated[str, StringConstraints(max_length=MAX_NAME)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_COUNT)]  # the vocabulary bounds it further
Stop = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
BiasKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]  # a token id in ASCII digits ("²" is not one)
RequestId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME, pattern=r"^[\x21-\x7e]+$")]
Json = Any  # any JSON value: an UNSERVED field, accepted only when it asks for nothing

# Accepted without effect, whatever the value (of its declared type): field -> why it changes nothing.
INERT = {
    "user": "an end user's identifier: nothing is kept per user",
    "safety_identifier": "an end user's identifier: nothing is kept per user",
    "prompt_cache_key": "the prefix cache is keyed by the token ids themselves (prefix.*)",
    "add_special_tokens": "the checkpoint's tokenizer adds no special token to a text: both values give the same ids",
    "separate_reasoning": "SGLang's: no reasoning parser runs here, so there is nothing to separate",
    "stream_reasoning": "SGLang's: no reasoning parser runs here, so there is nothing to stream apart",
}
NOT_SERVED = "is not served here"
# Known fields this server does not serve: field -> (the values that ask for nothing: accepted without effect; why
# any other value is refused).
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
    "no_stop_trim": ((None, False), "stop strings are always cut from the output"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated here"),
    "prompt_logprobs": (
        (None,),
        "prompt_logprobs " + NOT_SERVED + ": echo with logprobs (/v1/completions) scores every prompt token",
    ),
    "chat_template": ((None,), "only the checkpoint's own chat template is rendered here"),
    "return_hidden_states": ((None, False), "hidden states are not returned here"),
    "lora_path": ((None,), "LoRA adapters are " + NOT_SERVED),
    "session_params": ((None,), "session_params " + NOT_SERVED),
    "sampling_seed": ((None,), "sampling_seed " + NOT_SERVED + ": use seed"),
    # the Responses API's (responses_schema.py)
    "background": ((None, False), "background responses are " + NOT_SERVED + ": a response is answered as it runs"),
    "conversation": ((None,), "conversations are " + NOT_SERVED + ": use previous_response_id, or send the items"),
    "context_management": ((None,), "context_management " + NOT_SERVED),
    "prompt": ((None,), "prompt templates are " + NOT_SERVED + ": send instructions and input"),
    "max_tool_calls": ((None,), "max_tool_calls " + NOT_SERVED + " (at most 16 calls an answer)"),
    "truncation": ((None, "disabled"), "the input is never truncated here: one longer than cache.cap is refused"),
    **{
        name: ((None,), f"{name} " + NOT_SERVED + ": use structured_outputs")
        for name in ("regex", "ebnf", "json_schema")
    },
    **{
        f"guided_{kind}": ((None,), f"guided_{kind} " + NOT_SERVED + ": use structured_outputs")
        for kind in ("json", "regex", "choice", "grammar", "json_object", "decoding_backend", "whitespace_pattern")
    },
}


def sampling(default, **bounds) -> Any:
    """A field that becomes a SamplingParams field (engine/sampling.py's DOORS names it, `http`)."""
    return Field(default, json_schema_extra={"sampling": True}, **bounds)


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _raw(model: type[BaseModel], where: str):
    """A validator checking each item of a list against `model` and keeping the item as it was sent (templates
    render the client's own objects, key order and all)."""

    def check(items: list) -> list:
        for i, item in enumerate(items):
            try:
                model.model_validate(item)
            except ValidationError as exc:
                first = exc.errors()[0]
                at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
                raise ValueError(f"{where}[{i}]{at}: {first['msg']}") from None
        return items

    return AfterValidator(check)


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool = False  # refused when true (fields.py)
    continuous_usage_stats: bool = False  # vLLM's: refused when true


class JsonSchemaSpec(Body):
    name: Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME)]
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(Body):
    """vLLM's: exactly one of the forms (structured.py); structural_tag is declared to be refused by name."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Len(1, MAX_LIST)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Json = None


class Generating(Body):
    """What every generating route shares (completions, chat and the Responses API, responses_schema.py): the model,
    sampling and its extras, stops, detokenizing, priority."""

    model: Name | None = None
    temperature: float = sampling(1.0, ge=0.0, le=100.0)
    top_p: float = sampling(1.0, gt=0.0, le=1.0)
    top_k: int = sampling(0, ge=-1)  # vLLM's: 0 or -1 = no cut; past the vocabulary it cuts nothing
    seed: int | None = sampling(None, ge=-INT64, lt=INT64)
    stop: Stop | Annotated[list[Stop], Len(0, MAX_STOPS)] | None = None
    stream: bool = False
    user: Name | None = None
    frequency_penalty: float = sampling(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = sampling(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = sampling(1.0, gt=0.0, le=100.0)  # vLLM's
    logit_bias: Annotated[dict[BiasKey, Annotated[float, Field(ge=-100, le=100)]], Len(0, MAX_LOGIT_BIAS)] | None = (
        sampling(None)
    )
    min_tokens: Count = sampling(0)  # vLLM's
    stop_token_ids: Annotated[list[TokenId], Len(0, MAX_STOP_IDS)] | None = None  # vLLM's
    ignore_eos: bool = False  # vLLM's
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    skip_special_tokens: bool = True  # vLLM's
    spaces_between_special_tokens: bool = True  # vLLM's
    request_id: RequestId | None = None  # vLLM's: the response's id
    priority: int = Field(0, ge=-(2**31), le=MAX_COUNT)  # vLLM's: lower first, then first come
    # known, not served (UNSERVED): accepted only when they ask for nothing
    service_tier: Json = None
    prompt_cache_retention: Json = None
    prompt_cache_options: Json = None
    min_p: Json = None


class Sampling(Generating):
    """What completions and chat share."""

    max_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's: token_ids per choice, prompt_token_ids
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # known, not served (UNSERVED): accepted only when they ask for nothing
    store: Json = None
    metadata: Json = None
    use_beam_search: Json = None
    length_penalty: Json = None
    allowed_token_ids: Json = None
    bad_words: Json = None
    include_stop_str_in_output: Json = None
    no_stop_trim: Json = None
    truncate_prompt_tokens: Json = None
    prompt_logprobs: Json = None
    return_hidden_states: Json = None
    lora_path: Json = None
    session_params: Json = None
    sampling_seed: Json = None
    regex: Json = None
    ebnf: Json = None
    guided_json: Json = None
    guided_regex: Json = None
    guided_choice: Json = None
    guided_grammar: Json = None
    guided_json_object: Json = None
    guided_decoding_backend: Json = None
    guided_whitespace_pattern: Json = None

    @property
    def budget(self) -> int | None:
        """The token budget asked for (chat: max_completion_tokens first)."""
        return self.max_tokens


Prompt = str | Annotated[list[TokenId], Len(0, 2**20)] | Annotated[list[str], Len(0, 1024)]


class CompletionRequest(Sampling):
    prompt: Prompt | Annotated[list[Annotated[list[TokenId], Len(0, 2**20)]], Len(0, 1024)]  # serve/completions.py
    max_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None  # 0: the prompt only scored (echo, logprobs)
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's (INERT)
    suffix: Json = None
    best_of: Json = None
    json_schema: Json = None  # SGLang's


class ToolFunction(Body):
    name: Name
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: ToolFunction


class CalledFunction(Body):
    name: Name
    arguments: str | dict


class ToolCall(Body):
    id: Name | None = None
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None


class Message(Body):
    """One chat message as the checkpoint's template takes it; content is text or text parts (text/chat.py checks
    the role and that a message says something)."""

    role: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    content: str | list[dict] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Len(0, MAX_LIST)] | None = None
    tool_call_id: Name | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None
    refusal: str | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


def _text_only(messages: list) -> list:
    """Content parts other than text (an image, audio, a file) are refused: the model takes text only."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"messages[{i}].content[{j}] is a {kind!r:.40} part: this model takes text only")
            try:
                TextPart.model_validate(part)
            except ValidationError as exc:
                raise ValueError(f"messages[{i}].content[{j}]: {exc.errors()[0]['msg']}") from None
    return messages


Messages = Annotated[list[dict], Len(1, MAX_LIST), _raw(Message, "messages"), AfterValidator(_text_only)]
Tools = Annotated[list[dict], Len(0, MAX_LIST), _raw(Tool, "tools")]
TemplateKwargs = dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z][A-Za-z0-9_]{0,63}$")], Json]


class Rendering(Body):
    """How messages become a prompt (the chat route's and /tokenize's): vLLM's extras to the checkpoint's template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Annotated[TemplateKwargs, Len(0, 64)] | None = None
    chat_template: Json = None


class ChatRequest(Sampling, Rendering):
    messages: Messages
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    tools: Tools | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: the last message's content in front of the answer, when it is the answer's role
    documents: Annotated[list[dict], Len(0, MAX_LIST)] | None = None  # vLLM's: to a template that reads them
    add_special_tokens: bool = False  # vLLM's (INERT)
    separate_reasoning: bool = True  # SGLang's (INERT)
    stream_reasoning: bool = True  # SGLang's (INERT)
    audio: Json = None
    modalities: Json = None
    prediction: Json = None
    reasoning_effort: Json = None
    verbosity: Json = None
    web_search_options: Json = None
    functions: Json = None
    function_call: Json = None
    moderation: Json = None

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Rendering):
    model: Name | None = None
    prompt: str | None = None
    messages: Messages | None = None
    tools: Tools | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: Name | None = None
    tokens: Annotated[list[TokenId], Len(0, 2**22)]
