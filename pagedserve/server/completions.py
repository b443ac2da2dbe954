"""/v1/completions: the request's checks and prompts, the response, and its stream's choices."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from pagedserve.engine.output_processor import OutputKind
from pagedserve.outputs import RequestOutput
from pagedserve.sampling import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import CompletionRequest
from pagedserve.server.request_handling import Prompt, count_prompts


class Completions:
    def prepare_completion(self, body: CompletionRequest):
        self.check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of: only best_of == n is supported", "best_of")
        if body.suffix:
            raise APIError(400, "suffix: not supported", "suffix")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 is only allowed with echo=true (score the prompt, generate nothing)",
                           "max_tokens")
        # echo + logprobs: the prompt tokens' logprobs come first (OpenAI's legacy scoring).
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        # max_tokens=0 runs one step and drops its token: the engine always samples at the prompt's end.
        max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
        params = self.sampling_params(body, max_tokens, body.logprobs, self.structured_constraint(body),
                                      prompt_logprobs)
        self.check_num_seqs(count_prompts(body.prompt), params.n)
        prompts = self.completion_prompts(body.prompt)
        self.validate(prompts, params)
        return prompts, params

    def _echo(self, body, prompt: Prompt) -> str:
        if not body.echo:
            return ""
        return prompt.text if prompt.text is not None else self.decode(prompt.token_ids)

    def _completion_choice(self, body, prompt: Prompt, comp, prompt_logprobs, first: bool, offset: int) -> dict:
        """One completion choice (or its delta). `offset`: where its logprobs' text_offset goes on,
        the length of the tokens already sent in this choice's logprobs (0 for the first).
        text_offset is one running offset over the choice's tokens, echoed prompt included: each
        token's offset is the length of the tokens before it joined (as vLLM counts it)."""
        prefix = self._echo(body, prompt) if first else ""
        text, logprobs = comp.text, comp.logprobs
        if body.max_tokens == 0:  # generated nothing: the one step's token is not part of the answer
            text, logprobs = "", ([] if logprobs is not None else None)
        lp = None
        if logprobs is not None:
            echoed = self.echo_logprobs(prompt, prompt_logprobs) if first and prompt_logprobs is not None else None
            lp = self.join_logprobs(echoed, self.completion_logprobs(logprobs, self._logprobs_end(echoed, offset)))
        return {"text": prefix + text, "logprobs": lp, "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason}

    @staticmethod
    def _logprobs_end(lp: dict | None, offset: int) -> int:
        """The text_offset that follows a logprobs object's last token (`offset` if it has none)."""
        if not lp or not lp["tokens"]:
            return offset
        return lp["text_offset"][-1] + len(lp["tokens"][-1])

    async def completion(self, body: CompletionRequest, prompts: list[Prompt], params: SamplingParams,
                         received: float | None = None) -> dict:
        rid = f"cmpl-{uuid.uuid4().hex}"
        queue, ids = self.submit(rid, prompts, params, body.priority, OutputKind.FINAL_ONLY, received)
        final: dict[int, RequestOutput] = {}
        async for i, out in self.results(queue, ids):
            final[i] = out
        choices = []
        num_generated = 0
        for i, prompt in enumerate(prompts):
            scored = self.prompt_logprobs_json(final[i].prompt_logprobs)
            for comp in final[i].outputs:
                num_generated += 0 if body.max_tokens == 0 else len(comp.token_ids)
                choice = self._completion_choice(body, prompt, comp, final[i].prompt_logprobs, True, 0)
                choices.append({"index": i * params.n + comp.index, **choice})
                if scored is not None:  # as vLLM: on each choice of the prompt
                    choices[-1]["prompt_logprobs"] = scored
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(prompts, num_generated, final.values())}

    def completion_stream(self, body: CompletionRequest, rid: str, prompts: list[Prompt], params: SamplingParams,
                          queue: asyncio.Queue, ids: list[str]) -> AsyncIterator[str]:
        lp_offset: dict[int, int] = {}  # choice index -> the text_offset its next token gets
        scored: dict[int, list] = {}  # prompt index -> its prompt logprobs (they come with its first output)

        def make_choice(index, comp, first, out):
            offset = lp_offset.get(index, 0)
            if out.prompt_logprobs is not None:
                scored[index // params.n] = out.prompt_logprobs
            choice = self._completion_choice(body, prompts[index // params.n], comp, scored.get(index // params.n),
                                             first, offset)
            lp_offset[index] = self._logprobs_end(choice["logprobs"], offset)
            return {"index": index, **choice}

        return self._sse(rid, "text_completion", body.stream_options, prompts, params.n, queue, ids, make_choice,
                         count_tokens=body.max_tokens != 0)
