"""Verify mode, lossless SBD (docs/sbd.md, "Lossless mode"): every draft is checked against AR's token at its position
before it is kept, so the output equals AR mode's for the same key; drafts and the policy only decide how many
calls, and of which width, a row takes.

A running row holds the commit window (commit_start cs, commit_len cl): the token at generated index cs is AR's
(verified; its K/V is written by the next clean query) and cs + 1 .. cs + cl - 1 are drafts; the current block
starts at block_offset = cs + cl, all masked. Each call is one of these (policy.py chooses per call):

  * wide (w a draft width): [commit CLEAN, w tokens ; w COPY blocks of w tokens, one per outcome]. The clean
    queries give AR's tokens at cs + 1 .. cs + w: the drafts' agreeing prefix (m) stands, and AR's next token at
    cs + m + 1 (a correction, or all standing the next block's first token) opens a block whose other w - 1
    positions the copy block of outcome m drafted in the same call from the verified text alone (one call checks
    a whole block and drafts the next, whatever the check's outcome; no call only refines drafts). A row holding
    more drafts than a narrower call checks keeps only those it checks.
  * AR (1-wide): the clean query at cs gives AR's token at cs + 1: it checks the next draft (agreeing, the window
    shrinks by one) or replaces it and what follows; a row with no draft left simply takes the token.
Row stop: a verified EOS (a standing draft or AR's token) or the cap. Tokens are drawn by generated index
(sampling.py), so a draft and AR's token at a position share their random numbers (coupled drafting).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from ....attention import clean_meta, concat_meta, copy_meta
from ....models.transformer import KVCache, forward, lm_head
from ... import sampling
from ...prefill import last_prompt_hidden, prefill
from ...state import DecodeEnv, LoopState, gather, tally
from .. import ar, sbd
from ..base import finalize_at, last_token_positions
from . import policy
from .state import DraftMemory, VerifyState, VerifyStats


# a wide call of width w at most this computes one output head over all its w + w * w queries instead of two of w
# rows (AR's tokens, then the chosen outcome's drafts): the head reads the vocabulary's weights once, not twice
# (SmolLM2-135M on a 2-core CPU, batch 1: -9% of a w = 2 call, -5% at w = 4; bench/bench_wide_call.py)
ONE_HEAD_MAX_WIDTH = 4


def ar_tokens(env: DecodeEnv, logits_clean, gen):
    """AR's token at generated index gen + 1 from each clean query's logits at gen."""
    return sampling.sample(logits_clean, env.keys, gen + 1, env.temp, top_k=env.spec.top_k, top_p=env.spec.top_p,
                           suppress=env.cfg.mask_token_id)


def with_mode(state: LoopState, **fields) -> LoopState:
    """`state` with these VerifyState fields replaced."""
    return state._replace(mode_state=state.mode_state._replace(**fields))


def restart(state: LoopState, rows, at) -> LoopState:
    """Rows `rows` hold only their verified token at `at`; the next block starts after it, nothing drafted."""
    vs = state.mode_state
    return with_mode(state, commit_start=jnp.where(rows, at, vs.commit_start),
                     commit_len=jnp.where(rows, 1, vs.commit_len), block_offset=jnp.where(rows, at + 1, vs.block_offset))


def check(state: LoopState, env: DecodeEnv, ar_BC):
    """Check the commit window's drafts against AR's tokens `ar_BC[:, i]` (AR's token at cs + 1 + i, from the
    clean query at cs + i; C queries ran). The agreeing prefix (m drafts) stands; AR's token at cs + 1 + m is
    placed when it corrects a draft or when every draft was checked and stood (C >= cl); otherwise (C < cl, all
    checked ones stood) the window moves on by C. A verified EOS or the cap ends the row. -> (state, the rows
    whose drafts all stood and whose next token, AR's, now sits at block_offset: they open the next block; the rows
    whose AR token corrected a draft: they restart after it with nothing drafted; m [B])."""
    C = ar_BC.shape[1]
    jc = jnp.arange(C, dtype=jnp.int32)[None]
    vs = state.mode_state
    running, cs, cl, max_new = ~state.done, vs.commit_start, vs.commit_len, env.max_new
    n_chk = jnp.minimum(C, cl - 1)
    drafts = gather(state.seq, (env.lengths + cs + 1)[:, None] + jc)
    m = jnp.sum(jnp.cumprod(((drafts == ar_BC) & (jc < n_chk[:, None])).astype(jnp.int32), axis=1), axis=1)
    rejected = running & (m < n_chk)
    put = rejected | (running & (C >= cl))  # AR's token at g = cs + 1 + m joins the output
    g = cs + 1 + m
    tok = jnp.take_along_axis(ar_BC, jnp.minimum(m, C - 1)[:, None], axis=1)[:, 0]
    eos_draft = jnp.isin(drafts, env.eos) & (jc < m[:, None])
    in_drafts = jnp.any(eos_draft, axis=1)
    eos_hit = running & (in_drafts | (put & (g < max_new) & jnp.isin(tok, env.eos)))
    verified = jnp.where(in_drafts, cs + 2 + jnp.argmax(eos_draft, axis=1).astype(jnp.int32),
                         jnp.minimum(g + put.astype(jnp.int32), max_new))
    finished = eos_hit | (running & (verified >= max_new))
    rows = jnp.arange(state.seq.shape[0])
    seq = state.seq.at[rows, jnp.where(put & (g < max_new), env.lengths + g, state.seq.shape[1])].set(tok, mode="drop")
    moved = running & ~put & ~finished  # every checked draft stood, C < cl: the window moves on by C
    stood = jnp.where(in_drafts, jnp.argmax(eos_draft, axis=1).astype(jnp.int32) + 1, m)  # none past an EOS
    vs = vs._replace(agreed=vs.agreed + jnp.where(running, m, 0), commit_start=jnp.where(moved, cs + m, cs),
                     commit_len=jnp.where(moved, cl - m, cl))
    state = state._replace(
        seq=env.constrain(seq), done=state.done | finished, eos=state.eos | eos_hit,
        n_generated=jnp.where(finished, verified, state.n_generated),
        accepted=tally(state.accepted, jnp.minimum(verified - cs - 1, state.accepted.shape[1] - 1), running),
        mode_state=policy.update_counts(vs, running & (n_chk > 0), cs + 1 - vs.opened, stood,
                                        (rejected & ~in_drafts).astype(jnp.int32)))
    return restart(state, rejected & ~finished, g), put & ~rejected & ~finished, rejected & ~finished, m


def open_block(state: LoopState, env: DecodeEnv, logits_BwV, opened, w=None) -> LoopState:
    """Rows `opened` (their block's first token is AR's, just placed) draft the block's other w - 1 positions from
    the copy queries' logits at once (w: all of them, or the first w, traced); the block becomes the commit window
    the next call checks."""
    vs = state.mode_state
    b = vs.block_offset
    j = jnp.arange(logits_BwV.shape[1], dtype=jnp.int32)[None]
    w = logits_BwV.shape[1] if w is None else w
    drawn = sampling.sample(logits_BwV, env.keys, b[:, None] + j, env.temp, top_k=env.spec.top_k,
                            top_p=env.spec.top_p, suppress=env.cfg.mask_token_id)
    put = opened[:, None] & (j >= 1) & (j < w) & ((b[:, None] + j) < env.max_new[:, None])
    pos = jnp.where(put, (env.lengths + b)[:, None] + j, state.seq.shape[1])
    seq = state.seq.at[jnp.arange(state.seq.shape[0])[:, None], pos].set(drawn, mode="drop")
    n = jnp.minimum(w, env.max_new - b)
    vs = drafted(vs, jnp.where(opened, n - 1, 0))
    return state._replace(seq=env.constrain(seq), mode_state=vs._replace(
        commit_start=jnp.where(opened, b, vs.commit_start), commit_len=jnp.where(opened, n, vs.commit_len),
        block_offset=jnp.where(opened, b + w, b), opened=jnp.where(opened, b, vs.opened)))


def drafted(vs: VerifyState, n_B) -> VerifyState:
    """`n_B` more drafts placed (negative: dropped unchecked)."""
    return vs._replace(proposed=vs.proposed + n_B)


def since_wide(state: LoopState, n) -> LoopState:
    """The policy's count of calls since the last drafting call, set to `n`."""
    return with_mode(state, memory=state.mode_state.memory._replace(since_wide=jnp.asarray(n, jnp.int32)))


