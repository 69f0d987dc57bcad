"""The one SBD mask definition vs a hand-written, loop-based dense reference (docs/sbd.md, Training, rule 4, written
independently from scratch: per-document positions, blocks aligned to the document start)."""
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.attention import TokenMeta, clean_meta, concat_meta, copy_meta, dense_mask, reference_attention
from layouts import training_meta


def doubled_layout(doc_lengths, pad, k):
    """Metadata of one packed training row [x ; x_hat] built with the library's builders."""
    return training_meta([doc_lengths], sum(doc_lengths) + pad, k)


def brute_mask(doc_lengths, pad, k):
    """Loop reference: token t of the 2L row is (half, doc, pos)."""
    toks = []
    for half in ("clean", "copy"):
        for d, n in enumerate(doc_lengths, start=1):
            toks += [(half, d, p) for p in range(n)]
        toks += [(half, 0, 0)] * pad
    M = np.zeros((len(toks), len(toks)), bool)
    for i, (hq, dq, pq) in enumerate(toks):
        for j, (hk, dk, pk) in enumerate(toks):
            if dq == 0 or dk == 0 or dq != dk:
                continue
            if hq == "clean":
                M[i, j] = hk == "clean" and pk <= pq
            else:
                bq, bk = pq // k, pk // k
                M[i, j] = (hk == "clean" and bk < bq) or (hk == "copy" and bk == bq)
    return M


@pytest.mark.parametrize("docs,pad,k", [
    ([11], 0, 4),          # L not a multiple of k
    ([7, 5, 9], 0, 3),     # packed segments, each restarting positions and blocks
    ([6, 4], 5, 4),        # padding at the end
    ([13], 3, 1),          # k = 1: copy token sees the strict clean prefix and itself
    ([5, 8], 2, 16),       # k larger than every document: one block per document
])
def test_training_mask_matches_brute_force(docs, pad, k):
    meta = doubled_layout(docs, pad, k)
    np.testing.assert_array_equal(np.asarray(dense_mask(meta, meta))[0], brute_mask(docs, pad, k))


def test_first_copy_block_sees_no_clean_context():
    meta = doubled_layout([8], 0, 4)
    m = np.asarray(dense_mask(meta, meta))[0]
    assert not m[8:12, :8].any()          # copy block 0 -> nothing clean
    assert m[12:16, :4].all() and not m[12:16, 4:8].any()  # copy block 1 -> clean block 0 only
    assert m[8:12, 8:12].all()            # bidirectional inside the block


def test_decode_window_mask_uses_block_starts_not_positions():
    """Inference: a prompt of 5 tokens, block of k=4 opened right after it (block start 5, not 4)."""
    cache = clean_meta(np.ones((1, 5)), np.arange(5)[None])
    window = copy_meta(np.ones((1, 4)), np.arange(5, 9)[None], np.full((1, 4), 5))
    kv = concat_meta(cache, window)
    m = np.asarray(dense_mask(window, kv))[0]
    assert m.all()  # every copy token sees the whole prompt and the whole block


def test_reference_attention_matches_float64_numpy():
    rng = np.random.default_rng(0)
    B, T, H, K, D = 2, 13, 4, 2, 8
    q, k, v = (rng.standard_normal((B, T, n, D)).astype(np.float32) for n in (H, K, K))
    meta = doubled_layout([4, 2], 0, 2)  # T = 2 * 6 = 12 -> pad one more clean-padding token
    meta = TokenMeta(*(jnp.concatenate([jnp.broadcast_to(f, (B, 12)), jnp.zeros((B, 1), jnp.int32)], 1)
                       for f in meta))
    out = np.asarray(reference_attention(q, k, v, meta, meta))
    mask = np.asarray(dense_mask(meta, meta))
    ref = np.zeros((B, T, H, D))
    for b in range(B):
        for h in range(H):
            s = q[b, :, h].astype(np.float64) @ k[b, :, h // (H // K)].T.astype(np.float64) / np.sqrt(D)
            for t in range(T):
                if mask[b, t].any():
                    w = np.exp(s[t][mask[b, t]] - s[t][mask[b, t]].max())
                    ref[b, t, h] = (w / w.sum()) @ v[b, mask[b, t], h // (H // K)]
    assert np.abs(out - ref).max() < 1e-5
    assert np.all(out[:, -1] == 0)  # the padding query attends nothing
