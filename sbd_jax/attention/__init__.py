"""SBD attention: one mask definition (`mask.py`), a reference XLA implementation and kernels."""
from .mask import (CLEAN, COPY, TokenMeta, block_starts, clean_meta, concat_meta, copy_meta,
                   dense_mask, sbd_mask)
from .reference import reference_attention


def attention(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta, *, impl: str = "xla"):
    """Dispatch on `impl` ("xla" reference, or "pallas" fused kernels)."""
    if impl == "xla":
        return reference_attention(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta)
    if impl == "pallas":
        from .pallas import pallas_attention  # imported lazily: kernels are optional
        return pallas_attention(q_BTHD, k_BSKD, v_BSKD, q_meta, kv_meta)
    raise ValueError(f"unknown attention_impl {impl!r} (expected 'xla' or 'pallas')")


__all__ = ["CLEAN", "COPY", "TokenMeta", "attention", "block_starts", "clean_meta", "concat_meta",
           "copy_meta", "dense_mask", "reference_attention", "sbd_mask"]
