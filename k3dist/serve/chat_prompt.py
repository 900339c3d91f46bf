"""A chat's prompt: its messages through the checkpoint's template, with vLLM's rendering extras each honoured or
refused by name (the chat route's and /tokenize's), and chat's `echo`.

- `add_generation_prompt` (default true) opens the assistant's turn after the messages; false leaves it out.
- `continue_final_message` ends the prompt where the last message's text does, its turn left open for the model to
  continue (transformers' cut); it cannot go with add_generation_prompt, as in vLLM.
- `chat_template_kwargs` become template variables, and `documents` the template's `documents`, where the template
  reads them: a name it does not read would change nothing, so it is refused rather than dropped, as is one the
  server sets itself (`messages`, `bos_token`, ...).
- `echo` puts the last message's text in front of the answer when that message has the answer's role (the
  assistant's, or with add_generation_prompt false the last message's own), as vLLM does.
"""

from ..base.errors import K3Error
from ..text.chat import template_variables
from ..text.tokenizer import NAMED_TOKENS
from .errors import bad
from .schema import ChatRequest

SET_BY_THE_SERVER = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "raise_exception", "strftime_now", "namespace", "dict"}
) | frozenset(NAMED_TOKENS)


def rendering(text, req) -> dict:
    """The render options a ChatRequest or TokenizeRequest asks for (text/chat.py's render_chat keywords), each
    checked against the checkpoint's template (`text`: offline/prompts.py's TextTools)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise bad(
            "continue_final_message and add_generation_prompt cannot both be true: the last message is continued, "
            "or the assistant's turn is opened (set add_generation_prompt=false)",
            "continue_final_message",
        )
    documents = req.documents if isinstance(req, ChatRequest) else None
    variables = req.chat_template_kwargs or {}
    if variables or documents:
        reads = template_reads(text)
        for name in variables:
            if name in SET_BY_THE_SERVER:
                raise bad(f"chat_template_kwargs.{name} is set by the server, not by a request", "chat_template_kwargs")
            if name not in reads:
                raise bad(
                    f"chat_template_kwargs.{name}: the checkpoint's chat template reads no variable {name!r}, so it "
                    "would change nothing",
                    "chat_template_kwargs",
                )
        if documents and "documents" not in reads:
            raise bad(
                "the checkpoint's chat template does not read documents, so they would change nothing", "documents"
            )
    out = dict(add_generation_prompt=req.add_generation_prompt, continue_final=req.continue_final_message)
    return out | ({"variables": variables} if variables else {}) | ({"documents": documents} if documents else {})


def template_reads(text) -> frozenset[str]:
    """The variables the checkpoint's template reads (`text`: offline/prompts.py's TextTools)."""
    if text.template is None:
        return frozenset()
    try:
        return template_variables(*text.template)
    except K3Error as exc:
        raise bad(str(exc), "messages") from None


class ChatEcho:
    """Chat's echo, as completions.py's Echo is completions': the text each choice's answer starts with."""

    def __init__(self, text: str):
        self.text = text

    @staticmethod
    def of(req: ChatRequest) -> "ChatEcho | None":
        """The request's echo: None without it, or when the last message is not of the answer's role."""
        if not req.echo:
            return None
        last = req.messages[-1]
        role = "assistant" if req.add_generation_prompt else last.get("role")
        content = last.get("content") if last.get("role") == role else None
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        return ChatEcho(content) if content else None

    def head(self, choice: int, entries) -> tuple[str, None]:
        return self.text, None

    def whole(self, body: dict, prompt_entries: list) -> dict:
        for choice in body["choices"]:
            choice["message"]["content"] = self.text + (choice["message"]["content"] or "")
        return body
