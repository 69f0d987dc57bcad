"""The train step: examples from a packed batch (PRNG from the state), dual loss, gradient accumulation,
the optimizer. `jit_train_step` compiles it for a device mesh (parameters by the logical-axis rules, the
batch over (data, fsdp), the state donated).

Gradient accumulation: the whole batch's examples are built first, so each microbatch's loss divides by the
*global* token counts and the summed gradient is the full batch's (up to summation order). Microbatch j
takes rows j::A, so a batch sharded in contiguous row blocks splits without moving data.

Context parallelism (mesh.context = n > 1): the batch's rows stay whole on every device of the context axis
(the data side is unchanged); the step splits the example's sequence ([x ; x_hat], T tokens) into n shards in a
balanced order (training/context.py) and the attention exchanges K/V over the axis (sbd_jax/attention/context.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..models.config import ModelConfig
from ..models.lora import AdapterLayout, adapter_specs, attach
from ..models.params import param_specs
from ..sharding import batch_sharding, mesh_context, spec_shardings
from .context import check_layout, context_shards, example_spec, place_example, whole_table
from .examples import Example, PackedBatch, make_example
from .loss import LossSums, combine, loss_sums, metrics_from_sums
from .spec import StepOptions


class TrainState(NamedTuple):
    step: jnp.ndarray  # int32 scalar: optimizer steps done
    params: dict
    opt_state: Any
    rng: jnp.ndarray  # uint32[2] raw PRNG key, split once per step


def init_state(params, tx: optax.GradientTransformation, rng) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), jnp.asarray(rng, jnp.uint32))


def state_initializer(tx: optax.GradientTransformation, shardings: TrainState):
    """jitted (params, rng) -> the initial state committed to the mesh by `shardings`; `params` is donated."""
    return jax.jit(lambda p, r: init_state(p, tx, r), out_shardings=shardings, donate_argnums=(0,))


def create_state(params, tx: optax.GradientTransformation, rng, shardings: TrainState) -> TrainState:
    return state_initializer(tx, shardings)(params, jnp.asarray(rng, jnp.uint32))


# what a step's `nonfinite` metric names (0: the step is finite and its update was applied)
NONFINITE = {1: "the loss", 2: "the gradient norm", 3: "the update (learning rate x AdamW step)"}


class NonFiniteStepError(RuntimeError):
    """A train step whose loss, gradient norm or update is not finite: its update was not applied and no
    checkpoint holds it. `step`: that step (None where unknown)."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


def nonfinite_code(loss, grad_norm, update_norm) -> jnp.ndarray:
    """int32 scalar: 0 when all three are finite, else the NONFINITE key of the first that is not."""
    codes = [jnp.where(jnp.isfinite(x), 0, c) for c, x in zip(NONFINITE, (loss, grad_norm, update_norm))]
    return jnp.where(codes[0] > 0, codes[0], jnp.where(codes[1] > 0, codes[1], codes[2])).astype(jnp.int32)


def keep_if_bad(bad, new, old):
    """`new` when `bad` == 0, else `old` (leaf by leaf, inside the jitted step: no host sync)."""
    return jax.tree.map(lambda n, o: jnp.where(bad == 0, n, o), new, old)


def _micro(x, A: int, mesh: Mesh | None):
    """[B, T] -> [A, B/A, T] with microbatch j = rows j::A, each sharded like the batch when it divides (and its
    sequence over "context" under context parallelism)."""
    y = jnp.swapaxes(x.reshape(x.shape[0] // A, A, *x.shape[1:]), 0, 1)
    spec = None if mesh is None else example_spec(mesh, *y.shape[1:])
    if spec is not None and any(s is not None for s in spec):
        y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, *spec)))
    return y


def make_train_step(model_cfg: ModelConfig, opts: StepOptions, tx: optax.GradientTransformation,
                    schedule=None, mesh: Mesh | None = None, layout: AdapterLayout | None = None,
                    context_layout: str = "balanced"):
    """-> step(state, batch: PackedBatch) -> (state, metrics). Pure; jit it with `jit_train_step`. With a LoRA
    `layout`: step(state, batch, base), where state.params is the adapter (all that is differentiated and has
    optimizer state) and `base` the frozen weights it is attached to (sbd_jax/models/lora.py). `context_layout`:
    the token order under context parallelism (training/context.py: "balanced" or "contiguous")."""
    A = opts.grad_accum
    check_layout(context_layout)  # here, before any trace

    def loss_fn(params, ex: Example, totals, L: int, base):
        n = context_shards(mesh, ex.tokens.shape[-1])
        if layout is None:
            tree = whole_table(params, mesh, n, model_cfg.dtype)
        else:
            tree = attach(whole_table(base, mesh, n, model_cfg.dtype), params, layout)
        # under context parallelism one attention over the whole row: the clean_prefix split would reshard the
        # sequence across the context axis (the Pallas kernel skips the masked clean x copy tiles anyway)
        prefix = None if opts.ntp_only or n > 1 else L
        s = loss_sums(tree, model_cfg, ex, chunk=opts.loss_chunk, clean_prefix=prefix, shards=n,
                      copy_only=layout is not None and layout.copy_only, soft_targets=opts.soft_targets)
        return combine(s, *totals), s

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)  # L (the clean half's length) is static

    def step(state: TrainState, batch: PackedBatch, base=None):
        with mesh_context(mesh):  # ambient while tracing: attention_impl="pallas" then runs per shard
            rng, key = jax.random.split(state.rng)
            ex, k = make_example(key, batch, opts)
            L = batch.tokens.shape[1]
            ex = place_example(ex, mesh, L, context_layout)
            if layout is not None and layout.copy_only:  # the clean stream is the base's: no NTP term
                ex = ex._replace(ntp_weight=jnp.zeros_like(ex.ntp_weight))
            totals = (jnp.sum(ex.ntp_weight), jnp.sum(ex.matp_weight))
            if A == 1:
                (loss, sums), grads = grad_fn(state.params, ex, totals, L, base)
            else:
                if batch.tokens.shape[0] % A:
                    raise ValueError(f"batch of {batch.tokens.shape[0]} rows does not split into {A} microbatches")
                micro = jax.tree.map(lambda x: _micro(x, A, mesh), ex)

                def body(acc, mex):
                    (l, s), g = grad_fn(state.params, mex, totals, L, base)
                    return jax.tree.map(jnp.add, acc, (g, l, s)), None

                zeros_g = jax.tree.map(jnp.zeros_like, state.params)
                z = jnp.zeros((), jnp.float32)
                (grads, loss, sums), _ = jax.lax.scan(body, (zeros_g, z, LossSums(z, z, z, z)), micro)
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            bad = nonfinite_code(loss, grad_norm, optax.tree.norm(updates))
            params = keep_if_bad(bad, optax.apply_updates(state.params, updates), state.params)
            opt_state = keep_if_bad(bad, opt_state, state.opt_state)
            metrics = dict(metrics_from_sums(sums), loss=loss, grad_norm=grad_norm, k=k, nonfinite=bad,
                           tokens=jnp.sum(batch.segment > 0).astype(jnp.float32))
            if schedule is not None:
                metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
            return TrainState(state.step + 1, params, opt_state, rng), metrics

    return step


