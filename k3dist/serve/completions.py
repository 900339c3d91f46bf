"""Completions' prompts and echo.

`prompt` is one prompt or a batch, as OpenAI and vLLM take it: a string, a list of strings, a list of token ids, or
a list of id lists. Each prompt is checked on its own (ids in the vocabulary, prompt + max_tokens within
`cache.cap`), with its number in the error, and gets `n` choices, numbered prompt-major (`index = i * n + j`);
choice j of every prompt is seeded `seed + j`, so a prompt's choices in a batch are the ones it has alone.

`echo` puts each prompt's text in front of its choices' text; with `logprobs` the tokens, log-probabilities, top
log-probabilities and text offsets cover the prompt's tokens first (the first token's log-probability is null:
nothing precedes it), scored in the prefill (engine/prompt_logprobs.py), then the generated ones. This is what
evaluators' log-likelihood requests read (lm-eval: `max_tokens: 1, logprobs: 1, echo: true`).
"""

from dataclasses import dataclass

from ..engine.sampling import SamplingParams
from ..engine.sequences import Prompt
from .errors import APIError, bad
from .protocol import budget, choices
from .schema import CompletionRequest

MAX_PROMPTS = 1024  # prompts one body may hold (all their choices must also fit the slots and the queue)


@dataclass(frozen=True)
class Batch:
    """A request's prompts: their ids, their text (what echo puts in front), and the choices each gets."""

    ids: list[list[int]]
    texts: list[str]
    n: int

    def prompt_of(self, choice: int) -> int:
        return choice // self.n

    @property
    def tokens(self) -> int:
        return sum(map(len, self.ids))


def prompt_batch(req: CompletionRequest, tokenizer, vocab: int) -> Batch:
    """The prompts of a completions request, each tokenized (text) or checked against the vocabulary (ids)."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = prompt or [[]]
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} in one request", "prompt")
    ids, texts = [], []
    for i, p in enumerate(prompts):
        where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
        if isinstance(p, str):
            ids.append(tokenizer.encode(p))
            texts.append(p)
            continue
        if out := [t for t in p if t < 0 or t >= vocab]:
            raise bad(f"{where}: token ids {out[:5]} are outside the vocabulary (0..{vocab - 1})", "prompt")
        ids.append(list(p))
        texts.append(tokenizer.decode(p) if req.echo else "")
    return Batch(ids, texts, req.n)


def budgets(req: CompletionRequest, batch: Batch, cap: int) -> list[int]:
    """Each prompt's token budget (protocol.budget), a refusal naming the prompt's number in a batch."""
    out = []
    for i, ids in enumerate(batch.ids):
        try:
            out.append(budget(req, len(ids), cap))
        except APIError as exc:
            if len(batch.ids) == 1:
                raise
            raise bad(f"prompt[{i}]: {exc.message}", exc.param) from None
    return out


def batch_choices(
    req: CompletionRequest,
    request_id: str,
    batch: Batch,
    limits: list[int],
    room: int,
    sampling: SamplingParams,
    extra: dict | None = None,
) -> list[Prompt]:
    """Every prompt's choices, prompt-major; refused when they could never all be queued (`room`); `extra`: more
    Prompt fields (grammar, stop ids, detokenizing)."""
    count = len(batch.ids) * req.n
    if len(batch.ids) > 1 and count > room:
        raise bad(f"{len(batch.ids)} prompts x n={req.n} = {count} choices can never be queued: {room} fit", "prompt")
    score = req.logprobs if req.echo else None
    out: list[Prompt] = []
    for i, (ids, max_new) in enumerate(zip(batch.ids, limits, strict=True)):
        at = dict(first=i * req.n, sampling=sampling, score=score, extra=extra)
        out += choices(req, request_id, ids, max_new, req.logprobs, **at)
    return out


class Echo:
    """A request's echo: each choice's prompt text, and with logprobs its prompt tokens' log-probabilities."""

    def __init__(self, batch: Batch, shape, scored: bool):
        self.batch, self.shape, self.scored = batch, shape, scored

    def head(self, choice: int, entries: list | None) -> tuple[str, dict | None]:
        """(the prompt's text, the logprobs object of its tokens or None) for choice `choice`."""
        p = self.batch.prompt_of(choice)
        if not self.scored:
            return self.batch.texts[p], None
        texts = [self.shape.token_text(t)[0] for t in self.batch.ids[p]]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        entries = entries or [None] * len(texts)
        return self.batch.texts[p], {
            "tokens": texts,
            "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else self.shape.top_by_text(e[1]) for e in entries],
            "text_offset": offsets,
        }

    def whole(self, body: dict, prompt_entries: list) -> dict:
        """A whole completions body with each choice's prompt in front (prompt_entries: per choice, its scores)."""
        for choice, entries in zip(body["choices"], prompt_entries, strict=True):
            text, head = self.head(choice["index"], entries)
            choice["text"] = text + choice["text"]
            if head is not None:
                choice["logprobs"] = join(head, choice["logprobs"], len(text))
        return body


def join(head: dict, tail: dict | None, shift: int) -> dict:
    """The prompt's logprobs object followed by the generated tokens' (their offsets moved past the prompt's text)."""
    if tail is None:
        return head
    out = {key: head[key] + tail[key] for key in ("tokens", "token_logprobs", "top_logprobs")}
    return out | {"text_offset": head["text_offset"] + [o + shift for o in tail["text_offset"]]}
