"""The checks of a decoding request, in one place: the model can serve the spec, the prompt fits the model's
positions with max_new_tokens, each row's cap is within the spec's, the ids are in the vocabulary, gamma and
temperature are valid rates. Every entry point (generate, the batch runner, the continuous engine, Sampler,
decode.py) raises the same DecodeError for the same problem. (The options alone are checked by DecodeSpec.)"""
from __future__ import annotations

import os

import jax
import numpy as np

from ..models.config import ModelConfig
from .spec import DecodeError, DecodeSpec, PromptTooLongError


def check_model(cfg, spec: DecodeSpec) -> None:
    """The model-dependent checks of a request that hold for any prompt: SBD needs a mask token, the stop ids are
    in the vocabulary."""
    if spec.mode == "sbd" and cfg.mask_token_id is None:
        raise DecodeError("SBD decoding needs a mask token but the model config has no mask_token_id "
                          "(fine-tune it with SBD first, or use AR mode)")
    if spec.mode == "sbd" and spec.block_size > cfg.max_position_embeddings:
        raise DecodeError(f"block_size {spec.block_size} (decode.py --block-size) is more positions than the model "
                          f"has (max_position_embeddings {cfg.max_position_embeddings})")
    bad = [e for e in (cfg.eos_ids if spec.eos_ids is None else spec.eos_ids) if not 0 <= e < cfg.vocab_size]
    if bad:
        raise DecodeError(f"eos id(s) {bad} (eos_ids, decode.py --eos-id) are outside the vocabulary "
                          f"[0, {cfg.vocab_size})")


def check_rate(name: str, value, rows: int | None = None) -> None:
    """gamma / temperature: >= 0 and finite; a scalar or one value per row."""
    arr = np.asarray(value, dtype=np.float64)
    if np.any(arr < 0) or np.any(~np.isfinite(arr)):
        raise DecodeError(f"{name} must be >= 0 (and finite), got {value!r}")
    if rows is not None and (arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != rows)):
        raise DecodeError(f"{name} must be a scalar or one value per row ({rows}), got shape {arr.shape}")


def max_prompt_width(cfg, max_new_tokens: int) -> int:
    """The widest prompt that fits the model's positions with `max_new_tokens` generated after it."""
    return cfg.max_position_embeddings - max_new_tokens


def check_fits(cfg, width: int, max_new_tokens: int, what: str) -> None:
    """`what` (a prompt, or the padded width of a batch of them) of `width` tokens fits the model's positions
    with `max_new_tokens` after it; else PromptTooLongError."""
    if width > max_prompt_width(cfg, max_new_tokens):
        raise PromptTooLongError(
            f"{what} has {width} tokens; with max_new_tokens {max_new_tokens} it needs {width + max_new_tokens} "
            f"positions, but the model has max_position_embeddings {cfg.max_position_embeddings}")


def ids_in_vocab(ids, vocab_size: int, real=None) -> bool:
    """Every id (where `real`, when given) is in [0, vocab_size)."""
    ids = np.asarray(ids)
    bad = (ids < 0) | (ids >= vocab_size)
    return not np.any(bad if real is None else real & bad)


def check_ids(cfg, ids, what: str) -> None:
    if not ids_in_vocab(ids, cfg.vocab_size):
        raise DecodeError(f"{what}: token ids must be in [0, {cfg.vocab_size}) (the vocabulary)")
    _refuse_mask(cfg, np.asarray(ids)[None], None, what)


def _refuse_mask(cfg, ids_BP, real_BP, what: str) -> None:
    """The SBD mask token marks positions to fill: in a prompt it would be read as a hole, never as text (training
    refuses it in data the same way)."""
    if cfg.mask_token_id is None:
        return
    hit = ids_BP == cfg.mask_token_id
    rows, cols = np.nonzero(hit if real_BP is None else hit & real_BP)
    if rows.size:
        at = f"position {cols[0]}" if real_BP is None else f"row {rows[0]}, position {cols[0]}"
        raise DecodeError(f"{what} holds the SBD mask token (id {cfg.mask_token_id}) at {at}: it marks positions "
                          "to fill and cannot be prompt text")


def check_cap(cap: int | None, max_new_tokens: int, what: str) -> None:
    """A prompt's own max_new_tokens (None: the run's) is within the run's."""
    if cap is not None and cap > max_new_tokens:
        raise DecodeError(f"{what} asks for max_new_tokens {cap}, more than the run's {max_new_tokens} "
                          "(raise --max-new-tokens)")


def check_prompts(cfg, spec: DecodeSpec, prompts) -> None:
    """Every `Prompt` fits the model's positions with max_new_tokens and asks for no more than it (a bad prompt
    is named by id and line)."""
    for p in prompts:
        what = f"prompt {p.id!r} (line {p.line})"
        check_cap(p.max_new_tokens, spec.max_new_tokens, what)
        check_fits(cfg, len(p.ids), spec.max_new_tokens, what)


def check_stream_prompt(cfg, i: int, ids, width: int) -> None:
    """Prompt `i` of a continuous decoder's stream: 1 to `width` (the decoder's prompt_width) ids, in the
    vocabulary."""
    if not 1 <= len(ids) <= width:
        raise DecodeError(f"prompt {i} has {len(ids)} tokens; this decoder takes 1 to {width} (prompt_width)")
    check_ids(cfg, ids, f"prompt {i}")


