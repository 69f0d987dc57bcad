"""The decode loop's state and environment, built by name.

  * `LoopState` is the while-loop carry (a mode's own state in `mode_state`). A field annotated `Row` holds one
    entry per batch row (axis 0): those are what continuous batching resets when a slot takes a new prompt
    (`put_rows` finds them by type, so a new per-row field is reset without anyone listing it). The cache is per
    row along its batch axis and is reset by writing the new prompt's K/V (continuous.py); `iters` and `wide`
    count the batch's calls.
  * `DecodeEnv` is what the loop body reads and never changes: the model, the spec and the per-row inputs.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ..models.config import ModelConfig
from ..models.transformer import KVCache, init_cache
from ..sharding import batch_sharding, cache_sharding
from .spec import DecodeSpec

PER_ROW = "per_row"
Row = Annotated[jax.Array, PER_ROW]  # a [B, ...] field of the loop state, one entry per row


class LoopState(NamedTuple):
    """The while-loop carry: what every mode uses. B = rows, W = token buffer width. A mode's own fields (where its
    block stands, what it drafted) are its `mode_state` (modes/: ARState, SBDState, VerifyState)."""

    seq: Row                  # [B, W] tokens by position
    cache: KVCache            # per row along its batch axis (reset by writing a prompt's K/V, not by put_rows)
    done: Row                 # [B]
    eos: Row                  # [B] stopped by EOS
    n_generated: Row          # [B] final number of generated tokens (valid once done)
    nfe: Row                  # [B]
    iters: jax.Array          # scalar: model calls
    wide: jax.Array           # scalar: calls wider than one token per row (a commit window, or drafts to check)
    accepted: Row             # [B, window + 1] per row: calls that decoded 0, 1, ... tokens (of the output)
    mode_state: Any           # the mode's own NamedTuple (`Mode.init_state`), its per-row fields annotated `Row`


def row_fields(cls=LoopState) -> tuple[str, ...]:
    """The fields of `cls` annotated `Row` (one entry per batch row)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple(f for f in cls._fields if PER_ROW in getattr(hints[f], "__metadata__", ()))


def put_rows(old, new, rows):
    """`old` (a NamedTuple of arrays) with its `Row` fields at `rows` (indices; out-of-range ones dropped) taken
    from `new`, whose rows are those `rows` name; NamedTuple fields (a mode's state) the same way, recursively. A
    new per-row field is reset without anyone listing it."""
    rowed = row_fields(type(old))
    return old._replace(**{f: getattr(old, f).at[rows].set(getattr(new, f), mode="drop") for f in rowed},
                        **{f: put_rows(getattr(old, f), getattr(new, f), rows) for f in old._fields
                           if f not in rowed and hasattr(getattr(old, f), "_fields")})


@dataclasses.dataclass(frozen=True)
class DecodeEnv:
    """What the loop body reads and never changes: the model, the spec and the per-row inputs."""

    params: dict
    cfg: ModelConfig
    spec: DecodeSpec
    lengths: jax.Array        # [B] prompt lengths
    max_new: jax.Array        # [B] tokens to generate at most (<= spec.max_new_tokens)
    gamma: jax.Array          # [B]
    temp: jax.Array           # [B]
    keys: jax.Array           # [B] typed PRNG keys
    eos: jax.Array            # [E] stop ids ([-1] = none)
    constrain: Callable       # sharding constraint of per-row arrays and the cache (identity without a mesh)


def make_env(params, cfg: ModelConfig, spec: DecodeSpec, lengths, max_new_B, gamma_B, temp_B, keys_B,
             mesh) -> DecodeEnv:
    eos = jnp.asarray(spec.stop_ids(cfg) or (-1,), jnp.int32)  # -1 matches no token
    return DecodeEnv(params=params, cfg=cfg, spec=spec, lengths=lengths,
                     max_new=jnp.minimum(max_new_B, spec.max_new_tokens), gamma=gamma_B, temp=temp_B, keys=keys_B,
                     eos=eos,
                     constrain=constrainer(cfg, mesh, lengths.shape[0]))


def prompt_seq(prompt_ids, lengths, spec: DecodeSpec, env: DecodeEnv):
    """The token buffer [B, P + max_new_tokens + window] (room for a whole last block past the cap): the
    prompts, then the pad id."""
    B, P = prompt_ids.shape
    pad = spec.pad(env.cfg)
    seq = jnp.full((B, P + spec.max_new_tokens + spec.window), pad, jnp.int32)
    return seq.at[:, :P].set(jnp.where(jnp.arange(P)[None] < lengths[:, None], prompt_ids, pad))


def new_state(env: DecodeEnv, seq, P: int, mode_state, done=None) -> LoopState:
    """The loop carry before the first call: an empty cache of P + max_new_tokens slots per row; `mode_state`: the
    mode's own (`Mode.init_state`)."""
    B, spec = seq.shape[0], env.spec
    zeros_B, false_B = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool)
    return LoopState(
        seq=env.constrain(seq),
        cache=env.constrain(init_cache(env.cfg, B, P + spec.max_new_tokens, spec.kv_cache_dtype)),
        done=false_B if done is None else done,
        eos=false_B,
        n_generated=zeros_B,
        nfe=zeros_B,
        iters=jnp.int32(0),
        wide=jnp.int32(0),
        accepted=jnp.zeros((B, spec.window + 1), jnp.int32),
        mode_state=mode_state)


def constrainer(cfg, mesh, B):
    """Per-row arrays over the batch axes, the cache as `cache_sharding` (identity without a mesh)."""
    if mesh is None:
        return lambda x: x
    cs = cache_sharding(cfg, mesh, B)
    scales = NamedSharding(mesh, PartitionSpec(*tuple(cs.spec)[:4]))  # an int8 cache's [L, B, S, K] scales
    return lambda x: jax.lax.with_sharding_constraint(
        x, x.with_arrays((cs, cs, scales, scales)[:len(x.arrays())], batch_sharding(mesh, 1, B))
        if isinstance(x, KVCache) else batch_sharding(mesh, x.ndim, B))


def tally(accepted_BN, n_B, active_B):
    """Count one model call that decoded `n_B` tokens for each active row."""
    return accepted_BN + (jax.nn.one_hot(n_B, accepted_BN.shape[1], dtype=jnp.int32) * active_B[:, None])


def gather(seq, pos):
    """seq's tokens at positions `pos` [B, n] (clipped into the buffer)."""
    return jnp.take_along_axis(seq, jnp.clip(pos, 0, seq.shape[1] - 1), axis=1)


def block_positions(offset_B, env: DecodeEnv):
    """Positions [B, K] of the block starting at generated index `offset_B`."""
    return (env.lengths + offset_B)[:, None] + jnp.arange(env.spec.block_size, dtype=jnp.int32)[None]
