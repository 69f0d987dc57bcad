from .transformer import (KVCache, causal_meta, forward, init_cache, init_params, lm_head, param_shapes,
                          unstack_layers)

__all__ = ["KVCache", "causal_meta", "forward", "init_cache", "init_params", "lm_head", "param_shapes",
           "unstack_layers"]
