"""SBD attention: one mask definition (`mask.py`), a reference XLA implementation and kernels.

`attention(..., impl="pallas")` and `attention_parts(..., impl="pallas")` go through
`sharded.py`: under an active mesh (`jax.set_mesh`, or `sbd_jax.sharding.mesh_context` inside the
training step and the decoder) the Pallas kernels run per shard inside `jax.shard_map` (batch over
data x fsdp, heads over tensor); without one they are called directly. Under a mesh with a "context" axis
(context parallelism, training) a one-part call runs per sequence shard (`context.py`), either impl."""
import jax

from .mask import (CLEAN, COPY, TokenMeta, block_starts, clean_meta, concat_meta, copy_meta,
                   dense_mask, sbd_mask)
from ..sharding_rules import context_size
from .context import context_attention
from .reference import concat_parts, reference_attention
from .sharded import active_mesh


def attention(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta, *, impl: str = "xla"):
    """Dispatch on `impl`: "xla" reference, "pallas" fused kernels, "auto" = the kernels on GPU/TPU."""
    return attention_parts(q_BTHD, [(k_BSKD, v_BSKD, kv_meta)], q_meta, impl=impl, kv_meta=kv_meta)


def attention_parts(q_BTHD, kv_parts, q_meta, *, impl: str = "xla", kv_meta=None):
    """Attention over keys/values given in parts of one sequence: kv_parts = [(k, v, meta), ...]
    means k = concat(k_i) along time. "pallas" reads the parts in place (decoding reads its cache
    without a concatenated copy per layer); "xla" concatenates (`kv_meta`: the concatenated
    metadata if the caller has it already)."""
    if impl == "auto":
        impl = "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    if len(kv_parts) == 1 and context_size(active_mesh()) > 1:  # one row split over "context": context.py
        k, v, meta = kv_parts[0]
        return context_attention(q_BTHD, k, v, q_meta, meta if kv_meta is None else kv_meta, impl=impl)
    if impl == "pallas":  # the kernels (imported lazily, they are optional), per shard under a mesh
        from .sharded import pallas_attention_parts
        return pallas_attention_parts(q_BTHD, kv_parts, q_meta)
    if impl != "xla":
        raise ValueError(f"unknown attention_impl {impl!r} (expected 'auto', 'xla' or 'pallas')")
    k, v, meta = concat_parts(kv_parts)
    return reference_attention(q_BTHD, k, v, q_meta, meta if kv_meta is None else kv_meta)


__all__ = ["CLEAN", "COPY", "TokenMeta", "attention", "attention_parts", "block_starts", "clean_meta", "concat_meta",
           "copy_meta", "dense_mask", "reference_attention", "sbd_mask"]
