from .params import init_params, param_shapes, unstack_layers
from .transformer import KVCache, causal_meta, forward, init_cache, lm_head

__all__ = ["KVCache", "causal_meta", "forward", "init_cache", "init_params", "lm_head", "param_shapes",
           "unstack_layers"]