def counted(state: LoopState, ran, cache, wide: bool) -> LoopState:
    """A call's counters: NFE for the rows it carried, the batch's calls and wide calls."""
    state = since_wide(state, 0 if wide else state.mode_state.memory.since_wide + 1)
    return state._replace(cache=cache, nfe=state.nfe + ran.astype(jnp.int32), iters=state.iters + 1,
                          wide=state.wide + int(wide))


def shorten(state: LoopState, env: DecodeEnv, w: int) -> LoopState:
    """Rows holding more than w - 1 drafts keep the first w - 1: a w-wide call then checks all it holds and, if
    they stand, drafts the next block (checking one more draft instead would leave the copy queries unused)."""
    vs = state.mode_state
    cut = ~state.done & (vs.commit_len > w)
    vs = drafted(vs, -jnp.where(cut, vs.commit_len - w, 0))
    return state._replace(mode_state=vs._replace(commit_len=jnp.where(cut, w, vs.commit_len),
                                                 block_offset=jnp.where(cut, vs.commit_start + w, vs.block_offset)))


def outcome_window(state: LoopState, env: DecodeEnv, w: int):
    """Copy queries for every outcome of this call's check: block m (m = 0 .. w - 1: the first m waiting drafts
    stand) starts at generated index cs + m + 1, where AR's token then goes, and drafts the w - 1 positions after it
    from the verified text up to cs + m alone (the copy queries attend clean keys before their block's start, this
    call's included). Padding where the row holds fewer than m drafts, past its cap, or is done.
    -> (tokens [B, w * w], meta), block m at columns m * w .. m * w + w - 1."""
    B, vs = state.seq.shape[0], state.mode_state
    m = jnp.arange(w, dtype=jnp.int32)[None, :, None]
    start = vs.commit_start[:, None, None] + 1 + m
    gen = start + jnp.arange(w, dtype=jnp.int32)[None, None, :]
    valid = (~state.done)[:, None, None] & (m < vs.commit_len[:, None, None]) & (gen < env.max_new[:, None, None])
    flat = lambda x: jnp.broadcast_to(x, (B, w, w)).reshape(B, w * w)  # noqa: E731
    meta = copy_meta(flat(valid.astype(jnp.int32)), flat(env.lengths[:, None, None] + gen),
                     flat(env.lengths[:, None, None] + start))
    return jnp.full((B, w * w), env.cfg.mask_token_id, jnp.int32), meta


