"""SBD training examples (SBD.md, training section): packed rows -> the doubled input `[x ; x_hat]`
with its mask metadata, targets and per-term loss weights. Pure JAX, jittable, driven by a PRNG key.

Input: a `PackedBatch` of B rows of L tokens (see `data.py`), possibly several documents per row:
  tokens [B,L], segment [B,L] (0 = padding, 1.. = document), position [B,L] (restarts at 0 in every
  document), loss_mask [B,L] (1 = token counted by the losses: every token of a text document, the
  response tokens of an SFT document; 0 = prompt or padding).

Output (`Example`, T = 2L for SBD (L + copy_len with a compact copy stream), T = L for the NTP-only baseline):
  tokens [B,T]   clean half x, then x_hat (x with `<m>` at masked positions)
  meta           `TokenMeta` [B,T] built with the builders of `sbd_jax.attention.mask` (the one mask
                 definition): clean half = `clean_meta`, copy half = `copy_meta` with duplicated
                 positions and block starts `block_starts(position, k, offset)`.
  targets [B,T]  clean i -> x_{i+1}; copy i -> x_i
  ntp_weight     1 where the clean token's next token is in the same document and counted
  matp_weight    1 where the copy token is masked (only counted tokens are ever masked)

Choices (SBD.md marks these as ours):
  - eta ~ U[0,1) is drawn per *document* (a packed row holds several sequences; each document is a
    sequence in the paper's sense), then each counted token is masked with probability eta.
  - One block size k per step, drawn uniformly from [2, k_max] (or fixed). k is a traced int32, so
    every k runs the same compiled step.
  - Blocks are aligned to the document start (paper) or, for SFT with `block_align="response"`, to
    the response start (the first counted token); then the prompt's copy tokens are dropped from the
    copy stream (segment 0): they are never masked, carry no loss, and would otherwise form a block
    that does not exist at inference.
  - The prompt stays clean: only loss-counted tokens can be masked.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..attention.mask import TokenMeta, block_starts, clean_meta, concat_meta, copy_meta


class PackedBatch(NamedTuple):
    """B packed rows of L tokens (int32 arrays [B, L]); see the module docstring."""

    tokens: jnp.ndarray
    segment: jnp.ndarray
    position: jnp.ndarray
    loss_mask: jnp.ndarray


class Example(NamedTuple):
    tokens: jnp.ndarray  # [B, T] int32
    meta: TokenMeta  # [B, T]
    targets: jnp.ndarray  # [B, T] int32
    ntp_weight: jnp.ndarray  # [B, T] float32
    matp_weight: jnp.ndarray  # [B, T] float32


def ntp_targets(batch: PackedBatch):
    """Next-token targets and weights for the clean half: [B, L] int32, [B, L] float32.
    Token i predicts x_{i+1} when i+1 is in the same (non-padding) document and is loss-counted."""
    nxt = lambda a: jnp.concatenate([a[:, 1:], jnp.zeros_like(a[:, :1])], axis=1)
    seg_next = nxt(batch.segment)
    ok = (batch.segment > 0) & (seg_next == batch.segment) & (nxt(batch.loss_mask) > 0)
    return nxt(batch.tokens).astype(jnp.int32), ok.astype(jnp.float32)


def response_start(batch: PackedBatch):
    """[B, L] int32: for every token, the position of the first loss-counted token of its document
    (0 for text documents; the response start for SFT documents)."""
    L = batch.tokens.shape[1]
    big = jnp.int32(2 ** 30)
    cand = jnp.where((batch.loss_mask > 0) & (batch.segment > 0), batch.position, big)

    def row(seg, c):
        first = jnp.full((L + 1,), big, jnp.int32).at[seg].min(c)
        return first[seg]

    start = jax.vmap(row)(batch.segment.astype(jnp.int32), cand.astype(jnp.int32))
    return jnp.where(start == big, 0, start).astype(jnp.int32)


def sample_block_size(key, k_max: int, fixed: int | None = None):
    """One block size for the step: int32 scalar, uniform on [2, k_max] (or `fixed`)."""
    if fixed is not None:
        return jnp.int32(fixed)
    return jax.random.randint(key, (), 2, k_max + 1, dtype=jnp.int32)


def sample_masked(key, batch: PackedBatch):
    """bool [B, L]: which tokens of x_hat become `<m>`. eta ~ U[0,1) per document, each counted token
    masked independently with probability eta; prompt and padding tokens never."""
    B, L = batch.tokens.shape
    k_eta, k_tok = jax.random.split(key)
    eta_BS = jax.random.uniform(k_eta, (B, L + 1))  # one eta per (row, segment id)
    eta_BL = jnp.take_along_axis(eta_BS, batch.segment.astype(jnp.int32), axis=1)
    u_BL = jax.random.uniform(k_tok, (B, L))
    return (u_BL < eta_BL) & (batch.loss_mask > 0) & (batch.segment > 0)


def build_sbd_example(batch: PackedBatch, masked_BL, k, mask_token_id: int,
                      block_align: str = "document", copy_len: int | None = None,
                      block_fill: bool = False) -> Example:
    """Deterministic part: the doubled input for given masked positions and block size k (traced ok).

    `copy_len=C` (static; needs block_align="response"): the copy half keeps only the tokens that belong
    to it (from each document's response start on), in row order, packed into C slots (segment 0 after
    them): [x ; x_hat] becomes L + C tokens with the same attention, targets and weights on every kept
    token. The packer guarantees they fit (data.py `copy_len`).

    `block_fill` (needs `copy_len`): each document's last copy block is filled to k positions with uncounted
    `<m>` (positions continuing after its end, the document's segment), as every block is k wide at inference
    (a block holding the EOS has masks after it). Without it the last block is cut at the document's end,
    and its width gives the answer's end away. The fill takes copy slots (k - 1 at most per document, about
    k/2 on average; `data.copy_reserve` makes the packer leave room); what does not fit C is cut off."""
    if block_align not in ("document", "response"):
        raise ValueError(f"block_align must be 'document' or 'response', got {block_align!r}")
    if copy_len is not None and block_align != "response":
        raise ValueError("copy_len needs block_align='response' (otherwise prompts are part of the copy stream)")
    if block_fill and copy_len is None:
        raise ValueError("block_fill needs copy_len (the compact copy stream, where the fill has room)")
    seg = batch.segment.astype(jnp.int32)
    pos = batch.position.astype(jnp.int32)
    tok = batch.tokens.astype(jnp.int32)
    offset = response_start(batch) if block_align == "response" else jnp.zeros_like(pos)
    copy_seg = jnp.where(pos >= offset, seg, 0)
    x_hat = jnp.where(masked_BL, jnp.int32(mask_token_id), tok)
    matp_w = (masked_BL & (copy_seg > 0)).astype(jnp.float32)
    c_pos, c_start, c_tgt = pos, block_starts(pos, k, offset), tok
    if copy_len is not None:
        copy_seg, x_hat, c_pos, c_start, c_tgt, matp_w = _compact_copy_stream(
            copy_seg, x_hat, pos, tok, matp_w, k, copy_len, mask_token_id, block_fill)
    meta = concat_meta(clean_meta(seg, pos), copy_meta(copy_seg, c_pos, c_start))
    ntp_tgt, ntp_w = ntp_targets(batch)
    return Example(jnp.concatenate([tok, x_hat], axis=1), meta,
                   jnp.concatenate([ntp_tgt, c_tgt], axis=1),
                   jnp.concatenate([ntp_w, jnp.zeros_like(matp_w)], axis=1),
                   jnp.concatenate([jnp.zeros_like(ntp_w), matp_w], axis=1))


def _compact_copy_stream(copy_seg, x_hat, pos, tok, matp_w, k, C: int, mask_token_id: int, fill: bool):
    """The compact copy stream: each document's copy tokens in row order in C slots (segment 0 after them;
    what does not fit is cut off), with `fill` each document's last block filled to k wide with uncounted `<m>`
    (see `build_sbd_example`). Inputs [B, L] (copy_seg > 0 marks the copy tokens, contiguous per document,
    documents in increasing segment order); returns copy_seg, x_hat, position, block start, target, matp
    weight [B, C]."""
    L = copy_seg.shape[1]

    def row(cseg, xh, p, t, w):
        keep = cseg > 0
        n_S = jnp.zeros((L + 1,), jnp.int32).at[cseg].add(keep.astype(jnp.int32)).at[0].set(0)  # copy tokens
        first_S = jnp.full((L + 1,), L, jnp.int32).at[cseg].min(jnp.where(keep, jnp.arange(L), L))
        ext_S = n_S + jnp.where(fill & (n_S > 0), (k - n_S % k) % k, 0)  # slots: tokens (+ fill)
        end_S = jnp.cumsum(ext_S)
        slot = jnp.arange(C)
        d = jnp.minimum(jnp.searchsorted(end_S, slot, side="right"), L)  # the document slot s falls in
        valid = slot < end_S[-1]
        within = slot - (end_S[d] - ext_S[d])
        real = valid & (within < n_S[d])
        src = jnp.clip(first_S[d] + within, 0, L - 1)
        start_pos = p[jnp.minimum(first_S[d], L - 1)]  # the document's response start (its first copy token)
        c_pos = jnp.where(valid, start_pos + within, 0)
        return (jnp.where(valid, d, 0), jnp.where(real, xh[src], jnp.int32(mask_token_id)), c_pos,
                block_starts(c_pos, k, start_pos), jnp.where(real, t[src], 0), jnp.where(real, w[src], 0.0))

    return jax.vmap(row)(copy_seg, x_hat, pos, tok, matp_w)


def build_ntp_example(batch: PackedBatch) -> Example:
    """The NTP baseline: only the clean half (L tokens), MATP weight 0 (same loss code path)."""
    seg = batch.segment.astype(jnp.int32)
    ntp_tgt, ntp_w = ntp_targets(batch)
    return Example(batch.tokens.astype(jnp.int32), clean_meta(seg, batch.position), ntp_tgt, ntp_w,
                   jnp.zeros_like(ntp_w))


def make_example(key, batch: PackedBatch, *, mask_token_id: int | None, k_max: int = 16,
                 block_size: int | None = None, ntp_only: bool = False,
                 block_align: str = "document", copy_len: int | None = None, block_fill: bool = False):
    """PRNG-driven example for one step -> (Example, k int32 scalar). k is 0 for NTP-only."""
    if ntp_only:
        return build_ntp_example(batch), jnp.int32(0)
    if mask_token_id is None:
        raise ValueError("SBD training needs a mask token id (model.mask_token_id)")
    k_key, m_key = jax.random.split(key)
    k = sample_block_size(k_key, k_max, block_size)
    return build_sbd_example(batch, sample_masked(m_key, batch), k, mask_token_id, block_align, copy_len,
                             block_fill), k
