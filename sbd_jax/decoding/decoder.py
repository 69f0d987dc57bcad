"""Jitted SBD / AR decoding over a static KV cache: one `lax.while_loop`, nothing returns to the host
per step.

Layout (choices documented here, see SBD.md "Inference"):
  * Prompts arrive right-padded: `prompt_ids [B, P]`, `prompt_lengths [B]` (1 <= len_b <= P). Row b's
    prompt occupies positions (= cache slots) [0, len_b); its generated token j sits at position
    len_b + j. Rows never see each other (one sequence per row) and never see padding (segment 0).
  * The KV cache holds S = P + max_new_tokens slots per row (`PromptTooLongError` if that exceeds
    the model's max_position_embeddings). A token buffer `seq [B, P + max_new_tokens + k]` holds
    every token by position (prompt, then decoded tokens); the output is read from it at the end.
  * Blocks start right after each row's prompt (block starts len_b, len_b + k, ...; explicit block
    ids in the metadata, SBD.md step 8). The last block is cut at max_new_tokens: its positions
    beyond the cap are padding (segment 0), so the model sees a shorter block.
  * NFE 1 (SBD) = [prompt as CLEAN causal tokens ; first block as COPY tokens]: the prompt prefill is
    folded into the first unmasking step (SBD.md step 8).
  * Each later iteration is one model call on one of two window shapes, chosen by `lax.cond` (only
    one executes): if some live row has just finished a block, the 2k window
    [finished block as CLEAN ; current block as COPY] writes the finished block's exact causal K/V
    (paper Algorithm 3, no extra forward); otherwise the k window [current block as COPY].
    Rows that did not just finish a block put padding in the clean half.
  * A copy token carries its decoded token once accepted and the mask token while still masked.
  * Rows that are done become padding in every later window: their state, their cache and their
    NFE stop changing. The loop ends when every row is done.
  * Stop (SBD.md step 7): a row stops when an EOS is decoded and every earlier position of its block
    is decoded, or when max_new_tokens are decoded. Tokens after the EOS are dropped (the output is
    padded with `pad_id` beyond `lengths`).
  * Sharding: with `mesh`, the cache is constrained to `cache_sharding` (batch over data x fsdp, KV
    heads over tensor, as wk/wv) and per-row state to `batch_sharding`; params come laid out by
    `shard_params` (the training rules). Without `mesh`, XLA propagates the inputs' shardings.
    The decoder traces under `mesh_context(mesh)`: with attention_impl="pallas" the attention kernels
    run per shard inside `jax.shard_map` (sbd_jax/attention/sharded.py).
  * Randomness: row b draws its step-n tokens from fold_in(key_b, n) (see sampling.py).
  * SBD never samples the mask token (its logit is set to -inf for the draw, not for the entropy).
    AR is left untouched (plain next-token decoding, the baseline, identical to `transformers`).
  * NFE counts model calls that carry at least one token of the row (so a finished row stops
    counting). AR: the prefill call yields the first token (NFE 1 for 1 token), then one clean
    1-token call per token, both with next-token (NTP) logits.
  * Finished-block K/V written by the window scheme covers everything except the row's last block
    (SBD) or last token (AR). `finalize_cache=True` writes those with one extra clean call that is
    NOT counted in NFE, after which the cache equals one causal forward over prompt + output
    (useful to continue a conversation from the returned cache, and tested exactly).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..attention import clean_meta, concat_meta, copy_meta
from ..config import ModelConfig
from ..models.transformer import KVCache, causal_meta, forward, init_cache
from ..sharding import mesh_context
from . import sampling

MODES = ("sbd", "ar")


class DecodeError(ValueError):
    """A decoding request that cannot be served as asked (bad option, prompt too long, ...)."""


class PromptTooLongError(DecodeError):
    """Prompt + max_new_tokens do not fit the cache / the model's positions."""


