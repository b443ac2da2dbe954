"""Copy HF-named checkpoint tensors into a model whose parameters are fused or stacked.

A model gives `resolve(name) -> Placement | None`: which parameter (and which part of
it) a checkpoint tensor fills, or None for a tensor the model skips on purpose (another
expert-parallel rank's expert, DeepSeek's multi-token-prediction layer, a rotary cache).
Invariant: after `load_tensors` every element of every parameter was written exactly by
one checkpoint tensor (elements are counted per parameter), or loading raises ValueError
naming what is missing; a tensor no parameter takes, or one of the wrong shape, raises too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Placement:
    target: str                        # parameter name in the model
    index: tuple = ()                  # where in it: () = the whole parameter
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None  # e.g. a row permutation


def fused_rows(offset: int, size: int, *lead: int) -> tuple:
    """Index of rows [offset, offset + size) of a parameter (after the leading indices)."""
    return (*lead, slice(offset, offset + size))


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 resolve: Callable[[str], Placement | None]) -> None:
    params = dict(model.named_parameters())
    written = dict.fromkeys(params, 0)
    for name, tensor in tensors:
        if name.startswith("model."):
            name = name[len("model."):]
        place = resolve(name)
        if place is None:
            continue
        if place.target not in params:
            raise ValueError(f"model: unexpected tensor {name!r} in checkpoint")
        dest = params[place.target].data[place.index] if place.index else params[place.target].data
        if place.transform is not None:
            tensor = place.transform(tensor)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"model: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        written[place.target] += dest.numel()
    missing = [n for n, count in written.items() if count < params[n].numel()]
    if missing:
        raise ValueError(f"model: checkpoint is missing tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")
