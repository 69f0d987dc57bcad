"""SBD mode (Set Block Decoding, docs/sbd.md, "Inference"): blocks of k positions start masked after each row's prompt;
each call predicts the masked positions of the current block, the acceptance rule keeps some of them (sampling.py),
and a block whose positions are all decoded is committed by a later call.

  * NFE 1 = [prompt CLEAN ; first block COPY]: the prefill is folded into the first step (`first_call`).
  * Each later call runs one of two windows chosen by `lax.cond` (`window_call`): once a quorum of the running
    rows (`spec.commit_quorum`) has just finished a block, [finished block CLEAN ; current block COPY] writes
    the finished blocks' exact causal K/V (paper Algorithm 3, no extra forward); otherwise [current block COPY],
    which rows waiting for a commit sit out (their tokens and NFE do not change). A copy token carries its token
    once accepted, the mask token while masked; SBD never samples `<m>`.
  * A call's update is four jobs: `draw` (entropies, acceptance, sampling), `place` (write the accepted tokens),
    the block outcome (`close_block`: EOS / cap stop, the accepted histogram, the next commit), and `next_state`.
    Verify mode (modes/verify/) reuses the copy window and the first call.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ...attention import clean_meta, concat_meta, copy_meta
from ...models.transformer import forward, lm_head
from .. import sampling
from ..prefill import prefill, prompt_meta
from ..state import DecodeEnv, LoopState, Row, block_positions, gather
from .base import Mode, finalize_at


class SBDState(NamedTuple):
    """SBD mode's part of the loop state (K = block_size)."""

    block_offset: Row  # [B] generated tokens before the current block
    masked: Row        # [B, K] still-masked positions of the current block
    # the finished block at generated indices [commit_start, commit_start + commit_len) still needs its clean causal
    # K/V, which the next wide call writes
    commit_start: Row  # [B]
    commit_len: Row    # [B] 0 = nothing to commit
    decoded_at: Row    # [B, K] the call (counted within the block) that decoded each position; K = not yet


def init_state(env: DecodeEnv, B: int, memory) -> SBDState:
    K, zeros = env.spec.block_size, jnp.zeros((B,), jnp.int32)
    return SBDState(zeros, block_mask(zeros, env), zeros, zeros, jnp.full((B, K), K, jnp.int32))


def block_mask(offset_B, env: DecodeEnv):
    """[B, K] the positions of a block starting at generated index `offset_B` that lie within each row's cap."""
    j = jnp.arange(env.spec.block_size, dtype=jnp.int32)[None]
    return (offset_B[:, None] + j) < env.max_new[:, None]


def copy_window(state: LoopState, env: DecodeEnv, offset_B, masked_BK):
    """The block at generated index `offset_B` as COPY tokens: (tokens [B, K], meta); masked positions carry `<m>`."""
    pos = block_positions(offset_B, env)
    valid = block_mask(offset_B, env)
    tok = jnp.where(masked_BK, env.cfg.mask_token_id, gather(state.seq, pos))
    seg = (valid & ~state.done[:, None]).astype(jnp.int32)
    return tok, copy_meta(seg, pos, jnp.broadcast_to(pos[:, :1], pos.shape))


def first_call(state: LoopState, env: DecodeEnv, prompt_ids):
    """NFE 1's model call: [prompt CLEAN ; first block COPY] (a long prompt's earlier pieces prefilled first).
    -> (state, the copy block's logits, hidden states h, cache, first prompt column of h, the hidden state at
    each row's last prompt token where a prefilled piece held it)."""
    state, start, h_last = prefill(state, env, prompt_ids)
    logits, h, cache = first_forward(state, env, prompt_ids, start, env.spec.block_size)
    return state, logits, h, cache, start, h_last


def first_forward(state: LoopState, env: DecodeEnv, prompt_ids, start: int, width: int, used=None):
    """[the prompt's last piece (columns start..) CLEAN ; the first block's first `width` positions COPY] ->
    (the copy positions' logits, None when width is 0; hidden states h; cache). `used` (traced, <= width): only
    the first `used` copy positions take part, the others are padding (the call computes what a `used`-wide one
    would, in one program for every width)."""
    P = prompt_ids.shape[1]
    tokens, meta = prompt_ids[:, start:], prompt_meta(env.lengths, start, P - start)
    if width:
        zeros = jnp.zeros_like(env.lengths)  # the first block, all masked
        ctok, cmeta = copy_window(state, env, zeros, block_mask(zeros, env))
        cmeta = jax.tree.map(lambda x: x[:, :width], cmeta)
        if used is not None:
            cmeta = cmeta._replace(segment=jnp.where(jnp.arange(width)[None] < used, cmeta.segment, 0))
        tokens = jnp.concatenate([tokens, ctok[:, :width]], axis=1)
        meta = concat_meta(meta, cmeta)
    h, cache = forward(env.params, env.cfg, tokens, meta, state.cache, return_hidden=True)
    return (lm_head(env.params, env.cfg, h[:, P - start:]) if width else None), h, env.constrain(cache)


