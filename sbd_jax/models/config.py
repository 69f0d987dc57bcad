"""The model's architecture: `ModelConfig` (a Llama-3.x / Qwen3 decoder, HF `config.json` field names) and its
RoPE scaling, each validated where it is built."""
from __future__ import annotations

import dataclasses
import math
import numbers

from ..config import ConfigError


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style (`rope_type == "llama3"`) frequency scaling. `None` in ModelConfig = plain RoPE."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def __post_init__(self):
        if self.rope_type != "llama3":
            raise ConfigError(f"rope_scaling.rope_type must be 'llama3', got {self.rope_type!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _positive_number(f"rope_scaling.{name}", getattr(self, name))
        _positive_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)
        if not self.high_freq_factor > self.low_freq_factor:  # the smooth ramp divides by their difference
            raise ConfigError(f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must be greater than "
                              f"low_freq_factor ({self.low_freq_factor})")


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")


def _positive_number(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")


ATTENTION_IMPLS = ("auto", "xla", "pallas")
REMAT_POLICIES = ("none", "full", "save_dots")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-3.x / Qwen3 decoder. Field names follow HF `config.json` where one exists."""

    model_type: str = "llama"  # "llama" | "qwen3"
    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    mask_token_id: int | None = None  # the SBD `<m>` token; None -> model not SBD-ready
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    param_dtype: str = "float32"  # storage dtype of parameters
    dtype: str = "float32"  # compute dtype of activations / matmuls
    # "auto": the Pallas kernels on GPU/TPU, the XLA reference on CPU | "xla" | "pallas"
    attention_impl: str = "auto"
    # layers per iteration of the `lax.scan` over layers (training and decoding): 1 = a rolled loop (compiles
    # once per layer shape, what big models want); num_hidden_layers = fully unrolled, which spares the loop's
    # stacked residual buffers (faster at small shapes, see BENCHMARKS.md)
    scan_unroll: int = 1
    # what the backward pass keeps of each layer of the cache-free forward (`REMAT_POLICIES`): "none" keeps every
    # activation, "full" only the layer's input (the layer is recomputed), "save_dots" also the matmul outputs
    remat: str = "none"

    def __post_init__(self):
        if self.model_type not in ("llama", "qwen3"):
            raise ConfigError(f"model_type {self.model_type!r} is not supported (supported: 'llama', 'qwen3')")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        # a zero, negative or non-finite eps / theta decodes to NaN logits without an error anywhere downstream
        _positive_number("rms_norm_eps", self.rms_norm_eps)
        _positive_number("rope_theta", self.rope_theta)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError("hidden_size must be divisible by num_attention_heads when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        _positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"{name} must be float32, bfloat16 or float16, got {getattr(self, name)!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if not 1 <= self.scan_unroll <= self.num_hidden_layers:
            raise ConfigError(f"scan_unroll must be in [1, num_hidden_layers={self.num_hidden_layers}], "
                              f"got {self.scan_unroll}")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
