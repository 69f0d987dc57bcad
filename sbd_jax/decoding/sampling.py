"""Per-position entropies, the two SBD acceptance rules and token sampling (pure, jittable; B = batch rows,
K = block positions, V = vocabulary).

Entropies (docs/sbd.md, Inference step 3): H_i is the entropy of the model's own distribution q_i = softmax(logits_i),
at temperature 1 whatever the sampling temperature. With `tempered_entropy=True` and T > 0, H is computed on
softmax(logits / T) instead (the EB paper's / diffusers' convention); greedy rows (T == 0) always use
temperature 1, because a one-hot tempered distribution has zero entropy and would accept every position.

Acceptance rules (docs/sbd.md, Inference step 4), both applied to the still-masked positions only:
  "eb"        sort by H ascending, i_1, i_2, ...; accept i_1..i_s for the largest s >= 1 with
              H_{i_1} + ... + H_{i_{s-1}} <= gamma (the last accepted entropy is not counted).
  "threshold" accept every position with H_i < gamma, and at least the one of lowest entropy.
Ties in H are broken by position (stable sort / first argmin), so the rule is deterministic.

Sampling: temperature, then top-k, then top-p (HF's order) shape the distribution p_i used to draw the token;
temperature 0 means argmax of the raw logits. SBD row b at its n-th model call draws from `fold_in(key_b, n)`;
AR mode and verify mode draw the token at generated index j from `fold_in(key_b, j)` (docs/sbd.md, "Lossless mode"
step 3: the same key gives the same tokens in AR and verify mode). A row's output does not depend on its batch
(given per-row keys), and the cached and brute-force decoders draw identically.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

def entropy(logits_BKV, temperature_B=None, *, tempered: bool = False):
    """Entropy (nats, float32) of softmax(logits) per position -> [B, K]. With `tempered`, rows with
    temperature > 0 use softmax(logits / T)."""
    logits = logits_BKV.astype(jnp.float32)
    if tempered:
        if temperature_B is None:
            raise ValueError("tempered entropy needs the temperature")
        t = jnp.asarray(temperature_B, jnp.float32)[:, None, None]
        logits = logits / jnp.where(t > 0, t, 1.0)
    # H = log Z - sum(e * (x - m)) / Z with e = exp(x - m): one exp pass over V (not log_softmax + exp)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(shifted)
    z = jnp.sum(e, axis=-1)
    h = jnp.log(z) - jnp.sum(e * shifted, axis=-1) / z
    return jnp.maximum(h, 0.0)  # rounding can make a one-hot entropy -0.0 / -1e-9


def argmax(x):
    """First index of the maximum over the last axis (== jnp.argmax without NaNs). Written as two
    plain reductions: XLA:CPU's variadic (value, index) argmax reduction is ~5x slower, and it runs
    over [B, k, V] at every decoding step."""
    m = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1).astype(jnp.int32)


def accept_eb(h_BK, masked_BK, gamma_B):
    """EB rule: bool [B, K] of accepted positions (a subset of `masked`, non-empty when any is masked)."""
    inf = jnp.float32(jnp.inf)
    h = jnp.where(masked_BK, h_BK, inf)
    order = jnp.argsort(h, axis=-1, stable=True)  # masked first, ascending entropy
    h_sorted = jnp.take_along_axis(h, order, axis=-1)
    masked_sorted = jnp.take_along_axis(masked_BK, order, axis=-1)
    finite = jnp.where(masked_sorted, h_sorted, 0.0)
    csum = jnp.cumsum(finite, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(csum[:, :1]), csum[:, :-1]], axis=-1)  # ranked strictly before
    ok_sorted = masked_sorted & (before <= jnp.asarray(gamma_B, jnp.float32)[:, None])
    ok_sorted = ok_sorted.at[:, 0].set(masked_sorted[:, 0])  # s >= 1 even if gamma is tiny
    inv = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(ok_sorted, inv, axis=-1)


def accept_threshold(h_BK, masked_BK, gamma_B):
    """Threshold rule: H < gamma among masked positions, plus the lowest-entropy masked one."""
    h = jnp.where(masked_BK, h_BK, jnp.inf)
    best = jnp.argmin(h, axis=-1)
    K = h_BK.shape[-1]
    is_best = (jnp.arange(K)[None, :] == best[:, None]) & jnp.any(masked_BK, axis=-1, keepdims=True)
    return masked_BK & ((h < jnp.asarray(gamma_B, jnp.float32)[:, None]) | is_best)


def accept(rule, h_BK, masked_BK, gamma_B):
    """Apply `rule`: "eb" or "threshold", or its index in `spec.RULES`, which may be traced (both rules are then
    computed, O(K log K) per row, and one is selected)."""
    if isinstance(rule, str):
        return (accept_eb if rule == "eb" else accept_threshold)(h_BK, masked_BK, gamma_B)
    return jnp.where(jnp.asarray(rule) == 0, accept_eb(h_BK, masked_BK, gamma_B),
                     accept_threshold(h_BK, masked_BK, gamma_B))


def shape_logits(logits_BKV, temperature_B, *, top_k: int = 0, top_p: float = 1.0):
    """Sampling logits: divide by temperature (rows with T == 0 keep raw logits, they take the argmax
    anyway), keep the top_k largest (0 = all; ties at the k-th value are kept), then the smallest set
    whose probability reaches top_p (1.0 = all; the most likely token is always kept)."""
    logits = logits_BKV.astype(jnp.float32)
    t = jnp.asarray(temperature_B, jnp.float32)[:, None, None]
    logits = logits / jnp.where(t > 0, t, 1.0)
    V = logits.shape[-1]
    if top_k and top_k < V:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly more likely than this one
        keep_sorted = before < top_p
        # smallest kept logit value = cut-off (ties at the cut-off are kept)
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def row_keys(key, batch: int):
    """Normalise `key` to one typed PRNG key per row: a single key (typed or raw uint32[2]) is split
    into `batch` keys; a batch of keys (typed [B] or raw [B, 2]) is used as is."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape == (2,) or key.ndim == 2 and key.shape[-1] == 2:
            key = jax.random.wrap_key_data(key.astype(jnp.uint32))
        else:
            raise ValueError(f"key must be a PRNG key, a raw uint32[2] key or a batch of them, got shape {key.shape}")
    if key.shape == ():
        return jax.random.split(key, batch)
    if key.shape != (batch,):
        raise ValueError(f"per-row keys must have shape ({batch},), got {key.shape}")
    return key