class GenerateOutput(NamedTuple):
    """tokens [B, max_new_tokens] (int32, `pad_id` beyond `lengths`), lengths [B] generated tokens
    (EOS included), nfe [B] model calls, stopped_by_eos [B] bool, iterations (scalar: model calls of
    the batch as a whole = loop iterations + 1), wide_steps (scalar: SBD iterations that used the
    2k commit window), cache (KVCache or None)."""

    tokens: jax.Array
    lengths: jax.Array
    nfe: jax.Array
    stopped_by_eos: jax.Array
    iterations: jax.Array
    wide_steps: jax.Array
    cache: KVCache | None = None

    @property
    def tokens_per_forward(self):
        return self.lengths / jnp.maximum(self.nfe, 1)


class _State(NamedTuple):
    seq: jax.Array        # [B, W] tokens by position
    cache: KVCache
    blk: jax.Array        # [B] SBD: generated tokens before the current block; AR: generated tokens
    masked: jax.Array     # [B, k] still-masked positions of the current block (SBD)
    commit: jax.Array     # [B] previous block still needs its clean causal re-run (SBD)
    done: jax.Array       # [B]
    eos: jax.Array        # [B] stopped by EOS
    n_gen: jax.Array      # [B] final number of generated tokens (valid once done)
    nfe: jax.Array        # [B]
    iters: jax.Array      # scalar: model calls
    wide: jax.Array       # scalar: calls with the 2k commit window


def _is_concrete(x) -> bool:
    """A value the host can read now (not traced inside a user's jit, not spread over other hosts)."""
    if isinstance(x, jax.core.Tracer):
        return False
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def check_request(cfg: ModelConfig, prompt_shape, *, max_new_tokens, block_size, mode, rule, top_k, top_p,
                  gamma=None, temperature=None, prompt_lengths=None, prompt_ids=None) -> None:
    """Validate a decoding request; raises DecodeError (a ValueError) naming the problem. Values that
    are traced (generate called inside a user's jit) are checked only when concrete. `prompt_shape=None`
    checks the options alone."""
    if mode not in MODES:
        raise DecodeError(f"mode must be one of {MODES}, got {mode!r}")
    if rule not in sampling.RULES:
        raise DecodeError(f"rule must be one of {sampling.RULES}, got {rule!r}")
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise DecodeError(f"block_size must be >= 1 (an integer), got {block_size!r}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise DecodeError(f"max_new_tokens must be >= 1 (an integer), got {max_new_tokens!r}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise DecodeError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not 0.0 < float(top_p) <= 1.0:
        raise DecodeError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if mode == "sbd" and cfg.mask_token_id is None:
        raise DecodeError("SBD decoding needs a mask token but the model config has no mask_token_id "
                          "(fine-tune it with SBD first, or use AR mode)")
    for name, val in (("gamma", gamma), ("temperature", temperature)):
        if val is not None and _is_concrete(val):
            arr = np.asarray(val, dtype=np.float64)
            if np.any(arr < 0) or np.any(~np.isfinite(arr)):
                raise DecodeError(f"{name} must be >= 0 (and finite), got {val!r}")
    if prompt_shape is None:  # options only (decode.py checks them before reading any prompt)
        return
    if len(prompt_shape) != 2:
        raise DecodeError(f"prompt_ids must be [batch, prompt_len], got shape {tuple(prompt_shape)}")
    P = prompt_shape[1]
    if P < 1:
        raise DecodeError("prompt_ids has no columns: every prompt needs at least one token")
    if P + max_new_tokens > cfg.max_position_embeddings:
        raise PromptTooLongError(
            f"prompt width {P} + max_new_tokens {max_new_tokens} = {P + max_new_tokens} exceeds the model's "
            f"max_position_embeddings {cfg.max_position_embeddings}")
    for name, val in (("gamma", gamma), ("temperature", temperature)):
        if val is not None and _is_concrete(val):
            arr = np.asarray(val, dtype=np.float64)
            if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != prompt_shape[0]):
                raise DecodeError(f"{name} must be a scalar or one value per row ({prompt_shape[0]}), "
                                  f"got shape {arr.shape}")
    if prompt_lengths is not None and _is_concrete(prompt_lengths):
        lens = np.asarray(prompt_lengths)
        if lens.shape != (prompt_shape[0],):
            raise DecodeError(f"prompt_lengths must have shape ({prompt_shape[0]},), got {lens.shape}")
        if np.any(lens < 1) or np.any(lens > P):
            raise DecodeError(f"prompt_lengths must be in [1, {P}] (the padded prompt width), got {lens.tolist()}")
        if prompt_ids is not None and _is_concrete(prompt_ids):
            ids = np.asarray(prompt_ids)
            real = np.arange(P)[None] < lens[:, None]
            if np.any(real & ((ids < 0) | (ids >= cfg.vocab_size))):
                raise DecodeError(f"prompt token ids must be in [0, {cfg.vocab_size}) (the vocabulary)")


