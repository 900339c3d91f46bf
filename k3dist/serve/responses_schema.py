"""The Responses API's request body (`POST /v1/responses`), declared as schema.py declares the others: each field
with its type and bounds, unknown fields refused by name, the sampling fields and vLLM's and SGLang's extras shared
with chat (schema.Generating).

`input` is a text or a list of items, each checked against its kind and kept as the client sent it: messages
(`role` user, assistant, system or developer; `content` a text or input_text / output_text parts; an item echoed
back with its `id`, `status`, `annotations` and `logprobs`), `function_call`, `function_call_output` and `reasoning`
(its reasoning_text parts, as this server makes them; no summary, no encrypted content). Another kind of item (a
built-in tool's call, an item reference) or of part (an image, a file) is refused naming `input`; a tool other than a
function is refused naming `tools`. docs/serving.md lists every field.
"""

from typing import Annotated, Literal

from annotated_types import Len
from pydantic import AfterValidator, BaseModel, Field, StringConstraints, ValidationError

from .schema import MAX_COUNT, MAX_LIST, MAX_NAME, TOP_LOGPROBS, Body, Generating, Json, Name

Status = Literal["in_progress", "completed", "incomplete"]
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
LOGPROBS = "message.output_text.logprobs"  # the include entry that asks for output_text's log-probabilities
REASONING = "reasoning.encrypted_content"  # asks for reasoning items' encrypted content: none is ever made here
INCLUDABLE = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]


class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):
    """An answer's text part as this server (or another) sent it, echoed back in a later turn."""

    type: Literal["output_text"]
    text: str
    annotations: Annotated[list[dict], Len(0, MAX_LIST)] = []  # an echo: no effect on the prompt
    logprobs: Annotated[list[dict], Len(0, MAX_COUNT)] | None = None


class MessageItem(Body):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[dict], Len(0, MAX_LIST)]
    id: Name | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # an echo: no effect on the prompt


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: str
    id: Name | None = None
    status: Status | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: Name
    output: str | Annotated[list[dict], Len(0, MAX_LIST)]
    id: Name | None = None
    status: Status | None = None


class ReasoningText(Body):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Body):
    """A reasoning item as this server sends it (K3's thinking), echoed back: the assistant turn it precedes carries
    it as its reasoning_content, which the checkpoint's template renders as it renders a chat's."""

    type: Literal["reasoning"]
    content: Annotated[list[ReasoningText], Len(0, MAX_LIST)] = []
    summary: Annotated[list[dict], Len(0, 0)] = []  # summaries are not made here
    encrypted_content: None = None  # nor encrypted reasoning
    id: Name | None = None
    status: Status | None = None


ITEMS = {None: MessageItem, "message": MessageItem, "function_call": FunctionCallItem}
ITEMS |= {"function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
PARTS = {"input_text": InputText, "output_text": OutputText}


def _check(model: type[BaseModel], value, where: str) -> None:
    try:
        model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        raise ValueError(f"{where}{at}: {first['msg']}") from None


def _parts(parts, where: str) -> None:
    """Text parts only: the model takes text."""
    for j, part in enumerate(parts if isinstance(parts, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PARTS:
            raise ValueError(f"{where}[{j}] is a {kind!r:.40} part: this model takes text only (input_text)")
        _check(PARTS[kind], part, f"{where}[{j}]")


def _items(items: list) -> list:
    """Each item checked against its kind (kept as sent: the conversion reads the client's own objects)."""
    for i, item in enumerate(items):
        kind = item.get("type") if isinstance(item, dict) else None
        if not isinstance(item, dict) or kind not in ITEMS:
            raise ValueError(
                f"input[{i}] is a {kind!r:.40} item: messages, function_call, function_call_output and reasoning "
                "items are served (no built-in tool or item_reference items)"
            )
        _check(ITEMS[kind], item, f"input[{i}]")
        if kind != "reasoning":
            _parts(item.get("content") if kind != "function_call_output" else item.get("output"), f"input[{i}].content")
    return items


class FunctionTool(Body):
    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


def _tools(tools: list) -> list:
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"tools[{i}] is a {kind!r:.40} tool: only function tools are served here")
        _check(FunctionTool, tool, f"tools[{i}]")
    return tools


class TextFormatText(Body):
    type: Literal["text"]


class TextFormatJsonObject(Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(Body):
    type: Literal["json_schema"]
    name: Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME)]
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body):
    format: (
        Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")] | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None  # medium (the default) only: fields.py


class ReasoningConfig(Body):
    """Accepted when it asks for nothing more than the checkpoint's template does (effort null or none, no summary):
    effort none turns off a template's `thinking` (K3's), which chat sets with chat_template_kwargs."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(Body):
    include_obfuscation: bool = False  # refused when true


Metadata = dict[
    Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY)],
    Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)],
]


class ResponsesRequest(Generating):
    input: str | Annotated[list[dict], Len(0, MAX_LIST), AfterValidator(_items)]
    instructions: str | None = None
    previous_response_id: Name | None = None
    store: bool | None = None  # null: stored while serve.store_responses > 0
    metadata: Annotated[Metadata, Len(0, MAX_METADATA)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    include: Annotated[list[INCLUDABLE], Len(0, 16)] | None = None
    tools: Annotated[list[dict], Len(0, MAX_LIST), AfterValidator(_tools)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream_options: ResponsesStreamOptions | None = None
    # known, not served (schema.UNSERVED): accepted only when they ask for nothing
    background: Json = None
    conversation: Json = None
    context_management: Json = None
    prompt: Json = None
    max_tool_calls: Json = None
    truncation: Json = None
    moderation: Json = None

    @property
    def budget(self) -> int | None:
        return self.max_output_tokens