def trainable_specs(model_cfg: ModelConfig, layout: AdapterLayout | None = None) -> dict:
    """The table of what a step trains: every weight (ParamSpecs), or a LoRA adapter's arrays (AdapterSpecs)."""
    return param_specs(model_cfg) if layout is None else adapter_specs(model_cfg, layout)


def state_shardings(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, rules=None,
                    layout: AdapterLayout | None = None):
    """NamedShardings for a TrainState: params (the weights, or a LoRA `layout`'s adapter) by the logical-axis
    rules, optimizer moments like their parameters, scalars (step, counts, rng) replicated."""
    psh = spec_shardings(trainable_specs(model_cfg, layout), model_cfg, mesh, rules)
    repl = NamedSharding(mesh, P())
    osh = optax.tree_map_params(tx, lambda _, s: s, abstract_state(model_cfg, tx, layout=layout).opt_state, psh,
                                transform_non_params=lambda _: repl,
                                is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(repl, psh, osh, repl)


def abstract_state(model_cfg: ModelConfig, tx, shardings: TrainState | None = None,
                   layout: AdapterLayout | None = None) -> TrainState:
    """ShapeDtypeStructs of the TrainState (with shardings when given): the restore target."""
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape(model_cfg), model_cfg.param_dtype),
                          trainable_specs(model_cfg, layout))
    st = jax.eval_shape(lambda p: init_state(p, tx, jnp.zeros((2,), jnp.uint32)), params)
    if shardings is None:
        return st
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), st, shardings)


def batch_shardings(mesh: Mesh, batch_size: int) -> PackedBatch:
    return PackedBatch(*[batch_sharding(mesh, 2, batch_size)] * 4)


def jit_train_step(step_fn, mesh: Mesh, state_sh: TrainState, batch_size: int, base_sh: dict | None = None):
    """jit with explicit in/out shardings; the state (argument 0) is donated. `base_sh`: the shardings of a LoRA
    step's frozen base (argument 2, read, never donated)."""
    base = () if base_sh is None else (base_sh,)
    return jax.jit(step_fn, in_shardings=(state_sh, batch_shardings(mesh, batch_size), *base),
                   out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=(0,))


class WithBase:
    """A jitted LoRA step called as step(state, batch): its frozen base bound as the third argument."""

    def __init__(self, jitted, base: dict):
        self.jitted, self.base = jitted, base

    def __call__(self, state: TrainState, batch: PackedBatch):
        return self.jitted(state, batch, self.base)


def local_rows(mesh: Mesh, batch_size: int) -> list[int]:
    """The global batch rows this process's devices hold: the only rows its data iterator needs to pack."""
    shards = batch_shardings(mesh, batch_size).tokens.addressable_devices_indices_map((batch_size, 1))
    return sorted({r for idx in shards.values() for r in range(*idx[0].indices(batch_size))})


def put_batch(batch_np: PackedBatch, mesh: Mesh, batch_size: int, rows=None) -> PackedBatch:
    """Host rows -> global arrays sharded over (data, fsdp). `batch_np` holds the global batch rows `rows`
    (sorted; default all); each process passes at least the rows of its own devices (`local_rows`)."""
    where = None if rows is None else {r: i for i, r in enumerate(rows)}

    def take(a, idx):
        if where is None:
            return a[idx]
        picked = [where[r] for r in range(*idx[0].indices(batch_size))]
        return a[picked][(slice(None),) + tuple(idx[1:])]
    arrays = (np.asarray(a, np.int32) for a in batch_np)
    return PackedBatch(*(jax.make_array_from_callback((batch_size,) + a.shape[1:], s, lambda idx, a=a: take(a, idx))
                         for a, s in zip(arrays, batch_shardings(mesh, batch_size))))
