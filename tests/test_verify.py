"""Verify mode (SBD.md "Lossless mode"): SBD drafts checked by the next call's clean queries against AR's
position-keyed tokens. Its output equals AR mode's for the same key (greedy and sampled), its NFE equals the
no-cache verifier's (brute.py), and on a model whose drafts are right it needs far fewer calls than AR. (A batched
row == its prompt decoded alone: tests/test_rows_alone.py; the final cache: tests/test_decoding.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import brute
from decoding_fixtures import CFG, LENGTHS, MAX_NEW, make_params, make_prompts, outputs
from sbd_jax.decoding import DecodeError, generate

B = len(LENGTHS)
CAPS = np.array([18, 7, 13, 1], np.int32)  # per-row max_new_tokens, not multiples of k (and a 1-token row)


@pytest.fixture(scope="module")
def eos(params, prompts):
    """A token AR emits often enough that rows stop on it (and some rows run to their cap)."""
    toks = np.asarray(generate(params, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=()).tokens)
    vals, counts = np.unique(toks[:, 2:], return_counts=True)
    return int(vals[np.argsort(-counts)][1])


def _ar(params, prompts, **kw):
    return generate(params, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, row_max_new_tokens=CAPS, **kw)


def _verify(params, prompts, k, gamma, rule, **kw):
    return generate(params, CFG, prompts, LENGTHS, mode="sbd", verify=True, block_size=k, rule=rule, gamma=gamma,
                    max_new_tokens=MAX_NEW, row_max_new_tokens=CAPS, **kw)


SAMPLING = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=5),
            dict(temperature=1.0, top_p=0.7)]


@pytest.mark.parametrize("how", SAMPLING, ids=["greedy", "t1", "topk", "topp"])
def test_verify_equals_ar_and_the_no_cache_verifier(params, prompts, eos, how):
    key = jax.random.key(3)
    ar = outputs(_ar(params, prompts, key=key, eos_ids=(eos,), **how))
    assert ar["stopped_by_eos"].any() and not ar["stopped_by_eos"].all()
    events = set()
    for k in (1, 4, 16):
        for rule, gamma in (("eb", 0.1), ("eb", 3.0), ("threshold", 1.0), ("eb", 100.0)):
            v = _verify(params, prompts, k, gamma, rule, key=key, eos_ids=(eos,), **how)
            got = outputs(v)
            for f in ("tokens", "lengths", "stopped_by_eos"):
                np.testing.assert_array_equal(got[f], ar[f], err_msg=f"verify k={k} {rule} {gamma}: {f} != AR's")
            ref = brute.brute_force_verify(params, CFG, prompts, LENGTHS, mode="sbd", verify=True, block_size=k,
                                           rule=rule, gamma=gamma, max_new_tokens=MAX_NEW, row_max_new_tokens=CAPS,
                                           key=key, eos_ids=(eos,), **how)
            for f, want in outputs(ref).items():
                np.testing.assert_array_equal(got[f], want, err_msg=f"verify k={k} {rule} {gamma}: {f} != brute")
            events |= brute.EVENTS
            # the histogram: one entry per verified block, drafts that stood
            assert got["accepted"][:, k:].sum() == 0 and (k == 1 or got["accepted"].sum() > 0)
    if how["temperature"] == 0.0:  # an EOS as AR's correction of a wrong draft happened in the grid
        assert "eos_as_correction" in events, events


def test_inside_a_user_jit(params, prompts):
    f = jax.jit(lambda p, x, t: generate(p, CFG, x, LENGTHS, mode="sbd", verify=True, block_size=4, gamma=t,
                                         max_new_tokens=MAX_NEW, eos_ids=()).tokens)
    want = generate(params, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=()).tokens
    np.testing.assert_array_equal(np.asarray(f(params, prompts, jnp.float32(2.0))), np.asarray(want))
    with pytest.raises(DecodeError, match="verify=True is a mode of SBD decoding"):
        generate(params, CFG, prompts, LENGTHS, mode="ar", verify=True)


def test_fewer_calls_than_ar_when_drafts_are_right():
    """A model whose every position predicts the same token (layers zeroed, one lm_head column aligned with every
    embedding): its drafts are all right, so a block of k costs ~1 call and verify mode needs ~max_new / k + 1
    calls where AR needs max_new, for the same tokens."""
    p = _bigram({})
    p["embed"][:, 0] = 5.0  # a component every embedding shares, which lm_head reads as token 17
    p["lm_head"][0, 17] = 10.0
    prompts = make_prompts()
    ar = generate(p, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=())
    v = generate(p, CFG, prompts, LENGTHS, mode="sbd", verify=True, block_size=4, gamma=0.5, max_new_tokens=MAX_NEW,
                 eos_ids=())
    np.testing.assert_array_equal(np.asarray(v.tokens), np.asarray(ar.tokens))
    assert (np.asarray(ar.tokens) == 17).all()
    assert (np.asarray(v.nfe) <= -(-MAX_NEW // 4) + 1).all() and (np.asarray(ar.nfe) == MAX_NEW).all()
    assert np.asarray(v.accepted)[:, 3].sum() >= B * (MAX_NEW // 4 - 1)  # whole blocks stood


def _bigram(rules: dict, std=0.01):
    """A model with zeroed layers (each position sees only its own token) whose lm_head maps token t to
    rules[t] (every other token: whatever the small random head says)."""
    p = jax.tree.map(np.asarray, make_params())
    p["layers"] = jax.tree.map(np.zeros_like, p["layers"])
    rng = np.random.default_rng(1)
    emb = rng.standard_normal(p["embed"].shape).astype(np.float32)
    head = std * rng.standard_normal(p["lm_head"].shape).astype(np.float32)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    for t, u in rules.items():
        head[:, u] += 4.0 * unit[t]
    return {**p, "embed": emb, "lm_head": head}


def test_eos_inside_an_accepted_prefix():
    """Drafts E E E after AR's first token Y, and AR's token after Y is E = EOS: the EOS stands inside the
    verified prefix and ends the row there (2 tokens, 2 calls, as AR), like the no-cache verifier."""
    Y, E, last = 9, 11, 5
    p = _bigram({last: Y, Y: E, CFG.mask_token_id: E})
    prompts = make_prompts().copy()
    prompts[np.arange(B), LENGTHS - 1] = last
    kw = dict(block_size=4, gamma=100.0, max_new_tokens=MAX_NEW, eos_ids=(E,))
    ar = outputs(generate(p, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=(E,)))
    v = outputs(generate(p, CFG, prompts, LENGTHS, mode="sbd", verify=True, **kw))
    ref = outputs(brute.brute_force_verify(p, CFG, prompts, LENGTHS, mode="sbd", verify=True, **kw))
    assert (ar["tokens"][:, :2] == [Y, E]).all() and (ar["lengths"] == 2).all() and ar["stopped_by_eos"].all()
    for f in ("tokens", "lengths", "stopped_by_eos"):
        np.testing.assert_array_equal(v[f], ar[f])
    for f in v:
        np.testing.assert_array_equal(v[f], ref[f])
    assert brute.EVENTS == {"eos_in_prefix"} and (v["nfe"] == 2).all()
