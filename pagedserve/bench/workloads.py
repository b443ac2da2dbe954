"""Workloads: what requests arrive, when, and how long they are.

The same generators feed the HTTP load test (`pagedserve bench`) and the simulator
(`pagedserve simulate`), so a simulated run and a real one see the same traffic for the
same seed. Torch-free and numpy-light on purpose.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = ("random", "sharegpt", "long-context", "prefix-repetition", "calibration")


@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int] | None  # exact tokens (random datasets) ...
    prompt: str | None                  # ... or text (ShareGPT)
    prompt_len: int
    output_len: int
    arrival_time: float = 0.0           # seconds after the run starts
    ignore_eos: bool = True             # synthetic data: generate exactly output_len tokens
    tags: dict = field(default_factory=dict)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Inter-arrival gaps ~ Gamma(shape=burstiness, mean=1/rate): burstiness 1 is Poisson,
    below 1 burstier, above 1 more regular. rate=inf sends everything at t=0."""
    if request_rate <= 0:
        raise ValueError(f"request_rate: must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness: must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        out.append(t)
    return out


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # Skip the lowest ids, where special tokens usually live.
    low = min(16, vocab_size - 1)
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def random_dataset(n: int, input_len: int = 1024, output_len: int = 128, range_ratio: float = 0.0,
                   vocab_size: int = 32000, seed: int = 0) -> list[WorkloadRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio: must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, o = _length(rng, input_len, range_ratio), _length(rng, output_len, range_ratio)
        out.append(WorkloadRequest(_tokens(rng, p, vocab_size), None, p, o))
    return out


def long_context_dataset(n: int, long_fraction: float = 0.05, long_input_len: int = 16384,
                         short_input_len: int = 256, output_len: int = 128, range_ratio: float = 0.25,
                         vocab_size: int = 32000, seed: int = 0) -> list[WorkloadRequest]:
    """A few very long prompts among many short ones: the source articles' hard case.
    Long ones are spread evenly through the run so they keep landing on running decodes."""
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction: must be in [0, 1], got {long_fraction}")
    rng = random.Random(seed)
    num_long = round(n * long_fraction)
    long_slots = {round((i + 0.5) * n / num_long) for i in range(num_long)} if num_long else set()
    out = []
    for i in range(n):
        is_long = i in long_slots
        p = _length(rng, long_input_len if is_long else short_input_len, range_ratio)
        o = _length(rng, output_len, range_ratio)
        out.append(WorkloadRequest(_tokens(rng, p, vocab_size), None, p, o, tags={"long": is_long}))
    return out


def calibration_dataset(n: int, input_len: int = 512, output_len: int = 128, vocab_size: int = 32000,
                        seed: int = 0, max_len: int | None = None) -> list[WorkloadRequest]:
    """Requests whose shapes span what a cost model is asked about: half the prompts
    log-uniform over 8 .. 2 x input_len (short prompts and small prefill chunks), half uniform
    over input_len / 2 .. 2 x input_len (so decodes run at long contexts often enough to fit
    the attention term there), outputs log-uniform over 4 .. 2 x output_len, each pair capped
    to `max_len` tokens. Paired with `ramp_arrival_times`, batches grow from one request to
    overload (a queue, full token budgets, mixed prefill + decode steps, and preemption where
    the pool is small enough)."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"random_input_len / random_output_len: must be >= 1, got {input_len} / {output_len}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            p = _log_uniform(rng, 8, max(8, 2 * input_len))
        else:
            p = rng.randint(max(1, input_len // 2), max(1, 2 * input_len))
        o = _log_uniform(rng, 4, max(4, 2 * output_len))
        if max_len is not None and p + o > max_len:
            p = max(1, min(p, max_len - 4))
            o = max(1, max_len - p)
        out.append(WorkloadRequest(_tokens(rng, p, vocab_size), None, p, o, tags={"calibration": True}))
    return out


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def ramp_arrival_times(n: int, request_rate: float, seed: int = 0, start_share: float = 0.1,
                       end_share: float = 2.0) -> list[float]:
    """Poisson arrivals whose rate rises linearly, request by request, from start_share x to
    end_share x `request_rate`: the server goes from idle (batch of one) to overloaded."""
    if not 0 < request_rate < math.inf:
        raise ValueError(f"request_rate: the calibration workload ramps its rate up to {end_share:g} x "
                         f"--request-rate, so it needs a finite rate > 0, got {request_rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        share = start_share + (end_share - start_share) * (i / max(n - 1, 1))
        t += rng.expovariate(request_rate * share)
        out.append(t)
    return out


def prefix_repetition_dataset(n: int, prefix_len: int = 512, suffix_len: int = 128, num_prefixes: int = 4,
                              output_len: int = 128, vocab_size: int = 32000, seed: int = 0) -> list[WorkloadRequest]:
    """Requests sharing one of `num_prefixes` long prefixes (system prompts, few-shot headers)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    out = []
    for _ in range(n):
        k = rng.randrange(num_prefixes)
        ids = prefixes[k] + _tokens(rng, suffix_len, vocab_size)
        out.append(WorkloadRequest(ids, None, len(ids), output_len, tags={"prefix": k}))
    return out


def sharegpt_dataset(path: str | Path, n: int, tokenizer=None, seed: int = 0,
                     max_prompt_len: int | None = None, max_output_len: int | None = None) -> list[WorkloadRequest]:
    """First human turn as the prompt, the reply's length as the output length (ShareGPT JSON).

    Without a tokenizer, lengths are estimated at 4 characters a token."""
    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    rng.shuffle(data)

    def count(text: str) -> int:
        return len(tokenizer(text).input_ids) if tokenizer is not None else max(1, len(text) // 4)

    out = []
    for item in data:
        conv = item.get("conversations") or item.get("conversation") or []
        if len(conv) < 2:
            continue
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        p, o = count(prompt), count(reply)
        if p < 4 or o < 4 or (max_prompt_len and p > max_prompt_len) or (max_output_len and o > max_output_len):
            continue
        out.append(WorkloadRequest(None, prompt, p, o, ignore_eos=False))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"dataset_path: no usable ShareGPT conversations in {path}")
    return out


def make_workload(dataset: str, num_prompts: int, *, request_rate: float = math.inf, burstiness: float = 1.0,
                  seed: int = 0, dataset_path: str | None = None, tokenizer=None, **kw) -> list[WorkloadRequest]:
    """One entry point for both bench and simulate; kw are the dataset's own options."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    if dataset == "random":
        reqs = random_dataset(num_prompts, seed=seed, **kw)
    elif dataset == "long-context":
        reqs = long_context_dataset(num_prompts, seed=seed, **kw)
    elif dataset == "prefix-repetition":
        reqs = prefix_repetition_dataset(num_prompts, seed=seed, **kw)
    elif dataset == "calibration":
        reqs = calibration_dataset(num_prompts, seed=seed, **kw)
        for req, t in zip(reqs, ramp_arrival_times(len(reqs), request_rate, seed + 1)):
            req.arrival_time = t
        return reqs
    elif dataset == "sharegpt":
        if not dataset_path:
            raise ValueError("dataset_path: the sharegpt dataset needs --dataset-path FILE.json")
        reqs = sharegpt_dataset(dataset_path, num_prompts, tokenizer=tokenizer, seed=seed, **kw)
    else:
        raise ValueError(f"dataset: must be one of {DATASETS}, got {dataset!r}")
    for req, t in zip(reqs, arrival_times(len(reqs), request_rate, burstiness, seed + 1)):
        req.arrival_time = t
    return reqs


def add_dataset_args(parser, default_num_prompts: int = 100):
    """The dataset flags `bench`, `simulate` and `tune` share (vLLM bench's names)."""
    d = parser.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", "--workload", dest="dataset", choices=DATASETS, default="random",
                   help="calibration: lengths log-uniform up to 2x --random-input-len / --random-output-len, "
                        "arrival rate ramping from 0.1x to 2x --request-rate (a step trace that covers the "
                        "shapes `pagedserve simulate calibrate` fits)")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (for --dataset sharegpt)")
    d.add_argument("--num-prompts", type=int, default=default_num_prompts)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128,
                   help="output length for random, long-context and prefix-repetition (ignore_eos is set)")
    d.add_argument("--random-range-ratio", type=float, default=None,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (random: default 0; long-context: 0.25)")
    d.add_argument("--long-input-len", type=int, default=16384, help="long-context: the long prompts")
    d.add_argument("--short-input-len", type=int, default=256, help="long-context: the short prompts")
    d.add_argument("--long-fraction", type=float, default=0.05, help="long-context: share of long prompts")
    d.add_argument("--prefix-len", type=int, default=512, help="prefix-repetition: shared prefix tokens")
    d.add_argument("--suffix-len", type=int, default=128, help="prefix-repetition: unique suffix tokens")
    d.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct prefixes")
    return d


def dataset_kwargs(args, vocab_size: int) -> dict:
    """make_workload's dataset options from add_dataset_args' flags."""
    ratio = args.random_range_ratio
    if args.dataset == "random":
        return dict(input_len=args.random_input_len, output_len=args.random_output_len,
                    range_ratio=0.0 if ratio is None else ratio, vocab_size=vocab_size)
    if args.dataset == "long-context":
        kw = dict(long_fraction=args.long_fraction, long_input_len=args.long_input_len,
                  short_input_len=args.short_input_len, output_len=args.random_output_len, vocab_size=vocab_size)
        if ratio is not None:
            kw["range_ratio"] = ratio
        return kw
    if args.dataset == "calibration":
        return dict(input_len=args.random_input_len, output_len=args.random_output_len, vocab_size=vocab_size)
    if args.dataset == "prefix-repetition":
        return dict(prefix_len=args.prefix_len, suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
                    output_len=args.random_output_len, vocab_size=vocab_size)
    return {}
