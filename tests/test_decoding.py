"""SBD / AR decoding: cached decoder == brute-force decoder, exact KV cache, ragged batches,
EOS, block size 1, use inside a user's jit, HF greedy parity. (Bad input: tests/test_decoding_errors.py.)

The model is random but initialised with std 0.5, so its distributions are sharp enough that
entropies differ between positions and acceptance is non-trivial (1 < tokens/forward < k, asserted).
Every test uses the same static configuration (`BASE`, tests/decoding_fixtures.py, which the other decoding
test modules share) so that one compiled decoder serves most of them. A row of a batch equals its prompt
decoded alone: tests/test_rows_alone.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sbd_jax
from sbd_jax.decoding import generate
from brute import brute_force_generate
from decoding_fixtures import BASE, CFG, K, LENGTHS, MAX_NEW, B, P, assert_same, outputs, pick_eos
from sbd_jax.models import causal_meta, init_cache

KV_TOL = 1e-5  # relative to max|K/V|: float32 K/V written by windows vs one causal forward (other shapes)


@pytest.fixture(scope="module")
def eos_id(params, prompts):
    return pick_eos(generate(params, CFG, prompts, LENGTHS, gamma=2.0, eos_ids=(), **BASE).tokens)


# ------------------------------------------------------------------------------------------------


def test_cached_equals_brute_force(params, prompts, eos_id):
    """Identical tokens, lengths, NFE and EOS flags for both rules, several gammas and seeds, greedy
    and sampled (fixed key), with and without EOS; and the runs exercise multi-token steps."""
    cases = []
    for rule, gammas in (("eb", (0.5, 2.0, 4.0)), ("threshold", (1.5, 2.5))):
        for gamma in gammas:
            cases.append({"rule": rule, "gamma": gamma, "temperature": 0.0, "seed": 0, "eos_ids": (eos_id,)})
            for seed in (0, 1):  # without EOS: the EB rule's (the eos_id fixture's decoder); threshold: with it
                cases.append({"rule": rule, "gamma": gamma, "temperature": 1.0, "seed": seed,
                              "eos_ids": () if rule == "eb" else (eos_id,)})
    cases.append({"rule": "eb", "gamma": np.array([0.0, 1.0, 2.5, 6.0], np.float32), "temperature": 0.7,
                  "seed": 3, "eos_ids": (eos_id,)})  # per-row gamma
    for quorum in (0.0, 1.0):  # commit whenever a row needs one / only when every running row does
        cases.append({"rule": "eb", "gamma": np.array([0.0, 1.0, 2.5, 6.0], np.float32), "temperature": 0.7,
                      "seed": 3, "eos_ids": (eos_id,), "commit_quorum": quorum})
    tpf = {"eb": [], "threshold": []}
    eos_stops = 0
    sampled_vs_greedy = []
    held_calls = []  # per case: batch calls beyond the busiest row's (rows waited for a commit quorum)
    plain = None
    for c in cases:
        kw = dict(c)
        key = jax.random.key(kw.pop("seed"))
        ours = generate(params, CFG, prompts, LENGTHS, key=key, **kw, **BASE)
        ref = brute_force_generate(params, CFG, prompts, LENGTHS, key=key, max_new_tokens=MAX_NEW,
                                   block_size=K, pad_id=0, **kw)
        assert_same(ours, ref, f"case {c}")
        assert int(ours.iterations) == int(ref.iterations) >= int(np.max(ours.nfe))
        assert int(ours.wide_steps) == int(ref.wide_steps)
        if c.get("commit_quorum") == 0.0:  # no row ever waits
            assert int(ours.iterations) == int(np.max(ours.nfe)), c
        held_calls.append(int(ours.iterations) - int(np.max(ours.nfe)))
        if "commit_quorum" in c:  # the rows of the same case at the previous quorum (the default 0.5, then 0)
            assert_same(ours, plain, f"case {c}: waiting changed the rows")
        plain = ours
        o = outputs(ours)
        tpf[c["rule"]].append(o["lengths"].sum() / o["nfe"].sum())
        eos_stops += int(o["stopped_by_eos"].sum())
        if c["temperature"] == 1.0 and c["seed"] == 0:
            sampled_vs_greedy.append(o["tokens"])
    for rule, v in tpf.items():
        mean = float(np.mean(v))
        assert 1.0 < mean < K, f"{rule}: mean tokens/forward {mean} does not exercise multi-token steps"
        assert max(v) > 1.5, f"{rule}: no case accepted much ({v})"
    assert eos_stops >= 2, "EOS never stopped a row: the EOS path is not exercised"
    assert max(held_calls) > 0, "no row ever waited for a commit quorum: the waiting path is not exercised"
    greedy = outputs(generate(params, CFG, prompts, LENGTHS, gamma=0.5, eos_ids=(), **BASE))["tokens"]
    assert not np.array_equal(sampled_vs_greedy[0], greedy), "sampling had no effect"


def test_gamma_controls_speed(params, prompts):
    """Larger gamma -> fewer forwards (monotone here), and gamma 0 with the EB rule is one token
    per forward (only the lowest-entropy position is accepted)."""
    nfe = [int(np.asarray(generate(params, CFG, prompts, LENGTHS, gamma=g, eos_ids=(), **BASE).nfe).sum())
           for g in (0.0, 1.0, 3.0, 100.0)]
    assert nfe[0] == B * MAX_NEW
    assert nfe == sorted(nfe, reverse=True) and nfe[-1] < nfe[0]
    # gamma = inf-like accepts the whole block in one step: ceil(18 / 4) = 5 forwards per row
    assert nfe[-1] == B * -(-MAX_NEW // K)


def _causal_cache(params, seq, total):
    cache = init_cache(CFG, seq.shape[0], P + MAX_NEW)
    _, cache = sbd_jax.forward(params, CFG, seq, causal_meta(jnp.asarray(total), seq.shape[1]), cache)
    return cache


@pytest.mark.parametrize("mode", ["sbd", "ar", "verify"])
def test_final_cache_equals_one_causal_forward(params, prompts, mode):
    """verify (every call drafting, so drafts are rejected): rejected drafts wrote K/V past the output during
    decoding; the final cache holds none."""
    kw = dict(mode="sbd", verify=True, draft_policy="always") if mode == "verify" else dict(mode=mode)
    # verify's greedy tokens are AR's (tests/test_verify.py): its EOS is picked from AR's
    pick_kw = dict(mode="ar") if mode == "verify" else kw
    eos_id = pick_eos(generate(params, CFG, prompts, LENGTHS, gamma=2.0, eos_ids=(), **pick_kw, **BASE).tokens)
    out = generate(params, CFG, prompts, LENGTHS, gamma=2.0, eos_ids=(eos_id,), **kw, **BASE)
    o = outputs(out)
    total = LENGTHS + o["lengths"]
    assert o["stopped_by_eos"].any() and not o["stopped_by_eos"].all(), "want rows stopped by EOS and by length"
    seq = np.zeros((B, P + MAX_NEW), np.int32)
    for b in range(B):
        seq[b, :LENGTHS[b]] = prompts[b, :LENGTHS[b]]
        seq[b, LENGTHS[b]:total[b]] = o["tokens"][b, :o["lengths"][b]]
    ref = _causal_cache(params, seq, total)
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), total)
    for name in ("k", "v"):
        got, want = np.asarray(getattr(out.cache, name)), np.asarray(getattr(ref, name))
        for b in range(B):
            w = want[:, b, :total[b]]
            err = np.abs(got[:, b, :total[b]] - w).max() / max(1.0, np.abs(w).max())
            assert err <= KV_TOL, f"{mode} row {b}: cache {name} differs from the causal forward by {err} (rel)"
            assert not np.any(got[:, b, total[b]:]), f"{mode} row {b}: slots past the sequence were written"


@pytest.mark.parametrize("mode", ["sbd", "ar"])
def test_prompt_prefilled_in_pieces_equals_one_call(params, prompts, eos_id, mode):
    """`prefill_chunk=3` on 8-column prompts: two pieces of 3 prefilled, the last 2 columns with the first step;
    rows whose last prompt token lies in a piece (lengths 3 and 5) included. Same tokens, NFE and EOS as the
    brute-force decoder, and the final cache equals one causal forward."""
    for kw in ({"gamma": 2.0, "temperature": 0.0, "eos_ids": (eos_id,)}, {"gamma": 0.5, "temperature": 1.0,
                                                                          "eos_ids": (eos_id,)}):  # one decoder
        key = jax.random.key(1)
        ours = generate(params, CFG, prompts, LENGTHS, key=key, mode=mode, prefill_chunk=3, **kw, **BASE)
        ref = brute_force_generate(params, CFG, prompts, LENGTHS, key=key, max_new_tokens=MAX_NEW, block_size=K,
                                   pad_id=0, mode=mode, **kw)
        assert_same(ours, ref, f"{mode} {kw}")
        o = outputs(ours)
        total = LENGTHS + o["lengths"]
        seq = np.zeros((B, P + MAX_NEW), np.int32)
        for b in range(B):
            seq[b, :LENGTHS[b]] = prompts[b, :LENGTHS[b]]
            seq[b, LENGTHS[b]:total[b]] = o["tokens"][b, :o["lengths"][b]]
        want = np.asarray(_causal_cache(params, seq, total).k)
        for b in range(B):
            err = np.abs(np.asarray(ours.cache.k)[:, b, :total[b]] - want[:, b, :total[b]]).max()
            assert err <= KV_TOL * max(1.0, np.abs(want).max()), (mode, b, err)


@pytest.mark.parametrize("mode", ["sbd", "ar"])
def test_per_row_max_new_tokens(params, prompts, mode):
    """Each row stops at its own cap (`row_max_new_tokens`, <= the spec's cache-sizing cap): the same as the
    brute-force decoder with those caps (each row decoded alone with its cap as the spec's: tests/test_rows_alone.py)."""
    caps = np.array([18, 5, 9, 1], np.int32)
    kw = dict(gamma=0.5, temperature=0.0, eos_ids=(), mode=mode)
    ours = generate(params, CFG, prompts, LENGTHS, row_max_new_tokens=caps, **kw, **BASE)
    ref = brute_force_generate(params, CFG, prompts, LENGTHS, row_max_new_tokens=caps, max_new_tokens=MAX_NEW,
                               block_size=K, pad_id=0, **kw)
    assert_same(ours, ref, f"{mode} per-row caps")
    o = outputs(ours)
    np.testing.assert_array_equal(o["lengths"], caps)


def test_block_size_one_is_one_token_per_forward(params, prompts):
    kw = dict(BASE, block_size=1)
    free = outputs(generate(params, CFG, prompts, LENGTHS, gamma=5.0, eos_ids=(), **kw))
    np.testing.assert_array_equal(free["nfe"], MAX_NEW)
    eos_id = pick_eos(free["tokens"])
    out = outputs(generate(params, CFG, prompts, LENGTHS, gamma=5.0, eos_ids=(eos_id,), **kw))
    np.testing.assert_array_equal(out["nfe"], out["lengths"])
    assert out["stopped_by_eos"].any() and (out["lengths"] == MAX_NEW).any()
    ref = outputs(brute_force_generate(params, CFG, prompts, LENGTHS, gamma=5.0, eos_ids=(eos_id,), max_new_tokens=MAX_NEW,
                                   block_size=1, pad_id=0))
    for f in out:
        np.testing.assert_array_equal(out[f], ref[f], err_msg=f)


@pytest.mark.parametrize("mode", ["sbd", "ar"])
def test_eos_stops_row_and_drops_the_rest(params, prompts, mode):
    """With EOS = a token the model emits, each row's output is the no-EOS output cut right after
    its first EOS, padded after, with no more NFE; rows without that token are unchanged."""
    key = jax.random.key(5)
    free = outputs(generate(params, CFG, prompts, LENGTHS, gamma=2.0, temperature=0.0, key=key, eos_ids=(), mode=mode,
                        **BASE))
    eos_id = pick_eos(free["tokens"])
    stop = outputs(generate(params, CFG, prompts, LENGTHS, gamma=2.0, temperature=0.0, key=key, eos_ids=(eos_id,),
                        mode=mode, **BASE))
    n_stopped = 0
    for b in range(B):
        hits = np.flatnonzero(free["tokens"][b] == eos_id)
        if hits.size:
            n = hits[0] + 1
            n_stopped += 1
            assert stop["lengths"][b] == n and stop["stopped_by_eos"][b]
            np.testing.assert_array_equal(stop["tokens"][b, :n], free["tokens"][b, :n])
            assert not np.any(stop["tokens"][b, n:]), "tokens after EOS were kept"
            assert stop["nfe"][b] <= free["nfe"][b]
        else:
            assert stop["lengths"][b] == MAX_NEW and not stop["stopped_by_eos"][b]
            np.testing.assert_array_equal(stop["tokens"][b], free["tokens"][b])
            assert stop["nfe"][b] == free["nfe"][b]
    assert 1 <= n_stopped < B
    if mode == "ar":
        np.testing.assert_array_equal(stop["nfe"], stop["lengths"])


def test_ar_matches_brute_force_sampled(params, prompts):
    key = jax.random.key(2)
    ours = generate(params, CFG, prompts, LENGTHS, mode="ar", temperature=1.0, key=key, eos_ids=(), **BASE)
    ref = brute_force_generate(params, CFG, prompts, LENGTHS, mode="ar", temperature=1.0, key=key, eos_ids=(),
                               max_new_tokens=MAX_NEW, pad_id=0)
    assert_same(ours, ref, "ar sampled")
    np.testing.assert_array_equal(np.asarray(ours.nfe), MAX_NEW)


def test_ar_greedy_matches_transformers(params, prompts, hf_ref, tmp_path):
    model_dir = sbd_jax.save_pretrained(CFG, params, tmp_path / "m")
    ref = hf_ref.generate(model_dir, [prompts[b, :LENGTHS[b]].tolist() for b in range(B)], MAX_NEW)
    out = generate(params, CFG, prompts, LENGTHS, mode="ar", eos_ids=(), **BASE)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref))


