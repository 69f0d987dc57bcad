"""The Pallas attention kernels on a device mesh: run per shard inside `jax.shard_map`.

A `pallas_call` is opaque to XLA's SPMD partitioner: under a mesh, XLA would gather its inputs onto
every device or fail. Attention is independent per (row, KV-head group), so the kernels run
unchanged on each shard of the ambient mesh (`jax.sharding.get_abstract_mesh()`; none, or all axes
of size 1 or already manual: the kernels are called directly):

  * batch and metadata: split by the "batch" rule of sbd_jax/sharding_rules.py ("data", "fsdp":
    those with size > 1), or replicated if the batch does not divide (as `batch_sharding`);
  * heads, by the "heads" and "kv_heads" rules (both "tensor": t devices), from H query heads and
    K KV heads (G = H // K):
      - K % t == 0: q and KV heads both split (the layout of wq/wk/wv under the same rules);
      - else, if H % t == 0 and G % (H/t) == 0 (e.g. 8 KV heads on a tensor axis of 16): q heads
        split, K/V replicated over "tensor", each shard slicing out its query heads' KV head;
      - otherwise heads are replicated (correct, no tensor parallelism).
  Time and head_dim are never split here: the kernels read whole sequences (a "context" axis splitting
  training rows' time is context.py's, which reuses these layouts).

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

from ..sharding_rules import DEFAULT_RULES, logical_to_spec, rule_axes, spec_entry
from .mask import TokenMeta


class ShardedAttentionError(ValueError):
    """Inputs whose shapes the sharded wrapper cannot lay out (not 4-D, H not a multiple of K, ...)."""


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How one attention call is split over the mesh. `batch`: the batch axes (a name, a tuple of
    names, or None = replicated); `heads`: "split" | "q_only" | "replicated"; `t`: the size of the
    heads rule's mesh axes, `axis`: those axes (a name or a tuple of names)."""

    batch: str | tuple[str, ...] | None
    heads: str
    t: int = 1
    axis: str | tuple[str, ...] | None = DEFAULT_RULES["heads"]

    @property
    def head_axis(self):
        return self.axis if self.heads in ("split", "q_only") else None

    @property
    def trivial(self) -> bool:
        return self.batch is None and self.head_axis is None

    def specs(self):
        """(q/out spec, k/v spec, metadata spec)."""
        kv_axis = self.axis if self.heads == "split" else None
        return (P(self.batch, None, self.head_axis, None), P(self.batch, None, kv_axis, None),
                P(self.batch, None))


def active_mesh():
    """The ambient (abstract) mesh, or None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def head_layout(mesh, B: int, H: int, K: int, rules=None) -> HeadLayout:
    """The layout of a [B, T, H, D] x [B, S, K, D] attention on `mesh` by the logical-axis `rules`
    (default: sharding_rules.DEFAULT_RULES; how: module docstring)."""
    if mesh is None:
        return HeadLayout(None, "replicated")
    manual = tuple(getattr(mesh, "manual_axes", ()) or ())  # inside a shard_map: not split again
    q_spec = logical_to_spec(("batch", None, "heads", None), (B, 0, H, 0), mesh, rules, manual)
    kv_spec = logical_to_spec(("batch", None, "kv_heads", None), (B, 0, K, 0), mesh, rules, manual)
    # the q heads' axes; when they stay whole, those the rule names (t is reported either way)
    axis = q_spec[2] if q_spec[2] is not None else spec_entry(rule_axes("heads", mesh, rules, manual))
    t = int(np.prod([mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis or ())]))
    if q_spec[2] is None:
        heads = "replicated"
    elif kv_spec[2] == q_spec[2]:
        heads = "split"
    elif kv_spec[2] is None and (H // K) % (H // t) == 0:
        heads = "q_only"
    else:
        heads = "replicated"
    return HeadLayout(q_spec[0], heads, t, axis)


def qkv_dims(q, k, v, error=ShardedAttentionError) -> tuple[int, int, int]:
    """(batch, query heads, kv heads) of a q/k/v triple [B, T, heads, head_dim]; `error` names a bad one."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise error(f"{name} must be 4-D [batch, time, heads, head_dim], got shape {getattr(x, 'shape', None)}")
    B, H, K = q.shape[0], q.shape[2], k.shape[2]
    if K == 0 or H % K:
        raise error(f"query heads {H} must be a multiple of kv heads {K}")
    return B, H, K


def local_kv_heads(layout: HeadLayout, H: int, K: int):
    """Inside the shard_map: slice K/V (replicated over the heads axis) to the one KV head of this
    shard's query heads ("q_only" layout); identity otherwise."""
    if layout.heads != "q_only":
        return lambda x: x
    G, h_local = H // K, H // layout.t

    def take(x):
        idx = jax.lax.axis_index(layout.axis) * h_local // G
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
    dims = [qkv_dims(q_BTHD, k, v) for k, v, _ in kv_parts]
    if len(set(dims)) != 1:
        raise ShardedAttentionError(f"kv_parts disagree on (batch, heads, kv heads): {dims}")
    (B, H, K), parts = dims[0], tuple((k, v, _as_meta(m)) for k, v, m in kv_parts)
    layout = head_layout(active_mesh(), B, H, K)
    if layout.trivial:
        return kernel(q_BTHD, parts, q_meta, **kwargs)
    q_spec, kv_spec, m_spec = layout.specs()
    meta_spec = TokenMeta(*([m_spec] * len(TokenMeta._fields)))
    take = local_kv_heads(layout, H, K)

    def local(q, parts, qm):
        return kernel(q, [(take(k), take(v), m) for k, v, m in parts], qm, **kwargs)

    part_specs = tuple((kv_spec, kv_spec, meta_spec) for _ in parts)
    return jax.shard_map(local, in_specs=(q_spec, part_specs, meta_spec),
                         out_specs=q_spec, check_vma=False)(q_BTHD, parts, _as_meta(q_meta))


__all__ = ["HeadLayout", "ShardedAttentionError", "active_mesh", "head_layout", "local_kv_heads",
           "pallas_attention", "pallas_attention_parts"]
