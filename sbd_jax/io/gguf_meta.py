"""The GGUF converter's error type and metadata lookup, shared by gguf.py (which re-exports them) and
gguf_tokenizer.py."""
from __future__ import annotations

from pathlib import Path

from .hf_layout import CheckpointError


class GGUFError(CheckpointError):
    """A GGUF file that cannot be converted exactly: unsupported architecture, quantization, tokenizer..."""


def meta_value(meta: dict, key: str, path: Path, default=KeyError):
    """`meta[key]`; a missing key is an error naming it and the file unless a default is given."""
    if key in meta:
        return meta[key]
    if default is KeyError:
        raise GGUFError(f"{str(path)!r} lacks the required metadata key {key!r}")
    return default