def wide_step(state: LoopState, env: DecodeEnv, w: int) -> LoopState:
    """[commit CLEAN (w tokens) ; one block of w COPY tokens per outcome of the check]: check the waiting drafts (the
    first w - 1, `shorten`); whatever the agreeing prefix m, AR's token at cs + m + 1 (the correction, or the
    next block's first token) opens a block whose other w - 1 positions outcome m's copy queries drafted in this
    same call. So every such call checks drafts and drafts the next ones: a rejection costs no extra call."""
    state = shorten(state, env, w)
    j = jnp.arange(w, dtype=jnp.int32)[None]
    ran, vs = ~state.done, state.mode_state
    gen = vs.commit_start[:, None] + j
    pos = env.lengths[:, None] + gen
    meta = clean_meta((ran[:, None] & (j < vs.commit_len[:, None])).astype(jnp.int32), pos)
    otok, ometa = outcome_window(state, env, w)
    h, cache = forward(env.params, env.cfg, jnp.concatenate([gather(state.seq, pos), otok], axis=1),
                       concat_meta(meta, ometa), state.cache, return_hidden=True)
    one_head = w <= ONE_HEAD_MAX_WIDTH  # static: then x holds every query's logits, else its hidden state
    x = lm_head(env.params, env.cfg, h) if one_head else h
    head = (lambda rows: rows) if one_head else (lambda rows: lm_head(env.params, env.cfg, rows))  # noqa: E731
    state, stood, redo, m = check(state, env, ar_tokens(env, head(x[:, :w]), gen))
    B = x.shape[0]
    x_out = x[:, w:].reshape(B, w, w, x.shape[-1])[jnp.arange(B), jnp.clip(m, 0, w - 1)]  # outcome m's block
    vs = state.mode_state
    state = with_mode(state, block_offset=jnp.where(redo, vs.commit_start, vs.block_offset))
    state = open_block(state, env, head(x_out), stood | redo)
    return counted(state, ran, env.constrain(cache), wide=True)


