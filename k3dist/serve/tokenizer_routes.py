"""The tokenizer routes vLLM serves, which evaluators use instead of loading the checkpoint's tokenizer themselves
(lm-eval's `tokenizer_backend=remote`; Kimi's own tokenizer would need remote code): `POST /tokenize` (a prompt,
or chat messages through the checkpoint's template), `POST /detokenize` and `GET /tokenizer_info`. They want the
server's API key as the /v1 routes do, and refuse bad input with the same envelopes.

`add_special_tokens` is taken and honoured: the checkpoint's tokenizer adds no special token to a text (no BOS; a
special token's own text in the input still becomes its id), so both values give the ids the server's own prompts
get.
"""

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ..base.errors import K3Error
from ..text.chat import render_chat
from .chat_prompt import rendering
from .errors import bad
from .fields import refuse_unserved
from .protocol import parse_body
from .schema import DetokenizeRequest, TokenizeRequest

PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # keyed like /v1 (app.py's _Auth)


def add_tokenizer_routes(app: FastAPI, front, read_body) -> None:
    """`read_body(request, limit)`: the body, 413 past serve.max_body (app.py's)."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await run_in_threadpool(
            parse_body, await read_body(request, front.max_body), TokenizeRequest, front.unknown
        )
        refuse_unserved(req)
        _check_model(front, req.model)
        tokens = await run_in_threadpool(_tokenize, front, req)
        body = {"count": len(tokens), "max_model_len": front.cap, "tokens": tokens}
        if req.return_token_strs:
            body["token_strs"] = [front.text.tokenizer.decode_bytes([t]).decode("utf-8", "replace") for t in tokens]
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await run_in_threadpool(
            parse_body, await read_body(request, front.max_body), DetokenizeRequest, front.unknown
        )
        _check_model(front, req.model)
        if out := [t for t in req.tokens if t < 0 or t >= front.vocab]:
            raise bad(f"token ids {out[:5]} are outside the vocabulary (0..{front.vocab - 1})", "tokens")
        return {"prompt": await run_in_threadpool(front.text.tokenizer.decode, req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return info(front)


def _check_model(front, model: str | None) -> None:
    if model is not None and model != front.model_name:
        raise bad(f"model {model!r} is not served here (this server serves {front.model_name!r})", "model")


def _tokenize(front, req: TokenizeRequest) -> list[int]:
    """A prompt's ids (any length within serve.max_body, as vLLM counts a document's tokens), or messages' through
    the checkpoint's template (their render is bounded as a chat prompt's is)."""
    if (req.prompt is None) == (req.messages is None):
        raise bad("a tokenize request has either a prompt or messages", "prompt" if req.prompt is None else "messages")
    tok = front.text.tokenizer
    if req.prompt is not None:
        return tok.encode_any(req.prompt)
    if front.text.template is None:
        raise bad(f"{front.text.model_dir} has no chat template to render messages with", "messages")
    template, source = front.text.template
    options = rendering(front.text, req)
    try:
        text = render_chat(template, source, req.messages, req.tools, **options, **tok.named_tokens)
    except K3Error as exc:
        raise bad(str(exc), "messages") from None
    return tok.encode_any(text)


def info(front) -> dict:
    """The tokenizer's named tokens (from its config, else the ids generation stops on and begins with), its chat
    template and the longest sequence the server takes."""
    tok = front.text.tokenizer
    named = dict(tok.named_tokens)
    if "eos_token" not in named and tok.eos_ids:
        named["eos_token"] = tok.decode([tok.eos_ids[0]])
    if "bos_token" not in named and tok.bos_id is not None:
        named["bos_token"] = tok.decode([tok.bos_id])
    template = front.text.template[0] if front.text.template else None
    return {
        "tokenizer_class": type(tok.backend).__name__,
        "eos_token": named.get("eos_token"),
        "bos_token": named.get("bos_token"),
        "pad_token": named.get("pad_token"),
        "unk_token": named.get("unk_token"),
        "chat_template": template,
        "model_max_length": front.cap,
        "vocab_size": front.vocab,
    }
