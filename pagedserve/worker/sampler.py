"""Token sampling, one row per request: the grammar mask (structured outputs), logit_bias,
penalties, min_tokens masking, (raw) logprobs, then greedy or temperature → top-k → top-p →
min-p → draw.

The grammar mask is batched: every constrained row of the step gets its allowed-token
bitmask (ceil(vocab / 32) int32 words, bit i = token i) from its matcher, the rows are
unpacked together and applied in one masked_fill. A constrained row can only draw a token
its grammar allows, unless min_tokens banned every allowed token (then the grammar wins).

Each row is processed independently of the others, and a seeded request draws from its
own generator, so the same seed gives the same text whatever else shares the batch.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from pagedserve.core.outputs import TokenLogprobs
from pagedserve.sampling import SamplingParams


class SamplingRow(Protocol):
    """What the sampler reads of a request (worker.model_runner.CachedRequestState)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]

    @property
    def output_token_ids(self) -> list[int]: ...

    # Optional: `grammar`, a structured.compiler.GrammarMatcher already synced to the outputs.


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool, True = allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_logit_bias(logits: torch.Tensor, reqs) -> None:
    """Add each request's logit_bias to its row, in place (one index_put for the batch)."""
    rows, tokens, values = [], [], []
    for row, req in enumerate(reqs):
        bias = req.sampling_params.logit_bias
        if bias:
            rows.extend([row] * len(bias))
            tokens.extend(bias.keys())
            values.extend(bias.values())
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum (the first, on ties, as torch.argmax). On CPU through numpy,
    whose vectorised argmax is ~7x torch's here (256 x 32000 fp32: 3.9 vs 27 ms on one core)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.argmax(logits.contiguous().numpy(), axis=1))
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], seed: int, device: torch.device) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = device
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        self._bitmask = np.zeros((0, 0), dtype=np.int32)  # reused across steps

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)

    def _generator(self, req: SamplingRow) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self.default_generator
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[SamplingRow]) -> None:
        for row, req in enumerate(reqs):
            p = req.sampling_params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)),
                                    dtype=torch.long, device=logits.device)
                vals = logits[row, seen]
                logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
                counts = torch.bincount(torch.tensor(req.output_token_ids, device=logits.device),
                                        minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if p.min_tokens and len(req.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                if banned:
                    logits[row, sorted(banned)] = float("-inf")

    def grammar_bitmask(self, reqs: list[SamplingRow], vocab_size: int) -> tuple[list[int], np.ndarray | None]:
        """(constrained rows, their bitmasks [len(rows), words]) from each row's matcher."""
        rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
        if not rows:
            return rows, None
        words = (vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            self._bitmask = np.zeros((max(len(rows), 8), words), dtype=np.int32)
        bitmask = self._bitmask[:len(rows)]
        for k, row in enumerate(rows):
            reqs[row].grammar.fill_bitmask(bitmask[k])
        return rows, bitmask

    def _apply_grammar(self, logits: torch.Tensor, reqs: list[SamplingRow]) -> tuple[list[int], torch.Tensor | None]:
        rows, bitmask = self.grammar_bitmask(reqs, logits.shape[1])
        if not rows:
            return rows, None
        allowed = unpack_bitmask(torch.from_numpy(bitmask).to(logits.device), logits.shape[1])
        index = torch.tensor(rows, device=logits.device)
        masked = logits[index].masked_fill_(~allowed, float("-inf"))
        logits[index] = masked
        return rows, masked

    @staticmethod
    def greedy(logits: torch.Tensor) -> list[int]:
        """Each row's argmax: the token of every row that is plain greedy (no grammar)."""
        if logits.dtype == torch.float32 and logits.is_cpu:  # argmax_rows' numpy path, minus the tensor round trip
            return np.argmax(logits.numpy(), axis=1).tolist()
        return argmax_rows(logits.float()).tolist()

    def __call__(self, logits: torch.Tensor, reqs: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        if all(r.sampling_params.plain_greedy and getattr(r, "grammar", None) is None for r in reqs):
            # The common serving case: no copy, no per-row work, one vectorised argmax.
            return self.greedy(logits), [None] * len(reqs)
        logits = logits.to(torch.float32, copy=True)  # everything below edits in place; keep the caller's intact
        grammar_rows, grammar_logits = self._apply_grammar(logits, reqs)
        apply_logit_bias(logits, reqs)
        self._apply_penalties(logits, reqs)
        if grammar_rows:
            # min_tokens may have banned the only tokens the grammar allows (EOS at the end of
            # a finished JSON value): the grammar wins, so the text stays valid.
            index = torch.tensor(grammar_rows, device=logits.device)
            dead = torch.isneginf(logits[index]).all(dim=1)
            if bool(dead.any()):
                logits[index[dead]] = grammar_logits[dead]
        want_logprobs = any(r.sampling_params.logprobs is not None for r in reqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        tokens = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, r in enumerate(reqs) if r.sampling_params.greedy]
        random_rows = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            tokens[idx] = argmax_rows(logits[idx]).to(tokens.device)
        for row in random_rows:
            tokens[row] = self._sample_row(logits[row], reqs[row])

        token_list = tokens.tolist()
        lps: list[TokenLogprobs | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            for row, req in enumerate(reqs):
                k = req.sampling_params.logprobs
                if k is None:
                    continue
                lp_row = raw_logprobs[row]
                tok = token_list[row]
                lp = lp_row[tok].item()
                rank = int((lp_row > lp).sum().item()) + 1
                top = []
                if k > 0:
                    vals, ids = lp_row.topk(k)
                    top = list(zip(ids.tolist(), vals.tolist()))
                lps[row] = TokenLogprobs(tok, lp, rank, top)
        return token_list, lps

    def _sample_row(self, logits: torch.Tensor, req: SamplingRow) -> int:
        probs = processed_probs(logits, req.sampling_params)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i.
        noise = torch.empty_like(probs).exponential_(generator=self._generator(req))
        return int((probs / noise).argmax().item())


def processed_probs(logits: torch.Tensor, p) -> torch.Tensor:
    """The distribution one row is drawn from: temperature, then top-k, top-p, min-p."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        # Keep the most likely tokens until their mass reaches top_p (always at least one).
        sorted_probs = sorted_probs.masked_fill(mass_before >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs
