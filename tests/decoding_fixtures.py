"""What the decoding test modules share: the random decoding test model (`CFG`, `make_params`), its ragged
prompt batch (`make_prompts`, `LENGTHS`) and the static decoding configuration most tests use (`BASE`), so that
one compiled decoder serves most of them; `outputs` / `assert_same` compare decodings field by field and
`pick_eos` finds an EOS id the model really emits.

The model is random but initialised with std 0.5, so its distributions are sharp enough that entropies differ
between positions and acceptance is non-trivial (1 < tokens/forward < k, asserted in tests/test_decoding.py)."""
import jax
import jax.numpy as jnp
import numpy as np

import sbd_jax
from sbd_jax.models import param_shapes

CFG = sbd_jax.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          mask_token_id=63, rope_theta=10000.0, rms_norm_eps=1e-6)
B, P, K, MAX_NEW = 4, 8, 4, 18
LENGTHS = np.array([8, 5, 3, 6], np.int32)
BASE = {"max_new_tokens": MAX_NEW, "block_size": K, "finalize_cache": True, "return_cache": True, "pad_id": 0}
FIELDS = ("tokens", "lengths", "nfe", "stopped_by_eos", "accepted")  # a decoding's per-row results


def coin_policy(state, env):
    """The tests' drafting policy (`DecodeSpec(draft_policy=coin_policy)`): each verify call's kind by a fixed coin
    on the call count (any sequence of choices must give AR's tokens; tests/brute.py draws the same coins)."""
    return jax.random.randint(jax.random.fold_in(jax.random.key(0), state.iters), (), 0,
                              len(env.spec.draft_widths) + 1)



def make_params():
    """Random weights, normal(0, 0.5), norms 1 (numpy: compiling jax.random per leaf costs seconds)."""
    rng = np.random.default_rng(0)

    def leaf(path, shape):
        if path[-1].key.endswith("norm"):
            return jnp.ones(shape, jnp.float32)
        return jnp.asarray(0.5 * rng.standard_normal(shape), jnp.float32)
    return jax.tree.map_with_path(leaf, param_shapes(CFG), is_leaf=lambda x: isinstance(x, tuple))


def make_prompts(seed=0, garbage_seed=1):
    """[B, P] prompt ids (< 62, never the mask token 63) with random garbage in the padding, so a row
    that attended its padding would decode differently."""
    ids = np.random.default_rng(seed).integers(0, 62, (B, P)).astype(np.int32)
    garbage = np.random.default_rng(garbage_seed).integers(0, 62, (B, P)).astype(np.int32)
    return np.where(np.arange(P)[None] < LENGTHS[:, None], ids, garbage)


def outputs(out) -> dict:
    """A decoding's per-row results (FIELDS) as numpy arrays."""
    return {f: np.asarray(getattr(out, f)) for f in FIELDS}


def assert_same(a, b, what):
    a, b = outputs(a), outputs(b)
    for f in a:
        np.testing.assert_array_equal(a[f], b[f], err_msg=f"{what}: {f} differ")


def pick_eos(tokens):
    """An EOS id the model really emits in this configuration: a token of row 0 (after its 3rd
    token) that some other row never emits, so EOS stops some rows and not others."""
    tokens = np.asarray(tokens)
    for t in tokens[0, 3:]:
        if not all((tokens[b] == t).any() for b in range(1, len(tokens))):
            return int(t)
    return int(tokens[0, 5])
