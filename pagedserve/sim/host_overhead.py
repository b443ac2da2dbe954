"""The host CPU's side of serving, for any device: what the simulator charges besides the kernels.

Two parts, both as functions of the step's and the request's sizes:

* **per step, in the engine loop** (schedule, block allocation, update and output processing:
  ``step_s + per_request_s x requests + per_token_s x scheduled tokens``; plus the model runner's
  input preparation, the step's diffs and tensors: ``runner_step_s + runner_per_request_s x requests
  + runner_per_token_s x tokens``), added to every step (CostParams.step_overhead_s /
  per_request_overhead_s / per_token_overhead_s);
* **per request, in the serving layer** (ServingOverhead, below): admission
  ``admit_s + admit_per_prompt_token_s x prompt tokens`` (HTTP parse, tokenization, hand-off) before
  a request reaches the engine, and delivery ``deliver_s + deliver_per_output_s x requests the step
  fed`` (detokenization and one SSE frame per request) after each step.

The numbers are measured, not guessed: `pagedserve.sim.host_probe` times pagedserve's own
engine core (the scheduler the simulator runs, with an executor that computes nothing), its model
runner's input preparation (CPU time), its incremental detokenizer, its SSE frame and its
tokenizer on this machine, and fits the terms by
least squares (`python -m pagedserve.sim.host_probe --out pagedserve/sim/host_overhead.json`).
The shipped `host_overhead.json` holds one such run, with the CPU it ran on. A host is described
by its single-thread speed relative to that machine (`HOST_CPU_PRESETS`, or --host-cpu-speed):
every term is divided by it. Work on the device itself (sampling kernels, launches) is in the
GPU efficiencies, not here.

What vLLM publishes as a cross-check: its v0.6.0 blog ("vLLM v0.6.0: 2.7x Throughput Improvement
and 75% Latency Reduction", 2024-09) profiled Llama-3-8B on one H100 and found the API server
and scheduling took a large share of each step before the API server moved to its own process
and multi-step scheduling; V1's engine core does schedule -> execute -> update on one thread
with detokenization in the API process, the same split as here.
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

DEFAULTS_PATH = Path(__file__).with_name("host_overhead.json")

# Host CPUs by single-thread speed relative to the machine the shipped probe ran on. Only the
# probe machine itself is a measured 1.0; give a measured ratio with --host-cpu-speed (run the
# probe on the host and compare) rather than trusting a guess.
HOST_CPU_PRESETS = {"probe": 1.0}

# Whose engine loop a GPU deployment runs (--host-profile):
#  * "pagedserve" (the default): every term as the probe measured pagedserve's own loop and
#    front-end;
#  * "vllm": the serving layer as benchmarks/vllm_host_probe.py measured vLLM's own API server
#    (`vllm serve` of a tiny model on loopback, from outside: its API process's CPU time per request
#    and per chunk, and TTFT minus the engine's queue and prefill time), stored in
#    host_overhead_vllm.json with the machine and date (the probe's serving layer if that file is
#    absent); the engine loop per step at the figure vLLM v0.6.0's blog gives (2024: scheduling,
#    input preparation and output processing took milliseconds per step on Llama-3-8B / H100
#    before overlap), 2 ms + 20 us per request, the simulator's old default. pagedserve's loop
#    measures 10-200x less (its probe executor builds no device inputs and crosses no process
#    boundary).
#    (vLLM 0.6.0's blog figure, 2 ms + 20 us per request, was this profile's loop until the V1 engine
#    core was measured: benchmarks/serving_endpoint_probe.py, stored in host_overhead_vllm.json's
#    "engine_loop"; a file without it keeps the blog's figure.)
VLLM_STEP_S = 2e-3
VLLM_PER_REQUEST_S = 20e-6
HOST_PROFILES = ("vllm", "pagedserve")
VLLM_SERVING_PATH = Path(__file__).with_name("host_overhead_vllm.json")
_SERVING_KEYS = ("admit_s", "admit_per_prompt_token_s", "deliver_s", "deliver_per_output_s", "deliver_step_s",
                 "handover_s", "handover_per_prompt_token_s")
_SERVING_FLAGS = ("merge_outputs",)
# The client's endpoint (`simulate --endpoint`, as `pagedserve bench --endpoint` / `vllm bench serve
# --backend openai|openai-chat`): /v1/completions, or /v1/chat/completions, whose request renders the
# chat template and whose stream's chunks carry a delta (its terms: a probe file's "chat" block).
ENDPOINTS = ("completions", "chat")


def vllm_serving(path: str | Path | None = None) -> dict | None:
    """vLLM's measured serving-layer terms (the probe machine's speed) and their source, or None
    when no measurement is shipped. Read once per file (a sweep builds a deployment per point),
    as the shipped probe file is (default_host_overhead)."""
    terms = _read_vllm_serving(str(path or VLLM_SERVING_PATH))
    return dict(terms) if terms is not None else None


@functools.lru_cache(maxsize=8)
def _read_vllm_serving(path: str) -> dict | None:
    try:
        fit = json.loads(Path(path).read_text())["fit"]
    except (OSError, KeyError, ValueError):
        return None
    return {**{k: float(fit.get(k, 0.0)) for k in _SERVING_KEYS}, **{k: bool(fit.get(k, False)) for k in _SERVING_FLAGS},
            "source": fit.get("source", path), "chat": _chat_terms(fit), "engine_loop": fit.get("engine_loop")}


def _chat_terms(fit: dict) -> dict | None:
    chat = fit.get("chat")
    if not chat:
        return None
    return {**{k: float(chat[k]) for k in _SERVING_KEYS if k in chat}, "source": chat.get("source", "")}


# How many quantiles a measured scatter is stored as (the step residuals, CostParams.step_residuals_s;
# each token's delivery jitter, ServingOverhead.delivery_jitter_s), at the bins' centres (k + 0.5) / n.
# A tail percentile needs bins finer than its own distance from the end: with 100, the P99 of the draws
# lands on the one bin that stands for the top 1% (the median of the stalls), not on the 99th
# percentile, and a run's P99 ITL takes the calibration's stalls for its own (vLLM's CPU server,
# 2026-12-05: 0.6% of steps stalled 25-63 ms; P99 ITL simulated at 29 ms against 15 measured).
SCATTER_QUANTILES = 1000


def scatter_quantiles(values) -> list[float]:
    """`values`' SCATTER_QUANTILES quantiles at the bins' centres, as the simulator draws them."""
    import numpy as np

    return [float(v) for v in np.percentile(np.asarray(values, dtype=float),
                                            (np.arange(SCATTER_QUANTILES) + 0.5) * (100.0 / SCATTER_QUANTILES))]


def quantile_at(quantiles, u: float) -> float:
    """The value at probability `u` (0-1) of a distribution stored as its n quantiles at the bins'
    centres ((k + 0.5) / n: scatter_quantiles; older files hold 100), read off the straight lines
    between them and held at the end values beyond the outer centres. (A draw of one stored value
    at random gives each value 1/n of the mass: the distribution's steps, not its curve.)"""
    n = len(quantiles)
    x = u * n - 0.5
    if x <= 0.0:
        return float(quantiles[0])
    if x >= n - 1:
        return float(quantiles[-1])
    k = int(x)
    return float(quantiles[k] + (quantiles[k + 1] - quantiles[k]) * (x - k))


@dataclass
class ServingOverhead:
    """A request's time in the serving layer, outside the engine's steps. The simulator
    delays a request's entry into the engine by `admit` and every token's arrival at the
    client by `deliver`: so TTFT and E2E include them, and ITL their change from step to step.

    admit(prompt)   = admit_s + admit_per_prompt_token_s x prompt tokens
                      (HTTP, body parse, tokenization, validation, the hand-off to the engine)
    deliver(step)   = deliver_s + deliver_per_output_s x requests the step fed
                      (detokenization and one SSE chunk per request, one after another)
    """

    admit_s: float = 0.0
    admit_per_prompt_token_s: float = 0.0
    deliver_s: float = 0.0
    deliver_per_output_s: float = 0.0
    source: str = "none"
    # With `serial`: the loop's work per step that delivers anything, whatever the streams (the
    # wake-up on the engine's message and its unpacking: vLLM's output handler takes one message
    # holding every request's outputs of the step), before the per-stream frames. Measured as the
    # intercept of the API process's CPU per step against the streams it feeds
    # (benchmarks/serving_endpoint_probe.py); 0 in a file written before.
    deliver_step_s: float = 0.0
    # With `serial`: a stream's outputs that queue while the loop is still writing the frames of the
    # step before go out with those frames, not in frames of their own (vLLM's API process:
    # output_processor.RequestOutputCollector merges a streamed request's outputs when its consumer
    # is behind; measured: fewer chunks than tokens in bursts, benchmarks/serving_endpoint_probe.py).
    # Such a step costs the loop its per-step work only. False: every token gets a frame of its own
    # (HostOverhead's default, the profiles' flag, is True: both servers merge).
    merge_outputs: bool = False
    # One event loop does it all (pagedserve's server, vLLM's API process): with `serial` each
    # admission and each step's per-request delivery work waits for the work before it, so a burst
    # of arrivals, or many streams at once, queue for it (deliver_s stays a latency: the hand-over
    # from the engine, occupying nothing). Right for pure service times (the host probe's, which
    # the GPU presets use); a fit from a live trace (fit_serving) already holds the queueing it
    # saw, so it keeps False: every one served at once.
    serial: bool = False
    # With `serial`: the admission split at its await, as the server runs it (pagedserve's
    # server/request_handling.py and vLLM's API server both parse and validate on the loop,
    # tokenize on one tokenizer thread, then hand the request to the engine on the loop).
    # admit_s is the loop's part; admit_per_prompt_token_s x P runs on the tokenizer thread, one
    # prompt after another, beside the loop (transformers' fast tokenizer encodes through
    # tokenizers' encode_batch, which releases the GIL); the hand-over then waits its turn behind
    # the loop work that was ready before it. So in a burst every request's parse comes before
    # the first hand-over. Without it the admission is one block of loop work.
    tokenize_off_loop: bool = False
    # With the split: the loop's work at the hand-over, after the tokenizer await (input
    # processing, the output processor's entry, the send to the engine core), out of the admission's
    # fixed part: admit_s is what comes before the await. Measured for vLLM
    # (benchmarks/vllm_handover_probe.py); 0: not measured (pagedserve's).
    handover_s: float = 0.0
    handover_per_prompt_token_s: float = 0.0
    # How far each token's arrival at the client scatters around the delivery above, from a live
    # calibration (fit_serving: the client's arrival of every token against the end of the step that
    # made it): quantiles of the residual (scatter_quantiles), centred on 0, and its lag-1 correlation within a
    # stream. The simulator draws one per token (DeliveryJitter), so the ITL and TTFT tails hold the
    # serving layer's own scatter (the event loop, the socket, the client's loop), which the step
    # trace cannot see. Empty: none (the host probe's pure service times, vLLM's profile).
    delivery_jitter_s: list = field(default_factory=list)
    delivery_jitter_rho: float = 0.0

    def admit(self, prompt_len: int) -> float:
        return self.admit_s + self.admit_per_prompt_token_s * prompt_len + self.handover(prompt_len)

    def handover(self, prompt_len: int) -> float:
        return self.handover_s + self.handover_per_prompt_token_s * prompt_len

    def deliver(self, num_outputs: int) -> float:
        return self.deliver_s + self.deliver_step_s + self.deliver_per_output_s * num_outputs

    def deliver_work(self, num_outputs: int) -> float:
        """The loop's own work for a step that fed `num_outputs` streams (what occupies it)."""
        return self.deliver_step_s + self.deliver_per_output_s * num_outputs

    @property
    def is_zero(self) -> bool:
        return not (self.admit_s or self.admit_per_prompt_token_s or self.deliver_s or self.deliver_per_output_s
                    or self.deliver_step_s or self.handover_s or self.handover_per_prompt_token_s)

    def describe(self) -> str:
        if self.is_zero:
            return ("none modelled (asked for with --no-serving-overhead, or a cost model calibrated without a "
                    "request trace)")
        return (f"admission {self.admit_s * 1e3:.1f} ms + {self.admit_per_prompt_token_s * 1e6:.1f} us/prompt token, "
                f"delivery {self.deliver_s * 1e3:.1f} ms + "
                + (f"{self.deliver_step_s * 1e3:.3f} ms per step + " if self.deliver_step_s else "")
                + f"{self.deliver_per_output_s * 1e3:.3f} ms per request "
                f"in the step{', one event loop (queued)' if self.serial else ''} ({self.source})"
                + (f"; each token's arrival scatters {quantile_at(self.delivery_jitter_s, 0.01) * 1e3:+.2f} / "
                   f"{quantile_at(self.delivery_jitter_s, 0.99) * 1e3:+.2f} ms (p1 / p99) with lag-1 correlation "
                   f"{self.delivery_jitter_rho:.2f}" if self.delivery_jitter_s else ""))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ServingOverhead":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in known})


# The probe's serving terms as the server runs them: the admission split at its tokenizer await
# (ServingOverhead.tokenize_off_loop). A module switch so an ablation can leave it out
# (benchmarks/sim_validation.py --without split).
TOKENIZE_OFF_LOOP = True


@dataclass(frozen=True)
class HostOverhead:
    step_s: float = 0.0
    per_request_s: float = 0.0
    per_token_s: float = 0.0
    admit_s: float = 0.0
    admit_per_prompt_token_s: float = 0.0
    deliver_s: float = 0.0
    deliver_per_output_s: float = 0.0
    speed: float = 1.0           # the host's single-thread speed relative to the probe machine
    source: str = "none"
    # The model runner's host side per step (the step's diffs and input tensors, before the
    # forward), in CPU time: every device's runner does it, and the engine-loop terms above (the
    # real scheduler with a null executor) leave it out. Added to them in apply(); 0 in a probe
    # file written before it was measured.
    runner_step_s: float = 0.0
    runner_per_request_s: float = 0.0
    runner_per_token_s: float = 0.0
    # The serving layer's loop work per step that delivers anything (ServingOverhead.deliver_step_s).
    deliver_step_s: float = 0.0
    # ServingOverhead.merge_outputs. pagedserve's server merges a stream's queued outputs into one
    # chunk since issue 32 (server/request_handling.py results), as vLLM's does: True unless a file says.
    merge_outputs: bool = True
    handover_s: float = 0.0  # ServingOverhead.handover_s (out of admit_s: the part after the await)
    handover_per_prompt_token_s: float = 0.0
    # The chat endpoint's serving terms (a probe file's "chat" block: ServingOverhead's keys, the
    # probe machine's speed); empty: not measured for this file.
    chat: dict = field(default_factory=dict)
    # The engine schedules step n+1 while the device runs step n (vLLM's async scheduling): a
    # step's host work hides under the device's, the step takes max(device, host) instead of their
    # sum (CostParams.host_overlap).
    async_scheduling: bool = False

    @property
    def engine_step_s(self) -> float:
        """The engine loop's fixed part per step: scheduler + the runner's input preparation."""
        return self.step_s + self.runner_step_s

    def for_profile(self, profile: str) -> "HostOverhead":
        if profile not in HOST_PROFILES:
            raise ValueError(f"host_profile: one of {HOST_PROFILES}, got {profile!r}")
        if profile == "pagedserve":
            return self
        serving = vllm_serving()
        layer = {k: serving[k] for k in _SERVING_KEYS + _SERVING_FLAGS} if serving else {}
        if serving:
            layer["chat"] = serving.get("chat") or {}  # vLLM's own chat terms, never pagedserve's
        loop = (serving or {}).get("engine_loop")
        if loop:
            # vLLM V1's engine core measured per step (its whole loop: schedule, input preparation,
            # sampler, output processing), with async scheduling (on by default since vLLM 0.14)
            engine = {"step_s": float(loop["step_s"]), "per_request_s": float(loop["per_request_s"]),
                      "async_scheduling": bool(loop.get("async_scheduling", True))}
            how = loop.get("source", "measured")
        else:
            engine = {"step_s": VLLM_STEP_S, "per_request_s": VLLM_PER_REQUEST_S}
            how = "vLLM v0.6.0 blog's 2 ms + 20 us/request"
        # vLLM's figure is its whole loop, input preparation included: no runner terms on top.
        return replace(self, per_token_s=0.0, runner_step_s=0.0, runner_per_request_s=0.0, runner_per_token_s=0.0,
                       **engine, **layer,
                       source=f"engine loop: {how}; serving layer: "
                              + (serving["source"] if serving else self.source))

    def for_endpoint(self, endpoint: str) -> "HostOverhead":
        """The serving terms of the client's endpoint (ENDPOINTS): completions, the file's own; chat,
        its "chat" block."""
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: one of {ENDPOINTS}, got {endpoint!r}")
        if endpoint == "completions":
            return self
        if not self.chat:
            raise ValueError("endpoint chat: this host profile has no chat terms (measure them with "
                             "benchmarks/serving_endpoint_probe.py)")
        terms = {k: v for k, v in self.chat.items() if k in _SERVING_KEYS}
        return replace(self, **terms, source=f"{self.source}; /v1/chat/completions: {self.chat.get('source', '')}")

    def with_async_scheduling(self, on: bool | None) -> "HostOverhead":
        return self if on is None else replace(self, async_scheduling=bool(on))

    def scaled(self, speed: float) -> "HostOverhead":
        """The same work on a host `speed` times as fast per core as the probe machine."""
        if not speed > 0:
            raise ValueError(f"host_cpu_speed: must be > 0, got {speed}")
        return replace(self, speed=speed)

    def apply(self, params, serving: bool = True) -> None:
        """Put the engine-loop terms into `params` (a CostParams) and, with `serving`, the
        serving layer's (`params.serving`); without it the serving layer is left out."""
        k = 1.0 / self.speed
        params.step_overhead_s = (self.step_s + self.runner_step_s) * k
        params.per_request_overhead_s = (self.per_request_s + self.runner_per_request_s) * k
        params.per_token_overhead_s = (self.per_token_s + self.runner_per_token_s) * k
        params.host_overlap = self.async_scheduling

        note = f"{self.source}, host speed x{self.speed:g}"
        params.serving = ServingOverhead(self.admit_s * k, self.admit_per_prompt_token_s * k, self.deliver_s * k,
                                         self.deliver_per_output_s * k, source=note, deliver_step_s=self.deliver_step_s * k,
                                         merge_outputs=self.merge_outputs, handover_s=self.handover_s * k,
                                         handover_per_prompt_token_s=self.handover_per_prompt_token_s * k,
                                         serial=True, tokenize_off_loop=TOKENIZE_OFF_LOOP).to_dict() if serving else {}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HostOverhead":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def load_host_overhead(path: str | Path = DEFAULTS_PATH) -> HostOverhead:
    data = json.loads(Path(path).read_text())
    fit = data.get("fit", data)
    return HostOverhead.from_dict({**fit, "chat": _chat_terms(fit) or {}})


_DEFAULT: HostOverhead | None = None


def default_host_overhead(speed: float | None = None, profile: str = "pagedserve",
                          path: str | Path | None = None, endpoint: str = "completions",
                          async_scheduling: bool | None = None) -> HostOverhead:
    """The shipped probe's terms (host_overhead.json), or those of a probe run on the host itself
    (`path`: `python -m pagedserve.sim.host_probe --out FILE` there), for `profile` and the client's
    `endpoint`, at `speed` (default 1: the probe machine's single-thread speed); `async_scheduling`
    overrides the profile's (None: vLLM's on, pagedserve's off)."""
    global _DEFAULT
    if path is not None:
        base = load_host_overhead(path)
    else:
        if _DEFAULT is None:
            _DEFAULT = load_host_overhead()
        base = _DEFAULT
    host = base.for_profile(profile).for_endpoint(endpoint).with_async_scheduling(async_scheduling)
    return host if speed is None else host.scaled(speed)


def host_speed(name_or_ratio: str | float | None) -> float | None:
    """--host-cpu-speed: a number, or a HOST_CPU_PRESETS name."""
    if name_or_ratio is None:
        return None
    if isinstance(name_or_ratio, (int, float)):
        return float(name_or_ratio)
    key = str(name_or_ratio).strip().lower()
    if key in HOST_CPU_PRESETS:
        return HOST_CPU_PRESETS[key]
    try:
        return float(key)
    except ValueError:
        raise ValueError(f"host_cpu_speed: a number (single-thread speed relative to the probe machine) "
                         f"or one of {sorted(HOST_CPU_PRESETS)}, got {name_or_ratio!r}") from None
