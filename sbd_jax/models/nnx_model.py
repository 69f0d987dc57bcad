"""Flax NNX face of the model: an `nnx.Module` holding the same parameter tree as `init_params`, whose
`__call__` runs the pure `forward`. `nnx.split(model)` gives (graphdef, state); `model.params()` gives
the plain dict the pure functions, optax and orbax use."""
from __future__ import annotations

import jax
from flax import nnx

from .config import ModelConfig
from .transformer import forward
from .params import init_params


class SBDTransformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, params: dict | None = None):
        self.cfg = cfg
        if params is None:
            params = init_params(cfg, (rngs or nnx.Rngs(0)).params())
        self.weights = nnx.data(jax.tree.map(nnx.Param, params))

    def params(self) -> dict:
        """The parameters as a plain dict pytree (arrays, no NNX variables)."""
        return jax.tree.map(lambda p: p[...], self.weights, is_leaf=lambda x: isinstance(x, nnx.Param))

    def __call__(self, tokens_BT, meta, cache=None):
        return forward(self.params(), self.cfg, tokens_BT, meta, cache)
