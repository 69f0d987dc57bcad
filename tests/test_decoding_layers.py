"""The decoding package's structure (issue #29): continuous batching's per-row reset covers every per-row field of
the loop state (derived from its type), no module imports another's private names, and the size limits hold."""
import ast
from pathlib import Path

import jax
import jax.numpy as jnp
from test_decoding import CFG

from sbd_jax.decoding import DecodeSpec
from sbd_jax.decoding.state import ROW_FIELDS, LoopState, make_env, new_state, prompt_seq

PKG = Path(__file__).resolve().parents[1] / "sbd_jax" / "decoding"


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


def test_no_private_imports_and_size_limits():
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert len(path.read_text().splitlines()) <= 400, path
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 60, f"{path.name}: {node.name}"
