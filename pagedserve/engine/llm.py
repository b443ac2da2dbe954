"""LLM: offline generation, vLLM-style: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import time
from typing import Sequence

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import Engine
from pagedserve.outputs import RequestOutput
from pagedserve.sampling import SamplingParams

PromptInput = str | Sequence[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = set(engine_args) - set(EngineConfig.knob_names())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = Engine(config)
        return llm

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); a no-op otherwise."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's LLM.reset_prefix_cache); False, and nothing
        changes, while a request holds blocks. With KV events on, an AllBlocksCleared follows."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts")
        # Validate everything before queueing anything: bad input changes nothing.
        engine = self.engine
        processor = engine.input_processor
        token_lists = [processor.tokenize(p) if isinstance(p, str) else list(p) for p in prompt_list]
        for toks, params in zip(token_lists, params_list):
            processor.validate(toks, params)
        ids = []
        for i, (p, toks, params) in enumerate(zip(prompt_list, token_lists, params_list)):
            rid = f"gen-{engine.next_request_id()}"
            engine.add_request(rid, p, params, priority=priority[i] if priority else 0, prompt_token_ids=toks)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts) -> list:
        if isinstance(prompts, str) or isinstance(prompts, dict):
            prompts = [prompts]
        elif prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            out.append(p)
        return out

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        engine = self.engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s")
        finally:
            bar.close()
        return [done[i] for i in ids]
