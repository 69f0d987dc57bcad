"""GGUF (llama.cpp) -> a complete HF-layout model directory, the way `transformers` imports GGUF files: read and
dequantize with llama.cpp's own Python reader (`gguf.GGUFReader`, `gguf.quants.dequantize`), map the metadata to
a ModelConfig, undo llama.cpp's q/k row permutation (`llama` architecture only), and rebuild the tokenizer from
the vocabulary, merges and pre-tokenizer stored in the file (gguf_tokenizer.py: tokenizer.json +
tokenizer_config.json with the chat template; generation_config.json with the stop ids). Never downloads.

  convert(gguf_path, out_dir, dtype)     -> out_dir, written aside and renamed into place (never half-written)
  cached_convert(gguf_path, dtype=...)   -> a directory in the model cache ($SBD_MODEL_CACHE, default
                                            ~/.cache/sbd_jax/models), converted once per file content and dtype
  python -m sbd_jax.io.gguf FILE.gguf OUT_DIR [--dtype bfloat16] [--overwrite]

Untrusted files: gguf_header.py bounds every count and length of the header before gguf-py's reader trusts them;
`overwrite` replaces only a directory this converter wrote (its MARKER file lists the files), never one holding
the input or anything else; the CLI reports a bad file as one `error:` line (exit 2) and SIGTERM as exit 143 after
removing the temporary directory; a killed conversion's temporary directory is removed by the next conversion
into the same parent.

Architectures: `llama` (q/k rows un-permuted), `qwen3` (per-head q/k RMSNorm, HF row order) and `qwen2` (HF order;
its q/k/v biases are exactly a Llama with attention_bias and a zero o_proj bias, which is how it is written). The
tokenizer follows llama.cpp, where it and `transformers` differ: `pre=smollm` splits every digit (llama.cpp and the
original SmolLM2 tokenizer.json do; transformers' GGUF path has no entry for it and splits GPT-2 style: the same ids
for SmolLM2, whose vocabulary has no token joining a numeral with anything else), `llama3`-family files ignore
merges for whole words in the vocabulary (llama.cpp's ignore_merges), and add_bos_token defaults as in llama.cpp.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..config import ConfigError
from ..models.config import ModelConfig, RopeScaling
from ..models.params import param_specs
from .gguf_header import scan_header
from .gguf_meta import GGUFError, meta_value
from .gguf_output import (MARKER, Terminated, check_replaceable, entries, publish, remove_leftovers, sigterm_unwinds,
                          umask, write_marker)
from .gguf_tokenizer import build_tokenizer
from .hf_layout import hf_names
from .hf_save import save_generation_files, save_pretrained

CONVERTER_VERSION = 1  # part of the cache key: a changed converter never reuses an older conversion
DTYPES = ("float32", "bfloat16")


# --- reading --------------------------------------------------------------------------------------------------

def _reader(path: Path):
    import gguf
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist")
    try:
        scan_header(path)  # every count and length bounded before gguf-py's reader trusts them
    except OSError as e:
        raise GGUFError(f"cannot read GGUF file {str(path)!r}: {e}") from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError/struct.error/... on a bad file
        raise GGUFError(f"cannot read {str(path)!r} as GGUF (truncated or not a GGUF file?): {e}") from None


def read_metadata(reader, path: Path | None = None) -> dict:
    """Every key/value of the file, values as Python scalars, strings or lists; a string that is not UTF-8 is an
    error naming its key."""
    meta = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            meta[k] = f.contents()
        except UnicodeDecodeError as e:
            raise GGUFError(f"GGUF file {str(path or reader.data.filename)!r}: the value of key {k!r} is not valid "
                            f"UTF-8 ({e.reason} at byte {e.start})") from None
    return meta


# --- model config ---------------------------------------------------------------------------------------------

# GGUF architecture -> (our model_type, q/k rows permuted by llama.cpp's converter)
ARCHITECTURES = {"llama": ("llama", True), "qwen3": ("qwen3", False), "qwen2": ("llama", False)}


def _architecture(meta: dict, path: Path) -> str:
    arch = meta_value(meta, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} of {str(path)!r} is not supported (supported: "
                        f"{sorted(ARCHITECTURES)})")
    return arch


def _rope_scaling(meta: dict, arch: str, tensors: dict, head_dim: int, theta: float, path: Path):
    """llama.cpp stores Llama-3.1 RoPE scaling as a `rope_freqs.weight` tensor of per-frequency divisors, not as
    metadata: recover the HF parameters (low 1, high 4, as every Llama-3.x uses) and check they reproduce it."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind != "none":
        raise GGUFError(f"{arch}.rope.scaling.type {kind!r} in {str(path)!r} is not supported (only none, or "
                        "Llama-3 scaling stored as rope_freqs.weight)")
    if "rope_freqs.weight" not in tensors:
        return None
    divisors = _dequantize(tensors["rope_freqs.weight"], path).astype(np.float64)
    if np.allclose(divisors, 1.0):
        return None
    original = _number(meta, f"{arch}.rope.scaling.original_context_length", path, int, 8192)
    rs = RopeScaling(factor=float(divisors.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=original)
    from ..models.layers import rope_inv_freq
    plain = ModelConfig(head_dim=head_dim, rope_theta=theta)
    expected = rope_inv_freq(plain) / rope_inv_freq(ModelConfig(head_dim=head_dim, rope_theta=theta, rope_scaling=rs))
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-4):
        raise GGUFError(f"rope_freqs.weight in {str(path)!r} is not Llama-3 RoPE scaling with factor {rs.factor}, "
                        f"low_freq_factor 1, high_freq_factor 4, original context {original}: not supported")
    return rs