def quorum(state: LoopState, env: DecodeEnv):
    """-> (rows with a commit, whether this call runs the 2k commit window, rows held out of this k-wide call):
    the 2k window once a quorum of the running rows has a commit; else those rows sit this call out."""
    need = (state.mode_state.commit_len > 0) & ~state.done
    n_need, n_run = (jnp.sum(x).astype(jnp.float32) for x in (need, ~state.done))
    wide = (n_need > 0) & (n_need >= jnp.float32(env.spec.commit_quorum) * n_run)
    return need, wide, need & ~wide


def window_call(state: LoopState, env: DecodeEnv, need, wide):
    """The model call of a step: [commit CLEAN ; block COPY] when `wide`, else [block COPY]. -> (the copy block's
    logits, cache)."""
    K, ms = env.spec.block_size, state.mode_state
    ctok, cmeta = copy_window(state, env, ms.block_offset, ms.masked)
    j = jnp.arange(K, dtype=jnp.int32)[None]

    def with_commit(cache):
        pos = env.lengths[:, None] + ms.commit_start[:, None] + j
        meta = clean_meta((need[:, None] & (j < ms.commit_len[:, None])).astype(jnp.int32), pos)
        tokens = jnp.concatenate([gather(state.seq, pos), ctok], axis=1)
        h, cache = forward(env.params, env.cfg, tokens, concat_meta(meta, cmeta), cache, return_hidden=True)
        return lm_head(env.params, env.cfg, h[:, K:]), cache

    def copy_only(cache):
        return forward(env.params, env.cfg, ctok, cmeta, cache)

    logits, cache = jax.lax.cond(wide, with_commit, copy_only, state.cache)
    return logits, env.constrain(cache)


def draw(state: LoopState, env: DecodeEnv, logits_BKV, index):
    """Entropies, the acceptance rule and the tokens drawn for the current block (row b from fold_in(key_b,
    index)). -> (masked positions of running rows, accepted positions, drawn tokens)."""
    spec = env.spec
    with jax.named_scope("accept"):
        h = sampling.entropy(logits_BKV, env.temp, tempered=spec.tempered_entropy)
        masked = state.mode_state.masked & (~state.done)[:, None]
        acc = sampling.accept(spec.rule, h, masked, env.gamma)
        drawn = sampling.sample(logits_BKV, env.keys, index, env.temp, top_k=spec.top_k, top_p=spec.top_p,
                                suppress=env.cfg.mask_token_id)
    return masked, acc, drawn


class Placed(NamedTuple):
    """The current block after a call's accepted tokens are written."""

    seq: jax.Array         # [B, W] the token buffer
    block: jax.Array       # [B, K] the block's tokens
    decoded_at: jax.Array  # [B, K] the call (within the block) that decoded each position; K = not yet
    still: jax.Array       # [B, K] still masked
    complete: jax.Array    # [B] running rows whose block has no masked position left


def place(state: LoopState, env: DecodeEnv, masked, acc, drawn) -> Placed:
    """Write the accepted tokens into the block and note which call decoded them."""
    K, ms = env.spec.block_size, state.mode_state
    rows = jnp.arange(state.seq.shape[0])[:, None]
    pos = block_positions(ms.block_offset, env)
    call = jnp.max(jnp.where(ms.decoded_at < K, ms.decoded_at + 1, 0), axis=1)  # this call's number in the block
    block = jnp.where(acc, drawn, gather(state.seq, pos))
    still = masked & ~acc
    return Placed(seq=state.seq.at[rows, pos].set(block, mode="drop"), block=block,
                  decoded_at=jnp.where(acc, call[:, None], ms.decoded_at), still=still,
                  complete=~state.done & ~jnp.any(still, axis=1))


class Outcome(NamedTuple):
    """A call's effect on each row beyond its block's tokens."""

    advance: jax.Array       # [B] the next block starts
    done: jax.Array          # [B]
    eos_hit: jax.Array       # [B] stopped by an EOS in this call
    n_generated: jax.Array   # [B]
    accepted: jax.Array      # [B, K + 1]
    commit_start: jax.Array  # [B]
    commit_len: jax.Array    # [B]


def find_eos(env: DecodeEnv, block, decoded, active):
    """An EOS decoded with every earlier position of its block decoded (docs/sbd.md, Inference step 7) -> (rows it stops, its
    index in the block)."""
    prefix = jnp.cumprod(decoded.astype(jnp.int32), axis=1).astype(bool)
    stop = jnp.isin(block, env.eos) & decoded & prefix
    return active & jnp.any(stop, axis=1), jnp.argmax(stop, axis=1).astype(jnp.int32)