def generate(params: dict, cfg: ModelConfig, prompt_ids, prompt_lengths, *, max_new_tokens: int,
             block_size: int = 4, gamma=0.35, rule: str = "eb", temperature=0.0, top_k: int = 0,
             top_p: float = 1.0, tempered_entropy: bool = False, eos_ids=None, key=None, mode: str = "sbd",
             pad_id: int | None = None, finalize_cache: bool = False, return_cache: bool = False,
             mesh=None) -> GenerateOutput:
    """Decode a batch of right-padded prompts with SBD (`mode="sbd"`) or next-token AR (`mode="ar"`).

    params, cfg: the model (`init_params` / `from_pretrained`); params may be sharded
      (`sbd_jax.sharding.shard_params`) - pass `mesh` to lay the cache and per-row state out to match.
    prompt_ids [B, P] int, prompt_lengths [B] int (1 <= len <= P, right padding).
    max_new_tokens (static): cap on generated tokens per row.
    block_size (static, SBD): k, positions per block.
    gamma (scalar or [B]): acceptance threshold; rule: "eb" (default) or "threshold" (both rules
      share one compiled decoder).
    temperature (scalar or [B]; 0 = greedy argmax), top_k (static, 0 = off), top_p (static, 1 = off)
      shape the sampling only. tempered_entropy (static): compute H on the tempered distribution
      for rows with temperature > 0 (default: on the model's own distribution, as in SBD.md).
    eos_ids: int, sequence or int array (default cfg.eos_ids; () = never stop early). Only their
      count is static.
    key: PRNG key (typed or raw), or one per row [B] (then a row's output does not depend on its
      batch). Default key 0. Unused when every temperature is 0.
    pad_id: fills `tokens` beyond `lengths` (default cfg.pad_token_id or 0).
    finalize_cache / return_cache: see module docstring.

    Pure and static-shaped: works eagerly (compiled once per static configuration) and inside a
    user's `jax.jit` (then gamma/temperature/keys/prompts may be traced).
    """
    args, static = prepare_generate(params, cfg, prompt_ids, prompt_lengths, max_new_tokens=max_new_tokens,
                                    block_size=block_size, gamma=gamma, rule=rule, temperature=temperature,
                                    top_k=top_k, top_p=top_p, tempered_entropy=tempered_entropy, eos_ids=eos_ids,
                                    key=key, mode=mode, pad_id=pad_id, finalize_cache=finalize_cache,
                                    return_cache=return_cache, mesh=mesh)
    return generate_jit(*args, **static)


def prepare_generate(params: dict, cfg: ModelConfig, prompt_ids, prompt_lengths, *, max_new_tokens: int,
                     block_size: int = 4, gamma=0.35, rule: str = "eb", temperature=0.0, top_k: int = 0,
                     top_p: float = 1.0, tempered_entropy: bool = False, eos_ids=None, key=None, mode: str = "sbd",
                     pad_id: int | None = None, finalize_cache: bool = False, return_cache: bool = False,
                     mesh=None) -> tuple[tuple, dict]:
    """Validate and normalise `generate`'s arguments -> `(args, static)` with
    `generate(...) == generate_jit(*args, **static)`. For ahead-of-time compilation (e.g. to time
    compilation apart from decoding): `generate_jit.lower(*args, **static).compile()(*args)`."""
    prompt_ids = jnp.asarray(prompt_ids)
    check_request(cfg, prompt_ids.shape, max_new_tokens=max_new_tokens, block_size=block_size, mode=mode,
                  rule=rule, top_k=top_k, top_p=top_p, gamma=gamma, temperature=temperature,
                  prompt_lengths=prompt_lengths, prompt_ids=prompt_ids)
    B = prompt_ids.shape[0]
    eos = _eos_array(cfg, eos_ids)
    pad = int(pad_id if pad_id is not None else (cfg.pad_token_id if cfg.pad_token_id is not None else 0))
    keys = sampling.row_keys(jax.random.key(0) if key is None else key, B)
    gamma_B = jnp.broadcast_to(jnp.asarray(gamma, jnp.float32), (B,))
    temp_B = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))
    args = (params, prompt_ids.astype(jnp.int32), jnp.asarray(prompt_lengths, jnp.int32), gamma_B, temp_B, keys,
            jnp.int32(sampling.rule_id(rule)), eos)
    static = {"cfg": cfg, "max_new": int(max_new_tokens), "k": int(block_size) if mode == "sbd" else 1,
              "top_k": int(top_k), "top_p": float(top_p), "tempered": bool(tempered_entropy), "pad": pad,
              "mode": mode, "finalize": bool(finalize_cache), "return_cache": bool(return_cache), "mesh": mesh}
    return args, static


