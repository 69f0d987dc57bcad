"""Verify mode (docs/sbd.md, "Lossless mode"): drafts checked by the next call's clean queries against AR's
position-keyed tokens. Its output equals AR mode's for the same key (greedy and sampled) under every decision of
the draft policy, its calls equal the no-cache verifier's (brute.py), and on a model whose drafts are right it
needs far fewer calls than AR. (The policy itself: tests/test_draft_policy.py.) (A batched
row == its prompt decoded alone: tests/test_rows_alone.py; the final cache: tests/test_decoding.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import brute
from decoding_fixtures import CFG, LENGTHS, MAX_NEW, coin_policy, make_params, make_prompts, outputs
from sbd_jax.decoding import DecodeSpec, DraftMemory, generate

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


def _verify(params, prompts, k, **kw):
    return generate(params, CFG, prompts, LENGTHS, mode="sbd", verify=True, block_size=k, max_new_tokens=MAX_NEW,
                    row_max_new_tokens=CAPS, **kw)


SAMPLING = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0), "topk": dict(temperature=0.8, top_k=5),
            "topp": dict(temperature=1.0, top_p=0.7)}
# the draft policy's decisions (policy.py): forced (every call drafting at the widest width, every call AR, a coin
# per call switching mid-row between AR and each draft width) and the adaptive rule at a stated cost of the widest call
POLICIES = {"always": dict(draft_policy="always"), "never": dict(draft_policy="never"),
            "random": dict(draft_policy=coin_policy), "adaptive": dict(wide_cost=1.2)}
# (sampled: every policy at k 4; greedy also at k 16)
GRID = [(s, p, k) for s in ("greedy", "t1") for p in POLICIES for k in (4, 16)
        if (k == 4 or p in ("random", "adaptive")) and (s == "greedy" or k == 4)] + [
    ("greedy", "random", 1), ("topk", "random", 4), ("topp", "random", 4), ("topk", "always", 4)]


@pytest.mark.parametrize("how,pol,k", GRID, ids=[f"{s}-{p}-k{k}" for s, p, k in GRID])
def test_verify_equals_ar_and_the_no_cache_verifier(params, prompts, eos, how, pol, k, seen):
    """Tokens == AR's under every policy decision, greedy and sampled; tokens, NFE, calls, 2w-wide calls, the
    per-call histogram and the drafts placed / agreed == the no-cache oracle's (brute.py re-implements the rule)."""
    key = jax.random.key(3)
    ar = outputs(_ar(params, prompts, key=key, eos_ids=(eos,), **SAMPLING[how]))
    assert ar["stopped_by_eos"].any() and not ar["stopped_by_eos"].all()
    kw = dict(key=key, eos_ids=(eos,), **SAMPLING[how], **POLICIES[pol])
    v = _verify(params, prompts, k, **kw)
    got = outputs(v)
    for f in ("tokens", "lengths", "stopped_by_eos"):
        np.testing.assert_array_equal(got[f], ar[f], err_msg=f"{f} != AR's")
    ref = brute.brute_force_verify(params, CFG, prompts, LENGTHS, mode="sbd", verify=True, block_size=k,
                                   max_new_tokens=MAX_NEW, row_max_new_tokens=CAPS, **kw)
    assert_same_run(v, ref)
    seen[how] |= brute.EVENTS
    # every call of a row is counted once with the tokens it added: never 0, and they sum to the output
    acc = got["accepted"]
    assert (acc.sum(1) == got["nfe"]).all() and (acc @ np.arange(k + 1) == got["lengths"]).all()
    assert acc[:, 0].sum() == 0 and (np.asarray(v.mode_stats.agreed) <= np.asarray(v.mode_stats.drafts)).all()
    if pol == "never":
        assert int(v.wide_steps) == 0 and (got["nfe"] == ar["nfe"]).all()
    if pol == "always":
        assert int(v.wide_steps) == int(v.iterations) - 1
    if how == "greedy" and (pol, k) == ("adaptive", 16):  # the last greedy case: the grid covered an EOS that
        assert "eos_as_correction" in seen[how], seen  # was AR's correction of a wrong draft


def test_a_batch_starts_from_an_earlier_memory(params, prompts, eos):
    """`draft_memory` carries what the policy learned from one call to the next (the batch runner does): a batch
    told that drafts always failed drafts less than one starting from nothing (which counts drafts as agreeing until
    checks show otherwise), its tokens stay AR's and its calls the oracle's,
    and the counts it returns add its EOS stops and tokens. (The grid's greedy adaptive k = 16 program.)"""
    kw = dict(key=jax.random.key(3), eos_ids=(eos,), temperature=0.0, **POLICIES["adaptive"])
    ar = outputs(_ar(params, prompts, key=kw["key"], eos_ids=(eos,)))
    cold = _verify(params, prompts, 16, **kw)
    told = DraftMemory(hits=np.zeros(15, np.float32), trials=np.full(15, 1e4, np.float32), stops=0.0, tokens=1e6,
                       since_wide=0)  # every draft failed, no EOS
    warm = _verify(params, prompts, 16, draft_memory=told, **kw)
    ref = brute.brute_force_verify(params, CFG, prompts, LENGTHS, mode="sbd", verify=True, block_size=16,
                                   max_new_tokens=MAX_NEW, row_max_new_tokens=CAPS, draft_memory=told, **kw)
    assert_same_run(warm, ref)
    np.testing.assert_array_equal(np.asarray(warm.tokens), ar["tokens"])
    assert int(warm.wide_steps) < int(cold.wide_steps)
    for out, start in ((cold, DraftMemory.empty(15)), (warm, told)):
        m = out.mode_stats.memory
        np.testing.assert_allclose([m.stops, m.tokens], [start.stops + ar["stopped_by_eos"].sum(),
                                                         start.tokens + ar["lengths"].sum()])
    again = _verify(params, prompts, 16, draft_memory=warm.mode_stats.memory.as_dict(), **kw)  # as a summary has it
    assert_same_run(again, _verify(params, prompts, 16, draft_memory=warm.mode_stats.memory, **kw))


