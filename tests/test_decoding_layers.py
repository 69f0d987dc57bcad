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


MODES = {"ar": dict(mode="ar"), "sbd": {}, "verify": dict(verify=True)}


@pytest.mark.parametrize("mode", list(MODES))
def test_put_rows_resets_exactly_the_per_row_fields(mode):
    spec = DecodeSpec(max_new_tokens=6, block_size=4, **MODES[mode])

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
    assert any("mode_state" in jax.tree_util.keystr(p) for p, _ in leaves)  # every mode has per-row state of its own
    for path, x in leaves:
        x = np.asarray(x)
        if x.shape[:1] == (B,):  # per row: rows 0 and 2 reset, row 1 kept
            assert x[[0, 2]].all() and not x[1].any(), jax.tree_util.keystr(path)
        else:  # over the batch (call counts, the policy's memory): kept
            assert not x.any(), jax.tree_util.keystr(path)


def test_the_loop_state_holds_only_what_every_mode_uses():
    """A mode's own fields live in its `mode_state` NamedTuple (each per-row field annotated `Row`), not in the
    shared carry: no field of one mode's state is in LoopState or in another mode's state, except the commit window
    SBD and verify both keep."""
    from sbd_jax.decoding.modes.ar import ARState
    from sbd_jax.decoding.modes.sbd import SBDState
    from sbd_jax.decoding.modes.verify import VerifyState
    from sbd_jax.decoding.state import LoopState, row_fields
    assert set(LoopState._fields) == {"seq", "cache", "done", "eos", "n_generated", "nfe", "iters", "wide",
                                      "accepted", "mode_state"}
    shared = {"block_offset", "commit_start", "commit_len"}
    states = (ARState, SBDState, VerifyState)
    for i, a in enumerate(states):
        assert not set(a._fields) & set(LoopState._fields), a
        for b in states[i + 1:]:
            assert set(a._fields) & set(b._fields) <= shared, (a, b)
    assert set(row_fields(VerifyState)) == set(VerifyState._fields) - {"memory"}  # the memory is over all rows
    assert set(row_fields(SBDState)) == set(SBDState._fields) and row_fields(ARState) == ("generated",)
