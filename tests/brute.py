"""Brute-force reference decoder (a test oracle): no KV cache, the whole sequence recomputed with the dense SBD mask
at every step. Used by tests to pin the cached decoder (`generate`): identical tokens and NFE.

Deliberately written differently from `generate`: a host-side Python loop with numpy bookkeeping and
its own (per-row, per-position) implementation of the acceptance rules and the stop rule. Only the
model call (one jitted no-cache `forward` at a FIXED shape, so it compiles once), the entropy and
the token draw (`sampling.entropy`, `sampling.sample`: same random stream by construction) are shared.

Layout of every model call, row b (W = P + max_new + k columns of clean tokens, then k copy tokens):
  clean tokens at column = position, segment 1 for positions < len_b + decoded-before-block (SBD)
  or < len_b + generated (AR), segment 0 after; SBD: the current block as copy tokens (block start
  len_b + blk, mask token while still masked, segment 0 beyond max_new_tokens).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.attention import clean_meta, concat_meta, copy_meta
from sbd_jax.models.config import ModelConfig
from sbd_jax.decoding import DecodeSpec, DraftMemory, GenerateOutput, VerifyStats, check_request, sampling
from sbd_jax.decoding.modes.verify import costs, policy
from sbd_jax.models.transformer import forward


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, tokens, meta, *, cfg):
    logits, _ = forward(params, cfg, tokens, meta)
    return logits


@functools.partial(jax.jit, static_argnames=("tempered", "top_k", "top_p", "suppress"))
def _score(logits, keys, step, temp, *, tempered, top_k, top_p, suppress):
    h = sampling.entropy(logits, temp, tempered=tempered)
    return h, sampling.sample(logits, keys, step, temp, top_k=top_k, top_p=top_p, suppress=suppress)


def _accept_row(rule: str, h: np.ndarray, masked: np.ndarray, gamma: float) -> np.ndarray:
    """Acceptance for one row, written out plainly (float32 arithmetic as the jitted rule)."""
    idx = [i for i in range(len(h)) if masked[i]]
    acc = np.zeros(len(h), bool)
    if not idx:
        return acc
    if rule == "eb":
        order = sorted(idx, key=lambda i: (h[i], i))
        total = np.float32(0.0)
        for s, i in enumerate(order):
            if s == 0 or total <= np.float32(gamma):
                acc[i] = True
            else:
                break
            total = np.float32(total + h[i])
    else:
        best = min(idx, key=lambda i: (h[i], i))
        for i in idx:
            acc[i] = h[i] < np.float32(gamma) or i == best
    return acc


def _setup(cfg, prompt_ids, prompt_lengths, spec, options, gamma, temperature, key, row_max_new_tokens):
    """The checked request as the oracles use it: (spec, lengths, per-row caps, EOS set, pad id, row keys, gammas,
    temperatures, the scoring function, the token buffer [B, P + max_new + window] holding the prompts)."""
    spec = DecodeSpec.make(spec, **options)
    prompt_ids = np.asarray(prompt_ids, np.int32)
    lengths = np.asarray(prompt_lengths, np.int32)
    check_request(cfg, spec, prompt_ids.shape, prompt_lengths=lengths, gamma=gamma, temperature=temperature,
                  row_max_new_tokens=row_max_new_tokens)
    B, P = prompt_ids.shape
    cap = np.broadcast_to(np.asarray(spec.max_new_tokens if row_max_new_tokens is None else row_max_new_tokens), (B,))
    seq = np.full((B, P + spec.max_new_tokens + spec.window), spec.pad(cfg), np.int32)
    for b in range(B):
        seq[b, :lengths[b]] = prompt_ids[b, :lengths[b]]
    return (spec, lengths, cap, set(spec.stop_ids(cfg)), spec.pad(cfg),
            sampling.row_keys(jax.random.key(0) if key is None else key, B),
            np.broadcast_to(np.asarray(gamma, np.float32), (B,)),
            jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,)),
            functools.partial(_score, tempered=spec.tempered_entropy, top_k=spec.top_k, top_p=spec.top_p), seq)


def _held(need, done, spec, calls):
    """Rows that sit call `calls` out: those waiting for a commit while fewer than the quorum of running rows wait
    (float32, as the decoder compares; the first call never waits)."""
    quorum = np.float32(need.sum()) >= np.float32(spec.commit_quorum) * np.float32((~done).sum())
    return need if calls > 1 and not quorum else np.zeros_like(need)


def brute_force_generate(params: dict, cfg: ModelConfig, prompt_ids, prompt_lengths, spec: DecodeSpec | None = None,
                         *, gamma=0.35, temperature=0.0, key=None, row_max_new_tokens=None, **options
                         ) -> GenerateOutput:
    """Same arguments and outputs as `generate` (cache None, iterations = batch model calls)."""
    spec, lengths, cap, eos, pad, keys, gam, temp, score, seq = _setup(
        cfg, prompt_ids, prompt_lengths, spec, options, gamma, temperature, key, row_max_new_tokens)
    B, W = seq.shape
    mode, rule, max_new_tokens, k = spec.mode, spec.rule, spec.max_new_tokens, spec.window
    gen = np.zeros(B, np.int32)          # SBD: tokens before the current block; AR: tokens generated
    masked = np.zeros((B, k), bool)
    for b in range(B):
        masked[b] = np.arange(k) < cap[b]
    done = np.zeros(B, bool)
    stopped_eos = np.zeros(B, bool)
    n_gen = np.zeros(B, np.int32)
    nfe = np.zeros(B, np.int32)
    accepted = np.zeros((B, k + 1), np.int32)  # per row: calls that decoded 0..k tokens
    calls = 0
    wide = 0  # calls after which the cached decoder would carry a finished block (2k window)
    pending_commit = np.zeros(B, bool)
    block_calls: list[list[np.ndarray]] = [[] for _ in range(B)]  # SBD: positions each call of the block decoded
    cols = np.broadcast_to(np.arange(W, dtype=np.int32), (B, W))
    while not done.all():
        calls += 1
        held = _held(pending_commit & ~done, done, spec, calls)
        wide += int(calls > 1 and (pending_commit & ~done).any() and not held.any())
        pending_commit &= held
        clean_seg = (cols < (lengths + gen)[:, None]).astype(np.int32)
        if mode == "sbd":
            start = lengths + gen
            pos_c = start[:, None] + np.arange(k, dtype=np.int32)[None]
            ctok = np.where(masked, cfg.mask_token_id, np.take_along_axis(seq, pos_c, 1))
            cseg = ((gen[:, None] + np.arange(k)[None]) < cap[:, None]).astype(np.int32)
            tokens = np.concatenate([seq, ctok], 1)
            meta = concat_meta(clean_meta(clean_seg, cols), copy_meta(cseg, pos_c, np.repeat(start[:, None], k, 1)))
            logits = _forward(params, tokens, meta, cfg=cfg)[:, W:]
        else:
            meta = clean_meta(clean_seg, cols)
            last = lengths + gen - 1
            logits = jnp.take_along_axis(_forward(params, seq, meta, cfg=cfg), jnp.asarray(last)[:, None, None], 1)
        index = jnp.asarray(nfe) if mode == "sbd" else jnp.asarray(gen)[:, None]  # AR: keyed by token index
        h, drawn = score(logits, keys, index, temp, suppress=cfg.mask_token_id)
        h, drawn = np.asarray(h), np.asarray(drawn)
        for b in range(B):
            if done[b] or held[b]:
                continue
            nfe[b] += 1
            if mode == "ar":
                tok = int(drawn[b, 0])
                seq[b, lengths[b] + gen[b]] = tok
                gen[b] += 1
                accepted[b, 1] += 1
                if tok in eos or gen[b] == cap[b]:
                    done[b], stopped_eos[b], n_gen[b] = True, tok in eos, gen[b]
                continue
            acc = _accept_row(rule, h[b], masked[b], gam[b])
            for i in np.flatnonzero(acc):
                seq[b, lengths[b] + gen[b] + i] = drawn[b, i]
            masked[b] &= ~acc
            block_calls[b].append(np.flatnonzero(acc))
            n_valid = min(k, cap[b] - gen[b])
            stop_at = None
            for i in range(n_valid):  # first EOS with everything before it decoded
                if masked[b, i]:
                    break
                if int(seq[b, lengths[b] + gen[b] + i]) in eos:
                    stop_at = i
                    break
            if stop_at is not None or not masked[b].any():  # the block ends: each call counts what the output keeps
                last = n_valid if stop_at is None else stop_at + 1
                for decoded in block_calls[b]:
                    accepted[b, int(np.sum(decoded < last))] += 1
                block_calls[b] = []
            if stop_at is not None:
                done[b], stopped_eos[b], n_gen[b] = True, True, gen[b] + stop_at + 1
            elif not masked[b].any():
                if gen[b] + k >= cap[b]:
                    done[b], n_gen[b] = True, cap[b]
                else:
                    gen[b] += k
                    masked[b] = (gen[b] + np.arange(k)) < cap[b]
                    pending_commit[b] = True
    out = np.full((B, max_new_tokens), pad, np.int32)
    for b in range(B):
        out[b, :n_gen[b]] = seq[b, lengths[b]:lengths[b] + n_gen[b]]
    return GenerateOutput(jnp.asarray(out), jnp.asarray(n_gen), jnp.asarray(nfe), jnp.asarray(stopped_eos),
                          jnp.int32(calls), jnp.int32(wide), jnp.asarray(accepted), None, None)


EVENTS: set[str] = set()  # how rows of the last brute_force_verify call stopped (for tests to assert coverage)


def brute_force_verify(params: dict, cfg: ModelConfig, prompt_ids, prompt_lengths, spec: DecodeSpec | None = None,
                       *, gamma=0.35, temperature=0.0, key=None, row_max_new_tokens=None, draft_memory=None,
                       **options) -> GenerateOutput:
    """The verify-mode oracle (docs/sbd.md, "Lossless mode"), no cache: every call recomputes [the known text as CLEAN
    tokens (the prompt, the verified tokens and the drafts waiting to be checked) ; the current block as COPY
    tokens]. AR's token at generated index g comes from the clean query at g - 1. A w-wide call keeps the first
    w - 1 waiting drafts (drops the others) and checks them all (the agreeing prefix stays, AR's token corrects
    the first wrong one or opens the next block, whose other positions the copy queries draft at once); an AR call
    checks the next waiting draft only (or takes AR's token when none waits). Wide or AR per call: the spec's draft
    policy, re-implemented here (its rule written out per row and offset; its constants are policy.py's)."""
    spec, lengths, cap, eos, pad, keys, gam, temp, score, seq = _setup(
        cfg, prompt_ids, prompt_lengths, spec, options, gamma, temperature, key, row_max_new_tokens)
    B, W = seq.shape
    EVENTS.clear()
    k, max_new_tokens = spec.block_size, spec.max_new_tokens
    blk = np.zeros(B, np.int32)                                  # generated index of the current block
    todo = [(-1, 1)] * B                                         # (verified token, window length incl. drafts)
    done, stopped_eos = np.zeros(B, bool), np.zeros(B, bool)
    n_gen, nfe = np.zeros(B, np.int32), np.zeros(B, np.int32)
    accepted = np.zeros((B, k + 1), np.int32)
    proposed, agreed = np.zeros(B, np.int32), np.zeros(B, np.int32)
    J = k - 1                                                    # draft offsets 1 .. k - 1
    trials, hits = np.zeros((B, J), np.float32), np.zeros((B, J), np.float32)
    opened = np.zeros(B, np.int32)                               # the waiting drafts' block starts here
    start = DraftMemory.empty(J) if draft_memory is None else draft_memory
    pool = np.stack([np.asarray(start.trials, np.float32), np.asarray(start.hits, np.float32)])  # [2, J] all rows
    calls = wide_calls = 0
    since_wide = int(start.since_wide)
    costs_w = np.asarray(costs.call_costs(params, cfg, spec, B, prompt_ids.shape[1] + max_new_tokens), np.float32)
    cols = np.broadcast_to(np.arange(W, dtype=np.int32), (B, W))
    while not done.all():
        verified = np.array([n_gen[b] if done[b] else todo[b][0] + 1 for b in range(B)], np.float32)
        stops = np.float32(start.stops + np.sum(stopped_eos & done)) / np.float32(max(start.tokens + verified.sum(), 1.0))
        w = _width_choice(spec, calls, trials, hits, pool, done, since_wide, costs_w, stops,
                          np.maximum(cap - verified, 1))  # 0: AR
        calls += 1
        since_wide = 0 if w else since_wide + 1
        if calls > 1:
            wide_calls += w > 0
            for b in np.flatnonzero(~done):
                if w and todo[b][1] > w:                        # keep the drafts this call checks
                    proposed[b] -= todo[b][1] - w
                    todo[b], blk[b] = (todo[b][0], w), todo[b][0] + w
        known = np.array([lengths[b] + todo[b][0] + todo[b][1] for b in range(B)])
        pos_c = (lengths + blk)[:, None] + np.arange(k, dtype=np.int32)[None]
        cseg = ((blk[:, None] + np.arange(k)[None]) < np.minimum(cap, blk + max(w, 1))[:, None]).astype(np.int32)
        meta = concat_meta(clean_meta((cols < known[:, None]).astype(np.int32), cols),
                           copy_meta(cseg, pos_c, np.repeat((lengths + blk)[:, None], k, 1)))
        logits = _forward(params, np.concatenate([seq, np.full((B, k), cfg.mask_token_id, np.int32)], 1), meta,
                          cfg=cfg)
        ar_all = np.asarray(score(logits[:, :W], keys, jnp.asarray(cols - lengths[:, None] + 1), temp,
                                  suppress=cfg.mask_token_id)[1])            # AR's token at column + 1
        drawn = np.asarray(score(logits[:, W:], keys, jnp.asarray(pos_c - lengths[:, None]), temp,
                                 suppress=cfg.mask_token_id)[1])
        C = max(w, 1)                                           # clean queries this call: AR 1, a width w
        call_n, call_a = np.zeros(J, np.float32), np.zeros(J, np.float32)
        for b in range(B):
            if done[b]:
                continue
            nfe[b] += 1
            L = lengths[b]
            first, count = todo[b]
            checkable = min(C, count - 1)
            m = 0
            while m < checkable and seq[b, L + first + 1 + m] == ar_all[b, L + first + m]:
                m += 1
            agreed[b] += m
            stood = list(range(first + 1, first + m + 1))       # the drafts that stand (first itself stood before)
            hit = next((i for i in stood if int(seq[b, L + i]) in eos), None)
            if checkable:  # the policy's counts per draft offset: none past a standing EOS
                good, bad = (m, int(m < checkable)) if hit is None else (hit - first, 0)
                for i in range(good + bad):
                    o = first + i - opened[b]                   # the offset (1-based) of draft first + 1 + i, - 1
                    trials[b, o] = trials[b, o] * np.float32(policy.DECAY) + np.float32(1.0)
                    hits[b, o] = hits[b, o] * np.float32(policy.DECAY) + np.float32(i < good)
                    call_n[o] += 1
                    call_a[o] += i < good
            if hit is not None:
                EVENTS.add("eos_in_prefix")
            if m == checkable and C < count:                    # every checked draft stood; the others wait
                if hit is not None or first + m + 1 >= cap[b]:
                    done[b], stopped_eos[b] = True, hit is not None
                    n_gen[b] = hit + 1 if hit is not None else cap[b]
                else:
                    todo[b] = (first + m, count - m)
                accepted[b, min(m, k)] += 1
                continue
            g = first + m + 1                                   # AR's token goes here: correction or next block
            tok = int(ar_all[b, L + first + m])
            if hit is not None or g >= cap[b]:
                done[b], stopped_eos[b] = True, hit is not None
                n_gen[b] = hit + 1 if hit is not None else cap[b]
                accepted[b, min(n_gen[b] - first - 1, k)] += 1
                continue
            seq[b, L + g] = tok
            accepted[b, min(m + 1, k)] += 1
            if tok in eos:
                EVENTS.add("eos_as_correction" if m < count - 1 else "eos_as_next_first")
            if tok in eos or g + 1 >= cap[b]:
                done[b], stopped_eos[b], n_gen[b] = True, tok in eos, g + 1
                continue
            if not w:                                           # an AR call: nothing drafted
                todo[b], blk[b] = (g, 1), g + 1
                continue
            # AR's token opens the block at g; a wide call drafted its other positions from the text before g
            # (all drafts standing: this call's copy block; a correction: the copy block of that outcome)
            n = int(min(w, cap[b] - g))
            row = drawn[b] if m == count - 1 else _outcome_drafts(params, cfg, seq, b, L, g, k, n, score, keys, temp)
            seq[b, L + g + 1:L + g + n] = row[1:n]
            proposed[b] += n - 1
            opened[b] = g
            todo[b], blk[b] = (g, n), g + w
        seen = call_n > 0  # the counts over all rows, per offset checked this call: a new row's prior
        pool[0] = np.where(seen, pool[0] * np.float32(policy.POOL_DECAY), pool[0]) + call_n
        pool[1] = np.where(seen, pool[1] * np.float32(policy.POOL_DECAY), pool[1]) + call_a
    out = np.full((B, max_new_tokens), pad, np.int32)
    for b in range(B):
        out[b, :n_gen[b]] = seq[b, lengths[b]:lengths[b] + n_gen[b]]
    memory = DraftMemory(jnp.asarray(pool[1]), jnp.asarray(pool[0]), jnp.float32(start.stops + np.sum(stopped_eos)),
                         jnp.float32(start.tokens + np.sum(n_gen)), jnp.int32(since_wide))
    return GenerateOutput(jnp.asarray(out), jnp.asarray(n_gen), jnp.asarray(nfe), jnp.asarray(stopped_eos),
                          jnp.int32(calls), jnp.int32(wide_calls), jnp.asarray(accepted),
                          VerifyStats(jnp.asarray(proposed), jnp.asarray(agreed), memory), None)


def _outcome_drafts(params, cfg: ModelConfig, seq, b: int, L: int, g: int, k: int, n: int, score, keys, temp):
    """Row b's drafts for a block starting at generated index g from the text before it alone (no cache): [seq[b]'s
    columns before L + g CLEAN ; n masks COPY (the call's width, within the row's cap), padding to k], drawn by
    generated index as the decoder draws them -> [k] (entry 0, the block's first position, is AR's token's place:
    unused)."""
    W = seq.shape[1]
    cols = np.arange(W, dtype=np.int32)[None]
    pos_c = L + g + np.arange(k, dtype=np.int32)[None]
    meta = concat_meta(clean_meta((cols < L + g).astype(np.int32), cols),
                       copy_meta((np.arange(k) < n).astype(np.int32)[None], pos_c, np.full((1, k), L + g, np.int32)))
    logits = _forward(params, np.concatenate([seq[b:b + 1], np.full((1, k), cfg.mask_token_id, np.int32)], 1), meta,
                      cfg=cfg)
    return np.asarray(score(logits[:, W:], keys[b:b + 1], jnp.asarray(pos_c - L), temp[b:b + 1],
                            suppress=cfg.mask_token_id)[1])[0]


def _width_choice(spec: DecodeSpec, calls: int, trials, hits, pool, done, since_wide, costs_w, stops, left) -> int:
    """The draft policy's choice for the batch's call number `calls`: 0 (a 1-wide AR call) or a draft width
    (policy.py's rule, written out per row and offset; `costs_w`: the costs `generate` used, the spec's or the cost
    model's; `stops`: the chance a verified token is an EOS; `left`: each row's tokens before its cap)."""
    widths = spec.draft_widths
    if spec.draft_policy in ("always", "never"):
        return widths[0] if spec.draft_policy == "always" else 0
    if callable(spec.draft_policy):  # the tests' coin_policy (decoding_fixtures.py): the same coins
        i = int(jax.random.randint(jax.random.fold_in(jax.random.key(0), calls), (), 0, len(widths) + 1))
        return 0 if i == 0 else widths[i - 1]
    run = np.flatnonzero(~done)
    pooled, prev = np.zeros(len(pool[0]), np.float32), np.float32(1.0)
    for j in range(len(pooled)):  # each offset's prior: the rate of the one before it
        prev = pooled[j] = (pool[1][j] + np.float32(policy.POOL_PRIOR) * prev) / (pool[0][j] + np.float32(policy.POOL_PRIOR))
    prior = np.float32(policy.PRIOR)
    rates = [np.float32(policy.MARGIN)]
    for w, c in zip(widths, costs_w):
        taus = []
        for b in run:
            p = (hits[b] + prior * pooled) / (trials[b] + prior) * (np.float32(1.0) - stops)
            chain = np.cumprod(p[:w - 1], dtype=np.float32)
            taus.append(min(np.float32(1.0) + np.float32(chain.sum(dtype=np.float32)), np.float32(left[b])))
        rates.append(np.float32(sum(taus)) / np.float32(max(len(run), 1)) / c)
    best = int(np.argmax(rates))
    every = int(np.ceil(max(float(np.max(costs_w)) - 1.0, 0.0) / policy.EXPLORE_SHARE))
    if best == 0 and (since_wide >= every or pool[0].sum() == 0):
        best = 1 + int(np.argmax(rates[1:]))
    return 0 if best == 0 else widths[best - 1]