def _attention_bias(tensors: dict, path: Path) -> bool:
    """q/k/v biases all present (qwen2, Llama with attention_bias) or none; a lone o bias needs q/k/v ones."""
    kinds = [any(n.endswith(f".{t}.bias") for n in tensors) for t in ("attn_q", "attn_k", "attn_v", "attn_output")]
    if any(kinds[:3]) and not all(kinds[:3]) or kinds[3] and not kinds[0]:
        names = [t for t, k in zip(("q", "k", "v", "o"), kinds) if k]
        raise GGUFError(f"{str(path)!r} has attention biases on {names} only: not representable (q, k and v "
                        "biases together, optionally with an o bias)")
    return kinds[0]


def _number(meta: dict, key: str, path: Path, kind: type, default=KeyError):
    """Metadata `key` as an int or float; a string, list, bool or fractional count is an error naming key and value
    (`int()` would raise a bare ValueError/TypeError or silently truncate)."""
    v = meta_value(meta, key, path, default)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer()):
        return kind(v)
    raise GGUFError(f"GGUF file {str(path)!r}: metadata key {key!r} must be "
                    f"{'an integer' if kind is int else 'a number'}, got {v!r:.80}")


def read_config(meta: dict, tensors: dict, path: Path) -> ModelConfig:
    """The ModelConfig of a GGUF file (metadata keys `{arch}.*`, `tokenizer.ggml.*_token_id`); ModelConfig's own
    validation errors name the file."""
    try:
        return _read_config(meta, tensors, path)
    except GGUFError:
        raise
    except ConfigError as e:
        raise GGUFError(f"GGUF file {str(path)!r}: {e}") from None


