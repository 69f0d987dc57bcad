"""Verify mode's drafting policy (docs/sbd.md, "Lossless mode", step 2): before each call, the batch chooses between a
1-wide AR call (one token per row; the next waiting draft checked for free) and a wide call [commit CLEAN ; one
COPY block per outcome of the check] for a draft width w of `spec.draft_widths` (k, k/2, k/4, k/8), which checks the
waiting drafts and drafts the next w - 1 positions. Whatever it chooses, every row's tokens are AR's (step.py); the choice
only sets how many calls, and of which width, a row takes.

  * Per row and draft offset (a draft's place in its block after the block's first token, 1 .. k - 1): the decayed
    counts of checked drafts (`trials`) and of those that agreed (`hits`) give p_j, the chance that a draft at
    offset j agrees given the drafts before it did, with a prior of weight PRIOR at the rate over all rows (so a
    row admitted by continuous batching, or the first row of a batch that started from an earlier output's
    `draft_memory`, starts from what the model's drafts did for the others). Far drafts agree less often than
    near ones, so a width is judged by the offsets it drafts. Over all rows, offset 1 starts at 1 (drafts agree
    until checks show otherwise) and each later offset has a prior of weight POOL_PRIOR at the rate of the one
    before it. A check's drafts after a standing EOS are not counted (the row ends there).
  * A token is useful only up to the row's end: h, the chance that a verified token is an EOS (EOS stops over
    tokens, over the finished rows and those before them), makes a draft useful with chance p_j (1 - h), and no row
    makes more tokens per call than it has left before its cap.
  * A width-w call checks the row's w - 1 waiting drafts and, whatever their outcome, drafts the next w - 1 (one
    copy block per outcome, step.py): tokens per call tau_w = 1 + E[m], E[m] = c_1 + ... + c_(w-1),
    c_i = p_1 ... p_i the chance the first i drafts stand.
  * The call that makes the most tokens per unit of time: AR gives 1 per running row at cost 1 (MARGIN); width w
    gives the running rows' mean tau_w at `call_costs[w]`
    (what a width-w call's loop step, w + w * w queries per row, costs in AR steps at this batch on this device,
    costs.py).
    Every (c - 1) / EXPLORE_SHARE calls without drafting (c: the dearest width's cost), and while no draft was
    ever checked (a batch that started without `draft_memory`), the most promising width drafts anyway, so rows
    whose drafts start to agree, and far offsets the estimate has few checks of, are noticed at a bounded cost
    (the AR calls after it check those drafts for nothing).
  * The first call chooses too: its copy queries (the first block's drafts) are as wide as the chosen width, none
    for an AR call (a prompt-wide call is compute-bound, and k copy tokens per row add to it).
"""
from __future__ import annotations

import jax.numpy as jnp

from ...state import DecodeEnv, LoopState
from . import costs
from .state import DraftMemory, VerifyState

DECAY = 0.9  # weight of a row's earlier counts at an offset per draft it checks there (a memory of ~10 blocks)
PRIOR = 16.0  # weight, in drafts, of the rate over all rows in a row's estimate at an offset
POOL_DECAY = 0.9  # weight of the counts over all rows at an offset at each call that checks drafts there
POOL_PRIOR = 4.0  # weight, in drafts, of the rate at the offset before in the rate over all rows at an offset
EXPLORE_SHARE = 0.03  # the share of the run's cost spent on drafting calls the estimate did not ask for
NEVER = 2 ** 30
MARGIN = 1.0  # AR's tokens per unit of time; a drafting call is made when it promises more


def pooled_prob(memory: DraftMemory):
    """[J] per draft offset, the rate over all rows with a prior of weight POOL_PRIOR at the rate of the offset
    before it (1 before offset 1): drafts count as agreeing until shown otherwise, and an offset few drafts reached
    as good as the nearer ones, so the policy tries drafting, and a wider call when the drafts it makes agree
    (learning the far offsets' rate there); drafts that fail bring the rates down within a few checks, and one
    failure does not rule a width out."""
    rates, prev = [], jnp.float32(1.0)
    for j in range(memory.hits.shape[0]):  # the (few, static) offsets in order
        prev = (memory.hits[j] + POOL_PRIOR * prev) / (memory.trials[j] + POOL_PRIOR)
        rates.append(prev)
    return jnp.stack(rates) if rates else jnp.zeros((0,), jnp.float32)


def agree_prob(vs: VerifyState):
    """[B, J] the chance a draft at each offset agrees given the drafts before it in its block did: the row's
    decayed counts with a prior of weight PRIOR at the rate over all rows, so a new row starts from the batch's
    experience of this model and one rejection does not outweigh it. Far drafts agree less often than near ones;
    per offset, a width is judged by the drafts it would make."""
    return (vs.hits + PRIOR * pooled_prob(vs.memory)[None]) / (vs.trials + PRIOR)


def verified(state: LoopState):
    """[B] tokens each row has verified (its output so far)."""
    return jnp.where(state.done, state.n_generated, state.mode_state.commit_start + 1)


def ends(state: LoopState):
    """(EOS stops, verified tokens) over the batch's rows and the counts carried in (a row's eos implies done)."""
    m = state.mode_state.memory
    return (m.stops + jnp.sum(state.eos).astype(jnp.float32), m.tokens + jnp.sum(verified(state)).astype(jnp.float32))