NONFINITE = -1  # the token of a position whose logits are not finite (row_result names it as an error)


def sample(logits_BKV, keys_B, index, temperature_B, *, top_k: int = 0, top_p: float = 1.0, suppress=None):
    """Token per position [B, K] (int32): argmax for rows with temperature 0, else a Gumbel-max draw from the
    shaped distribution. `index` [B]: row b draws all K positions from fold_in(keys_B[b], index[b]) (SBD: its
    call count); `index` [B, K]: each position from fold_in(keys_B[b], index[b, k]) alone (its generated-token
    index), so a token is a pure function of (logits, key, position) whatever window it was computed in: how
    AR mode draws and how verify mode checks drafts. `suppress`: a token id never drawn (the SBD mask token).
    A position whose logits are not finite (a NaN, +inf, or no finite value: NaN/overflowing weights) gets
    NONFINITE, an id no vocabulary has, instead of a token chosen from garbage."""
    if suppress is not None:  # a select (fuses into the reductions), not a scatter (copies the logits)
        logits_BKV = jnp.asarray(logits_BKV)
        vocab = jax.lax.broadcasted_iota(jnp.int32, logits_BKV.shape, logits_BKV.ndim - 1)
        logits_BKV = jnp.where(vocab == suppress, -jnp.inf, logits_BKV)
    greedy = argmax(logits_BKV)
    top = jnp.max(logits_BKV, axis=-1)  # NaN-propagating; the same reduction as argmax's (XLA computes it once)
    t = jnp.asarray(temperature_B, jnp.float32)
    index = jnp.asarray(index, jnp.int32)

    def drawn(_):
        shaped = shape_logits(logits_BKV, t, top_k=top_k, top_p=top_p)
        if index.ndim == 1:
            step_keys = jax.vmap(jax.random.fold_in)(keys_B, index)
            g = jax.vmap(lambda k: jax.random.gumbel(k, shaped.shape[1:], jnp.float32))(step_keys)
        else:
            pos_keys = jax.vmap(lambda k, i: jax.vmap(lambda n: jax.random.fold_in(k, n))(i))(keys_B, index)
            g = jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, shaped.shape[-1:], jnp.float32)))(pos_keys)
        # Gumbel-max, as jax.random.categorical, with the fast argmax
        tok = argmax(jnp.where(jnp.isneginf(shaped), -jnp.inf, shaped + g))
        return jnp.where(t[:, None] > 0, tok, greedy)

    # all-greedy batches skip the shaping (a sort over V for top-p) and the draw entirely
    tok = jax.lax.cond(jnp.any(t > 0), drawn, lambda _: greedy, None)
    return jnp.where(jnp.isfinite(top), tok, NONFINITE)
