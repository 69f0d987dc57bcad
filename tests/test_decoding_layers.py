"""The decoding package's structure: continuous batching's per-row reset (`state.put_rows`) covers every per-row
field of the loop state, a mode's own state included (found by type, not listed). (Private imports and size
limits: tests/test_structure.py, for all of sbd_jax.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decoding_fixtures import CFG

from sbd_jax.decoding import DecodeSpec
from sbd_jax.decoding.modes import mode_of
from sbd_jax.decoding.state import make_env, new_state, prompt_seq, put_rows


@pytest.mark.parametrize("verify", [False, True], ids=["sbd", "verify"])
def test_put_rows_resets_exactly_the_per_row_fields(verify):
    spec = DecodeSpec(max_new_tokens=6, block_size=4, verify=verify)

    def build(B):
        lengths = jnp.ones((B,), jnp.int32)
        env = make_env({}, CFG, spec, lengths, lengths, jnp.zeros((B,)), jnp.zeros((B,)),
                       jax.random.split(jax.random.key(0), B), None)
        return new_state(env, prompt_seq(jnp.zeros((B, 5), jnp.int32), lengths, spec, env), 5,
                         mode_of(spec).init_state(env, B, None))

    B = 5  # not block_size - 1 (the policy memory's per-offset length)
    old = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(lambda: build(B))._replace(cache=None))
    new = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), jax.eval_shape(lambda: build(2))._replace(cache=None))
    got = put_rows(old, new, jnp.array([0, 2]))  # new rows 0 and 1 into slots 0 and 2
    leaves = jax.tree_util.tree_leaves_with_path(got)
    assert any("mode_state" in jax.tree_util.keystr(p) for p, _ in leaves) == verify
    for path, x in leaves:
        x = np.asarray(x)
        if x.shape[:1] == (B,):  # per row: rows 0 and 2 reset, row 1 kept
            assert x[[0, 2]].all() and not x[1].any(), jax.tree_util.keystr(path)
        else:  # over the batch (call counts, the policy's memory): kept
            assert not x.any(), jax.tree_util.keystr(path)
