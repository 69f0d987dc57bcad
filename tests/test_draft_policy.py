"""Verify mode's drafting policy (sbd_jax/decoding/modes/verify/policy.py): its expected tokens per call, the
options' checks, and drafts that fail costing about one call per token, like AR. (Every decision giving AR's
tokens and the no-cache oracle's calls: tests/test_verify.py.)"""
import jax
import numpy as np
import pytest

from decoding_fixtures import CFG, LENGTHS, MAX_NEW, coin_policy, make_params, make_prompts, pick_eos
from sbd_jax.decoding import DecodeError, DecodeSpec, generate
from sbd_jax.models.config import ModelConfig
from bench.calibrate import calibrate
from sbd_jax.decoding.modes.verify import costs, policy
from sbd_jax.models.params import init_params

CAPS = np.array([18, 7, 13, 1], np.int32)


@pytest.fixture(scope="module")
def model():
    params, prompts = make_params(), make_prompts()
    eos = pick_eos(generate(params, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=()).tokens)
    return params, prompts, eos


def test_tokens_per_wide_call():
    """Drafts never / always standing make 1 / w tokens per wide call; more agreement never makes fewer; one
    agreement rate at every offset gives the closed form 1 + E[m], E[m] = p + ... + p^(w-1) (every wide call checks
    a block and drafts the next, whatever the outcome); a far draft that never agrees makes a wider call worth no
    more than the narrower one that stops before it."""
    p = np.linspace(0.0, 1.0, 11, dtype=np.float32)
    for k in (1, 4, 16):
        tau = np.asarray(policy.tokens_per_wide_call(np.repeat(p[:, None], 15, 1), k))
        np.testing.assert_allclose(tau[[0, -1]], [1.0, k], rtol=1e-6)
        assert (np.diff(tau) >= -1e-6).all()
        powers = p[:, None] ** np.arange(1, k)[None]
        np.testing.assert_allclose(tau, 1 + powers.sum(1), rtol=1e-5)
    near = np.array([[1.0] * 3 + [0.0] * 12], np.float32)  # offsets 1-3 always agree, 4 and on never
    assert float(policy.tokens_per_wide_call(near, 8)[0]) == float(policy.tokens_per_wide_call(near, 4)[0]) == 4.0
    # a policy is a name or the caller's own function (the tests' coin: tests/decoding_fixtures.py); anything else
    # is refused by name
    assert DecodeSpec(verify=True, draft_policy=coin_policy).draft_policy is coin_policy
    with pytest.raises(DecodeError, match=r"draft_policy must be one of \('adaptive', 'always', 'never'\) or a function"):
        DecodeSpec(verify=True, draft_policy="random")

    class Unhashable:
        __hash__ = None

        def __call__(self, state, env):
            return 0
    with pytest.raises(DecodeError, match="is not hashable: pass a function"):
        DecodeSpec(verify=True, draft_policy=Unhashable())


def test_failing_drafts_cost_about_one_call_per_token(model):
    """The random test model's drafts rarely stand. At wide calls costing 3 one-wide calls (every width) the adaptive
    policy makes AR calls, but for the explorations it owes (one per (cost - 1) / EXPLORE_SHARE calls), and no row
    needs more calls than AR. (Measured costs: tests/test_verify.py::test_inside_a_user_jit.)"""
    params, prompts, _ = model
    ar = generate(params, CFG, prompts, LENGTHS, mode="ar", max_new_tokens=MAX_NEW, eos_ids=())
    spec = DecodeSpec(mode="sbd", verify=True, block_size=16, max_new_tokens=MAX_NEW, eos_ids=(), wide_cost=(3.0,) * 4)
    v = generate(params, CFG, prompts, LENGTHS, spec)
    np.testing.assert_array_equal(np.asarray(v.tokens), np.asarray(ar.tokens))
    assert (np.asarray(v.nfe) <= np.asarray(ar.nfe)).all()
    every = int(policy.explore_every(np.asarray(spec.stated_call_costs())))
    assert int(v.wide_steps) <= int(v.iterations) // every + 1, (int(v.wide_steps), int(v.iterations))


def test_calibrate_times_every_width_and_its_result_is_stated(model):
    """`calibrate` (an explicit step, outside any trace) times every draft width, the widest (20 queries a row)
    dearer than an AR call (the narrowest, 6, is within timing noise of one on a busy CPU); its result is a valid
    `wide_cost`, used as given. Inside a trace it refuses (tests/test_decoding_errors.py): it would compile and
    time programs there."""
    params = model[0]
    spec = DecodeSpec(mode="sbd", verify=True, block_size=4, max_new_tokens=MAX_NEW)  # widths 4, 2
    got = calibrate(params, CFG, spec, 2, 128)
    assert len(got) == len(spec.draft_widths) and all(np.isfinite(got)) and min(got) > 0 and got[0] > 1.0
    stated = DecodeSpec.make(spec, wide_cost=got)
    assert stated.stated_call_costs() == got == costs.call_costs(params, CFG, stated, 2, 128)



def test_the_cost_model_reads_shapes_only():
    """The default costs: arithmetic on shapes and a backend's constants (no device work; `jax.ShapeDtypeStruct`
    weights do). An 8B bf16 model at batch 1 reads 16 GB of weights per call whatever its width, so on a GPU the
    width-8 and width-4 calls (72 and 20 queries per row) cost about what a 1-wide one does and the widest (272)
    less than two; at batch 64 the widest call is compute-bound and costs several.
    Every width costs more than the next narrower one."""
    cfg = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      param_dtype="bfloat16", dtype="bfloat16", mask_token_id=128255)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    spec = DecodeSpec(mode="sbd", verify=True, block_size=16, max_new_tokens=256)
    one, many = (costs.estimate(shapes, cfg, spec, b, 1280, backend="gpu") for b in (1, 64))
    assert max(one[1:]) < 1.25 and one[0] < 2.0 and many[0] > 3.0
    for c in (one, many, costs.estimate(shapes, cfg, spec, 1, 1280, backend="cpu")):
        assert all(a > b > 1.0 for a, b in zip(c, c[1:])), c
