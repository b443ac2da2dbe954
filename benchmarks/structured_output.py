"""Output tok/s with and without a JSON-schema constraint on the same load, in one run.

The constrained run goes first; each request's output length is recorded, and the
unconstrained run then generates exactly that many tokens per request (ignore_eos), so
both runs compute the same tokens and differ only by the grammar work: the per-step
bitmask (llguidance), its unpacking and masked_fill in the sampler, and the matcher's
advance per token. Also printed: the share of the constrained run's wall time spent in
that grammar work, timed around the runner's calls.

    python benchmarks/structured_output.py                 # the built-in default model
    python benchmarks/structured_output.py --num-prompts 64 --items 12
"""
from __future__ import annotations

import argparse
import time

from common import write_result
from pagedserve import LLM, SamplingParams
from pagedserve.structured import StructuredOutputsParams
from pagedserve.structured import compiler as compiler_module
from pagedserve.worker import sampler as sampler_module


def record_schema(num_items: int) -> dict:
    item = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "kind": {"enum": ["file", "dir", "link"]},
        "size": {"type": "number", "minimum": 0}},
        "required": ["name", "id", "kind", "size"], "additionalProperties": False}
    return {"type": "array", "items": item, "minItems": num_items, "maxItems": num_items}


class GrammarTimer:
    """Wall seconds spent in the grammar's share of sampling (mask fill + apply, and accept)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._patches = []

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, name, timed)
        self._patches.append((owner, name, original))

    def undo(self) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list[int], list[str]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, [len(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the built-in default model")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--items", type=int, default=8, help="records per JSON array (sets the output length)")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=1024, kv_cache_memory="1GiB", max_num_seqs=args.num_prompts)
    prompts = [f"# listing {i}\n" for i in range(args.num_prompts)]
    schema = record_schema(args.items)
    spec = StructuredOutputsParams(json=schema)
    llm.engine.input_processor.compile_grammar(SamplingParams(structured_outputs=spec))  # compile outside the timing
    warm = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 2
    llm.generate(prompts[:2], warm, use_tqdm=False)

    timer = GrammarTimer()
    timer.wrap(sampler_module.Sampler, "_apply_grammar")
    timer.wrap(compiler_module.GrammarMatcher, "accept")
    constrained = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=900, structured_outputs=spec)
                   for i in range(args.num_prompts)]
    t_json, lengths, texts = run(llm, prompts, constrained)
    timer.undo()
    free = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=n, ignore_eos=True)
            for i, n in enumerate(lengths)]
    t_free, free_lengths, _ = run(llm, prompts, free)
    assert free_lengths == lengths
    tokens = sum(lengths)
    result = {
        "num_prompts": args.num_prompts, "output_tokens": tokens, "items_per_answer": args.items,
        "unconstrained_tok_s": tokens / t_free, "json_schema_tok_s": tokens / t_json,
        "ratio_json_over_free": t_free / t_json,
        "grammar_share_of_constrained_wall": timer.seconds / t_json,
        "grammar_ms_per_token": 1e3 * timer.seconds / tokens,
    }
    print(f"{args.num_prompts} requests, {tokens} output tokens each way (same tokens per request), "
          f"model {llm.engine.model_name}, temperature {args.temperature}")
    print(f"  unconstrained  {result['unconstrained_tok_s']:9.1f} tok/s")
    print(f"  json_schema    {result['json_schema_tok_s']:9.1f} tok/s")
    print(f"  ratio (json / unconstrained): {result['ratio_json_over_free']:.3f}")
    print(f"  grammar work: {100 * result['grammar_share_of_constrained_wall']:.1f}% of the constrained run's wall "
          f"time, {result['grammar_ms_per_token']:.3f} ms per token")
    print(f"  sample answer: {texts[0][:120]}...")
    print(f"wrote {write_result('structured_output', {'args': vars(args), 'results': result})}")


if __name__ == "__main__":
    main()
