"""Verify mode's drafting policy (sbd_jax/decoding/policy.py): its expected tokens per call, the
options' checks, and drafts that fail costing about one call per token, like AR. (Every decision giving AR's
tokens and the no-cache oracle's calls: tests/test_verify.py.)"""
import numpy as np
import pytest

from decoding_fixtures import CFG, LENGTHS, MAX_NEW, make_params, make_prompts, pick_eos
from sbd_jax.decoding import DecodeError, DecodeSpec, costs, generate, policy
from sbd_jax.decoding.spec import DRAFT_POLICIES, EXTRA_DRAFT_POLICIES, register_draft_policy

CAPS = np.array([18, 7, 13, 1], np.int32)


@pytest.fixture(scope="module")
def model():
    params, prompts = make_params(), make_prompts()
    eos = pick_eos(generate(params, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=()).tokens)
    return params, prompts, eos


def test_tokens_per_wide_call():
    p = np.linspace(0.0, 1.0, 11, dtype=np.float32)
    for k in (1, 4, 16):
        tau = np.asarray(policy.tokens_per_wide_call(p, k))
        np.testing.assert_allclose(tau[[0, -1]], [1.0, k], rtol=1e-6)  # drafts never / always stand
        assert (np.diff(tau) >= -1e-6).all()
    with pytest.raises(DecodeError, match="draft_policy"):
        DecodeSpec(verify=True, draft_policy="sometimes")
    with pytest.raises(DecodeError, match="wide_cost"):
        DecodeSpec(verify=True, wide_cost=-1.0)
    # the tests' coin policy is registered by tests/decoding_fixtures.py, not an option of the library or its CLI
    assert "random" not in DRAFT_POLICIES and "random" in EXTRA_DRAFT_POLICIES
    with pytest.raises(ValueError, match="built in"):
        register_draft_policy("adaptive", lambda state, env: 0)


def test_failing_drafts_cost_about_one_call_per_token(model):
    """The random test model's drafts rarely stand. At a wide call costing 3 one-wide calls the adaptive policy
    makes AR calls, but for the explorations it owes (one per (cost - 1) / EXPLORE_SHARE calls), and no row
    needs more calls than AR. (Measured costs: tests/test_verify.py::test_inside_a_user_jit.)"""
    params, prompts, _ = model
    ar = generate(params, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=())
    spec = DecodeSpec(mode="sbd", verify=True, block_size=16, max_new_tokens=MAX_NEW, eos_ids=(), wide_cost=3.0)
    v = generate(params, CFG, prompts, LENGTHS, spec)
    np.testing.assert_array_equal(np.asarray(v.tokens), np.asarray(ar.tokens))
    assert (np.asarray(v.nfe) <= np.asarray(ar.nfe)).all()
    every = int(policy.explore_every(np.asarray(spec.stated_call_costs())))
    assert int(v.wide_steps) <= int(v.iterations) // every + 1, (int(v.wide_steps), int(v.iterations))


def test_cost_measurement_runs_eagerly_on_the_model_weights(model):
    """`costs.measure` outside any trace (decode.py, the batch runner, the GPU run; inside a user's jit:
    tests/test_verify.py::test_inside_a_user_jit) measures every draft width, each dearer than an AR call on this
    CPU (a wider call does more arithmetic)."""
    params = model[0]
    spec = DecodeSpec(mode="sbd", verify=True, block_size=16, max_new_tokens=MAX_NEW)
    got = costs.measure(params, CFG, spec, 2, 128)
    assert len(got) == len(spec.draft_widths) and all(np.isfinite(got)) and min(got) > 1.0
