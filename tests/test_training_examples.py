"""SBD training examples: the doubled input, metadata, targets and loss weights against hand-built
arrays (docs/sbd.md, "Training"), and the PRNG-driven parts (eta per document, k per step)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.training.examples import (
    PackedBatch,
    build_ntp_example,
    build_sbd_example,
    make_example,
    response_start,
    sample_block_size,
    sample_masked,
)
from sbd_jax.training.spec import ExampleSpec

M = 99  # mask token id
DOC, RESP = ExampleSpec(M), ExampleSpec(M, block_align="response")


def _batch(rows):
    return PackedBatch(*(jnp.asarray(np.array(f), jnp.int32) for f in zip(*rows)))


# row 0: two text documents and one padding token; row 1: an SFT pair (prompt 3, response 2) + a text doc
ROW0 = ([10, 11, 12, 13, 14, 20, 21, 0], [1, 1, 1, 1, 1, 2, 2, 0], [0, 1, 2, 3, 4, 0, 1, 0], [1, 1, 1, 1, 1, 1, 1, 0])
ROW1 = ([30, 31, 32, 40, 41, 50, 51, 52], [1, 1, 1, 1, 1, 2, 2, 2], [0, 1, 2, 3, 4, 0, 1, 2], [0, 0, 0, 1, 1, 1, 1, 1])
MASKED = np.array([[0, 1, 0, 1, 1, 0, 1, 0],
                   [0, 0, 0, 1, 0, 0, 1, 1]], bool)


def test_hand_built_document_aligned():
    ex = build_sbd_example(_batch([ROW0, ROW1]), jnp.asarray(MASKED), jnp.int32(3), DOC)
    # row 0 with k = 3
    exp_tokens0 = [10, 11, 12, 13, 14, 20, 21, 0] + [10, M, 12, M, M, 20, M, 0]
    np.testing.assert_array_equal(ex.tokens[0], exp_tokens0)
    np.testing.assert_array_equal(ex.meta.segment[0], [1, 1, 1, 1, 1, 2, 2, 0] * 2)
    np.testing.assert_array_equal(ex.meta.position[0], [0, 1, 2, 3, 4, 0, 1, 0] * 2)  # duplicated positions
    np.testing.assert_array_equal(ex.meta.stream[0], [0] * 8 + [1] * 8)
    np.testing.assert_array_equal(ex.meta.block[0, 8:], [0, 0, 0, 3, 3, 0, 0, 0])  # blocks restart per document
    np.testing.assert_array_equal(ex.targets[0], [11, 12, 13, 14, 20, 21, 0, 0] + [10, 11, 12, 13, 14, 20, 21, 0])
    np.testing.assert_array_equal(ex.ntp_weight[0], [1, 1, 1, 1, 0, 1, 0, 0] + [0] * 8)
    np.testing.assert_array_equal(ex.matp_weight[0], [0] * 8 + [0, 1, 0, 1, 1, 0, 1, 0])
    # row 1: SFT, document-aligned blocks: the prompt's copy tokens stay (unmasked) in the copy stream
    np.testing.assert_array_equal(ex.tokens[1, 8:], [30, 31, 32, M, 41, 50, M, M])
    np.testing.assert_array_equal(ex.meta.segment[1, 8:], [1, 1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(ex.meta.block[1, 8:], [0, 0, 0, 3, 3, 0, 0, 0])
    np.testing.assert_array_equal(ex.ntp_weight[1, :8], [0, 0, 1, 1, 0, 1, 1, 0])  # response targets only
    np.testing.assert_array_equal(ex.matp_weight[1, 8:], [0, 0, 0, 1, 0, 0, 1, 1])


def test_hand_built_response_aligned_and_k2():
    ex = build_sbd_example(_batch([ROW0, ROW1]), jnp.asarray(MASKED), jnp.int32(2), RESP)
    # text documents: response start = 0, so k=2 blocks from the document start
    np.testing.assert_array_equal(ex.meta.block[0, 8:], [0, 0, 2, 2, 4, 0, 0, 0])
    np.testing.assert_array_equal(ex.meta.segment[0, 8:], [1, 1, 1, 1, 1, 2, 2, 0])
    # SFT document: blocks start at the response (position 3); prompt copies dropped (segment 0)
    np.testing.assert_array_equal(ex.meta.segment[1, 8:], [0, 0, 0, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(ex.meta.block[1, 8:], [3, 3, 3, 3, 3, 0, 0, 2])
    np.testing.assert_array_equal(ex.meta.segment[1, :8], [1, 1, 1, 1, 1, 2, 2, 2])  # clean half untouched
    np.testing.assert_array_equal(ex.matp_weight[1, 8:], [0, 0, 0, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(response_start(_batch([ROW0, ROW1])),
                                  [[0, 0, 0, 0, 0, 0, 0, 0], [3, 3, 3, 3, 3, 0, 0, 0]])


def test_ntp_only_example_is_the_clean_half():
    b = _batch([ROW0, ROW1])
    ntp = build_ntp_example(b)
    sbd = build_sbd_example(b, jnp.asarray(MASKED), jnp.int32(4), DOC)
    assert ntp.tokens.shape == (2, 8)
    for a, s in zip(ntp.meta, sbd.meta):
        np.testing.assert_array_equal(a, s[:, :8])
    np.testing.assert_array_equal(ntp.targets, sbd.targets[:, :8])
    np.testing.assert_array_equal(ntp.ntp_weight, sbd.ntp_weight[:, :8])
    assert float(jnp.sum(ntp.matp_weight)) == 0.0


def _sft_batch(B=64, L=64, n_prompt=10, split=40):
    """Rows of 2 documents: SFT (prompt n_prompt, response to `split`), then text to L-4, then padding."""
    tok = np.random.default_rng(0).integers(4, 90, (B, L))
    seg = np.zeros((B, L), int)
    seg[:, :split], seg[:, split:L - 4] = 1, 2
    pos = np.where(seg == 1, np.arange(L), np.arange(L) - split) * (seg > 0)
    lm = ((seg == 2) | ((seg == 1) & (pos >= n_prompt))).astype(int)
    return PackedBatch(*(jnp.asarray(a, jnp.int32) for a in (tok, seg, pos, lm)))


def test_masking_eta_per_document_prompt_and_padding_clean():
    b = _sft_batch()
    masked = np.asarray(jax.jit(sample_masked)(jax.random.PRNGKey(0), b))
    lm = np.asarray(b.loss_mask)
    assert not masked[lm == 0].any()  # prompt and padding never masked
    f1 = masked[:, 10:40].mean(1)  # per-document masking rate ~ its eta
    f2 = masked[:, 40:60].mean(1)
    assert 0.35 < np.concatenate([f1, f2]).mean() < 0.65  # E[eta] = 1/2
    assert np.std(f1) > 0.2 and f1.min() < 0.15 and f1.max() > 0.85  # eta ~ U[0,1] spreads the rates
    assert np.mean(np.abs(f1 - f2)) > 0.2  # a fresh eta per document (E|U1-U2| = 1/3), not one per row


def test_block_size_uniform_in_2_kmax_and_fixed():
    ks = np.asarray(jax.vmap(lambda k: sample_block_size(k, 16))(jax.random.split(jax.random.PRNGKey(1), 600)))
    assert ks.min() == 2 and ks.max() == 16 and set(ks.tolist()) == set(range(2, 17))
    counts = np.bincount(ks, minlength=17)[2:]
    assert counts.min() > 15  # ~40 each
    assert int(sample_block_size(jax.random.PRNGKey(0), 16, fixed=5)) == 5


def test_make_example_varies_k_without_recompiling():
    b = _sft_batch(B=4, L=32, split=20)
    f = jax.jit(lambda key, batch: make_example(key, batch, ExampleSpec(M, k_max=16)))
    seen = set()
    for i in range(12):
        ex, k = f(jax.random.PRNGKey(i), b)
        k = int(k)
        seen.add(k)
        pos = np.asarray(ex.meta.position[:, 32:])
        np.testing.assert_array_equal(np.asarray(ex.meta.block[:, 32:]), (pos // k) * k)
        # x_hat has <m> exactly where MATP counts tokens
        np.testing.assert_array_equal(np.asarray(ex.tokens[:, 32:]) == M, np.asarray(ex.matp_weight[:, 32:]) > 0)
    assert len(seen) >= 4
    assert f._cache_size() == 1


def test_make_example_requires_mask_token():
    with pytest.raises(ValueError, match="mask token"):
        make_example(jax.random.PRNGKey(0), _sft_batch(B=1, L=8, n_prompt=2, split=6), ExampleSpec())


def test_compact_copy_stream_hand_built():
    """copy_len C: each row's copy tokens (from every document's response start on) in row order in C slots,
    segment 0 after them; what does not fit C is cut off. The clean half is the same as without it."""
    b, masked = _batch([ROW0, ROW1]), jnp.asarray(MASKED)
    ex = build_sbd_example(b, masked, jnp.int32(3), ExampleSpec(M, block_align="response", copy_len=8))
    full = build_sbd_example(b, masked, jnp.int32(3), RESP)
    np.testing.assert_array_equal(ex.tokens[:, :8], full.tokens[:, :8])
    c = slice(8, 16)
    # row 0: two text documents (5 + 2 copy tokens), then one padding slot
    np.testing.assert_array_equal(ex.tokens[0, c], [10, M, 12, M, M, 20, M, M])
    np.testing.assert_array_equal(ex.meta.segment[0, c], [1, 1, 1, 1, 1, 2, 2, 0])
    np.testing.assert_array_equal(ex.meta.position[0, c], [0, 1, 2, 3, 4, 0, 1, 0])
    np.testing.assert_array_equal(ex.meta.block[0, 8:15], [0, 0, 0, 3, 3, 0, 0])
    np.testing.assert_array_equal(ex.targets[0, 8:15], [10, 11, 12, 13, 14, 20, 21])
    np.testing.assert_array_equal(ex.matp_weight[0, c], [0, 1, 0, 1, 1, 0, 1, 0])
    # row 1: the SFT response (positions 3-4, prompt dropped), the text document of 3, then padding
    np.testing.assert_array_equal(ex.tokens[1, 8:13], [M, 41, 50, M, M])
    np.testing.assert_array_equal(ex.meta.segment[1, c], [1, 1, 2, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(ex.meta.position[1, 8:13], [3, 4, 0, 1, 2])
    np.testing.assert_array_equal(ex.meta.block[1, 8:13], [3, 3, 0, 0, 0])
    np.testing.assert_array_equal(ex.matp_weight[1, c], [1, 0, 0, 1, 1, 0, 0, 0])
    # C = 6 cuts row 0's seventh copy token off; under jit with a traced k
    f = jax.jit(lambda k: build_sbd_example(b, masked, k, ExampleSpec(M, block_align="response", copy_len=6)))
    cut = f(jnp.int32(2))
    assert cut.tokens.shape == (2, 14)
    np.testing.assert_array_equal(cut.meta.segment[0, 8:], [1, 1, 1, 1, 1, 2])
    np.testing.assert_array_equal(cut.meta.block[0, 8:], [0, 0, 2, 2, 4, 0])
