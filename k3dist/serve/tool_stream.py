"""What the two tool-call parsers (tools_k2.py, tools_k3.py) share: a call as OpenAI gives it, its two stream
deltas, and how much of a text's end to hold back while it could still become a marker."""

TOOL_INDEX = r"[0-9]{1,4}"  # a call's number, as the model writes it under a grammar


def call_object(name: str, index: int | str, arguments: str) -> dict:
    """One call as OpenAI gives it. Its id is `functions.NAME:INDEX`, the form Kimi's models write (K2) or are
    shown (K3 numbers its calls in the answer; the id is only ever read back by the server's own template)."""
    return {"id": f"functions.{name}:{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def call_deltas(call: dict, index: int) -> list[dict]:
    """A complete call's two stream deltas: index, id, type and name first; then its whole arguments."""
    first = {"index": index, "id": call["id"], "type": "function"}
    return [
        first | {"function": {"name": call["function"]["name"], "arguments": ""}},
        {"index": index, "function": {"arguments": call["function"]["arguments"]}},
    ]


def held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could still become the start of one of `markers`."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0
