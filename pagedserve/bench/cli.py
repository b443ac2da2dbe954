"""`pagedserve bench`: the load script built in — change one knob, rerun, compare.

    pagedserve bench --base-url http://127.0.0.1:8000 --dataset random --num-prompts 200 \\
        --request-rate 4 --goodput ttft:500 tpot:50 --result-file out.json --plot plots/
    pagedserve bench --base-url ... --max-concurrency 1,4,16,64     # a sweep: one table, one curve

Works against pagedserve, vLLM (`vllm serve`) and llama.cpp's server alike.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from pathlib import Path

from pagedserve.bench.workloads import add_dataset_args, dataset_kwargs
from pagedserve.utils import json_safe

logger = logging.getLogger("pagedserve.bench")


def register(sub) -> None:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server (pagedserve, vLLM, llama.cpp)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    t.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    t.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    t.add_argument("--api-key", default=None)
    t.add_argument("--tokenizer", default=None,
                   help="local tokenizer dir: exact ShareGPT lengths, random prompts as text for chat, vocab size")
    t.add_argument("--vocab-size", type=int, default=None,
                   help="random token ids are drawn below this (default: tokenizer, else the model dir's config.json)")
    t.add_argument("--prompt-as-text", action="store_true",
                   help="send token-id prompts as text decoded by --tokenizer (servers that take text only)")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds per request")

    add_dataset_args(p)

    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", default="inf",
                    help="req/s ('inf' = all at once; Poisson arrivals); a comma list sweeps it, e.g. 1,2,4,8")
    lo.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 steadier")
    lo.add_argument("--max-concurrency", default=None,
                    help="at most this many requests in flight; a comma list sweeps it, e.g. 1,4,16,64")
    lo.add_argument("--seed", type=int, default=0)
    lo.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 e2el:10000 (milliseconds)")

    o = p.add_argument_group("output")
    o.add_argument("--result-file", default=None, help="JSON with every request's timings and the summary")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNGs: latency CDFs, timeline, sweep curve")
    o.add_argument("--no-metrics", action="store_true", help="do not scrape the server's /metrics")
    o.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics samples")
    o.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run)


def _load_tokenizer(path: str | None):
    if not path:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _config_vocab(path: str | None) -> int | None:
    if not path:
        return None
    cfg = Path(path) / "config.json"
    if cfg.is_file():
        try:
            return int(json.loads(cfg.read_text()).get("vocab_size") or 0) or None
        except (ValueError, json.JSONDecodeError):
            return None
    return None


def resolve_vocab_size(args, tokenizer, model_info: dict) -> int:
    if args.vocab_size:
        return args.vocab_size
    if tokenizer is not None:
        return len(tokenizer)
    for candidate in (args.model, model_info.get("root"), model_info.get("id")):
        vocab = _config_vocab(candidate)
        if vocab:
            return vocab
    logger.warning("vocab size unknown (give --vocab-size or --tokenizer); drawing random token ids below 32000")
    return 32000


def _validate(args) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {args.num_prompts}")
    if args.burstiness <= 0:
        raise ValueError(f"burstiness: must be > 0, got {args.burstiness}")
    if args.metrics_interval <= 0:
        raise ValueError(f"metrics_interval: must be > 0, got {args.metrics_interval}")
    if args.dataset == "sharegpt" and not args.dataset_path:
        raise ValueError("dataset_path: the sharegpt dataset needs --dataset-path FILE.json")


def run(args) -> int:
    from pagedserve.bench.client import BenchTarget, fetch_model_info
    from pagedserve.bench.report import format_summary, format_sweep, parse_goodput
    from pagedserve.bench.sweep import BenchConfig, parse_values, run_point, sweep_points

    _validate(args)
    slos = parse_goodput(args.goodput)
    rates = parse_values(args.request_rate, float, "request_rate")
    concurrencies = parse_values(args.max_concurrency, int, "max_concurrency")

    model_info = asyncio.run(fetch_model_info(args.base_url, args.api_key))
    model = args.model or model_info.get("id")
    if not model:
        raise ValueError(f"model: GET {args.base_url}/v1/models gave no model; pass --model NAME")
    tokenizer = _load_tokenizer(args.tokenizer)
    vocab = resolve_vocab_size(args, tokenizer, model_info)
    target = BenchTarget(args.base_url, model, args.endpoint, args.api_key, args.temperature, args.request_timeout)
    kwargs = dataset_kwargs(args, vocab)
    if args.dataset == "calibration" and model_info.get("max_model_len"):
        kwargs["max_len"] = int(model_info["max_model_len"])  # every request fits the server
    base = BenchConfig(target=target, dataset=args.dataset, num_prompts=args.num_prompts, burstiness=args.burstiness,
                       seed=args.seed, dataset_path=args.dataset_path, dataset_kwargs=kwargs,
                       goodput=slos, tokenizer=tokenizer, metrics_interval=args.metrics_interval,
                       scrape_metrics=not args.no_metrics, progress=not args.disable_tqdm,
                       prompts_as_text=args.prompt_as_text)
    knob, points = sweep_points(base, rates, concurrencies)

    done = []
    for label, config in points:
        rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
        print(f"pagedserve bench: {args.dataset} x {config.num_prompts} -> {target.url} (model {model}), "
              f"request rate {rate}, burstiness {config.burstiness:g}, max concurrency {config.max_concurrency}",
              flush=True)
        point = run_point(config)
        done.append((label, point))
        title = f"Serving Benchmark Result ({knob}={label})" if knob else "Serving Benchmark Result"
        print(format_summary(point.summary, title), flush=True)
        if args.plot:
            from pagedserve.bench.plots import plot_run
            out_dir = Path(args.plot) / f"{knob}={label}" if knob else Path(args.plot)
            plot_run(point.results, point.timeline, point.duration, out_dir)

    if knob:
        print(f"\nSweep over {knob}:")
        print(format_sweep(knob, [(label, p.summary) for label, p in done]))
        if args.plot:
            from pagedserve.bench.plots import plot_sweep
            plot_sweep(knob, [(label, p.summary) for label, p in done], args.plot)
    if args.result_file:
        if knob:
            payload = {"sweep": knob, "points": [{"label": label, **p.to_dict()} for label, p in done]}
        else:
            payload = done[0][1].to_dict()
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json_safe(payload), indent=1, default=str, allow_nan=False))
        print(f"results written to {path}")
    if args.plot:
        print(f"plots written to {args.plot}")
    if all(p.summary["successful_requests"] == 0 for _, p in done):
        print("pagedserve bench: every request failed", file=sys.stderr)
        return 1
    return 0
