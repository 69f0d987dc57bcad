"""The SBD dual loss: NTP cross-entropy on the clean half + MATP cross-entropy on the masked copy positions,
each a mean over its own counted tokens, summed (docs/sbd.md, Training, rule 8: the paper's eq. 14 with per-token
means); the NTP baseline is the same function with MATP weights 0. With `chunk > 0` (by default when the logits
are large), lm_head + CE run over time chunks in a rematerialised scan, so the [B, T, V] float32 logits never
exist at once."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..models.config import ModelConfig
from ..models.transformer import forward, lm_head
from .examples import Example


class LossSums(NamedTuple):
    ntp_sum: jnp.ndarray  # sum over counted clean tokens of CE
    matp_sum: jnp.ndarray  # sum over masked copy tokens of CE
    ntp_count: jnp.ndarray
    matp_count: jnp.ndarray


def _weighted_ce(params, cfg: ModelConfig, h_BTD, targets_BT, w_ntp_BT, w_matp_BT, teacher_BTD=None, soft_BT=None):
    """The two weighted CE sums; with `teacher_BTD` (hidden states, no gradient) each target is (1 - s) x the
    token + s x the teacher's softmax, s = soft_BT: CE = lse - (1 - s) * logit[target] - s * sum_v p_v logit_v."""
    logits = lm_head(params, cfg, h_BTD).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    if teacher_BTD is not None:
        p = jax.lax.stop_gradient(jax.nn.softmax(lm_head(params, cfg, teacher_BTD).astype(jnp.float32), axis=-1))
        tgt = (1.0 - soft_BT) * tgt + soft_BT * jnp.einsum("btv,btv->bt", p, logits)
    return jnp.sum((lse - tgt) * w_ntp_BT), jnp.sum((lse - tgt) * w_matp_BT)


def auto_chunk(vocab_size: int, T: int) -> int:
    """The default loss chunk: 1024 tokens once a row's float32 logits pass 256 MiB (Llama-3's vocabulary at
    T > 512), else 0 (one piece)."""
    return 1024 if T * vocab_size > 2 ** 26 else 0


def loss_sums(params, cfg: ModelConfig, ex: Example, *, chunk: int | None = None,
              clean_prefix: int | None = None, shards: int = 1, copy_only: bool = False,
              soft_targets: float = 0.0) -> LossSums:
    """Run the model on `ex.tokens` under `ex.meta` and sum the two CE terms (float32). `chunk`: tokens per
    lm_head + CE piece (0: one piece; None: `auto_chunk`). `clean_prefix=L`: the example is the SBD layout
    `[x ; x_hat]` with an L-token clean half that attends only itself (see `forward(clean_prefix)`).
    `shards`: the sequence is split into this many contiguous shards (the context axis); each loss piece then
    takes `chunk` tokens of every shard, so no piece needs another shard's hidden states. `copy_only` (with
    `clean_prefix`; the NTP weights all zero, as for a copy-only adapter): the lm_head and CE run on the copy half
    only. `soft_targets` > 0 (copy_only, one shard): each copy token's target mixes in the clean stream's
    next-token distribution at its position (`ex.teacher`; sbd.soft_targets)."""
    h, _ = forward(params, cfg, ex.tokens, ex.meta, return_hidden=True, clean_prefix=clean_prefix)
    teacher = None
    if soft_targets:
        if not (copy_only and clean_prefix is not None and shards == 1 and ex.teacher is not None):
            raise ValueError("soft targets need a copy-only SBD example (clean_prefix, one shard, ex.teacher)")
        index = ex.teacher[:, clean_prefix:]
        h_t = jnp.take_along_axis(h[:, :clean_prefix], jnp.maximum(index, 0)[..., None], axis=1)
        teacher = (jax.lax.stop_gradient(h_t), jnp.where(index >= 0, jnp.float32(soft_targets), 0.0))
    if copy_only and clean_prefix is not None:  # the clean half's CE has weight 0: no lm_head for its L tokens
        h = h[:, clean_prefix:]  # (every MATP weight lies in the copy half, every NTP weight is 0: the same sums)
        ex = ex._replace(**{f: getattr(ex, f)[:, clean_prefix:] for f in ("targets", "ntp_weight", "matp_weight")})
    return _sums_of_hidden(params, cfg, h, ex, chunk, shards, teacher)


def _sums_of_hidden(params, cfg: ModelConfig, h, ex: Example, chunk: int | None, shards: int,
                    teacher=None) -> LossSums:
    """The two CE sums of hidden states `h` [B, T, D] against `ex`'s targets and weights (loss_sums' second half);
    `teacher`: (hidden states [B, T, D], soft weights [B, T]) of the soft targets, aligned with `h`."""

    B, T = h.shape[:2]
    if T % shards:
        raise ValueError(f"a row of {T} tokens does not split into {shards} context shards")
    chunk = auto_chunk(cfg.vocab_size, T // shards) if chunk is None else chunk
    if chunk <= 0 or chunk >= T // shards:
        ntp, matp = _weighted_ce(params, cfg, h, ex.targets, ex.ntp_weight, ex.matp_weight, *(teacher or ()))
    else:
        n = -(-(T // shards) // chunk)
        pad = n * chunk - T // shards

        def split(a):  # [B, T, ...] -> [n, B, shards * chunk, ...] (piece j: chunk j of each shard), weight 0 on padding
            rest = a.shape[2:]
            a = jnp.pad(a.reshape(B, shards, T // shards, *rest), [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * len(rest))
            return jnp.moveaxis(a.reshape(B, shards, n, chunk, *rest), 2, 0).reshape(n, B, shards * chunk, *rest)

        @jax.checkpoint
        def body(carry, xs):
            a, b = _weighted_ce(params, cfg, *xs)
            return (carry[0] + a, carry[1] + b), None

        zero = jnp.zeros((), jnp.float32)
        xs = (split(h), split(ex.targets), split(ex.ntp_weight), split(ex.matp_weight))
        (ntp, matp), _ = jax.lax.scan(body, (zero, zero), xs + tuple(map(split, teacher or ())))
    return LossSums(ntp, matp, jnp.sum(ex.ntp_weight), jnp.sum(ex.matp_weight))


def combine(sums: LossSums, ntp_total=None, matp_total=None):
    """Scalar loss = NTP mean + MATP mean. `*_total` = the token counts of the whole (global) batch,
    when `sums` covers only a microbatch (gradient accumulation); default = this batch's counts.
    A term with no counted token contributes 0."""
    nt = sums.ntp_count if ntp_total is None else ntp_total
    mt = sums.matp_count if matp_total is None else matp_total
    return sums.ntp_sum / jnp.maximum(nt, 1.0) + sums.matp_sum / jnp.maximum(mt, 1.0)


def sbd_loss(params, cfg: ModelConfig, ex: Example, *, chunk: int | None = None):
    """-> (loss, metrics dict with loss, ntp_loss, matp_loss, ntp_tokens, matp_tokens)."""
    m = metrics_from_sums(loss_sums(params, cfg, ex, chunk=chunk))
    return m["loss"], m


def metrics_from_sums(s: LossSums) -> dict:
    ntp = s.ntp_sum / jnp.maximum(s.ntp_count, 1.0)
    matp = s.matp_sum / jnp.maximum(s.matp_count, 1.0)
    return {"loss": ntp + matp, "ntp_loss": ntp, "matp_loss": matp,
            "ntp_tokens": s.ntp_count, "matp_tokens": s.matp_count}