def ar_step(state: LoopState, env: DecodeEnv) -> LoopState:
    """One clean query at each row's verified token: AR's next token checks the next draft or is taken."""
    ran, cs = ~state.done, state.mode_state.commit_start
    pos = (env.lengths + cs)[:, None]
    logits, cache = forward(env.params, env.cfg, gather(state.seq, pos), clean_meta(ran[:, None].astype(jnp.int32),
                                                                                     pos), state.cache)
    ar = sampling.sample(logits, env.keys, cs[:, None] + 1, env.temp, top_k=env.spec.top_k,
                         top_p=env.spec.top_p, suppress=env.cfg.mask_token_id)
    state, opened, _, _ = check(state, env, ar)
    state = restart(state, opened, state.mode_state.block_offset)  # no copy queries ran: nothing drafted
    return counted(state, ran, env.constrain(cache), wide=False)


def as_ar(state: LoopState) -> LoopState:
    """Verify's rows as AR mode's step sees them: AR's next generated index is where verify's next block starts."""
    return state._replace(mode_state=ar.ARState(state.mode_state.block_offset))


def from_ar(ar_state: LoopState, vs: VerifyState) -> LoopState:
    """Back from AR mode's steps (`as_ar`): each row's next block starts after the tokens AR placed."""
    return ar_state._replace(mode_state=vs._replace(block_offset=ar_state.mode_state.generated))


def none_finished(state: LoopState, running) -> jax.Array:
    """A run of calls inside one loop step goes on: no row of `running` (the rows running when it began) has
    finished (the loop's own check between steps, and a continuous batch's slot refill, then see every finish)."""
    return ~jnp.any(state.done & running)


def ar_segment(state: LoopState, env: DecodeEnv) -> LoopState:
    """No running row holds a draft: AR mode's own step (one clean query, the token drawn by generated index, as
    here) until the policy's next exploration or until a row finishes (its choice cannot change before either)."""
    budget = policy.ar_budget(state, env)
    running, vs = ~state.done, state.mode_state

    def more(carry):
        s, n = carry
        return (n < budget) & none_finished(s, running)

    # the inner loop carries AR's state only
    stepped, n = jax.lax.while_loop(more, lambda c: (ar.step(c[0], env), c[1] + 1), (as_ar(state), jnp.int32(0)))
    state = from_ar(stepped, vs)
    state = restart(state, running & ~state.done, state.mode_state.block_offset - 1)
    return since_wide(state, vs.memory.since_wide + n)


def wide_run(state: LoopState, env: DecodeEnv, kind: int, w: int) -> LoopState:
    """Width-w calls while the policy keeps choosing them (`kind`) and no running row finishes: the calls the loop
    would make one by one, with one pass through `step`'s switch for the run (on a CPU a pass costs ~a fifth of
    a call: it moves the loop state, cache included, into and out of the branch)."""
    running = ~state.done

    def more(s):
        with jax.named_scope("draft_policy"):
            same = policy.choose(s, env) == kind
        return same & none_finished(s, running)
    return jax.lax.while_loop(more, lambda s: wide_step(s, env, w), wide_step(state, env, w))


