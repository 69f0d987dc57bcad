"""The decoding package's structure: continuous batching's per-row reset covers every per-row field of
the loop state (derived from its type). (Private imports and size limits: tests/test_structure.py, for all of sbd_jax.)"""
import jax
import jax.numpy as jnp
from decoding_fixtures import CFG

from sbd_jax.decoding import DecodeSpec
from sbd_jax.decoding.state import ROW_FIELDS, LoopState, make_env, new_state, prompt_seq


def test_row_fields_are_exactly_the_per_row_fields_of_the_state():
    B = 3
    spec = DecodeSpec(max_new_tokens=6, block_size=4)

    def build():
        lengths = jnp.ones((B,), jnp.int32)
        env = make_env({}, CFG, spec, lengths, lengths, jnp.zeros((B,)), jnp.zeros((B,)),
                       jax.random.split(jax.random.key(0), B), None)
        return new_state(env, prompt_seq(jnp.zeros((B, 5), jnp.int32), lengths, spec, env), 5)

    state = jax.eval_shape(build)
    per_row = {f for f in LoopState._fields if f != "cache" and getattr(state, f).shape[:1] == (B,)}
    assert set(ROW_FIELDS) == per_row and {"iters", "wide", "cache"}.isdisjoint(ROW_FIELDS)