def assert_same_run(got, want):
    """Every output field equal (the mode's stats and memory included), the cache apart."""
    for path, a in jax.tree_util.tree_leaves_with_path(got._replace(cache=None)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(_at(want, path)), err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
    for p in path:
        tree = getattr(tree, p.name) if hasattr(p, "name") else tree[p.idx]
    return tree


@pytest.fixture(scope="module")
def seen():
    """How rows stopped in the grid so far, per sampling (brute.EVENTS)."""
    return {s: set() for s in SAMPLING}


def test_inside_a_user_jit(params, prompts, eos):
    """The adaptive policy with no stated `wide_cost` inside a user's jit: its costs come from the cost model
    (arithmetic on shapes), so tracing and lowering the user's function compiles nothing and times nothing; the
    compiled function's tokens are AR's. (The suite's other verify tests state `wide_cost`.)"""
    spec = DecodeSpec(mode="sbd", verify=True, block_size=4, max_new_tokens=MAX_NEW, eos_ids=(eos,))
    f = jax.jit(lambda p, x, t: generate(p, CFG, x, LENGTHS, spec, gamma=t).tokens)
    compiles = []

    def count(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        lowered = f.lower(params, prompts, jnp.float32(2.0))
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == [], f"{len(compiles)} backend compilations while the user's function traced"
    got = lowered.compile()(params, prompts, jnp.float32(2.0))
    want = generate(params, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=(eos,)).tokens
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_fewer_calls_than_ar_when_drafts_are_right(eos):
    """A model whose every position predicts the same token (layers zeroed, one lm_head column aligned with every
    embedding): its drafts are all right, so a block of k costs ~1 call and verify mode needs ~max_new / k + 1
    calls where AR needs max_new, for the same tokens. (The grid's EOS, which this model never emits, and its
    policies: the grid's compiled programs.)"""
    p = _bigram({})
    p["embed"][:, 0] = 5.0  # a component every embedding shares, which lm_head reads as token 17
    p["lm_head"][0, 17] = 10.0
    prompts = make_prompts()
    assert eos != 17
    ar = generate(p, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=(eos,))
    assert (np.asarray(ar.tokens) == 17).all() and (np.asarray(ar.nfe) == MAX_NEW).all()
    for pol in ("always", "adaptive"):  # every call drafting at the widest width; adaptive
        v = generate(p, CFG, prompts, LENGTHS, mode="sbd", verify=True, block_size=4, max_new_tokens=MAX_NEW,
                     eos_ids=(eos,), **POLICIES[pol])
        np.testing.assert_array_equal(np.asarray(v.tokens), np.asarray(ar.tokens))
        assert (np.asarray(v.mode_stats.agreed) == np.asarray(v.mode_stats.drafts)).all()  # every draft stood
        if pol == "always":  # the first call drafts 3, then each call adds 4 (3 drafts + AR's next)
            assert (np.asarray(v.nfe) <= -(-MAX_NEW // 4) + 1).all()
            assert np.asarray(v.accepted)[:, 4].sum() >= B * (MAX_NEW // 4 - 1)  # whole blocks per call
        else:
            assert (np.asarray(v.nfe) <= MAX_NEW // 2).all()


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


def test_eos_inside_an_accepted_prefix(eos):
    """Drafts E E E after AR's first token Y, and AR's token after Y is E = EOS: the EOS stands inside the
    verified prefix and ends the row there (2 tokens, 2 calls, as AR), like the no-cache verifier. (E: the grid's
    EOS, the adaptive policy at the grid's stated cost: the grid's compiled programs.)"""
    E = eos
    Y, last = [t for t in (9, 5, 7) if t != E][:2]
    p = _bigram({last: Y, Y: E, CFG.mask_token_id: E})
    prompts = make_prompts().copy()
    prompts[np.arange(B), LENGTHS - 1] = last
    kw = dict(block_size=4, max_new_tokens=MAX_NEW, eos_ids=(E,), **POLICIES["adaptive"])
    ar = outputs(generate(p, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=(E,)))
    v = outputs(generate(p, CFG, prompts, LENGTHS, mode="sbd", verify=True, **kw))
    ref = outputs(brute.brute_force_verify(p, CFG, prompts, LENGTHS, mode="sbd", verify=True, **kw))
    assert (ar["tokens"][:, :2] == [Y, E]).all() and (ar["lengths"] == 2).all() and ar["stopped_by_eos"].all()
    for f in ("tokens", "lengths", "stopped_by_eos"):
        np.testing.assert_array_equal(v[f], ar[f])
    for f in v:
        np.testing.assert_array_equal(v[f], ref[f])
    assert brute.EVENTS == {"eos_in_prefix"} and (v["nfe"] == 2).all()