def count_calls(accepted, decoded_at, keep, ends, K: int):
    """When a block ends, each of its calls is counted with the tokens it added to the output (`keep`): none
    past the cap, none after the EOS that ends the row (a call may have decoded those before the EOS was)."""
    j = jnp.arange(K, dtype=jnp.int32)[None]
    calls = jnp.max(jnp.where(decoded_at < K, decoded_at + 1, 0), axis=1)  # [B] calls this block took
    per_call = jnp.sum(keep[:, None, :] & (decoded_at[:, None, :] == j[..., None]), axis=2)  # [B, call]
    return accepted + jnp.sum(jax.nn.one_hot(per_call, K + 1, dtype=jnp.int32)
                              * ((j < calls[:, None]) & ends[:, None])[..., None], axis=1)


def close_block(state: LoopState, env: DecodeEnv, placed: Placed) -> Outcome:
    """SBD's outcome: a decoded EOS or the cap ends the row, a complete block advances and is committed by the
    next wide call, the calls of an ended block are counted."""
    K, max_new, ms = env.spec.block_size, env.max_new, state.mode_state
    j = jnp.arange(K, dtype=jnp.int32)[None]
    active = ~state.done
    valid = block_mask(ms.block_offset, env)
    decoded = valid & ~placed.still
    eos_hit, first = find_eos(env, placed.block, decoded, active)
    complete = placed.complete & ~eos_hit
    cap_hit = complete & (ms.block_offset + K >= max_new)
    advance = complete & ~cap_hit
    keep = valid & (placed.decoded_at < K) & (~eos_hit[:, None] | (j <= first[:, None]))
    # rows that sat this call out (done or held, see `step`) keep a commit they are waiting for
    return Outcome(
        advance=advance, done=state.done | eos_hit | cap_hit, eos_hit=eos_hit,
        n_generated=jnp.where(eos_hit, ms.block_offset + first + 1, jnp.where(cap_hit, max_new, state.n_generated)),
        accepted=count_calls(state.accepted, placed.decoded_at, keep, active & (eos_hit | cap_hit | advance), K),
        commit_start=jnp.where(active, ms.block_offset, ms.commit_start),
        commit_len=jnp.where(advance, K, jnp.where(active, 0, ms.commit_len)))


def next_state(state: LoopState, env: DecodeEnv, placed: Placed, out: Outcome, cache, ran) -> LoopState:
    """The state after a call: `placed` tokens, `out`'s row updates, the next block's mask where it advanced;
    `ran`: the rows the call carried a token of (their NFE counts it)."""
    K, ms = env.spec.block_size, state.mode_state
    active = ~state.done
    nxt = ms.block_offset + K
    return state._replace(
        seq=env.constrain(placed.seq),
        cache=cache,
        done=out.done,
        eos=state.eos | out.eos_hit,
        n_generated=out.n_generated,
        nfe=state.nfe + ran.astype(jnp.int32),
        iters=state.iters + 1,
        accepted=out.accepted,
        mode_state=SBDState(
            block_offset=jnp.where(out.advance, nxt, ms.block_offset),
            masked=jnp.where(out.advance[:, None], block_mask(nxt, env),
                             jnp.where(active[:, None], placed.still, ms.masked)),
            commit_start=out.commit_start,
            commit_len=out.commit_len,
            decoded_at=jnp.where(out.advance[:, None], K, placed.decoded_at)))


def update(state: LoopState, env: DecodeEnv, logits_BKV, cache) -> LoopState:
    """Acceptance + sampling + block bookkeeping after one model call on the current block."""
    masked, acc, drawn = draw(state, env, logits_BKV, state.nfe)
    placed = place(state, env, masked, acc, drawn)
    return next_state(state, env, placed, close_block(state, env, placed), cache, ~state.done)


def first(state: LoopState, env: DecodeEnv, prompt_ids) -> LoopState:
    state, logits, _, cache, _, _ = first_call(state, env, prompt_ids)
    return update(state, env, logits, cache)


def step(state: LoopState, env: DecodeEnv) -> LoopState:
    """One loop iteration: pick the window, run it, update; held rows (waiting for a commit quorum) get no token
    and no NFE, their state unchanged."""
    need, wide, held = quorum(state, env)
    state = state._replace(done=state.done | held)
    logits, cache = window_call(state, env, need, wide)
    state = update(state._replace(wide=state.wide + wide.astype(jnp.int32)), env, logits, cache)
    return state._replace(done=state.done & ~held)


def finalize(state: LoopState, env: DecodeEnv):
    """The last block's K/V (committed by no later call)."""
    return env.constrain(finalize_at(state, env, block_positions(state.mode_state.block_offset, env)))


SBD = Mode("sbd", init_state=init_state, first=first, step=step, finalize=finalize, prefills_last_token=True)