def step(state: LoopState, env: DecodeEnv) -> LoopState:
    """The policy's call: a 1-wide AR call (a run of them while no row holds a draft, policies "adaptive" and
    "never") or a run of wide ones for a draft width w."""
    with jax.named_scope("draft_policy"):
        kind = policy.choose(state, env)
    branches = [lambda s: ar_step(s, env)] + [lambda s, i=i, w=w: wide_run(s, env, i, w)
                                              for i, w in enumerate(env.spec.draft_widths, 1)]
    if env.spec.draft_policy in ("adaptive", "never"):
        plain = (kind == 0) & jnp.all(state.done | (state.mode_state.commit_len == 1))
        kind = jnp.where(plain, len(branches), kind)
        branches.append(lambda s: ar_segment(s, env))
    return jax.lax.switch(kind, branches, state)


def admit(state: LoopState, env: DecodeEnv) -> LoopState:
    """The last prompt token rides as a 1-token commit window: its query gives AR's first token."""
    return with_mode(state, commit_start=jnp.full_like(env.lengths, -1), commit_len=jnp.ones_like(env.lengths),
                     block_offset=jnp.zeros_like(env.lengths))


def first(state: LoopState, env: DecodeEnv, prompt_ids) -> LoopState:
    """NFE 1: [prompt CLEAN ; first block COPY, w positions], w the policy's first choice (0: no copy query takes
    part, an AR call): AR's first token (from the last prompt token's query) opens the first block, whose other
    w - 1 positions the copy queries draft. One program for every w: the call is as wide as the widest choice."""
    P = prompt_ids.shape[1]
    ran = ~state.done
    state, start, h_last = prefill(state, env, prompt_ids)
    state = admit(state, env)
    with jax.named_scope("draft_policy"):
        kind = policy.choose(state, env)

    # one call at the widest width; a narrower choice leaves the copy queries past it as padding
    w = jnp.asarray((0,) + env.spec.draft_widths, jnp.int32)[kind]
    logits, h, cache = sbd.first_forward(state, env, prompt_ids, start, max(env.spec.draft_widths), used=w)
    last = last_prompt_hidden(h, env.lengths, start, P, h_last)
    tok = sampling.sample(lm_head(env.params, env.cfg, last), env.keys, jnp.zeros_like(env.lengths)[:, None],
                          env.temp, top_k=env.spec.top_k, top_p=env.spec.top_p, suppress=env.cfg.mask_token_id)
    state, opened, _, _ = check(state, env, tok)
    state = jax.lax.cond(w > 0, lambda s: open_block(s, env, logits, opened, w),
                         lambda s: restart(s, opened, s.mode_state.block_offset), state)._replace(cache=cache)
    state = since_wide(state, jnp.where(kind > 0, 0, state.mode_state.memory.since_wide + 1))
    return state._replace(nfe=state.nfe + ran.astype(jnp.int32), iters=state.iters + 1)


def finalize(state: LoopState, env: DecodeEnv) -> KVCache:
    """The last output token's K/V; the K/V rejected drafts wrote past the output cleared."""
    cache = finalize_at(state, env, last_token_positions(state, env))
    total = env.lengths + state.n_generated
    keep = (jnp.arange(cache.k.shape[2])[None] < total[:, None])[None, :, :, None]  # [1, B, S, 1] (+ Dh)
    return env.constrain(cache.with_arrays(tuple(jnp.where(keep if a.ndim == 4 else keep[..., None], a, 0)
                                                 for a in cache.arrays()), total))


def init_state(env: DecodeEnv, B: int, memory) -> VerifyState:
    return VerifyState.new(B, DraftMemory.checked(memory, env.spec.block_size - 1))


def start_from(memory, spec) -> DraftMemory:
    return DraftMemory.checked(memory, spec.block_size - 1)


def report(state: LoopState) -> VerifyStats:
    return VerifyStats(drafts=state.mode_state.proposed, agreed=state.mode_state.agreed, memory=policy.memory(state))
