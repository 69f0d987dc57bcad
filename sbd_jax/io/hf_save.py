"""Writing HF-layout model directories: `config.json` + (sharded, indexed) safetensors, written tensor by tensor,
and the tokenizer/generation files beside them (re-exported by hf.py)."""
from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ConfigError
from ..models.config import ModelConfig
from ..models.hf_config import config_to_hf
from ..models.quant import QUANTIZED, quantization_of
from ..models.params import param_specs
from .hf_layout import hf_names, hf_shape
from .hf_quant import Tensor, config_entry, tensors


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
    to a temporary name and renamed, so a killed save never leaves a half-written file under its final name.
    Quantized projections (sbd_jax/models/quant.py) are written as they are, values and scales (hf_quant.py), with
    the scheme in config.json: `from_pretrained` reads them back; transformers does not."""
    out_dir = Path(out_dir)
    lead = jax.process_index() == 0
    dtype = jnp.dtype(dtype or cfg.param_dtype)
    if dtype.name not in _ST_DTYPES:
        raise ConfigError(f"export dtype must be one of {sorted(_ST_DTYPES)}, got {dtype.name!r}")
    q = quantization_of(params)
    entries, shards = [], [[]]  # entries: Tensors; shards: lists of them
    for spec in jax.tree.leaves(param_specs(cfg)):
        for layer, name in enumerate(hf_names(spec, cfg)):
            layer = layer if spec.stacked else None
            if q is not None and spec.name.removeprefix("layers/") in QUANTIZED:  # values, scales (hf_quant.py)
                entries += tensors(name, spec, cfg, q, functools.partial(_layer_weight, params, spec, layer))
            else:
                entries.append(Tensor(name, hf_shape(spec, cfg), _ST_DTYPES[dtype.name],
                                      functools.partial(_hf_tensor, params, spec, layer, cfg, dtype)))
    for e in entries:
        if shards[-1] and sum(e.nbytes for e in shards[-1]) + e.nbytes > max_shard_bytes:
            shards.append([])
        shards[-1].append(e)
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    if lead:
        out_dir.mkdir(parents=True, exist_ok=True)
    for fname, shard in zip(files, shards):
        if lead:
            atomic_write(out_dir / fname, lambda p, s=shard: _write_safetensors(p, s))
        else:
            for e in shard:
                e.produce()  # takes part in the gathers
    if not lead:
        return out_dir
    index_path = out_dir / "model.safetensors.index.json"
    if n == 1:
        index_path.unlink(missing_ok=True)  # a stale index would shadow the single file
    else:
        index = {"metadata": {"total_size": int(sum(e.nbytes for e in entries))},
                 "weight_map": {e.name: fname for fname, shard in zip(files, shards) for e in shard}}
        atomic_write(index_path, lambda p: Path(p).write_text(json.dumps(index, indent=2)))
    hf_cfg = {**config_to_hf(cfg), "torch_dtype": dtype.name, **(config_entry(q) if q is not None else {})}
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


def _hf_tensor(params: dict, spec, layer: int | None, cfg: ModelConfig, dtype) -> np.ndarray:
    """One layer's weight (or a whole unstacked one) on the host, in `dtype` and HF's layout."""
    shape = hf_shape(spec, cfg)
    w = functools.reduce(lambda tree, key: tree[key], spec.name.split("/"), params)
    w = host_value(w if layer is None else w[layer]).astype(dtype)
    return np.ascontiguousarray(w.reshape(shape[::-1]).T if spec.hf_t else w.reshape(shape))


def _layer_weight(params: dict, spec, layer: int):
    """One layer of a quantized projection, its arrays on the host."""
    w = functools.reduce(lambda tree, key: tree[key], spec.name.split("/"), params)
    return jax.tree.map(lambda a: host_value(a[layer]), w)


def _write_safetensors(path, entries: list[Tensor]) -> None:
    """A safetensors file written one tensor at a time (the `safetensors` writers take every tensor of a file
    at once): a little-endian u64 header size, the JSON header padded to 8 bytes, then the raw tensors."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for e in entries:
            data = e.produce()
            if data.nbytes != e.nbytes:
                raise ValueError(f"{e.name}: {data.nbytes} bytes produced, {e.nbytes} declared")
            f.write(data.tobytes())


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
