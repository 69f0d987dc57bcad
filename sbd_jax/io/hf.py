"""HF-layout interop: read/write `config.json` + (sharded, indexed) safetensors. Never a hub download:
`from_pretrained` takes a local directory only."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from ..config import ConfigError, ModelConfig
from ..models.hf_config import KNOWN_KEYS, config_from_hf, config_to_hf
from ..models.transformer import ParamSpec, axis_sizes, param_specs


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked (missing/truncated file, bad shape...)."""


def load_hf_config(model_dir: str | os.PathLike, *, allow_unknown_keys: bool = False, **overrides) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"model directory {str(model_dir)!r} does not exist (hub names are not "
                              "downloaded: pass a local directory)")
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} is missing")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{str(path)!r} must hold a JSON object, not {type(d).__name__}")
    check_number_types(d, path)
    mt = d.get("model_type")
    if mt not in KNOWN_KEYS:
        raise ConfigError(f"model_type {mt!r} in {str(path)!r} is not supported (supported: {sorted(KNOWN_KEYS)})")
    return config_from_hf(d, allow_unknown_keys=allow_unknown_keys, **overrides)


def check_number_types(d: dict, path: Path) -> None:
    """A ModelConfig number given as a string, bool or list in config.json is an error naming the key and value."""
    for f in dataclasses.fields(ModelConfig):
        kind = str(f.type).replace(" | None", "")
        v = d.get(f.name)
        if kind not in ("int", "float") or v is None:
            continue
        ok = isinstance(v, int) if kind == "int" else isinstance(v, (int, float))
        if not ok or isinstance(v, bool):
            raise CheckpointError(f"{str(path)!r}: {f.name} is {v!r} ({type(v).__name__}), expected "
                                  f"{'an integer' if kind == 'int' else 'a number'}")


def hf_names(s: ParamSpec, cfg: ModelConfig) -> list[str]:
    """The HF tensor name(s) of one parameter: one per layer for a stacked weight."""
    return [f"model.layers.{i}.{s.hf}" for i in range(cfg.num_hidden_layers)] if s.stacked else [s.hf]


def _hf_shape(s: ParamSpec, cfg: ModelConfig) -> tuple[int, ...]:
    """HF's shape for one layer of `s`: dims joined by `*` are one, a Linear weight is [out, in]."""
    sizes = axis_sizes(cfg)
    groups = tuple(math.prod(sizes[a] for a in g.split("*")) for g in s.axes.split())
    return groups[::-1] if s.hf_t else groups


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> shard file, from model.safetensors.index.json or the single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = {name: model_dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"safetensors shard {str(f)!r} listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {str(model_dir)!r}")
    try:
        with safe_open(str(single), framework="flax") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read safetensors file {str(single)!r} (truncated or corrupt?): {e}") from None


def _hf_slices(s: ParamSpec, shape: tuple[int, ...], box: list[tuple[int, int]]):
    """How to read the block `box` ([start, stop) per dim) of one layer of `s` (shape `shape`) from its HF
    tensor: -> (the HF slice, the shape of what it gives in our dim order, the cut of it that is the block).
    An HF dim joins several of ours (`heads*head_dim`): it is read over whole rows of its leading one."""
    hf_index, our_shape, cut, at = [], [], [], 0
    for group in s.axes.split():
        (a, b), rest = box[at], shape[at + 1:at + len(group.split("*"))]
        hf_index.append(slice(a * math.prod(rest), b * math.prod(rest)))
        our_shape += [b - a, *rest]
        cut += [slice(None), *(slice(*box[i]) for i in range(at + 1, at + 1 + len(rest)))]
        at += 1 + len(rest)
    return tuple(hf_index[::-1] if s.hf_t else hf_index), our_shape, tuple(cut)


def from_pretrained(model_dir: str | os.PathLike, *, param_dtype: str | None = None, dtype: str | None = None,
                    mesh=None, rules=None, allow_unknown_keys: bool = False, gguf_file: str | None = None,
                    **config_overrides) -> tuple[ModelConfig, dict]:
    """Load a local HF-layout Llama-3.x/Qwen3 checkpoint -> (ModelConfig, params pytree). `param_dtype`
    (storage) and `dtype` (compute) default to float32, whatever the checkpoint stores. With `mesh`, every
    weight is built in its shards (`sbd_jax.sharding.param_shardings(cfg, mesh, rules)`): each process reads
    from the safetensors only the slices its own devices hold, one device's slice of one layer at a time;
    without, the weights land on the default device. With `gguf_file` (a name in `model_dir`, or a path), as in
    transformers: that llama.cpp file is converted once into the model cache (`sbd_jax.io.gguf.cached_convert`,
    float32) and the conversion is loaded."""
    from ..sharding import param_shardings  # (sharding imports the model; a module-level import would cycle)

    if gguf_file is not None:
        from .gguf import cached_convert
        model_dir = cached_convert(Path(model_dir) / gguf_file)
    model_dir = Path(model_dir)
    dtypes = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v}
    cfg = load_hf_config(model_dir, allow_unknown_keys=allow_unknown_keys, **{**config_overrides, **dtypes})
    files = _weight_files(model_dir)

    def read(name: str, index: tuple[slice, ...], expected_shape) -> np.ndarray:
        """The slice `index` of HF tensor `name`, whose shape is checked against the config's. The file is
        memory-mapped for this read only, so its pages leave the process's memory with it."""
        if name not in files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint in {str(model_dir)!r}")
        f = files[name]
        try:
            with safe_open(str(f), framework="numpy") as handle:
                t = handle.get_slice(name)
                shape = tuple(t.get_shape())
                out = t[index] if shape == tuple(expected_shape) else None
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {name!r} from {str(f)!r} (truncated or corrupt?): {e}") from None
        if out is None:
            raise CheckpointError(f"weight {name!r} has shape {shape}, expected {tuple(expected_shape)} for this "
                                  f"config (vocab/hidden/head sizes disagree with config.json?)")
        return out

    def load(s: ParamSpec, sharding):
        shape = s.shape(cfg)
        names, hf_shape = hf_names(s, cfg), _hf_shape(s, cfg)

        def block(index: tuple[slice, ...]) -> np.ndarray:
            box = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
            layers, box = (range(*box[0]), box[1:]) if s.stacked else ([0], box)
            hf_index, our_shape, cut = _hf_slices(s, shape[s.stacked:], box)
            ws = [read(names[i], hf_index, hf_shape) for i in layers]
            ws = [(w.T if s.hf_t else w).reshape(our_shape)[cut].astype(cfg.param_dtype) for w in ws]
            return np.stack(ws) if s.stacked else ws[0]
        return jax.make_array_from_callback(shape, sharding, block)

    specs = param_specs(cfg)
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return cfg, jax.tree.map(lambda sp: load(sp, one), specs)
    return cfg, jax.tree.map(load, specs, param_shardings(cfg, mesh, rules))


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
            entries.append((name, _hf_shape(spec, cfg), spec, layer if spec.stacked else None))
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
