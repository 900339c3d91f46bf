"""What flows through the engine: a request made ready (Prompt), its result (Completion), and what each step of the
engine reports about it (Event)."""

from collections.abc import Callable
from dataclasses import dataclass, field

from .logits import Processing
from .sampling import SamplingMode


@dataclass(frozen=True)
class Prompt:
    """A request made ready for the engine: token ids and its own budget, sampling, stops and log-probabilities."""

    id: str
    ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely (k <= 20)
    prompt_logprobs: int | None = None  # the same for every prompt token (scored in the prefill; prompt_logprobs.py)
    processing: Processing | None = None  # logit processors (engine/logits.py); None: none
    grammar: Callable | None = None  # () -> a grammar matcher (engine/grammar.py), rank 0 only; needs `processing`
    stop_ids: tuple[int, ...] = ()  # token ids that end the sequence as an eos id does
    ignore_eos: bool = False  # eos ids do not end it (stop_ids still do)

    @property
    def mode(self) -> SamplingMode:
        return SamplingMode.of(
            self.temperature, self.top_p, self.top_k, self.processing.level if self.processing else 0
        )

    @property
    def min_tokens(self) -> int:
        return self.processing.min_tokens if self.processing else 0


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
