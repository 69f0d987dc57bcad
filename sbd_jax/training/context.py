"""Context parallelism in the train step (mesh.context = n > 1): how an example's sequence is laid out over the
context axis. The batch's rows stay whole on every device of the axis (the data side is unchanged: a process reads
the rows of its devices, `step.local_rows`); the step builds the example ([x ; x_hat], T tokens), puts its tokens
in the balanced order and splits the sequence into n contiguous shards. Attention exchanges K/V over the axis
(sbd_jax/attention/context.py); everything else in a layer is per token, and the losses are sums over tokens, so
any token order gives the same loss and gradients.

The balanced layout: causal work grows along each half (a clean query at position p sees ~p keys; a copy query
~its block start p of clean keys plus its own block), so contiguous shards would leave the first device with the
least work and the one holding the end of the clean half with the most. Each half is cut into 2n equal chunks and
device i holds chunks i and 2n-1-i of both halves (the zigzag of causal ring attention, applied to both streams):
every device then has about the same number of visible (query, key) pairs, which the Pallas kernel's tile skipping
turns into equal time. The XLA path computes every pair of its shard either way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..sharding import context_size, logical_to_spec
from .examples import Example

CONTEXT_LAYOUTS = ("balanced", "contiguous")


def check_layout(layout: str) -> str:
    if layout not in CONTEXT_LAYOUTS:
        raise ValueError(f"context layout must be one of {CONTEXT_LAYOUTS}, got {layout!r}")
    return layout


def example_spec(mesh: Mesh, rows: int, T: int) -> P:
    """The layout of an Example's [rows, T] arrays: rows by the "batch" rule, the sequence by the "seq" rule
    (the context axis; replicated without one)."""
    return logical_to_spec(("batch", "seq"), (rows, T), mesh)


def context_shards(mesh: Mesh | None, T: int) -> int:
    """The context axis' size for rows of T tokens (1: no context parallelism); a clear error when it does not
    divide T."""
    n = context_size(mesh)
    if T % n:
        raise ValueError(f"training rows of T = {T} tokens (data.seq_len + the copy stream) do not split over "
                         f"mesh.context = {n}: T must be a multiple of it")
    return n


def balanced_order(L: int, T: int, n: int) -> np.ndarray | None:
    """The balanced layout's token order (module docstring) for rows of an L-token clean half and T - L copy-stream
    tokens (none: NTP-only), or None when n == 1 or a half does not cut into 2n equal chunks (then the contiguous
    order is kept)."""
    halves = [(0, L)] + ([(L, T - L)] if T > L else [])
    if n == 1 or any(size % (2 * n) for _, size in halves):
        return None
    shards: list[list[np.ndarray]] = [[] for _ in range(n)]
    for start, size in halves:
        c = size // (2 * n)
        for i in range(n):
            shards[i] += [np.arange(start + i * c, start + (i + 1) * c),
                          np.arange(start + (2 * n - 1 - i) * c, start + (2 * n - i) * c)]
    return np.concatenate([np.concatenate(s) for s in shards])


def place_example(ex: Example, mesh: Mesh | None, L: int, layout: str = "balanced") -> Example:
    """Under context parallelism: the example's tokens in the `layout` order ("balanced" when the halves cut
    evenly, else "contiguous") and every [B, T] array split over rows and sequence, so each device runs the
    forward on T/n tokens. Unchanged without a context axis."""
    B, T = ex.tokens.shape
    n = context_shards(mesh, T)
    if n == 1:
        return ex
    order = balanced_order(L, T, n) if check_layout(layout) == "balanced" else None
    if order is not None:
        ex = jax.tree.map(lambda a: jnp.take(a, order, axis=1), ex)
    sh = NamedSharding(mesh, example_spec(mesh, B, T))
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sh), ex)


def whole_table(tree: dict, mesh: Mesh | None, n: int, dtype) -> dict:
    """Under context parallelism (n > 1): the embedding table in the compute dtype (the forward casts it so anyway)
    and whole on every device, so looking up a row shard's tokens is local. Split like the other weights (its D over
    fsdp x context), the [B, T, D] lookup would have to change layout, which XLA does by replicating it (GiBs at
    long L; bench/plan_memory.py). Unchanged for n == 1."""
    if n == 1:
        return tree
    table = tree["embed"].astype(dtype)
    return {**tree, "embed": jax.lax.with_sharding_constraint(table, NamedSharding(mesh, P()))}


__all__ = ["CONTEXT_LAYOUTS", "balanced_order", "check_layout", "context_shards", "example_spec", "place_example",
           "whole_table"]
