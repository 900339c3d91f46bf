"""What flows through the engine: a request made ready (Prompt), its result (Completion), and what each step of the
engine reports about it (Event)."""

from collections.abc import Callable
from dataclasses import dataclass, field

from .sampling import SamplingMode, SamplingParams


@dataclass(frozen=True)
class Prompt:
    """A request made ready for the engine: token ids and its own budget, sampling, stops and log-probabilities."""

    id: str
    ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()  # how its tokens are chosen, on every rank (sampling.py)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely (k <= 20)
    prompt_logprobs: int | None = None  # the same for every prompt token (scored in the prefill; prompt_logprobs.py)
    grammar: Callable | None = None  # () -> a grammar matcher (engine/grammar.py), rank 0 only; needs sampling.grammar
    stop_ids: tuple[int, ...] = ()  # token ids that end the sequence as an eos id does
    ignore_eos: bool = False  # eos ids do not end it (stop_ids still do)
    skip_special: bool = False  # the tokenizer's special tokens (eos aside) add no text
    spaced_special: bool = False  # with their text: a space between a special token and the text beside it
    priority: int = 0  # waiting prompts take free slots lowest first, then first come (vLLM's priority)

    @property
    def mode(self) -> SamplingMode:
        return self.sampling.mode

    @property
    def min_tokens(self) -> int:
        return self.sampling.min_tokens


@dataclass
class Completion:
    id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str = "length"  # stop (eos or a stop string), length (the budget), abort
    top_logits: list = field(default_factory=list)  # per token: [[token_id, logit] x 5]
    logprobs: list = field(default_factory=list)  # with Prompt.logprobs: per token (logprob, [(id, logprob) x k])


@dataclass
class Event:
    """What one engine step did for one request: new tokens (and their text), and on the last event of a request its
    finish reason and whole completion."""

    id: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)  # with Prompt.logprobs: per new token, as in Completion.logprobs
    prompt_logprobs: list | None = None  # with Prompt.prompt_logprobs, on its first event: per prompt token, None first
    finish_reason: str | None = None
    completion: Completion | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
