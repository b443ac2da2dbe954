"""The logprob formats: OpenAI's legacy completions object, the chat object, and vLLM's
prompt_logprobs (a mixin of OpenAIServer: it decodes through self.decode)."""
from __future__ import annotations

import math

from pagedserve.server.request_handling import Prompt

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf


class LogprobFormats:
    def _token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    @staticmethod
    def _lp(value: float) -> float:
        return value if math.isfinite(value) else _LOGPROB_FLOOR

    def completion_logprobs(self, logprobs: list, offset: int) -> dict:
        """OpenAI's completions logprobs object; an entry of None (the first prompt token,
        which nothing predicts) has null token_logprobs and top_logprobs."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(self._lp(lp.logprob))
            top = {text: self._lp(lp.logprob)}
            for tid, v in lp.top:
                top.setdefault(self._token_text(tid), self._lp(v))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def echo_logprobs(self, prompt: Prompt, prompt_logprobs: list) -> dict:
        """The prompt's part of an echo's logprobs: its first token has null logprobs."""
        first_text = self._token_text(prompt.token_ids[0])
        rest = self.completion_logprobs(prompt_logprobs[1:], len(first_text))
        return {"tokens": [first_text] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}

    def prompt_logprobs_json(self, prompt_logprobs: list | None) -> list | None:
        """vLLM's `prompt_logprobs`: null for the first prompt token (nothing predicts it), then
        per token {token id (a string): {"logprob", "rank", "decoded_token"}} for the prompt's own
        token (its rank in the vocabulary) and the top k (ranks 1..k)."""
        if prompt_logprobs is None:
            return None
        out: list[dict | None] = []
        for lp in prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": self._lp(lp.logprob), "rank": lp.rank,
                                        "decoded_token": self._token_text(lp.token_id)}}
            for rank, (tid, value) in enumerate(lp.top, 1):
                entry.setdefault(str(tid), {"logprob": self._lp(value), "rank": rank,
                                            "decoded_token": self._token_text(tid)})
            out.append(entry)
        return out

    @staticmethod
    def join_logprobs(*parts: dict | None) -> dict | None:
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return {key: [v for p in parts for v in p[key]] for key in parts[0]}

    def chat_logprobs(self, logprobs: list, top_n: int) -> dict:
        content = []
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            content.append({
                "token": text, "logprob": self._lp(lp.logprob), "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self._token_text(tid)), "logprob": self._lp(v),
                                  "bytes": list(t.encode())} for tid, v in lp.top[:top_n]],
            })
        return {"content": content}
