"""The offline run: a thin loop over the engine. Every prompt goes in at once (each takes a slot as one frees up),
the engine runs windows until every request has ended, and the other ranks are told to stop."""

from collections.abc import Callable

from ..engine.engine import Engine
from ..engine.sequences import Completion, Event, Prompt


def run_offline(engine: Engine, prompts: list[Prompt], on_event: Callable[[Event], None]) -> list[Completion]:
    """Completions in input order; `on_event` sees every event as it comes (streaming, progress)."""
    for prompt in prompts:
        engine.add(prompt)
    done: dict[str, Completion] = {}
    while engine.busy:
        for event in engine.run_window():
            on_event(event)
            if event.finished:
                done[event.id] = event.completion
    engine.shutdown()
    return [done[p.id] for p in prompts]