def _eos_array(cfg: ModelConfig, eos_ids):
    """EOS ids as an int32 array (traced: changing the ids does not recompile, only their count does).
    No EOS -> [-1], which matches no token."""
    if eos_ids is None:
        eos_ids = cfg.eos_ids
    if isinstance(eos_ids, (int, np.integer)):
        eos_ids = (int(eos_ids),)
    eos = jnp.asarray(eos_ids, jnp.int32).reshape(-1)
    return eos if eos.shape[0] else jnp.full((1,), -1, jnp.int32)


_STATIC = ("cfg", "max_new", "k", "top_k", "top_p", "tempered", "pad", "mode", "finalize", "return_cache", "mesh")


@functools.partial(jax.jit, static_argnames=_STATIC)
def generate_jit(params, prompt_ids, lengths, gamma_B, temp_B, keys_B, rule, eos, *, cfg, max_new, k, top_k, top_p,
                 tempered, pad, mode, finalize, return_cache, mesh):
    with mesh_context(mesh):  # ambient while tracing: attention_impl="pallas" then runs per shard
        return _generate(params, prompt_ids, lengths, gamma_B, temp_B, keys_B, rule, eos, cfg=cfg, max_new=max_new,
                         k=k, top_k=top_k, top_p=top_p, tempered=tempered, pad=pad, mode=mode, finalize=finalize,
                         return_cache=return_cache, mesh=mesh)


def _generate(params, prompt_ids, lengths, gamma_B, temp_B, keys_B, rule, eos, *, cfg, max_new, k, top_k, top_p,
              tempered, pad, mode, finalize, return_cache, mesh):
    B, P = prompt_ids.shape
    S = P + max_new
    W = S + k  # token buffer: room for a whole last block past the cap
    constrain = _constrainer(cfg, mesh, B)
    seq = jnp.full((B, W), pad, jnp.int32).at[:, :P].set(
        jnp.where(jnp.arange(P)[None] < lengths[:, None], prompt_ids, pad))
    cache = constrain(init_cache(cfg, B, S))
    zeros_B = jnp.zeros((B,), jnp.int32)
    false_B = jnp.zeros((B,), bool)
    state = _State(constrain(seq), cache, zeros_B, jnp.zeros((B, k), bool), false_B, false_B, false_B, zeros_B,
                   zeros_B, jnp.int32(0), jnp.int32(0))
    env = {"params": params, "cfg": cfg, "lengths": lengths, "gamma": gamma_B, "temp": temp_B, "keys": keys_B,
           "k": k, "max_new": max_new, "rule": rule, "top_k": top_k, "top_p": top_p, "tempered": tempered,
           "eos": eos, "constrain": constrain}
    if mode == "sbd":
        state = _sbd_first(state, env, prompt_ids)
        body = functools.partial(_sbd_step, env=env)
    else:
        state = _ar_first(state, env, prompt_ids)
        body = functools.partial(_ar_step, env=env)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    cache = state.cache
    if finalize:
        cache = _finalize(state, env, mode)
    j = jnp.arange(max_new, dtype=jnp.int32)[None]
    out = jnp.take_along_axis(state.seq, jnp.minimum(lengths[:, None] + j, W - 1), axis=1)
    out = jnp.where(j < state.n_gen[:, None], out, pad)
    return GenerateOutput(out, state.n_gen, state.nfe, state.eos, state.iters, state.wide,
                          cache if return_cache else None)


