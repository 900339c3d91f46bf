"""Response bodies and stream chunks in OpenAI's shapes, for completions (`text_completion`) and chat
(`chat.completion`, `chat.completion.chunk`), with usage and log-probabilities. A chat answer's reasoning, where the
checkpoint's format writes it apart (K3's think tag, tools.py), is the message's `reasoning_content`, as vLLM and
SGLang give it."""

import time


class Shape:
    """What one request's responses share: its id, model, creation time and kind (chat or completions)."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer, token_ids: list[int] | None = None):
        """`token_ids`: the prompt's ids, when the request asked for ids back (return_token_ids)."""
        self.id, self.model, self.chat, self.tokenizer = request_id, model, chat, tokenizer
        self.created, self.prompt_ids = int(time.time()), token_ids

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.decode_bytes([token])
        return raw.decode("utf-8", errors="replace"), list(raw)

    def top_by_text(self, top: list) -> dict:
        """[(id, logprob)] best first -> {token text: logprob}; tokens sharing a text keep the best one's (so the
        largest value is always the best token's, which evaluators compare a token's log-probability with)."""
        out: dict = {}
        for t, v in top:
            out.setdefault(self.token_text(t)[0], v)
        return out

    def logprobs(self, entries: list, tokens: list[int], offset: int = 0) -> dict | None:
        """Per token (logprob, [(id, logprob)...]) -> the API's logprobs object, or None when none were asked."""
        if not entries:
            return None
        if self.chat:
            content = []
            for token, (lp, top) in zip(tokens, entries, strict=False):
                text, raw = self.token_text(token)
                tops = [dict(zip(("token", "bytes"), self.token_text(t), strict=True)) | {"logprob": v} for t, v in top]
                content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
            return {"content": content}
        texts = [self.token_text(t)[0] for t in tokens]
        offsets, at = [], offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [self.top_by_text(top) for _, top in entries],
            "text_offset": offsets,
        }

    def whole(self, results: list[dict], usage: dict) -> dict:
        """The non-streamed response: results[i] = {text, finish_reason, logprobs, tokens, reasoning?, tool_calls?}
        of choice i."""
        choices = []
        for i, r in enumerate(results):
            logprobs = self.logprobs(r["logprobs"], r["tokens"])
            if self.chat:
                message = {"role": "assistant", "content": r["text"]}
                message |= {"reasoning_content": r["reasoning"]} if r.get("reasoning") else {}
                message |= {"tool_calls": r["tool_calls"]} if r.get("tool_calls") else {}
                choice = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": r["finish"]}
            else:
                choice = {"index": i, "text": r["text"], "logprobs": logprobs, "finish_reason": r["finish"]}
            choices.append(choice | ({"token_ids": r["tokens"]} if self.prompt_ids is not None else {}))
        body = self._head("chat.completion" if self.chat else "text_completion") | {"choices": choices, "usage": usage}
        return body | ({"prompt_token_ids": self.prompt_ids} if self.prompt_ids is not None else {})

    def chunk(
        self,
        index: int,
        text: str,
        finish: str | None = None,
        *,
        logprobs=None,
        first: bool = False,
        usage: bool = False,
        tokens=(),
        tool_calls=(),
        reasoning: str = "",
    ) -> dict:
        """One streamed piece of choice `index` (the first chat delta carries the role; `tool_calls`: call deltas;
        `reasoning`: more of the reasoning)."""
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            delta |= {"reasoning_content": reasoning} if reasoning else {}
            delta |= {"tool_calls": list(tool_calls)} if tool_calls else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.prompt_ids is not None:
            choice["token_ids"] = list(tokens)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [choice]} | ({"usage": None} if usage else {})

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
