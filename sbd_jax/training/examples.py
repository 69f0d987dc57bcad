"""SBD training examples (docs/sbd.md, "Training"): packed rows (`PackedBatch`, data.py) -> the doubled
input `[x ; x_hat]` (`Example`, T = 2L; L + copy_len with a compact copy stream; L for the NTP baseline)
with its mask metadata (`sbd_jax.attention.mask`), targets (clean i -> x_{i+1}, copy i -> x_i) and per-term
loss weights. Pure JAX, jittable, driven by a PRNG key.

Choices (docs/sbd.md, "Choices this project made"): eta ~ U[0,1) per *document*, each counted token masked with
probability eta (the prompt stays clean); one block size k per step, uniform on [2, k_max] or fixed, a
traced int32 (every k runs the same compiled step); blocks aligned to the document start (paper) or, with
`block_align="response"`, to the response start, and then the prompt's copy tokens leave the copy stream
(segment 0): never masked, no loss, and no such block exists at inference.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..attention.mask import TokenMeta, block_starts, clean_meta, concat_meta, copy_meta
from .spec import ExampleSpec


class PackedBatch(NamedTuple):
    """B packed rows of L tokens (int32 arrays [B, L]), several documents per row."""

    tokens: jnp.ndarray
    segment: jnp.ndarray  # 0 = padding, 1.. = document
    position: jnp.ndarray  # restarts at 0 in every document
    loss_mask: jnp.ndarray  # 1 = counted by the losses: a text document's every token, an SFT document's response


class Example(NamedTuple):
    tokens: jnp.ndarray  # [B, T] int32
    meta: TokenMeta  # [B, T]
    targets: jnp.ndarray  # [B, T] int32
    ntp_weight: jnp.ndarray  # [B, T] float32: the next token is in the same document and counted
    matp_weight: jnp.ndarray  # [B, T] float32: the copy token is masked
    # [B, T] int32: for a copy token, the clean token whose next-token prediction is its target (the one before it
    # in the clean half; -1: none, at a document's first token, on clean tokens and padding): the teacher of
    # `sbd.soft_targets`; None for NTP examples
    teacher: jnp.ndarray | None = None


def response_start(batch: PackedBatch):
    """[B, L] int32: for every token, the position of the first loss-counted token of its document
    (0 for text documents; the response start for SFT documents)."""
    big = jnp.int32(2 ** 30)
    cand = jnp.where((batch.loss_mask > 0) & (batch.segment > 0), batch.position, big).astype(jnp.int32)
    n_seg = batch.tokens.shape[1] + 1
    start = jax.vmap(lambda c, s: jax.ops.segment_min(c, s, n_seg)[s])(cand, batch.segment.astype(jnp.int32))
    return jnp.where(start == big, 0, start)


def sample_block_size(key, k_max: int, fixed: int | None = None):
    """One block size for the step: int32 scalar, uniform on [2, k_max] (or `fixed`)."""
    return jax.random.randint(key, (), 2, k_max + 1, dtype=jnp.int32) if fixed is None else jnp.int32(fixed)


def sample_masked(key, batch: PackedBatch, eta=(0.0, 1.0)):
    """bool [B, L]: which tokens of x_hat become `<m>`. eta ~ U[lo, hi) per document (the paper: [0, 1)), each
    counted token masked independently with probability eta; prompt and padding tokens never. hi == 1 == lo:
    every counted token."""
    B, L = batch.tokens.shape
    k_eta, k_tok = jax.random.split(key)
    eta_BS = jax.random.uniform(k_eta, (B, L + 1), minval=eta[0], maxval=eta[1])  # one eta per (row, segment id)
    eta_BL = jnp.take_along_axis(eta_BS, batch.segment.astype(jnp.int32), axis=1)
    u_BL = jax.random.uniform(k_tok, (B, L))
    return (u_BL < eta_BL) & (batch.loss_mask > 0) & (batch.segment > 0)  # eta = 1: u < 1 always


def build_sbd_example(batch: PackedBatch, masked_BL, k, spec: ExampleSpec) -> Example:
    """Deterministic part: the doubled input for given masked positions and block size k (traced ok).

    With `spec.copy_len=C` (static; response-aligned blocks) the copy half keeps only the tokens that belong
    to it (from each document's response start on), in row order, packed into C slots (segment 0 after
    them): [x ; x_hat] becomes L + C tokens with the same attention, targets and weights on every kept
    token. The packer guarantees they fit (data.py `copy_len`)."""
    if spec.mask_token_id is None:
        raise ValueError("SBD training needs a mask token id (model.mask_token_id)")
    M = jnp.int32(spec.mask_token_id)
    clean = build_ntp_example(batch)
    seg, pos, tok = clean.meta.segment, clean.meta.position, clean.tokens
    offset = response_start(batch) if spec.block_align == "response" else jnp.zeros_like(pos)
    copy_seg = jnp.where(pos >= offset, seg, 0)
    matp_w = (masked_BL & (copy_seg > 0)).astype(jnp.float32)
    starts = block_starts(pos, k, offset)
    if spec.position_decay is not None:
        matp_w = matp_w * jnp.float32(spec.position_decay) ** (pos - starts).astype(jnp.float32)
    if spec.offset0_weight != 1.0:
        matp_w = jnp.where(pos == starts, matp_w * jnp.float32(spec.offset0_weight), matp_w)
    teacher = jnp.where(pos > 0, jnp.arange(tok.shape[1], dtype=jnp.int32)[None] - 1, -1)  # none at a document's start
    copy = (copy_seg, jnp.where(masked_BL, M, tok), pos, starts, tok, matp_w, teacher)
    if spec.copy_len is not None:
        copy = _compact_copy_stream(copy, spec.copy_len, M)
    copy_seg, x_hat, c_pos, c_start, c_tgt, matp_w, c_teacher = copy
    cat = lambda a, b: jnp.concatenate([a, b], axis=1)
    return Example(cat(tok, x_hat), concat_meta(clean.meta, copy_meta(copy_seg, c_pos, c_start)),
                   cat(clean.targets, c_tgt), cat(clean.ntp_weight, jnp.zeros_like(matp_w)),
                   cat(clean.matp_weight, matp_w), cat(jnp.full_like(tok, -1), c_teacher))


def _compact_copy_stream(copy, C: int, mask_token_id):
    """The copy tokens of each row (copy segment > 0) gathered in row order into C slots, what does not fit
    cut off; the slots after them are padding (segment 0, `<m>`, weight 0). `copy`: (segment, x_hat,
    position, block start, target, matp weight, teacher index), each [B, L] -> the same [B, C]."""
    keep = copy[0] > 0
    src = jax.vmap(lambda r: jnp.nonzero(r, size=C, fill_value=0)[0])(keep)
    valid = jnp.arange(C) < jnp.sum(keep, axis=1, keepdims=True)
    pads = (0, mask_token_id, 0, 0, 0, 0.0, -1)
    return tuple(jnp.where(valid, jnp.take_along_axis(a, src, axis=1), pad) for a, pad in zip(copy, pads))


def build_ntp_example(batch: PackedBatch) -> Example:
    """The clean half alone (the NTP baseline, MATP weight 0): token i predicts x_{i+1} when i+1 is in the same
    (non-padding) document and is loss-counted."""
    nxt = lambda a: jnp.concatenate([a[:, 1:], jnp.zeros_like(a[:, :1])], axis=1)
    ntp_w = ((batch.segment > 0) & (nxt(batch.segment) == batch.segment) & (nxt(batch.loss_mask) > 0)).astype(jnp.float32)
    return Example(batch.tokens.astype(jnp.int32), clean_meta(batch.segment, batch.position.astype(jnp.int32)),
                   nxt(batch.tokens).astype(jnp.int32), ntp_w, jnp.zeros_like(ntp_w))


def make_example(key, batch: PackedBatch, spec: ExampleSpec):
    """PRNG-driven example for one step -> (Example, k int32 scalar). k is 0 for NTP-only."""
    if spec.ntp_only:
        return build_ntp_example(batch), jnp.int32(0)
    k_key, m_key = jax.random.split(key)
    k = sample_block_size(k_key, spec.k_max, spec.block_size)
    return build_sbd_example(batch, sample_masked(m_key, batch, spec.eta), k, spec), k