def _constrainer(cfg, mesh, B):
    if mesh is None:
        return lambda x: x
    from ..sharding import batch_sharding, cache_sharding
    cs = cache_sharding(cfg, mesh, B)

    def constrain(x):
        if isinstance(x, KVCache):
            return KVCache(jax.lax.with_sharding_constraint(x.k, cs), jax.lax.with_sharding_constraint(x.v, cs),
                           jax.lax.with_sharding_constraint(x.lengths, batch_sharding(mesh, 1, B)))
        return jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim, B))
    return constrain


def _gather(seq, pos):
    return jnp.take_along_axis(seq, jnp.clip(pos, 0, seq.shape[1] - 1), axis=1)


# ------------------------------------------------------------------------------------------------
# SBD


def _copy_window(state: _State, env):
    """The current block as COPY tokens: (tokens [B,k], meta) - masked positions carry `<m>`."""
    k, lengths = env["k"], env["lengths"]
    j = jnp.arange(k, dtype=jnp.int32)[None]
    start = lengths + state.blk
    pos = start[:, None] + j
    valid = (state.blk[:, None] + j) < env["max_new"]
    tok = jnp.where(state.masked, env["cfg"].mask_token_id, _gather(state.seq, pos))
    seg = (valid & ~state.done[:, None]).astype(jnp.int32)
    return tok, copy_meta(seg, pos, jnp.broadcast_to(start[:, None], pos.shape))


def _sbd_update(state: _State, env, logits_BKV, cache) -> _State:
    """Acceptance + sampling + block bookkeeping after one model call on the current block."""
    k, max_new, lengths = env["k"], env["max_new"], env["lengths"]
    active = ~state.done
    h = sampling.entropy(logits_BKV, env["temp"], tempered=env["tempered"])
    masked = state.masked & active[:, None]
    acc = sampling.accept(env["rule"], h, masked, env["gamma"])
    drawn = sampling.sample(logits_BKV, env["keys"], state.nfe, env["temp"], top_k=env["top_k"], top_p=env["top_p"],
                            suppress=env["cfg"].mask_token_id)
    j = jnp.arange(k, dtype=jnp.int32)[None]
    pos = (lengths + state.blk)[:, None] + j
    block = jnp.where(acc, drawn, _gather(state.seq, pos))
    rows = jnp.arange(state.seq.shape[0])[:, None]
    seq = state.seq.at[rows, pos].set(block, mode="drop")
    still = masked & ~acc
    valid = (state.blk[:, None] + j) < max_new
    decoded = valid & ~still
    prefix = jnp.cumprod(decoded.astype(jnp.int32), axis=1).astype(bool)
    is_eos = jnp.isin(block, env["eos"])
    stop = is_eos & decoded & prefix
    eos_hit = active & jnp.any(stop, axis=1)
    first = jnp.argmax(stop, axis=1).astype(jnp.int32)
    complete = active & ~jnp.any(still, axis=1) & ~eos_hit
    nxt = state.blk + k
    cap_hit = complete & (nxt >= max_new)
    advance = complete & ~cap_hit
    new_valid = (nxt[:, None] + j) < max_new
    done = state.done | eos_hit | cap_hit
    n_gen = jnp.where(eos_hit, state.blk + first + 1, jnp.where(cap_hit, max_new, state.n_gen))
    return _State(
        seq=env["constrain"](seq),
        cache=cache,
        blk=jnp.where(advance, nxt, state.blk),
        masked=jnp.where(advance[:, None], new_valid, jnp.where(active[:, None], still, state.masked)),
        commit=advance,
        done=done,
        eos=state.eos | eos_hit,
        n_gen=n_gen,
        nfe=state.nfe + active.astype(jnp.int32),
        iters=state.iters + 1,
        wide=state.wide,
    )