def stop_chance(state: LoopState):
    """The chance that a verified token is an EOS: EOS stops over tokens (0 before any row has stopped)."""
    stops, tokens = ends(state)
    return stops / jnp.maximum(tokens, 1.0)


def memory(state: LoopState) -> DraftMemory:
    """What a later run may start from (this batch's rows folded in)."""
    stops, tokens = ends(state)
    return state.mode_state.memory._replace(stops=stops, tokens=tokens)


def retire(state: LoopState, slots) -> LoopState:
    """The finished rows in `slots` (indices; out-of-range ones ignored) join the counts over all rows before
    their slots take new prompts (continuous batching)."""
    take = lambda a: jnp.sum(a.at[slots].get(mode="fill", fill_value=0)).astype(jnp.float32)  # noqa: E731
    vs = state.mode_state
    m = vs.memory._replace(stops=vs.memory.stops + take(state.eos), tokens=vs.memory.tokens + take(state.n_generated))
    return state._replace(mode_state=vs._replace(memory=m))


def tokens_per_wide_call(p_BJ, w: int):
    """[B] expected tokens per width-w call of a row that drafts w - 1 positions, p_BJ[:, j - 1] the chance the
    draft at offset j agrees given the earlier ones did: 1 + E[m], E[m] = c_1 + ... + c_(w-1), c_i = p_1 ... p_i
    the chance the first i stand."""
    return 1.0 + jnp.sum(jnp.cumprod(p_BJ[:, :w - 1], axis=1), axis=1)


def update_counts(vs: VerifyState, checked, first_B, agreed_B, failed_B) -> VerifyState:
    """Fold one call's checks into the decayed counts: rows that checked drafts (`checked`), the first at offset
    `first_B`, saw `agreed_B` agree and `failed_B` (0 or 1) not (the draft after the agreeing ones)."""
    j = jnp.arange(1, vs.hits.shape[1] + 1, dtype=jnp.int32)[None]
    start, end = first_B[:, None], (first_B + agreed_B)[:, None]
    hit = checked[:, None] & (j >= start) & (j < end)
    seen = hit | (checked & (failed_B > 0))[:, None] & (j == end)
    m = vs.memory
    pool = jnp.any(seen, axis=0)
    return vs._replace(trials=jnp.where(seen, vs.trials * DECAY + 1.0, vs.trials),
                       hits=jnp.where(seen, vs.hits * DECAY + hit, vs.hits),
                       memory=m._replace(trials=jnp.where(pool, m.trials * POOL_DECAY, m.trials) + jnp.sum(seen, 0),
                                         hits=jnp.where(pool, m.hits * POOL_DECAY, m.hits) + jnp.sum(hit, 0)))


def call_costs(state: LoopState, env: DecodeEnv):
    """[W] what a width-w call costs in 1-wide calls per draft width at this batch and cache (costs.py: the spec's
    stated `wide_cost`, else the cost model's estimate; static numbers, no device work)."""
    return jnp.asarray(costs.call_costs(env.params, env.cfg, env.spec, state.done.shape[0], state.cache.k.shape[2]),
                       jnp.float32)


def explore_every(call_costs):
    """Calls without drafting between two drafting calls the estimate did not ask for (at most the dearest width's
    extra cost per EXPLORE_SHARE of the calls' cost)."""
    return jnp.ceil(jnp.maximum(jnp.max(call_costs) - 1.0, 0.0) / EXPLORE_SHARE).astype(jnp.int32)


def ar_budget(state: LoopState, env: DecodeEnv):
    """AR calls the policy makes before its next drafting call if no row finishes and no draft is checked."""
    if env.spec.draft_policy == "never":
        return jnp.int32(NEVER)
    return jnp.maximum(explore_every(call_costs(state, env)) - state.mode_state.memory.since_wide, 1)


def choose(state: LoopState, env: DecodeEnv):
    """This call's kind (a traced int): 0 = a 1-wide AR call, i >= 1 = the draft width `spec.draft_widths[i - 1]`."""
    widths = env.spec.draft_widths
    policy = env.spec.draft_policy
    if policy in ("always", "never"):
        return jnp.int32(1 if policy == "always" else 0)
    if callable(policy):  # the spec's own choose(state, env)
        return policy(state, env)
    running, memory, cost = ~state.done, state.mode_state.memory, call_costs(state, env)
    n = jnp.maximum(jnp.sum(running), 1).astype(jnp.float32)
    p = agree_prob(state.mode_state) * (1.0 - stop_chance(state))
    left = jnp.maximum(env.max_new - verified(state), 1).astype(jnp.float32)
    rate = jnp.stack([jnp.float32(MARGIN)] + [
        jnp.sum(jnp.where(running, jnp.minimum(tokens_per_wide_call(p, w), left), 0.0)) / n / c
        for w, c in zip(widths, cost)])
    best = jnp.argmax(rate).astype(jnp.int32)
    # explore with the most promising width: after (c - 1) / EXPLORE_SHARE calls without drafting, or while no
    # draft was ever checked
    explore = (memory.since_wide >= explore_every(cost)) | (jnp.sum(memory.trials) == 0)
    return jnp.where((best == 0) & explore, 1 + jnp.argmax(rate[1:]).astype(jnp.int32), best)
