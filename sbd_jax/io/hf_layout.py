"""How our parameters are named and shaped in an HF-layout checkpoint, and its error type: shared by the reader
(hf.py), the writer (hf_save.py) and the GGUF converter (gguf.py)."""
from __future__ import annotations

import math

from ..models.config import ModelConfig
from ..models.params import ParamSpec, axis_sizes


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked (missing/truncated file, bad shape...)."""


def hf_names(s: ParamSpec, cfg: ModelConfig) -> list[str]:
    """The HF tensor name(s) of one parameter: one per layer for a stacked weight."""
    return [f"model.layers.{i}.{s.hf}" for i in range(cfg.num_hidden_layers)] if s.stacked else [s.hf]


def hf_shape(s: ParamSpec, cfg: ModelConfig) -> tuple[int, ...]:
    """HF's shape for one layer of `s`: dims joined by `*` are one, a Linear weight is [out, in]."""
    sizes = axis_sizes(cfg)
    groups = tuple(math.prod(sizes[a] for a in g.split("*")) for g in s.axes.split())
    return groups[::-1] if s.hf_t else groups