def test_generate_inside_user_jit(params, prompts):
    @jax.jit
    def user_fn(params, ids, lens, gamma, key):
        out = generate(params, CFG, ids, lens, gamma=gamma, temperature=1.0, key=key, eos_ids=(), **BASE)
        return out.tokens, out.nfe, jnp.sum(out.lengths)  # and keep computing on the result

    key = jax.random.key(4)
    gamma = jnp.array([0.5, 2.0, 3.0, 1.0])
    toks, nfe, total = user_fn(params, jnp.asarray(prompts), jnp.asarray(LENGTHS), gamma, key)
    eager = generate(params, CFG, prompts, LENGTHS, gamma=gamma, temperature=1.0, key=key, eos_ids=(), **BASE)
    np.testing.assert_array_equal(np.asarray(toks), np.asarray(eager.tokens))
    np.testing.assert_array_equal(np.asarray(nfe), np.asarray(eager.nfe))
    assert int(total) == int(np.asarray(eager.lengths).sum())
    # one while_loop, no host round trip per step: the compiled program holds the loop
    hlo = user_fn.lower(params, jnp.asarray(prompts), jnp.asarray(LENGTHS), gamma, key).as_text()
    assert "while" in hlo


# ------------------------------------------------------------------------------------------------
# the spec


def test_decode_spec_is_validated_where_built_and_hashable(params, prompts):
    from sbd_jax.decoding import DecodeSpec
    spec = DecodeSpec(max_new_tokens=MAX_NEW, block_size=K, eos_ids=[5, 6], pad_id=0)
    assert spec.eos_ids == (5, 6) and hash(spec) == hash(DecodeSpec.make(max_new_tokens=MAX_NEW, block_size=K,
                                                                         eos_ids=(5, 6), pad_id=0))
    # keywords replace the spec's fields: the same decoder as a spec that holds them
    a = generate(params, CFG, prompts, LENGTHS, spec, gamma=2.0, eos_ids=(), finalize_cache=True, return_cache=True)
    b = generate(params, CFG, prompts, LENGTHS, gamma=2.0, eos_ids=(), **BASE)
    assert_same(a, b, "spec + keywords vs keywords")