def _read_config(meta: dict, tensors: dict, path: Path) -> ModelConfig:
    arch = _architecture(meta, path)
    a = lambda key, default=KeyError, kind=int: _number(meta, f"{arch}.{key}", path, kind, default)  # noqa: E731
    hidden, heads = a("embedding_length"), a("attention.head_count")
    if heads < 1:  # divides hidden below
        raise GGUFError(f"GGUF file {str(path)!r}: {arch}.attention.head_count must be >= 1, got {heads}")
    head_dim = a("attention.key_length", hidden // heads)
    if a("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{str(path)!r}: {arch}.attention.value_length != key_length is not supported")
    if a("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(f"{str(path)!r}: {arch}.rope.dimension_count {a('rope.dimension_count')} != head_dim "
                        f"{head_dim} (partial rotary embeddings) is not supported")
    theta = a("rope.freq_base", 10000.0, float)
    embd = tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise GGUFError(f"{str(path)!r} has no 2-D token_embd.weight tensor")
    tok = lambda key: meta.get(f"tokenizer.ggml.{key}_token_id")  # noqa: E731
    return ModelConfig(
        model_type=ARCHITECTURES[arch][0], qk_norm=arch == "qwen3",
        vocab_size=int(embd.shape[1]), hidden_size=hidden,
        intermediate_size=a("feed_forward_length"), num_hidden_layers=a("block_count"),
        num_attention_heads=heads, num_key_value_heads=a("attention.head_count_kv", heads), head_dim=head_dim,
        rms_norm_eps=a("attention.layer_norm_rms_epsilon", KeyError, float), rope_theta=theta,
        rope_scaling=_rope_scaling(meta, arch, tensors, head_dim, theta, path),
        max_position_embeddings=a("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors, attention_bias=_attention_bias(tensors, path),
        bos_token_id=tok("bos"), eos_token_id=tok("eos"), pad_token_id=tok("padding"))


# --- weights --------------------------------------------------------------------------------------------------

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}
for _t, _h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
    _LAYER |= {f"{_t}.weight": f"self_attn.{_h}.weight", f"{_t}.bias": f"self_attn.{_h}.bias"}
_IGNORED = {"rope_freqs.weight"}  # read into the config (RoPE scaling)


def hf_name(name: str, path: Path) -> str:
    """GGUF tensor name -> HF name; an unknown tensor (MoE experts, extra norms...) is an error naming it."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise GGUFError(f"tensor {name!r} in {str(path)!r} has no counterpart in a Llama/Qwen3 model: not supported")


def _dequantize(t, path: Path) -> np.ndarray:
    """One tensor as float32 in numpy (HF) dim order: GGUF lists dims innermost first."""
    import gguf
    kind = gguf.GGMLQuantizationType(t.tensor_type)
    try:
        w = gguf.quants.dequantize(np.asarray(t.data), kind)
    except NotImplementedError:  # the reader's own word on types it cannot dequantize
        raise GGUFError(f"tensor {t.name!r} in {str(path)!r} has quantization type {kind.name}, which "
                        "gguf.quants cannot dequantize: not supported") from None
    return np.asarray(w, np.float32).reshape([int(n) for n in reversed(t.shape)])


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `permute` of q/k rows (each head's rotary halves interleaved for ggml's rope)."""
    rows = w.shape[0] // n_head // 2
    return w.reshape(n_head, rows, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(tensors: dict, cfg: ModelConfig, arch: str, path: Path) -> dict[str, np.ndarray]:
    """HF name -> float32 weight in HF layout; zero o_proj biases where the file has q/k/v biases only."""
    out = {}
    for name, t in tensors.items():
        if name in _IGNORED:
            continue
        w = _dequantize(t, path)
        if ARCHITECTURES[arch][1] and (".attn_q." in name or ".attn_k." in name):
            w = unpermute(w, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        out[hf_name(name, path)] = w
    if cfg.attention_bias:
        for i in range(cfg.num_hidden_layers):
            out.setdefault(f"model.layers.{i}.self_attn.o_proj.bias", np.zeros(cfg.hidden_size, np.float32))
    return out


def to_params(cfg: ModelConfig, hf: dict[str, np.ndarray], path: Path) -> dict:
    """HF tensors -> our param pytree (the inverse of save_pretrained's layout), consuming `hf` as it goes."""
    def one(spec):
        names = hf_names(spec, cfg)
        missing = [n for n in names if n not in hf]
        if missing:
            raise GGUFError(f"{str(path)!r} lacks the weight(s) {missing[:3]} (HF names) for this config")
        shape = spec.shape(cfg)[spec.stacked:]
        ws = [(w.T if spec.hf_t else w).reshape(shape) for w in (hf.pop(n) for n in names)]
        return np.stack(ws) if spec.stacked else ws[0]
    import jax
    params = jax.tree.map(one, param_specs(cfg))
    if hf:
        raise GGUFError(f"{str(path)!r} has weights this config does not use: {sorted(hf)[:5]}")
    return params


# --- conversion -----------------------------------------------------------------------------------------------

def _write_model(path: Path, out: Path, dtype: str) -> None:
    """Everything of the model directory into `out` (an empty directory)."""
    from .tokenizer import Tokenizer
    reader = _reader(path)
    meta = read_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = read_config(meta, tensors, path)
    tok, tok_conf = build_tokenizer(meta, path)  # before the weights: a bad tokenizer fails fast
    params = to_params(cfg, read_weights(tensors, cfg, meta["general.architecture"], path), path)
    save_pretrained(cfg, params, out, dtype=dtype)
    del params
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_conf, indent=2, ensure_ascii=False) + "\n")
    save_generation_files(out, cfg, Tokenizer.load(out), chat="chat_template" in tok_conf)


def convert(gguf_path, out_dir, dtype: str = "float32", *, overwrite: bool = False, exist_ok: bool = False) -> Path:
    """Convert `gguf_path` into the HF model directory `out_dir` (config.json, safetensors in `dtype`,
    tokenizer.json, tokenizer_config.json, generation_config.json, and MARKER listing them), written in a temporary
    directory beside it and renamed into place. An existing `out_dir` is an error unless `overwrite` (replace it:
    only a directory this converter wrote, holding nothing else and not the input GGUF) or `exist_ok` (keep it:
    what a cache wants when another process converted the same file first)."""
    path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise GGUFError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if out_dir.is_symlink() or out_dir.exists() and not out_dir.is_dir():
        raise GGUFError(f"{str(out_dir)!r} exists and is not a directory (a file or a link): not replacing it; "
                        "remove it yourself or choose another OUT_DIR")
    if out_dir.exists() and not (overwrite or exist_ok):
        raise GGUFError(f"output directory {str(out_dir)!r} exists (pass overwrite=True / --overwrite to replace a "
                        "directory this converter wrote)")
    if out_dir.exists() and exist_ok and not overwrite:
        return out_dir
    if out_dir.exists():
        check_replaceable(out_dir, path)  # before converting: fail fast
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out_dir)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        write_marker(tmp)
        os.chmod(tmp, 0o777 & ~umask())  # as mkdir would (mkdtemp's 0700 hides it from other users)
        _write_model(path, tmp, dtype)
        write_marker(tmp, converter_version=CONVERTER_VERSION, source=str(path.resolve()),
                      files=[f for f in entries(tmp) if f != MARKER])
        if not publish(tmp, out_dir, path, overwrite) and not exist_ok:
            raise GGUFError(f"output directory {str(out_dir)!r} appeared while converting")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def fingerprint(path) -> str:
    """sha256 of the file's bytes (16 hex digits): the cache key of its conversions."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("SBD_MODEL_CACHE") or Path.home() / ".cache" / "sbd_jax" / "models")


def cached_convert(gguf_path, *, dtype: str = "float32", cache_dir=None) -> Path:
    """The conversion of `gguf_path` in the model cache (`cache_dir`, else $SBD_MODEL_CACHE, else
    ~/.cache/sbd_jax/models), made on first use. The directory name holds the file's content hash, the dtype and
    the converter version, and a directory only ever appears there complete (renamed into place), so a stale or
    partial conversion is never reused; two processes converting at once both end with the same directory."""
    path = Path(gguf_path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out = cache / f"{path.stem}-{fingerprint(path)}-{dtype}-v{CONVERTER_VERSION}"
    if (out / "config.json").is_file():
        return out
    return convert(path, out, dtype, exist_ok=True)


# What a bad or hostile input file can raise beyond GGUFError, from gguf-py, numpy, tokenizers or the config: each
# becomes one `error:` line. OSError too (unreadable input, full disk): a traceback says no more. Anything else
# (AttributeError, RuntimeError...) is a bug here and keeps its traceback.
_BAD_INPUT = (ConfigError, ValueError, TypeError, LookupError, ArithmeticError, struct.error, OSError)


def _error_line(e: BaseException, gguf_file: str) -> str:
    if isinstance(e, GGUFError):  # names the file already
        return f"error: {e}"
    if isinstance(e, MemoryError):
        return f"error: {gguf_file!r} asks for more memory than this machine has (a corrupt or hostile file?)"
    if isinstance(e, ConfigError):
        return f"error: cannot convert {gguf_file!r}: {e}"
    return f"error: cannot convert {gguf_file!r}: {type(e).__name__}: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sbd_jax.io.gguf", description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf_file")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="safetensors dtype")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing OUT_DIR written by this converter (never one holding other files)")
    args = ap.parse_args(argv)
    import time
    t0 = time.perf_counter()
    try:
        with sigterm_unwinds():
            out = convert(args.gguf_file, args.out_dir, args.dtype, overwrite=args.overwrite)
    except Terminated:
        print("error: terminated by SIGTERM; the partial conversion was removed", file=sys.stderr)
        return 128 + signal.SIGTERM
    except (MemoryError, *_BAD_INPUT) as e:
        print(_error_line(e, args.gguf_file), file=sys.stderr)
        return 2
    print(f"{out} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