def _sbd_first(state: _State, env, prompt_ids) -> _State:
    """NFE 1: [prompt CLEAN ; first block COPY]."""
    B, P = prompt_ids.shape
    k = env["k"]
    state = state._replace(masked=jnp.broadcast_to(jnp.arange(k)[None] < env["max_new"], (B, k)))
    ctok, cmeta = _copy_window(state, env)
    pmeta = causal_meta(env["lengths"], P)
    tokens = jnp.concatenate([prompt_ids, ctok], axis=1)
    logits, cache = forward(env["params"], env["cfg"], tokens, concat_meta(pmeta, cmeta), state.cache)
    return _sbd_update(state, env, logits[:, P:], env["constrain"](cache))


def _sbd_step(state: _State, env) -> _State:
    k, lengths = env["k"], env["lengths"]
    params, cfg = env["params"], env["cfg"]
    need = state.commit & ~state.done
    ctok, cmeta = _copy_window(state, env)

    def with_commit(cache):
        pos = (lengths + state.blk - k)[:, None] + jnp.arange(k, dtype=jnp.int32)[None]
        meta = clean_meta(jnp.broadcast_to(need[:, None], pos.shape).astype(jnp.int32), pos)
        tokens = jnp.concatenate([_gather(state.seq, pos), ctok], axis=1)
        logits, cache = forward(params, cfg, tokens, concat_meta(meta, cmeta), cache)
        return logits[:, k:], cache

    def copy_only(cache):
        logits, cache = forward(params, cfg, ctok, cmeta, cache)
        return logits, cache

    wide = jnp.any(need)
    logits, cache = jax.lax.cond(wide, with_commit, copy_only, state.cache)
    state = state._replace(wide=state.wide + wide.astype(jnp.int32))
    return _sbd_update(state, env, logits, env["constrain"](cache))


# ------------------------------------------------------------------------------------------------
# AR


def _ar_update(state: _State, env, logits_B1V, cache) -> _State:
    active = ~state.done
    tok = sampling.sample(logits_B1V, env["keys"], state.nfe, env["temp"], top_k=env["top_k"],
                          top_p=env["top_p"])[:, 0]
    pos = env["lengths"] + state.blk
    rows = jnp.arange(state.seq.shape[0])
    seq = state.seq.at[rows, jnp.where(active, pos, state.seq.shape[1])].set(tok, mode="drop")
    n = state.blk + active.astype(jnp.int32)
    eos_hit = active & jnp.isin(tok, env["eos"])
    cap_hit = active & (n >= env["max_new"])
    stop = eos_hit | cap_hit
    return state._replace(seq=env["constrain"](seq), cache=cache, blk=n, done=state.done | stop,
                          eos=state.eos | eos_hit, n_gen=jnp.where(stop, n, state.n_gen),
                          nfe=state.nfe + active.astype(jnp.int32), iters=state.iters + 1)


def _ar_first(state: _State, env, prompt_ids) -> _State:
    P = prompt_ids.shape[1]
    logits, cache = forward(env["params"], env["cfg"], prompt_ids, causal_meta(env["lengths"], P), state.cache)
    last = jnp.take_along_axis(logits, (env["lengths"] - 1)[:, None, None], axis=1)
    return _ar_update(state, env, last, env["constrain"](cache))


def _ar_step(state: _State, env) -> _State:
    pos = (env["lengths"] + state.blk - 1)[:, None]
    tok = _gather(state.seq, pos)
    meta = clean_meta((~state.done)[:, None].astype(jnp.int32), pos)
    logits, cache = forward(env["params"], env["cfg"], tok, meta, state.cache)
    return _ar_update(state, env, logits, env["constrain"](cache))


# ------------------------------------------------------------------------------------------------


def _finalize(state: _State, env, mode: str) -> KVCache:
    """One extra clean call (not counted in NFE) writing the K/V the loop left uncommitted."""
    lengths = env["lengths"]
    if mode == "sbd":
        first, width = lengths + state.blk, env["k"]
    else:
        first, width = lengths + state.n_gen - 1, 1
    pos = first[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
    seg = (pos < (lengths + state.n_gen)[:, None]).astype(jnp.int32)
    _, cache = forward(env["params"], env["cfg"], _gather(state.seq, pos), clean_meta(seg, pos), state.cache)
    return env["constrain"](cache)
