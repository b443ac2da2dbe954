"""One benchmark point (load + /metrics sampling + summary), and sweeps over request rate or concurrency.

A sweep reruns the same workload (same seed, same prompts) at each value of one knob of the
load, so the only thing that changes between points is that knob — the articles' method.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace

from pagedserve.bench.client import BenchTarget, RequestResult, run_load
from pagedserve.bench.metrics_scrape import MetricsSampler, summarize_server_metrics, timeline
from pagedserve.bench.report import summarize
from pagedserve.bench.workloads import make_workload


@dataclass
class BenchConfig:
    target: BenchTarget
    dataset: str = "random"
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    dataset_path: str | None = None
    dataset_kwargs: dict = field(default_factory=dict)
    goodput: dict[str, float] = field(default_factory=dict)
    tokenizer: object = None
    metrics_interval: float = 0.5
    scrape_metrics: bool = True
    progress: bool = True
    prompts_as_text: bool = False   # decode token-id prompts with `tokenizer` (servers that take text only)


@dataclass
class PointResult:
    config: BenchConfig
    results: list[RequestResult]
    duration: float
    summary: dict
    timeline: dict | None
    start_monotonic: float = 0.0

    def to_dict(self) -> dict:
        c = self.config
        return {
            "config": {"base_url": c.target.base_url, "model": c.target.model, "endpoint": c.target.endpoint,
                       "dataset": c.dataset, "num_prompts": c.num_prompts,
                       "request_rate": "inf" if math.isinf(c.request_rate) else c.request_rate,
                       "burstiness": c.burstiness, "max_concurrency": c.max_concurrency, "seed": c.seed,
                       "dataset_kwargs": c.dataset_kwargs},
            "run_start_monotonic": self.start_monotonic,
            "summary": self.summary,
            "server_timeline": self.timeline,
            "requests": [r.to_dict() for r in self.results],
        }


def parse_values(text: str | float | int | None, kind: type, name: str) -> list:
    """'1,2,4' -> [1, 2, 4]; 'inf' allowed for request rates; None -> [None]."""
    if text is None:
        return [None]
    if not isinstance(text, str):
        return [text]
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = math.inf if (kind is float and part.lower() == "inf") else kind(part)
        except ValueError:
            raise ValueError(f"{name}: expected a number or a comma-separated list, got {text!r}") from None
        if not value > 0:
            raise ValueError(f"{name}: values must be > 0, got {part!r}")
        values.append(value)
    if not values:
        raise ValueError(f"{name}: empty")
    return values


def build_workload(config: BenchConfig):
    workload = make_workload(config.dataset, config.num_prompts, request_rate=config.request_rate,
                             burstiness=config.burstiness, seed=config.seed, dataset_path=config.dataset_path,
                             tokenizer=config.tokenizer, **config.dataset_kwargs)
    if config.prompts_as_text:
        if config.tokenizer is None:
            raise ValueError("prompt_as_text: needs --tokenizer to decode the token ids")
        for req in workload:
            if req.prompt is None:
                req.prompt = config.tokenizer.decode(req.prompt_token_ids)
                req.prompt_token_ids = None
    return workload


async def run_point_async(config: BenchConfig) -> PointResult:
    workload = build_workload(config)
    sampler = MetricsSampler(config.target.base_url, config.metrics_interval, config.target.api_key)
    if config.scrape_metrics:
        await sampler.start()
    try:
        load = await run_load(config.target, workload, max_concurrency=config.max_concurrency,
                              tokenizer=config.tokenizer, progress=config.progress,
                              on_start=sampler.mark_run_start if config.scrape_metrics else None)
    finally:
        if config.scrape_metrics:
            await sampler.stop()
    server = summarize_server_metrics(sampler.before, sampler.after, sampler.samples)
    summary = summarize(load.results, load.duration, config.goodput, server)
    series = timeline(sampler.samples) if server is not None else None
    return PointResult(config, load.results, load.duration, summary, series, load.start_monotonic)


def run_point(config: BenchConfig) -> PointResult:
    return asyncio.run(run_point_async(config))


def sweep_points(config: BenchConfig, rates: list, concurrencies: list) -> tuple[str | None, list[tuple[str, BenchConfig]]]:
    """(knob name or None, [(label, config)]) — at most one of the two may be a list."""
    if len(rates) > 1 and len(concurrencies) > 1:
        raise ValueError("request_rate / max_concurrency: sweep one knob at a time (give a list to only one)")
    if len(rates) > 1:
        return "request_rate", [(_label(r), replace(config, request_rate=r)) for r in rates]
    if len(concurrencies) > 1:
        return "max_concurrency", [(str(c), replace(config, max_concurrency=c)) for c in concurrencies]
    return None, [("", replace(config, request_rate=rates[0] if rates[0] is not None else config.request_rate,
                               max_concurrency=concurrencies[0]))]


def _label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
