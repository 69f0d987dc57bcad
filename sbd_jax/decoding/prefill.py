"""Writing prompts into the cache: the prompt columns' clean metadata, the `prefill_chunk`-wide pieces before a
prompt's last piece (which rides with the first decoding call), and the hidden state at each row's last prompt
token (AR's and verify mode's first token comes from it)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..attention import clean_meta
from ..models.config import ModelConfig
from ..models.transformer import KVCache, forward
from .state import DecodeEnv, LoopState


def prompt_meta(lengths_B, start, width: int):
    """Clean metadata of the prompt columns [start, start + width) (segment 0 from each row's length on)."""
    pos = jnp.broadcast_to(start + jnp.arange(width, dtype=jnp.int32)[None], (lengths_B.shape[0], width))
    return clean_meta((pos < lengths_B[:, None]).astype(jnp.int32), pos)


def write_prompt(params, cfg: ModelConfig, cache: KVCache, prompt_ids, upto_B, pieces: int, C: int,
                 constrain=lambda x: x):
    """Write the K/V of each row's prompt columns [0, upto_B) among the first `pieces` (may be traced) x C columns,
    one call per C-column piece (attention and activations scale with the piece, not the prompt). -> (cache, each
    row's final hidden state [B, 1, D] at column upto_B - 1 where a piece held it, else 0)."""
    h_last = jnp.zeros((prompt_ids.shape[0], 1, cfg.hidden_size), cfg.dtype)

    def piece(i, carry):
        cache, h_last = carry
        tok = jax.lax.dynamic_slice_in_dim(prompt_ids, i * C, C, axis=1)
        h, cache = forward(params, cfg, tok, prompt_meta(upto_B, i * C, C), cache, return_hidden=True)
        idx = upto_B - 1 - i * C
        h_at = jnp.take_along_axis(h, jnp.clip(idx, 0, C - 1)[:, None, None], axis=1)
        return constrain(cache), jnp.where(((idx >= 0) & (idx < C))[:, None, None], h_at, h_last)

    return jax.lax.fori_loop(0, pieces, piece, (cache, h_last))


def prefill(state: LoopState, env: DecodeEnv, prompt_ids):
    """Write the prompt's K/V before its last `prefill_chunk`-wide piece (which rides with the first step).
    -> (state, that piece's first column, the hidden state at each row's last prompt token where written)."""
    P, C = prompt_ids.shape[1], env.spec.prefill_chunk
    start = (P - 1) // C * C
    if start == 0:  # the prompt is one piece
        return state, 0, jnp.zeros((prompt_ids.shape[0], 1, env.cfg.hidden_size), env.cfg.dtype)
    cache, h_last = write_prompt(env.params, env.cfg, state.cache, prompt_ids, env.lengths, start // C, C,
                                 env.constrain)
    return state._replace(cache=cache), start, h_last


def last_prompt_hidden(h, lengths, start: int, P: int, h_last):
    """[B, 1, D]: the hidden state at each row's last prompt token, from the window h of prompt columns
    [start, P) (first) or from the prefilled pieces before it (`h_last`)."""
    idx = lengths - 1 - start
    h_at = jnp.take_along_axis(h, jnp.clip(idx, 0, P - start - 1)[:, None, None], axis=1)
    return jnp.where((idx >= 0)[:, None, None], h_at, h_last)
