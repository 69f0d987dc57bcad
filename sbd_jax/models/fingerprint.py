"""A fingerprint of a model's weights: what an adapter (LoRA checkpoint or export) records of the base it was trained
on, so that a resume or a load onto another base is refused. sha256 over every weight's name, shape and a fixed
sample of its values (1024 evenly spaced elements, every layer's included) rounded to bfloat16: the same for a
checkpoint held in float32 or bfloat16, on any mesh; two different checkpoints share no sample by chance."""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

SAMPLES = 1024


def _sample(x) -> np.ndarray:
    """SAMPLES evenly spaced elements of `x` (by flat index) as bfloat16 bytes, gathered on device (a sharded
    array is not brought to the host whole)."""
    n = int(np.prod(x.shape))
    flat = np.unique(np.linspace(0, n - 1, min(n, SAMPLES)).astype(np.int64))
    coords = tuple(jnp.asarray(c, jnp.int32) for c in np.unravel_index(flat, x.shape))
    sh = getattr(x, "sharding", None)
    out = None if not isinstance(sh, jax.sharding.NamedSharding) else jax.sharding.NamedSharding(
        sh.mesh, jax.sharding.PartitionSpec())
    got = jax.jit(lambda a: a[coords].astype(jnp.bfloat16), out_shardings=out)(x)
    return np.asarray(got.addressable_data(0) if isinstance(got, jax.Array) else got)


def base_fingerprint(params: dict) -> str:
    """"sha256:<16 hex>" of `params` (the stacked parameter tree; every process must call it)."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        h.update(f"{jax.tree_util.keystr(path)}{tuple(x.shape)};".encode())
        h.update(_sample(x).view(np.uint16).tobytes())
    return "sha256:" + h.hexdigest()[:16]
