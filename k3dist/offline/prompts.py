"""What the user asked for, as engine Prompts: text (plain or through the chat template), token ids, a JSONL file of
requests, or seeded random ids for benchmarks. Every prompt is checked against the vocabulary and `cache.cap` here,
before any weight is read."""

from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..base.errors import K3Error
from ..config import ModelConfig
from ..engine.sampling import BadValue, SamplingParams
from ..engine.sequences import Prompt
from ..settings import GenerateSettings, Settings


class TextTools:
    """The checkpoint's tokenizer and chat template, loaded only when text is involved."""

    def __init__(self, model_dir: Path, cfg_raw: dict | None = None, cap: int | None = None):
        """`cap`: cache.cap, when prompts are for slots: texts and renders longer than it could hold are refused."""
        from ..text.chat import load_chat_template
        from ..text.tokenizer import load_tokenizer

        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir, cfg_raw)
        if self.tokenizer is not None and cap is not None:
            self.tokenizer.hold(cap)
        self.template = load_chat_template(model_dir)

    def need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise K3Error(f"{what} is text, but {self.model_dir} has no tokenizer (tiktoken.model or tokenizer.json)")
        return self.tokenizer

    def encode_chat(self, messages: list, what: str, tools: list | None = None, **rendering) -> list[int]:
        """`rendering`: text/chat.py's render_chat options (add_generation_prompt, documents, variables,
        continue_final)."""
        from ..text.chat import render_chat

        tok = self.need_tokenizer(what)
        if self.template is None:
            raise K3Error(f"{what} asks for the chat format, but {self.model_dir} has no chat template")
        text, source = self.template
        limit = {} if tok.max_chars is None else {"max_chars": tok.max_chars}  # a render past it fails at once
        return tok.encode(render_chat(text, source, messages, tools, **limit, **rendering, **tok.named_tokens))


def _messages(text: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


DEFAULT_PROMPT_LEN = 16  # generate.prompt=null without a prompt_len


def seeded_ids(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts for benchmarks: the same ids for the same (batch, length, vocab, seed) everywhere."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def cli_sampling(g: GenerateSettings, seed: int | None = None) -> SamplingParams:
    """The sampling generate.* asks for (the CLI's door: DOORS' `cli` names), seeded `seed` (None: generate.seed)."""
    given = {f"generate.{name}": value for name, value in asdict(g).items()}
    try:
        sampling = SamplingParams.taken("cli", given)
    except BadValue as exc:
        raise K3Error(f"{exc}") from None
    return sampling if seed is None else replace(sampling, seed=seed)


def build_prompts(s: Settings, cfg: ModelConfig, text: TextTools | None) -> list[Prompt]:
    g = s.generate
    base = dict(max_new_tokens=g.max_new_tokens, stop=g.stop)
    if g.prompts is not None:
        if g.prompt_len is not None:
            raise K3Error("generate.prompt_len (random prompts) and generate.prompts (a requests file) are exclusive")
        prompts = _from_file(g.prompts, s, text, base)
    else:
        if g.prompt_len is not None or g.prompt is None:  # prompt_len wins over the default text prompt
            rows = seeded_ids(g.batch, g.prompt_len or DEFAULT_PROMPT_LEN, cfg.vocab_size, g.seed)
        elif isinstance(g.prompt, str):
            what = "generate.prompt"
            ids = (
                text.encode_chat(_messages(g.prompt, g.system), what)
                if g.chat
                else _tools(text).need_tokenizer(what).encode(g.prompt)
            )
            rows = [ids] * g.batch
        else:
            rows = [list(g.prompt)] * g.batch
        # copies of one prompt draw differently when sampling: each slot its own seed
        prompts = [
            Prompt(f"seq-{i}", tuple(ids), sampling=cli_sampling(g, g.seed + i), **base) for i, ids in enumerate(rows)
        ]
    for p in prompts:
        _check(p, cfg, s)
    if any(p.stop for p in prompts) and (text is None or text.tokenizer is None):
        raise K3Error("generate.stop needs the checkpoint's tokenizer to match text, and this checkpoint has none")
    return prompts


def _encode_text(prompt: str, what: str, s: Settings, text: TextTools) -> list[int]:
    """A plain prompt as it is, or as the user turn of a chat (generate.chat, with generate.system)."""
    if s.generate.chat:
        return text.encode_chat(_messages(prompt, s.generate.system), what)
    return text.need_tokenizer(what).encode(prompt)


def _tools(text: TextTools | None) -> TextTools:
    if text is None:  # pragma: no cover - the job always loads text tools when text is given
        raise K3Error("text prompts need the checkpoint's tokenizer")
    return text


def _from_file(path: str, s: Settings, text: TextTools | None, base: dict) -> list[Prompt]:
    from ..text.prompt_file import read_requests

    out = []
    for r in read_requests(path):
        where = f"{path}:{r.index + 1} (request {r.id})"
        if r.ids is not None:
            ids = list(r.ids)
        elif r.messages is not None:
            ids = _tools(text).encode_chat(r.messages, where, r.tools)
        else:
            ids = _encode_text(r.prompt, where, s, _tools(text))
        own = {k: v for k, v in asdict(r).items() if v is not None}
        budget = {k: (tuple(v) if k == "stop" else v) for k, v in own.items() if k in ("max_new_tokens", "stop")}
        try:  # the file's own sampling fields over generate.*'s (DOORS' `file` names), each line seeded its own
            sampling = SamplingParams.taken("file", own, cli_sampling(s.generate, s.generate.seed + r.index))
        except BadValue as exc:
            raise K3Error(f"{where}: {exc}") from None
        out.append(Prompt(r.id, tuple(ids), sampling=sampling, **(base | budget)))
    return out


def _check(p: Prompt, cfg: ModelConfig, s: Settings) -> None:
    if not p.ids:
        raise K3Error(f"request {p.id}: the prompt is empty")
    bad = [t for t in p.ids if t >= cfg.vocab_size or t < 0]
    if bad:
        raise K3Error(f"request {p.id}: token ids {bad[:5]} are outside the vocabulary (vocab_size={cfg.vocab_size})")
    need = len(p.ids) + p.max_new_tokens
    if need > s.cache.cap:
        raise K3Error(
            f"request {p.id}: prompt of {len(p.ids)} tokens + max_new_tokens={p.max_new_tokens} exceeds "
            f"cache.cap={s.cache.cap} (raise cache.cap to at least {need})"
        )
