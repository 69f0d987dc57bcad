"""Context parallelism: SBD attention over rows whose sequence is split over the mesh's "context" axis.

A training row ([x ; x_hat]: T = 2L tokens, L + copy_len with a compact copy stream) is split into N contiguous
shards of T/N tokens, one per device of the context axis (the "seq" rule of sbd_jax/sharding_rules.py); its
per-token metadata (segment, position, stream, block start) is split the same way. Inside a `jax.shard_map`
every device keeps its T/N queries, all-gathers K, V and the key metadata over the axis, and runs the ordinary
single-device attention of its queries against all T keys: the SBD mask comes from the metadata (`sbd_mask`;
per tile in the Pallas kernel, which skips invisible tiles), so no (2L)^2 mask exists anywhere. Batch and
heads split as in sharded.py (batch over data x fsdp, heads over tensor, the same HeadLayout).

Gradients: the all-gather's transpose is a reduce-scatter, so each device's dK/dV contributions are summed
onto the shard that owns those keys. Per layer and device this moves (N-1)/N of the row's K/V forward and
the same again backward (plus the forward gather again when remat recomputes the layer).

The token order over the shards (balanced, so no device idles on a mostly-masked shard) is the train step's
(sbd_jax/training/context.py): the mask is a function of the metadata, so any order is exact here. Not yet here:
a ring (K/V passed around, overlapped with compute, instead of gathered whole).
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from ..sharding_rules import CONTEXT_AXIS, context_size
from .mask import TokenMeta
from .reference import reference_attention
from .sharded import ShardedAttentionError, active_mesh, head_layout, local_kv_heads, qkv_dims


class ContextParallelError(ShardedAttentionError):
    """A row the context axis cannot split (a length it does not divide, inputs of the wrong rank)."""


def local_kernel(impl: str):
    """The single-device attention each context shard runs: (q, k, v, q_meta, kv_meta) -> out."""
    if impl == "xla":
        return reference_attention
    if impl == "pallas":
        from .pallas import pallas_attention  # the kernels themselves: already inside the shard_map
        return pallas_attention
    raise ValueError(f"unknown attention_impl {impl!r} for context parallelism (expected 'xla' or 'pallas')")


def check_split(q_BTHD, k_BSKD, v_BSKD, n: int) -> tuple[int, int, int]:
    """(B, H, K) of a q/k/v triple whose query and key lengths `n` context shards divide."""
    dims = qkv_dims(q_BTHD, k_BSKD, v_BSKD, ContextParallelError)
    for name, T in (("query", q_BTHD.shape[1]), ("key", k_BSKD.shape[1])):
        if T % n:
            raise ContextParallelError(f"a row of {T} {name} tokens does not split over mesh.context={n}: the "
                                       f"row length (data.seq_len + the copy stream) must be a multiple of {n}")
    return dims


def with_time(spec: P) -> P:
    """A [batch, time, ...] PartitionSpec with time split over the context axis."""
    return P(spec[0], CONTEXT_AXIS, *spec[2:])


def context_attention(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta, *, impl: str = "xla"):
    """`reference_attention` (impl "xla") or `pallas_attention` ("pallas"), same arguments and result, with
    time split over the ambient mesh's context axis (the module docstring). Without a context axis (or size
    1) the kernel is called directly."""
    kernel = local_kernel(impl)
    mesh = active_mesh()
    n = context_size(mesh)
    q_meta, kv_meta = TokenMeta(*q_meta), TokenMeta(*kv_meta)
    if n == 1:
        return kernel(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta)
    B, H, K = check_split(q_BTHD, k_BSKD, v_BSKD, n)
    layout = head_layout(mesh, B, H, K)
    q_spec, kv_spec, m_spec = (with_time(s) for s in layout.specs())
    meta_spec = TokenMeta(*([m_spec] * len(TokenMeta._fields)))
    take = local_kv_heads(layout, H, K)

    def local(q, k, v, qm, km):
        gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)  # noqa: E731
        return kernel(q, gather(take(k)), gather(take(v)), qm, TokenMeta(*(gather(f) for f in km)))

    # check_vma=False as in sharded.py: the Pallas kernels' outputs carry no varying-axes annotation
    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, meta_spec, meta_spec), out_specs=q_spec,
                         check_vma=False)(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta)


__all__ = ["ContextParallelError", "check_split", "context_attention", "local_kernel", "with_time"]
