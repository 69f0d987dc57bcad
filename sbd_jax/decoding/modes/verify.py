"""Verify mode, lossless SBD (SBD.md "Lossless mode"): every block SBD drafts is checked against AR's tokens by
the next call's clean queries, so the output equals AR mode's for the same key; drafts only decide how many calls
it takes. Reuses SBD's window, draw and place (sbd.py); its own are the check of the drafts (`check`), the first
token (AR's, from the last prompt token's query) and the block outcome (drafts stop nothing)."""
from __future__ import annotations

import jax.numpy as jnp

from ...models.transformer import KVCache, lm_head
from .. import sampling
from ..prefill import last_prompt_hidden
from ..state import DecodeEnv, LoopState, gather, tally
from . import sbd
from .base import Mode, finalize_at, last_token_positions


def ar_tokens(env: DecodeEnv, h_clean, gen):
    """AR's token at generated index gen + 1 from each clean query: what the drafts are checked against."""
    return sampling.sample(lm_head(env.params, env.cfg, h_clean), env.keys, gen + 1, env.temp,
                           top_k=env.spec.top_k, top_p=env.spec.top_p)


def check(state: LoopState, env: DecodeEnv, ar_BK):
    """Rows whose commit window ran in this call compare the drafts at generated indices cs + 1 .. cs + cl - 1
    with AR's tokens there (`ar_BK[:, i]`: AR's token at cs + 1 + i, from the clean query at cs + i) and keep the
    agreeing prefix. All agree: AR's next token ar[cl - 1] becomes the current block's first token. A draft
    differs at cs + 1 + m: AR's token replaces it, the rest is dropped, the next block starts after it and the
    correction is committed (1 token) by the next call. A verified EOS or the cap ends the row.
    -> (state, rows whose drafts were rejected)."""
    K, max_new = env.spec.block_size, env.max_new
    j = jnp.arange(K, dtype=jnp.int32)[None]
    checked = ~state.done & (state.commit_len > 0)
    cs, cl = state.commit_start, state.commit_len
    kept = gather(state.seq, (env.lengths + cs)[:, None] + jnp.arange(K + 1, dtype=jnp.int32)[None])
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
        accepted=tally(state.accepted, upto, checked & (cl > 1)))  # per verified block: drafts that stood
    return state, rejected


def close_block(state: LoopState, env: DecodeEnv, placed: sbd.Placed, rejected) -> sbd.Outcome:
    """Drafts stop nothing: a complete block (of a row whose drafts stood) is verified by the next call, its
    commit window."""
    K = env.spec.block_size
    advance = placed.complete & ~rejected
    return sbd.Outcome(
        advance=advance, done=state.done, eos_hit=jnp.zeros_like(state.done), n_generated=state.n_generated,
        accepted=state.accepted, commit_start=jnp.where(advance, state.block_offset, state.commit_start),
        commit_len=jnp.where(advance, jnp.minimum(K, env.max_new - state.block_offset), state.commit_len))


def update(state: LoopState, env: DecodeEnv, logits_BKV, cache, ar_BK) -> LoopState:
    """The check of the committed drafts against AR's tokens `ar_BK`, then SBD's drafting of the current block
    (tokens drawn by generated index, coupled to AR's draw)."""
    ran = ~state.done  # rows this call carried a token of
    state, rejected = check(state, env, ar_BK)
    j = jnp.arange(env.spec.block_size, dtype=jnp.int32)[None]
    masked, acc, drawn = sbd.draw(state, env, logits_BKV, state.block_offset[:, None] + j)
    acc = acc & ~rejected[:, None]  # a rejected row's copy half drafted positions that no longer exist
    placed = sbd.place(state, env, masked, acc, drawn)
    return sbd.next_state(state, env, placed, close_block(state, env, placed, rejected), cache, ran)


def admit(state: LoopState, env: DecodeEnv) -> LoopState:
    """The last prompt token rides as a 1-token commit: its query gives AR's first token."""
    return state._replace(commit_start=jnp.full_like(env.lengths, -1), commit_len=jnp.ones_like(env.lengths))


def first(state: LoopState, env: DecodeEnv, prompt_ids) -> LoopState:
    """NFE 1: SBD's first call; AR's first token, from the last prompt token's query, is the first block's first
    token."""
    P = prompt_ids.shape[1]
    state, logits, h, cache, start, h_last = sbd.first_call(state, env, prompt_ids)
    last = last_prompt_hidden(h, env.lengths, start, P, h_last)
    tok = sampling.sample(lm_head(env.params, env.cfg, last), env.keys, jnp.zeros_like(env.lengths)[:, None],
                          env.temp, top_k=env.spec.top_k, top_p=env.spec.top_p)
    ar = jnp.zeros(state.masked.shape, jnp.int32).at[:, :1].set(tok)
    return update(admit(state, env), env, logits, cache, ar)


def step(state: LoopState, env: DecodeEnv) -> LoopState:
    return sbd.windowed_step(state, env, update, clean_tokens=ar_tokens)


def finalize(state: LoopState, env: DecodeEnv) -> KVCache:
    """The last output token's K/V; the K/V rejected drafts wrote past the output cleared."""
    cache = finalize_at(state, env, last_token_positions(state, env))
    total = env.lengths + state.n_generated
    keep = (jnp.arange(cache.k.shape[2])[None] < total[:, None])[None, :, :, None, None]
    return env.constrain(KVCache(jnp.where(keep, cache.k, 0), jnp.where(keep, cache.v, 0), total))


VERIFY = Mode("verify", first=first, step=step, finalize=finalize, admit=admit, prefills_last_token=False)
