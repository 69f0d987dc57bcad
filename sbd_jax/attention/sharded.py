"""The Pallas attention kernels on a device mesh: run per shard inside `jax.shard_map`.

A `pallas_call` is opaque to XLA's SPMD partitioner: under a mesh, XLA would gather its inputs onto
every device or fail. Attention is independent per (row, KV-head group), so the kernels run
unchanged on each shard of the ambient mesh (`jax.sharding.get_abstract_mesh()`; none, or all axes
of size 1 or already manual: the kernels are called directly):

  * batch and metadata: split over the batch axes ("data", "fsdp": those with size > 1), or
    replicated if the batch does not divide (as `batch_sharding`);
  * heads, over the "tensor" axis (t devices), from H query heads and K KV heads (G = H // K):
      - K % t == 0: q and KV heads both split (the layout of wq/wk/wv under the training rules);
      - else, if H % t == 0 and G % (H/t) == 0 (e.g. 8 KV heads on a tensor axis of 16): q heads
        split, K/V replicated over "tensor", each shard slicing out its query heads' KV head;
      - otherwise heads are replicated (correct, no tensor parallelism).

The custom VJP runs inside the shard_map, so gradients are per shard too. `check_vma=False`: the
kernels' out_shapes carry no varying-axes annotation; shard_map's transpose then sums the cotangent
of any input not split over an axis (K/V replicated over "tensor", a replicated batch) over that
axis, as it must. Results equal the unsharded kernels up to float summation order.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from .mask import TokenMeta

BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"


class ShardedAttentionError(ValueError):
    """Inputs whose shapes the sharded wrapper cannot lay out (not 4-D, H not a multiple of K, ...)."""


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How one attention call is split over the mesh. `batch`: the batch axes (a name, a tuple of
    names, or None = replicated); `heads`: "split" | "q_only" | "replicated"; `t`: the tensor size."""

    batch: str | tuple[str, ...] | None
    heads: str
    t: int = 1

    @property
    def head_axis(self):
        return HEAD_AXIS if self.heads in ("split", "q_only") else None

    @property
    def trivial(self) -> bool:
        return self.batch is None and self.head_axis is None

    def specs(self):
        """(q/out spec, k/v spec, metadata spec)."""
        kv_axis = HEAD_AXIS if self.heads == "split" else None
        return (P(self.batch, None, self.head_axis, None), P(self.batch, None, kv_axis, None),
                P(self.batch, None))


def active_mesh():
    """The ambient (abstract) mesh, or None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _free_axes(mesh) -> dict[str, int]:
    """Mesh axes we may still split over: size > 1 and not already manual (inside a shard_map)."""
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    return {a: int(s) for a, s in mesh.shape.items() if s > 1 and a not in manual}


def head_layout(mesh, B: int, H: int, K: int) -> HeadLayout:
    """The layout of a [B, T, H, D] x [B, S, K, D] attention on `mesh` (rules: module docstring)."""
    if mesh is None:
        return HeadLayout(None, "replicated")
    free = _free_axes(mesh)
    axes = tuple(a for a in BATCH_AXES if a in free)
    n = int(np.prod([free[a] for a in axes])) if axes else 1
    batch = None if not axes or B % n else (axes[0] if len(axes) == 1 else axes)
    t = free.get(HEAD_AXIS, 1)
    if t == 1:
        heads = "replicated"
    elif K % t == 0:
        heads = "split"
    elif H % t == 0 and (H // K) % (H // t) == 0:
        heads = "q_only"
    else:
        heads = "replicated"
    return HeadLayout(batch, heads, t)


def _shapes(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ShardedAttentionError(f"{name} must be 4-D [batch, time, heads, head_dim], "
                                        f"got shape {getattr(x, 'shape', None)}")
    B, H, K = q.shape[0], q.shape[2], k.shape[2]
    if K == 0 or H % K:
        raise ShardedAttentionError(f"query heads {H} must be a multiple of kv heads {K}")
    return B, H, K


def _local_kv(layout: HeadLayout, H: int, K: int):
    """Inside the shard_map: slice K/V (replicated over "tensor") to the one KV head of this shard's
    query heads ("q_only" layout); identity otherwise."""
    if layout.heads != "q_only":
        return lambda x: x
    G, h_local = H // K, H // layout.t

    def take(x):
        idx = jax.lax.axis_index(HEAD_AXIS) * h_local // G
        return jax.lax.dynamic_slice_in_dim(x, idx, 1, axis=2)
    return take


def _as_meta(m) -> TokenMeta:
    return m if isinstance(m, TokenMeta) else TokenMeta(*m)


def pallas_attention(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta, **kwargs):
    """`sbd_jax.attention.pallas.pallas_attention` (same arguments and result), run per shard
    inside `jax.shard_map` when a mesh is active (see the module docstring)."""
    return pallas_attention_parts(q_BTHD, [(k_BSKD, v_BSKD, kv_meta)], q_meta, **kwargs)


def pallas_attention_parts(q_BTHD, kv_parts, q_meta, **kwargs):
    """`sbd_jax.attention.pallas.pallas_attention_parts` (same arguments and result), run per shard
    inside `jax.shard_map` when a mesh is active (see the module docstring)."""
    from .pallas import pallas_attention_parts as kernel
    kv_parts = tuple(tuple(p) for p in kv_parts)
    if not kv_parts:
        raise ShardedAttentionError("kv_parts must be a non-empty sequence of (k, v, kv_meta)")
    dims = [_shapes(q_BTHD, k, v) for k, v, _ in kv_parts]
    if len(set(dims)) != 1:
        raise ShardedAttentionError(f"kv_parts disagree on (batch, heads, kv heads): {dims}")
    (B, H, K), parts = dims[0], tuple((k, v, _as_meta(m)) for k, v, m in kv_parts)
    layout = head_layout(active_mesh(), B, H, K)
    if layout.trivial:
        return kernel(q_BTHD, parts, q_meta, **kwargs)
    q_spec, kv_spec, m_spec = layout.specs()
    meta_spec = TokenMeta(*([m_spec] * len(TokenMeta._fields)))
    take = _local_kv(layout, H, K)

    def local(q, parts, qm):
        return kernel(q, [(take(k), take(v), m) for k, v, m in parts], qm, **kwargs)

    part_specs = tuple((kv_spec, kv_spec, meta_spec) for _ in parts)
    return jax.shard_map(local, in_specs=(q_spec, part_specs, meta_spec),
                         out_specs=q_spec, check_vma=False)(q_BTHD, parts, _as_meta(q_meta))


__all__ = ["HeadLayout", "ShardedAttentionError", "active_mesh", "head_layout", "pallas_attention",
           "pallas_attention_parts"]
