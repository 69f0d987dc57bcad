"""Frozen-dataclass configs from dicts/YAML plus `key=value` command-line overrides. Every config goes through
`from_dict`, so an unknown key is always an error naming it and the valid ones (never an ignored typo)."""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem the user can fix (unknown key, bad value, missing file)."""


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


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """`value` as the annotated type `tp`: Optional/unions, nested dataclasses from mappings, tuples from lists,
    numbers from strings (YAML reads `1e-3` as one), booleans from true/false/yes/no/1/0."""
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args or tp is Any:
            return None
        raise ConfigError(f"{where} may not be null")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return from_dict(tp, value, where=where)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _coerce(a, value, where)
            except (ConfigError, TypeError, ValueError) as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: cannot interpret {value!r} ({'; '.join(errors)})")
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_coerce(args[0] if args else Any, v, where) for v in value)
    if tp not in _KINDS:
        return value
    bad = ConfigError(f"{where} must be {_KINDS[tp]}, got {value!r}")
    if tp in (bool, str):
        if isinstance(value, tp):
            return value
        if tp is bool and isinstance(value, str) and value.lower() in _BOOLS:
            return _BOOLS[value.lower()]
        raise bad
    if tp is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
        raise bad
    try:
        return tp(value)
    except (TypeError, ValueError):
        raise bad from None


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str | None = None) -> T:
    """Build dataclass `cls` from `data`; unknown keys raise ConfigError naming them."""
    where = where or cls.__name__
    hints = typing.get_type_hints(cls)  # the fields' types, by name
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown} in {where}; valid keys: {sorted(hints)}")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides (values parsed as YAML) to a nested dict, returning a new dict."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(text)
        except yaml.YAMLError:
            node[parts[-1]] = text
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would keep the last one, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path):
    """A YAML file's content; malformed YAML, a key given twice or non-UTF-8 text is a ConfigError naming the file
    and line."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(path)!r}{at} is not valid YAML: {getattr(e, 'problem', None) or e}") \
            from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start})") from None


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """YAML file (optional) + `key=value` overrides -> frozen dataclass `cls`."""
    data = {}
    if path:
        if not Path(path).is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = read_yaml(Path(path))
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at top level")
    return from_dict(cls, apply_overrides(data, list(overrides)))


def _flat(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}": v})
    return out


def changed_settings(saved: Mapping, wanted: Any, neutral=()) -> list[str]:
    """Dotted keys whose values differ between `saved` (read back from JSON) and `wanted` (a dataclass or dict),
    as "key: saved there, wanted now"; keys in `neutral`, or under a neutral "section.", are ignored."""
    wanted = json.loads(json.dumps(to_dict(wanted) if dataclasses.is_dataclass(wanted) else wanted, default=str))
    old, new = _flat(saved), _flat(wanted)
    skip = lambda k: k in neutral or any(n.endswith(".") and k.startswith(n) for n in neutral)  # noqa: E731
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in sorted(old.keys() | new.keys())
            if not skip(k) and old.get(k) != new.get(k)]

