"""Jitted SBD / AR decoding over a static KV cache: one `lax.while_loop`, nothing returns to the host
per step (SBD.md "Inference"; the options are a `DecodeSpec`).

  * Prompts arrive right-padded: `prompt_ids [B, P]`, `prompt_lengths [B]`. Row b's prompt occupies
    positions (= cache slots) [0, len_b); its generated token j sits at position len_b + j. Rows never
    see each other or their padding (segment 0). The cache holds S = P + max_new_tokens slots; a
    token buffer `seq [B, S + block_size]` holds every token by position (room for a whole last block).
  * Blocks start right after each row's prompt (explicit block starts in the metadata, SBD.md step 8);
    the last block's positions beyond max_new_tokens are padding.
  * NFE 1 (SBD) = [prompt CLEAN ; first block COPY]: the prefill is folded into the first step. Each
    later step is one call on one of two window shapes chosen by `lax.cond`: once a quorum of the live
    rows (`spec.commit_quorum`) has just finished a block, [finished block CLEAN ; current block COPY]
    writes the finished blocks' exact causal K/V (paper Algorithm 3, no extra forward); otherwise
    [current block COPY], which rows waiting for a commit sit out (their tokens and NFE do not change).
    A copy token carries its token once accepted, the mask token while masked; SBD never samples `<m>`.
  * AR: the prefill call yields the first token, then one clean 1-token call per token (NTP logits).
  * Stop (SBD.md step 7): an EOS decoded with every earlier position of its block decoded, or
    max_new_tokens. Tokens after the EOS are dropped (the pad id fills the output beyond `lengths`).
    Finished rows become padding: their state, cache and NFE stop changing; NFE counts the calls that
    carry a token of the row. The loop ends when every row is done.
  * Randomness: row b draws its step-n tokens from fold_in(key_b, n) (sampling.py).
  * Sharding: with `mesh`, the cache is constrained to `cache_sharding` and per-row state to
    `batch_sharding`; params come laid out by `shard_params`. The loop traces under
    `mesh_context(mesh)`, so attention_impl="pallas" runs per shard (sbd_jax/attention/sharded.py).
  * The window scheme leaves the last block's (AR: last token's) K/V uncommitted; `finalize_cache`
    writes them with one uncounted call, after which the cache equals one causal forward over
    prompt + output (tested exactly).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..attention import clean_meta, concat_meta, copy_meta
from ..config import ModelConfig
from ..models.transformer import KVCache, forward, init_cache, lm_head
from ..sharding import batch_sharding, cache_sharding, mesh_context
from . import sampling
from .checks import check_request
from .spec import DEFAULT_GAMMA, DEFAULT_TEMPERATURE, DecodeSpec


class GenerateOutput(NamedTuple):
    """tokens [B, max_new_tokens] (int32, the pad id beyond `lengths`), lengths [B] generated tokens (EOS
    included), nfe [B] model calls, stopped_by_eos [B], iterations (model calls of the batch = loop iterations
    + 1; more than the largest NFE when rows waited for a commit quorum), wide_steps (SBD iterations that used
    the 2k commit window), accepted [B, window + 1]: per row, how many of its model calls decoded 0, 1, ...
    window tokens of the output (counted when their block ends; verify mode: how many verified blocks had 0, 1,
    ... drafts stand), cache (KVCache or None)."""

    tokens: jax.Array
    lengths: jax.Array
    nfe: jax.Array
    stopped_by_eos: jax.Array
    iterations: jax.Array
    wide_steps: jax.Array
    accepted: jax.Array
    cache: KVCache | None = None

    @property
    def tokens_per_forward(self):
        return self.lengths / jnp.maximum(self.nfe, 1)


class _State(NamedTuple):
    """The while-loop carry. B = rows, W = token buffer width, K = block_size (SBD)."""

    seq: jax.Array            # [B, W] tokens by position
    cache: KVCache
    block_offset: jax.Array   # [B] generated tokens before the current block (AR: generated tokens)
    masked: jax.Array         # [B, K] still-masked positions of the current block (SBD)
    # the tokens at generated indices [commit_start, commit_start + commit_len) still need their clean causal
    # re-run (the previous block; in verify mode also the tokens to verify, or a 1-token correction)
    commit_start: jax.Array   # [B]
    commit_len: jax.Array     # [B] 0 = nothing to commit
    done: jax.Array           # [B]
    eos: jax.Array            # [B] stopped by EOS
    n_generated: jax.Array    # [B] final number of generated tokens (valid once done)
    nfe: jax.Array            # [B]
    iters: jax.Array          # scalar: model calls
    wide: jax.Array           # scalar: calls with the 2k commit window
    accepted: jax.Array       # [B, window + 1] per row: calls that decoded 0, 1, ... tokens (of the output)
    decoded_at: jax.Array     # [B, K] SBD: the call (counted within the block) that decoded each position; K = not yet


@dataclasses.dataclass(frozen=True)
class _Env:
    """What the loop body reads and never changes: the model, the spec and the per-row inputs."""

    params: dict
    cfg: ModelConfig
    spec: DecodeSpec
    lengths: jax.Array        # [B] prompt lengths
    max_new: jax.Array        # [B] tokens to generate at most (<= spec.max_new_tokens)
    gamma: jax.Array          # [B]
    temp: jax.Array           # [B]
    keys: jax.Array           # [B] typed PRNG keys
    eos: jax.Array            # [E] stop ids ([-1] = none)
    constrain: Callable       # sharding constraint of per-row arrays and the cache (identity without a mesh)


def generate(params: dict, cfg: ModelConfig, prompt_ids, prompt_lengths, spec: DecodeSpec | None = None, *,
             gamma=DEFAULT_GAMMA, temperature=DEFAULT_TEMPERATURE, key=None, row_max_new_tokens=None, mesh=None,
             **options) -> GenerateOutput:
    """Decode a batch of right-padded prompts with SBD or next-token AR.

    params, cfg: the model (`init_params` / `from_pretrained`); params may be sharded
      (`sbd_jax.sharding.shard_params`): pass `mesh` to lay the cache and per-row state out to match.
      On GPU pass them through `models.unstack_layers` once (the stacked layout is slower to decode).
    prompt_ids [B, P] int, prompt_lengths [B] int (1 <= len <= P, right padding).
    spec: a `DecodeSpec` (static: one compiled decoder per spec and shape); `options` are DecodeSpec
      fields that build one or replace those of `spec` (`generate(..., max_new_tokens=64, mode="ar")`).
    gamma (scalar or [B]): the acceptance threshold of the spec's rule.
    temperature (scalar or [B]; 0 = greedy argmax).
    key: PRNG key (typed or raw), or one per row [B] (then a row's output does not depend on its
      batch). Default key 0. Unused when every temperature is 0.
    row_max_new_tokens [B] int: each row's own cap, <= the spec's `max_new_tokens` (the static cache size).

    Pure and static-shaped: works eagerly and inside a user's `jax.jit` (then gamma, temperature, keys
    and prompts may be traced).
    """
    args, static = prepare_generate(params, cfg, prompt_ids, prompt_lengths, spec, gamma=gamma,
                                    temperature=temperature, key=key, row_max_new_tokens=row_max_new_tokens,
                                    mesh=mesh, **options)
    return generate_jit(*args, **static)


def prepare_generate(params: dict, cfg: ModelConfig, prompt_ids, prompt_lengths, spec: DecodeSpec | None = None, *,
                     gamma=DEFAULT_GAMMA, temperature=DEFAULT_TEMPERATURE, key=None, row_max_new_tokens=None,
                     mesh=None, check: bool = True,
                     **options) -> tuple[tuple, dict]:
    """Validate and normalise `generate`'s arguments -> `(args, static)` with
    `generate(...) == generate_jit(*args, **static)`. For ahead-of-time compilation:
    `generate_jit.lower(*args, **static).compile()(*args)`. `check=False` skips `check_request`
    (for callers that checked the whole request once, like the batch runner)."""
    spec = DecodeSpec.make(spec, **options)
    prompt_ids = jnp.asarray(prompt_ids)
    if check:
        check_request(cfg, spec, prompt_ids.shape, prompt_lengths=prompt_lengths, prompt_ids=prompt_ids,
                      gamma=gamma, temperature=temperature, row_max_new_tokens=row_max_new_tokens)
    B = prompt_ids.shape[0]
    keys = sampling.row_keys(jax.random.key(0) if key is None else key, B)
    args = (params, prompt_ids.astype(jnp.int32), jnp.asarray(prompt_lengths, jnp.int32),
            jnp.broadcast_to(jnp.asarray(gamma, jnp.float32), (B,)),
            jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,)), keys,
            jnp.broadcast_to(jnp.asarray(spec.max_new_tokens if row_max_new_tokens is None else row_max_new_tokens,
                                         jnp.int32), (B,)))
    return args, {"cfg": cfg, "spec": spec, "mesh": mesh}


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "mesh"))
def generate_jit(params, prompt_ids, lengths, gamma_B, temp_B, keys_B, max_new_B, *, cfg: ModelConfig,
                 spec: DecodeSpec, mesh=None) -> GenerateOutput:
    with mesh_context(mesh):  # ambient while tracing: attention_impl="pallas" then runs per shard
        P = prompt_ids.shape[1]
        env = _make_env(params, cfg, spec, lengths, max_new_B, gamma_B, temp_B, keys_B, mesh)
        state = _new_state(env, _prompt_seq(prompt_ids, lengths, spec, env), P)
        first, step = (_sbd_first, _sbd_step) if spec.mode == "sbd" else (_ar_first, _ar_step)
        state = first(state, env, prompt_ids)
        state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), functools.partial(step, env=env), state)
        cache = _finalize(state, env) if spec.finalize_cache else state.cache
        j = jnp.arange(spec.max_new_tokens, dtype=jnp.int32)[None]
        out = jnp.where(j < state.n_generated[:, None], _gather(state.seq, lengths[:, None] + j), spec.pad(cfg))
        return GenerateOutput(out, state.n_generated, state.nfe, state.eos, state.iters, state.wide, state.accepted,
                              cache if spec.return_cache else None)


def _make_env(params, cfg: ModelConfig, spec: DecodeSpec, lengths, max_new_B, gamma_B, temp_B, keys_B, mesh) -> _Env:
    eos = jnp.asarray(spec.stop_ids(cfg) or (-1,), jnp.int32)  # -1 matches no token
    return _Env(params, cfg, spec, lengths, jnp.minimum(max_new_B, spec.max_new_tokens), gamma_B, temp_B, keys_B,
                eos, _constrainer(cfg, mesh, lengths.shape[0]))


def _prompt_seq(prompt_ids, lengths, spec: DecodeSpec, env: _Env):
    """The token buffer [B, P + max_new_tokens + window] (room for a whole last block past the cap): the
    prompts, then the pad id."""
    B, P = prompt_ids.shape
    pad = spec.pad(env.cfg)
    seq = jnp.full((B, P + spec.max_new_tokens + spec.window), pad, jnp.int32)
    return seq.at[:, :P].set(jnp.where(jnp.arange(P)[None] < lengths[:, None], prompt_ids, pad))


def _new_state(env: _Env, seq, P: int, done=None) -> _State:
    """The loop carry before the first call: an empty cache of P + max_new_tokens slots per row."""
    B, spec = seq.shape[0], env.spec
    zeros_B, false_B = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool)
    masked = (jnp.arange(spec.window)[None] < env.max_new[:, None]) & (spec.mode == "sbd")  # the first block
    return _State(env.constrain(seq), env.constrain(init_cache(env.cfg, B, P + spec.max_new_tokens)), zeros_B,
                  masked, zeros_B, zeros_B, false_B if done is None else done, false_B, zeros_B,
                  zeros_B, jnp.int32(0), jnp.int32(0), jnp.zeros((B, spec.window + 1), jnp.int32),
                  jnp.full((B, spec.window), spec.window, jnp.int32))


def _constrainer(cfg, mesh, B):
    """Per-row arrays over the batch axes, the cache as `cache_sharding` (identity without a mesh)."""
    if mesh is None:
        return lambda x: x
    cs = cache_sharding(cfg, mesh, B)
    return lambda x: jax.lax.with_sharding_constraint(
        x, KVCache(cs, cs, batch_sharding(mesh, 1, B)) if isinstance(x, KVCache) else batch_sharding(mesh, x.ndim, B))


def _tally(accepted_BN, n_B, active_B):
    """Count one model call that decoded `n_B` tokens for each active row."""
    return accepted_BN + (jax.nn.one_hot(n_B, accepted_BN.shape[1], dtype=jnp.int32) * active_B[:, None])


def _gather(seq, pos):
    return jnp.take_along_axis(seq, jnp.clip(pos, 0, seq.shape[1] - 1), axis=1)


# ------------------------------------------------------------------------------------------------
# SBD


def _block_positions(state: _State, env: _Env, offset=0):
    """Positions [B, K] of the current block (shifted by `offset` blocks)."""
    K = env.spec.block_size
    return (env.lengths + state.block_offset + offset * K)[:, None] + jnp.arange(K, dtype=jnp.int32)[None]


def _copy_window(state: _State, env: _Env):
    """The current block as COPY tokens: (tokens [B, K], meta); masked positions carry `<m>`."""
    pos = _block_positions(state, env)
    j = jnp.arange(env.spec.block_size, dtype=jnp.int32)[None]
    valid = (state.block_offset[:, None] + j) < env.max_new[:, None]
    tok = jnp.where(state.masked, env.cfg.mask_token_id, _gather(state.seq, pos))
    seg = (valid & ~state.done[:, None]).astype(jnp.int32)
    return tok, copy_meta(seg, pos, jnp.broadcast_to(pos[:, :1], pos.shape))


def _sbd_update(state: _State, env: _Env, logits_BKV, cache, ar_BK=None) -> _State:
    """Acceptance + sampling + block bookkeeping after one model call on the current block (verify mode: first
    the verification of the committed tokens against AR's tokens `ar_BK`, `_verify`)."""
    spec = env.spec
    K, max_new = spec.block_size, env.max_new
    j = jnp.arange(K, dtype=jnp.int32)[None]
    rows = jnp.arange(state.seq.shape[0])[:, None]
    ran = ~state.done  # rows this call carried a token of
    if spec.verify:
        state, rejected = _verify(state, env, ar_BK)
    pos = _block_positions(state, env)
    active = ~state.done
    with jax.named_scope("accept"):
        h = sampling.entropy(logits_BKV, env.temp, tempered=spec.tempered_entropy)
        masked = state.masked & active[:, None]
        acc = sampling.accept(spec.rule, h, masked, env.gamma)
        index = (state.block_offset[:, None] + j) if spec.verify else state.nfe  # verify: coupled to AR's draw
        drawn = sampling.sample(logits_BKV, env.keys, index, env.temp, top_k=spec.top_k, top_p=spec.top_p,
                                suppress=env.cfg.mask_token_id)
    if spec.verify:
        acc = acc & ~rejected[:, None]  # a rejected row's copy half drafted positions that no longer exist
    call = jnp.max(jnp.where(state.decoded_at < K, state.decoded_at + 1, 0), axis=1)  # this call's number in the block
    decoded_at = jnp.where(acc, call[:, None], state.decoded_at)
    block = jnp.where(acc, drawn, _gather(state.seq, pos))
    seq = state.seq.at[rows, pos].set(block, mode="drop")
    still = masked & ~acc
    valid = (state.block_offset[:, None] + j) < max_new[:, None]
    complete = active & ~jnp.any(still, axis=1)
    nxt = state.block_offset + K
    if spec.verify:  # drafts stop nothing: a complete block is verified by the next call (its commit window)
        advance = complete & ~rejected
        done, eos_hit, n_generated = state.done, jnp.zeros_like(state.done), state.n_generated
        accepted = state.accepted
        commit_start = jnp.where(advance, state.block_offset, state.commit_start)
        commit_len = jnp.where(advance, jnp.minimum(K, max_new - state.block_offset), state.commit_len)
    else:
        decoded = valid & ~still
        prefix = jnp.cumprod(decoded.astype(jnp.int32), axis=1).astype(bool)
        stop = jnp.isin(block, env.eos) & decoded & prefix
        eos_hit = active & jnp.any(stop, axis=1)
        first = jnp.argmax(stop, axis=1).astype(jnp.int32)
        complete = complete & ~eos_hit
        cap_hit = complete & (nxt >= max_new)
        advance = complete & ~cap_hit
        done = state.done | eos_hit | cap_hit
        n_generated = jnp.where(eos_hit, state.block_offset + first + 1,
                                jnp.where(cap_hit, max_new, state.n_generated))
        # when a block ends, each of its calls is counted with the tokens it added to the output: none past the
        # cap, none after the EOS that ends the row (a call may have decoded those before the EOS was decoded)
        calls = jnp.max(jnp.where(decoded_at < K, decoded_at + 1, 0), axis=1)  # [B] calls this block took
        keep = valid & (decoded_at < K) & (~eos_hit[:, None] | (j <= first[:, None]))
        per_call = jnp.sum(keep[:, None, :] & (decoded_at[:, None, :] == j[..., None]), axis=2)  # [B, call]
        ends = active & (eos_hit | cap_hit | advance)
        accepted = state.accepted + jnp.sum(jax.nn.one_hot(per_call, K + 1, dtype=jnp.int32)
                                            * ((j < calls[:, None]) & ends[:, None])[..., None], axis=1)
        # rows that sat this call out (done or held, see `_sbd_step`) keep a commit they are waiting for
        commit_start = jnp.where(active, state.block_offset, state.commit_start)
        commit_len = jnp.where(advance, K, jnp.where(active, 0, state.commit_len))
    block_offset = jnp.where(advance, nxt, state.block_offset)
    return _State(
        seq=env.constrain(seq),
        cache=cache,
        block_offset=block_offset,
        masked=jnp.where(advance[:, None], (nxt[:, None] + j) < max_new[:, None],
                         jnp.where(active[:, None], still, state.masked)),
        commit_start=commit_start,
        commit_len=commit_len,
        done=done,
        eos=state.eos | eos_hit,
        n_generated=n_generated,
        nfe=state.nfe + ran.astype(jnp.int32),
        iters=state.iters + 1,
        wide=state.wide,
        accepted=accepted,
        decoded_at=jnp.where(advance[:, None], K, decoded_at),
    )


def _verify(state: _State, env: _Env, ar_BK):
    """Verify mode (SBD.md "Lossless mode"): rows whose commit window ran in this call compare the drafts at
    generated indices cs + 1 .. cs + cl - 1 with AR's tokens there (`ar_BK[:, i]`: AR's token at cs + 1 + i,
    from the clean query at cs + i) and keep the agreeing prefix. All agree: AR's next token ar[cl - 1] becomes
    the current block's first token. A draft differs at cs + 1 + m: AR's token replaces it, the rest is dropped,
    the next block starts after it and the correction is committed (1 token) by the next call. A verified EOS
    or the cap ends the row. -> (state, rows whose drafts were rejected)."""
    K, max_new = env.spec.block_size, env.max_new
    j = jnp.arange(K, dtype=jnp.int32)[None]
    active = ~state.done
    checked = active & (state.commit_len > 0)
    cs, cl = state.commit_start, state.commit_len
    kept = _gather(state.seq, (env.lengths + cs)[:, None] + jnp.arange(K + 1, dtype=jnp.int32)[None])
    kept, drafts = kept[:, :K], kept[:, 1:]  # the commit tokens; the draft at cs + 1 + i, checked by ar[:, i]
    agree = jnp.cumprod(((drafts == ar_BK) & (j < cl[:, None] - 1)).astype(jnp.int32), axis=1)
    m = jnp.sum(agree, axis=1)  # drafts that stand
    rejected = checked & (m < cl - 1)
    upto = jnp.where(rejected, m, cl - 1)  # commit tokens cs .. cs + upto stand
    extra = jnp.take_along_axis(ar_BK, upto[:, None], axis=1)[:, 0]  # the correction or the next first token
    g_extra = cs + upto + 1
    # the first verified EOS: among the standing commit tokens (cs itself was verified before), then `extra`
    eos_at = jnp.isin(kept, env.eos) & (j >= 1) & (j <= upto[:, None])
    in_commit = jnp.any(eos_at, axis=1)
    extra_eos = ~in_commit & jnp.isin(extra, env.eos) & (g_extra < max_new)
    length = jnp.where(in_commit, cs + jnp.argmax(eos_at, axis=1).astype(jnp.int32) + 1,
                       jnp.minimum(g_extra + 1, max_new))
    finished = checked & (in_commit | extra_eos | (length >= max_new))
    rows = jnp.arange(state.seq.shape[0])
    put = checked & (g_extra < max_new)
    seq = state.seq.at[rows, jnp.where(put, env.lengths + g_extra, state.seq.shape[1])].set(extra, mode="drop")
    restart = rejected & ~finished  # the next block starts after the correction
    offset = jnp.where(restart, g_extra + 1, state.block_offset)
    masked = jnp.where(restart[:, None], (offset[:, None] + j) < max_new[:, None],
                       state.masked & ~((j == 0) & checked[:, None]))  # accepted: the first token is AR's
    state = state._replace(
        seq=env.constrain(seq), block_offset=offset, masked=masked,
        commit_start=jnp.where(restart, g_extra, jnp.where(checked, 0, cs)),
        commit_len=jnp.where(restart, 1, jnp.where(checked, 0, cl)),
        done=state.done | finished, eos=state.eos | (finished & (in_commit | extra_eos)),
        n_generated=jnp.where(finished, length, state.n_generated),
        accepted=_tally(state.accepted, upto, checked & (cl > 1)))  # per verified block: drafts that stood
    return state, rejected


def _prompt_meta(lengths_B, start, width: int):
    """Clean metadata of the prompt columns [start, start + width) (segment 0 from each row's length on)."""
    pos = jnp.broadcast_to(start + jnp.arange(width, dtype=jnp.int32)[None], (lengths_B.shape[0], width))
    return clean_meta((pos < lengths_B[:, None]).astype(jnp.int32), pos)


def write_prompt(params, cfg: ModelConfig, cache: KVCache, prompt_ids, upto_B, pieces: int, C: int,
                 constrain=lambda x: x):
    """Write the K/V of each row's prompt columns [0, upto_B) among the first `pieces` (may be traced) x C columns,
    one call per C-column piece (attention and activations scale with the piece, not the prompt). -> (cache, each row's final
    hidden state [B, 1, D] at column upto_B - 1 where a piece held it, else 0)."""
    h_last = jnp.zeros((prompt_ids.shape[0], 1, cfg.hidden_size), cfg.dtype)

    def piece(i, carry):
        cache, h_last = carry
        tok = jax.lax.dynamic_slice_in_dim(prompt_ids, i * C, C, axis=1)
        h, cache = forward(params, cfg, tok, _prompt_meta(upto_B, i * C, C), cache, return_hidden=True)
        idx = upto_B - 1 - i * C
        h_at = jnp.take_along_axis(h, jnp.clip(idx, 0, C - 1)[:, None, None], axis=1)
        return constrain(cache), jnp.where(((idx >= 0) & (idx < C))[:, None, None], h_at, h_last)

    return jax.lax.fori_loop(0, pieces, piece, (cache, h_last))


def _prefill(state: _State, env: _Env, prompt_ids):
    """Write the prompt's K/V before its last `prefill_chunk`-wide piece (which rides with the first step).
    -> (state, that piece's first column, the hidden state at each row's last prompt token where written)."""
    P, C = prompt_ids.shape[1], env.spec.prefill_chunk
    start = (P - 1) // C * C
    if start == 0:  # the prompt is one piece
        return state, 0, jnp.zeros((prompt_ids.shape[0], 1, env.cfg.hidden_size), env.cfg.dtype)
    cache, h_last = write_prompt(env.params, env.cfg, state.cache, prompt_ids, env.lengths, start // C, C,
                                 env.constrain)
    return state._replace(cache=cache), start, h_last


def _sbd_first(state: _State, env: _Env, prompt_ids) -> _State:
    """NFE 1: [prompt CLEAN ; first block COPY] (a long prompt's earlier pieces prefilled first)."""
    P = prompt_ids.shape[1]
    state, start, h_last = _prefill(state, env, prompt_ids)
    ctok, cmeta = _copy_window(state, env)
    tokens = jnp.concatenate([prompt_ids[:, start:], ctok], axis=1)
    h, cache = forward(env.params, env.cfg, tokens, concat_meta(_prompt_meta(env.lengths, start, P - start), cmeta),
                       state.cache, return_hidden=True)
    ar = None
    if env.spec.verify:  # AR's first token, from the last prompt token's query, is the first block's first token
        last = _last_prompt_hidden(h, env.lengths, start, P, h_last)
        first = sampling.sample(lm_head(env.params, env.cfg, last), env.keys, jnp.zeros_like(env.lengths)[:, None],
                                env.temp, top_k=env.spec.top_k, top_p=env.spec.top_p)
        ar = jnp.zeros(state.masked.shape, jnp.int32).at[:, :1].set(first)
        state = state._replace(commit_start=jnp.full_like(env.lengths, -1), commit_len=jnp.ones_like(env.lengths))
    return _sbd_update(state, env, lm_head(env.params, env.cfg, h[:, P - start:]), env.constrain(cache), ar)


def _sbd_step(state: _State, env: _Env) -> _State:
    K, spec = env.spec.block_size, env.spec
    need = (state.commit_len > 0) & ~state.done
    # the 2k window once a quorum of running rows has a commit; else those rows sit this k-wide call out
    n_need, n_run = (jnp.sum(x).astype(jnp.float32) for x in (need, ~state.done))
    wide = (n_need > 0) & (n_need >= jnp.float32(spec.commit_quorum) * n_run)
    held = need & ~wide
    state = state._replace(done=state.done | held)  # a held row: no token, no NFE, its state unchanged
    ctok, cmeta = _copy_window(state, env)
    j = jnp.arange(K, dtype=jnp.int32)[None]
    no_ar = jnp.zeros(state.masked.shape, jnp.int32)

    def with_commit(cache):
        gen = state.commit_start[:, None] + j
        pos = env.lengths[:, None] + gen
        meta = clean_meta((need[:, None] & (j < state.commit_len[:, None])).astype(jnp.int32), pos)
        tokens = jnp.concatenate([_gather(state.seq, pos), ctok], axis=1)
        h, cache = forward(env.params, env.cfg, tokens, concat_meta(meta, cmeta), cache, return_hidden=True)
        ar = no_ar
        if spec.verify:  # AR's token at gen + 1 from each clean query: what the drafts are checked against
            ar = sampling.sample(lm_head(env.params, env.cfg, h[:, :K]), env.keys, gen + 1, env.temp,
                                 top_k=spec.top_k, top_p=spec.top_p)
        return lm_head(env.params, env.cfg, h[:, K:]), ar, cache

    def copy_only(cache):
        logits, cache = forward(env.params, env.cfg, ctok, cmeta, cache)
        return logits, no_ar, cache

    logits, ar, cache = jax.lax.cond(wide, with_commit, copy_only, state.cache)
    state = state._replace(wide=state.wide + wide.astype(jnp.int32))
    state = _sbd_update(state, env, logits, env.constrain(cache), ar)
    return state._replace(done=state.done & ~held)


# ------------------------------------------------------------------------------------------------
# AR


def _ar_update(state: _State, env: _Env, logits_B1V, cache) -> _State:
    active = ~state.done
    spec = env.spec
    # the token at generated index j drawn from fold_in(key, j): what verify mode checks its drafts against
    tok = sampling.sample(logits_B1V, env.keys, state.block_offset[:, None], env.temp, top_k=spec.top_k,
                          top_p=spec.top_p)[:, 0]
    pos = env.lengths + state.block_offset
    rows = jnp.arange(state.seq.shape[0])
    seq = state.seq.at[rows, jnp.where(active, pos, state.seq.shape[1])].set(tok, mode="drop")
    n = state.block_offset + active.astype(jnp.int32)
    eos_hit = active & jnp.isin(tok, env.eos)
    stop = eos_hit | (active & (n >= env.max_new))
    return state._replace(seq=env.constrain(seq), cache=cache, block_offset=n, done=state.done | stop,
                          eos=state.eos | eos_hit, n_generated=jnp.where(stop, n, state.n_generated),
                          nfe=state.nfe + active.astype(jnp.int32), iters=state.iters + 1,
                          accepted=_tally(state.accepted, active.astype(jnp.int32), active))


def _ar_first(state: _State, env: _Env, prompt_ids) -> _State:
    P = prompt_ids.shape[1]
    state, start, h_last = _prefill(state, env, prompt_ids)
    h, cache = forward(env.params, env.cfg, prompt_ids[:, start:], _prompt_meta(env.lengths, start, P - start), state.cache,
                       return_hidden=True)
    last = _last_prompt_hidden(h, env.lengths, start, P, h_last)
    return _ar_update(state, env, lm_head(env.params, env.cfg, last), env.constrain(cache))


def _last_prompt_hidden(h, lengths, start: int, P: int, h_last):
    """[B, 1, D]: the hidden state at each row's last prompt token, from the window h of prompt columns
    [start, P) (first) or from the prefilled pieces before it (`h_last`)."""
    idx = lengths - 1 - start
    h_at = jnp.take_along_axis(h, jnp.clip(idx, 0, P - start - 1)[:, None, None], axis=1)
    return jnp.where((idx >= 0)[:, None, None], h_at, h_last)


def _ar_step(state: _State, env: _Env) -> _State:
    pos = (env.lengths + state.block_offset - 1)[:, None]
    meta = clean_meta((~state.done)[:, None].astype(jnp.int32), pos)
    logits, cache = forward(env.params, env.cfg, _gather(state.seq, pos), meta, state.cache)
    return _ar_update(state, env, logits, env.constrain(cache))


# ------------------------------------------------------------------------------------------------


def _finalize(state: _State, env: _Env) -> KVCache:
    """One extra clean call (not counted in NFE) writing the K/V the loop left uncommitted."""
    if env.spec.mode == "sbd" and not env.spec.verify:
        pos = _block_positions(state, env)
    else:  # AR and verify mode: only the last output token lacks its K/V (each is committed by the next call)
        pos = (env.lengths + state.n_generated - 1)[:, None]
    seg = (pos < (env.lengths + state.n_generated)[:, None]).astype(jnp.int32)
    _, cache = forward(env.params, env.cfg, _gather(state.seq, pos), clean_meta(seg, pos), state.cache,
                       return_hidden=True)
    if env.spec.verify:  # rejected drafts wrote K/V past the output: clear them
        total = env.lengths + state.n_generated
        keep = (jnp.arange(cache.k.shape[2])[None] < total[:, None])[None, :, :, None, None]
        cache = KVCache(jnp.where(keep, cache.k, 0), jnp.where(keep, cache.v, 0), total)
    return env.constrain(cache)
