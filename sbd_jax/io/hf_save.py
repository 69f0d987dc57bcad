"""Writing HF-layout model directories: `config.json` + (sharded, indexed) safetensors, written tensor by tensor,
and the tokenizer/generation files beside them (re-exported by hf.py)."""
from __future__ import annotations

import functools
import json
import math
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ConfigError, ModelConfig
from ..models.hf_config import config_to_hf
from ..models.transformer import param_specs
from .hf_layout import hf_names, hf_shape


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def host_value(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-process) array on this host, whole. Every process must call it."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save_pretrained(cfg: ModelConfig, params: dict, out_dir: str | os.PathLike, *,
                    max_shard_bytes: int = 5 * 2**30, dtype: str | None = None) -> Path:
    """Write config.json (with mask_token_id) + safetensors (sharded with an index past `max_shard_bytes`) so
    that `transformers` loads the directory. Tensor by tensor: one layer's weight is gathered to the host,
    converted and appended to its file at a time, so host memory stays near the largest tensor. With several
    processes every process must call it (the gathers are collective) and process 0 writes. Files are written
    to a temporary name and renamed, so a killed save never leaves a half-written file under its final name."""
    out_dir = Path(out_dir)
    lead = jax.process_index() == 0
    dtype = jnp.dtype(dtype or cfg.param_dtype)
    if dtype.name not in _ST_DTYPES:
        raise ConfigError(f"export dtype must be one of {sorted(_ST_DTYPES)}, got {dtype.name!r}")
    entries, shards = [], [[]]  # entries: (HF name, HF shape, spec, layer); shards: lists of entries
    for spec in jax.tree.leaves(param_specs(cfg)):
        for layer, name in enumerate(hf_names(spec, cfg)):
            entries.append((name, hf_shape(spec, cfg), spec, layer if spec.stacked else None))
    nbytes = lambda e: math.prod(e[1]) * dtype.itemsize  # noqa: E731
    for e in entries:
        if shards[-1] and sum(map(nbytes, shards[-1])) + nbytes(e) > max_shard_bytes:
            shards.append([])
        shards[-1].append(e)
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    def hf_tensor(e) -> np.ndarray:
        _, shape, spec, layer = e
        w = functools.reduce(lambda tree, key: tree[key], spec.name.split("/"), params)
        w = host_value(w if layer is None else w[layer]).astype(dtype)
        return np.ascontiguousarray(w.reshape(shape[::-1]).T if spec.hf_t else w.reshape(shape))

    if lead:
        out_dir.mkdir(parents=True, exist_ok=True)
    for fname, shard in zip(files, shards):
        if lead:
            atomic_write(out_dir / fname, lambda p, s=shard: _write_safetensors(p, s, dtype, hf_tensor))
        else:
            for e in shard:
                hf_tensor(e)  # takes part in the gathers
    if not lead:
        return out_dir
    index_path = out_dir / "model.safetensors.index.json"
    if n == 1:
        index_path.unlink(missing_ok=True)  # a stale index would shadow the single file
    else:
        index = {"metadata": {"total_size": int(sum(map(nbytes, entries)))},
                 "weight_map": {e[0]: fname for fname, shard in zip(files, shards) for e in shard}}
        atomic_write(index_path, lambda p: Path(p).write_text(json.dumps(index, indent=2)))
    hf_cfg = {**config_to_hf(cfg), "torch_dtype": dtype.name}
    atomic_write(out_dir / "config.json", lambda p: Path(p).write_text(json.dumps(hf_cfg, indent=2) + "\n"))
    return out_dir


def save_generation_files(out_dir: str | os.PathLike, cfg: ModelConfig, tokenizer=None, *, chat: bool = False) -> None:
    """Complete an exported model directory: the tokenizer's files (tokenizer.json, tokenizer_config.json, chat
    template) and generation_config.json, whose EOS ids add the chat template's end-of-turn token when the model
    was trained on the template (`chat`), so that decoding stops at the end of a turn."""
    out_dir = Path(out_dir)
    for f in getattr(tokenizer, "files", ()):
        atomic_write(out_dir / f.name, lambda p, f=f: Path(p).write_bytes(f.read_bytes()))
    eos = list(cfg.eos_ids)
    turn_end = tokenizer.end_of_turn_id() if chat and tokenizer is not None else None
    if turn_end is not None and turn_end not in eos:
        eos.append(turn_end)
    gen = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", eos or None),
                             ("pad_token_id", cfg.pad_token_id)) if v is not None}
    atomic_write(out_dir / "generation_config.json", lambda p: Path(p).write_text(json.dumps(gen, indent=2) + "\n"))


def _write_safetensors(path, entries, dtype, tensor) -> None:
    """A safetensors file written one tensor at a time (the `safetensors` writers take every tensor of a file
    at once): a little-endian u64 header size, the JSON header padded to 8 bytes, then the raw tensors."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, *_ in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype.name], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for e in entries:
            f.write(tensor(e).tobytes())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write) -> None:
    """`write(tmp_path)` then rename onto `path`: a killed write never leaves a half-written file under its name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # as a plain open() would (mkstemp's 0600 hides it from other users)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