def _is_concrete(x) -> bool:
    """A value the host can read now (not traced inside a user's jit, not spread over other hosts)."""
    if isinstance(x, jax.core.Tracer):
        return False
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def _check_row_caps(caps, B: int, max_new_tokens: int) -> None:
    caps = np.asarray(caps)
    if caps.shape not in ((), (B,)) or np.any(caps < 1) or np.any(caps > max_new_tokens):
        raise DecodeError(f"row_max_new_tokens must be a scalar or one value per row ({B}), each in [1, "
                          f"max_new_tokens={max_new_tokens}], got {caps.tolist()}")


def _check_lengths(cfg, lens, P: int, prompt_ids) -> None:
    lens = np.asarray(lens)
    if np.any(lens < 1) or np.any(lens > P):
        raise DecodeError(f"prompt_lengths must be in [1, {P}] (the padded prompt width), got {lens.tolist()}")
    if prompt_ids is not None and _is_concrete(prompt_ids):
        real = np.arange(P)[None] < lens[:, None]
        if not ids_in_vocab(prompt_ids, cfg.vocab_size, real):
            raise DecodeError(f"prompt token ids must be in [0, {cfg.vocab_size}) (the vocabulary)")
        _refuse_mask(cfg, np.asarray(prompt_ids), real, "prompt_ids")


def check_integers(name: str, value) -> None:
    """Token ids and lengths are integers: a float (or bool) array would be truncated silently. The dtype is
    known even for values traced inside a user's jit."""
    if value is None:
        return
    dtype = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
    if dtype.kind not in "iu":
        raise DecodeError(f"{name} must be integers, got dtype {dtype}"
                          + (f" ({np.asarray(value).ravel()[:8].tolist()})" if _is_concrete(value) else "")
                          + ": token ids and lengths are not truncated silently")


def check_request(cfg: ModelConfig, spec: DecodeSpec, prompt_shape, *, prompt_lengths=None, prompt_ids=None,
                  gamma=None, temperature=None, row_max_new_tokens=None) -> None:
    """The request's model- and prompt-dependent checks of `generate` (the options were checked by `DecodeSpec`);
    raises DecodeError naming the problem. Values traced inside a user's jit are checked only when concrete."""
    check_model(cfg, spec)
    if len(prompt_shape) != 2:
        raise DecodeError(f"prompt_ids must be [batch, prompt_len], got shape {tuple(prompt_shape)}")
    B, P = prompt_shape
    for name, val in (("prompt_ids", prompt_ids), ("prompt_lengths", prompt_lengths),
                      ("row_max_new_tokens", row_max_new_tokens)):
        check_integers(name, val)
    if P < 1:
        raise DecodeError("prompt_ids has no columns: every prompt needs at least one token")
    check_fits(cfg, P, spec.max_new_tokens, "the padded prompt width")
    for name, val in (("gamma", gamma), ("temperature", temperature)):
        if val is not None and _is_concrete(val):
            check_rate(name, val, B)
    if row_max_new_tokens is not None and _is_concrete(row_max_new_tokens):
        _check_row_caps(row_max_new_tokens, B, spec.max_new_tokens)
    if prompt_lengths is not None and _is_concrete(prompt_lengths):
        if np.shape(prompt_lengths) != (B,):
            raise DecodeError(f"prompt_lengths must have shape ({B},), got {np.shape(prompt_lengths)}")
        _check_lengths(cfg, prompt_lengths, P, prompt_ids)


@jax.jit
def _leaves_finite(params):
    import jax.numpy as jnp
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)
                      if jnp.issubdtype(x.dtype, jnp.inexact)] or [jnp.bool_(True)])


def check_finite_params(params, where: str) -> None:
    """Every float weight is finite (one jitted reduction, one host read); else DecodeError naming the first
    non-finite weights of `where` (a model that decodes every row as the mask id otherwise)."""
    ok = np.asarray(_leaves_finite(params))
    if ok.all():
        return
    import jax.numpy as jnp
    paths = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_leaves_with_path(params)
             if jnp.issubdtype(x.dtype, jnp.inexact)]
    bad = [p for p, good in zip(paths, ok) if not good]
    raise DecodeError(f"{where}: the weights are not finite (NaN or inf) in {len(bad)} of {len(paths)} tensors, "
                      f"first {', '.join(bad[:3])}: the checkpoint is broken (a diverged training run?); "
                      "decode from a good checkpoint")


def available_memory() -> int | None:
    """Bytes free on the first local device (GPU / TPU: its limit less what is in use), or on the host for a CPU
    device; None where neither is known."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_cache_fits(cfg, spec: DecodeSpec, slots: int, length: int, devices: int = 1) -> None:
    """The KV cache of `slots` rows of `length` positions (spread over `devices`) fits the free memory: a slot count
    far beyond it is refused here, before anything is allocated."""
    from ..models.transformer import init_cache
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(lambda: init_cache(cfg, slots, length, spec.kv_cache_dtype)))) // max(devices, 1)
    free = available_memory()
    if free is not None and need > free:
        raise DecodeError(f"{slots} slots (batch_size, decode.py --batch-size) need a KV cache of "
                          f"{need / 2**30:.1f} GiB per device for {length} positions, but {free / 2**30:.1f} GiB "
                          "is free: lower the batch size")
