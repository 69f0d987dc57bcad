"""Device meshes and logical-axis sharding rules, shared by training and decoding. Parameters carry logical
axis names (`ParamSpec.axes` in sbd_jax/models/transformer.py); `DEFAULT_RULES` maps them onto the mesh axes
("data", "fsdp", "tensor", and "context" when > 1: a training row's sequence); the rules live in sharding_rules.py
(re-exported here), which the Pallas attention wrapper reads too. A dimension whose size the mesh axis does not
divide is replicated instead (so e.g. 8 KV heads on a tensor axis of 16 still works). `mesh_context` makes a mesh
ambient for the Pallas kernels."""
from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ConfigError
from .models.config import ModelConfig
from .models.params import param_specs
from .sharding_rules import (CONTEXT_AXIS, DEFAULT_RULES, MESH_AXES, context_size,  # noqa: F401 (re-exported)
                             logical_to_spec)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape; -1 on one axis = all remaining devices. Same options for train.py and decode.py."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # context parallelism: each training row's sequence ([x ; x_hat], 2L tokens) split over this many devices
    # (sbd_jax/attention/context.py). 1: no "context" axis in the mesh at all (the mesh of before)
    context: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            n = getattr(self, axis)
            if not isinstance(n, int) or n == 0 or n < -1:
                raise ConfigError(f"mesh.{axis} must be >= 1 (or -1 for 'the rest'), got {n!r}")


def maybe_initialize_distributed() -> bool:
    """Call `jax.distributed.initialize()` when the environment describes a multi-process job; returns True if it
    did. Triggers: SBD_DISTRIBUTED=1 (explicit; e.g. Cloud TPU pods, which jax detects through the metadata
    server), JAX_COORDINATOR_ADDRESS (+ JAX_NUM_PROCESSES / JAX_PROCESS_ID, passed on explicitly), a SLURM job
    with more than one task, or an Open MPI / PMIx launch with more than one rank. SBD_DISTRIBUTED=0 disables it."""
    env = os.environ
    multi = env.get("SBD_DISTRIBUTED") != "0" and (
        env.get("SBD_DISTRIBUTED") == "1" or "JAX_COORDINATOR_ADDRESS" in env
        or int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", env.get("PMIX_SIZE", "1"))) > 1)
    if not multi:
        return False
    kwargs = {}
    if "JAX_COORDINATOR_ADDRESS" in env:
        kwargs = {"coordinator_address": env["JAX_COORDINATOR_ADDRESS"],
                  **{k: int(env[v]) for k, v in (("num_processes", "JAX_NUM_PROCESSES"),
                                                 ("process_id", "JAX_PROCESS_ID")) if v in env}}
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in env:  # CPU devices of different processes talk through gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True


def make_mesh(cfg: MeshConfig | None = None, devices=None) -> Mesh:
    """The device mesh of `cfg`, axes in MESH_AXES order; the "context" axis only when cfg.context > 1 (so a
    context-1 mesh is exactly the 3-axis mesh of before)."""
    cfg = cfg or MeshConfig()
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    shape = [getattr(cfg, a) for a in MESH_AXES]
    if sum(s == -1 for s in shape) > 1:
        raise ConfigError(f"mesh {shape}: at most one axis may be -1")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if n % known:
            raise ConfigError(f"mesh {_described(shape)} does not divide the {n} devices")
        shape[shape.index(-1)] = n // known
    if int(np.prod(shape)) != n:
        raise ConfigError(f"mesh {_described(shape)} needs {int(np.prod(shape))} devices, but {n} are available")
    names = [a for a, s in zip(MESH_AXES, shape) if a != CONTEXT_AXIS or s > 1]
    return Mesh(np.asarray(devices).reshape([s for a, s in zip(MESH_AXES, shape) if a in names]), tuple(names))


def _described(shape) -> dict:
    return {a: s for a, s in zip(MESH_AXES, shape) if a != CONTEXT_AXIS or s != 1}


def spec_shardings(specs: dict, cfg: ModelConfig, mesh: Mesh, rules=None) -> dict:
    """NamedShardings of a tree of specs (anything with `.logical_axes` and `.shape(cfg)`: the model's ParamSpecs,
    a LoRA adapter's AdapterSpecs) by the logical-axis rules."""
    return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_spec(s.logical_axes, s.shape(cfg), mesh, rules)),
                        specs)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules=None) -> dict:
    return spec_shardings(param_specs(cfg), cfg, mesh, rules)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh, rules=None) -> dict:
    """`params` laid out by the rules; an attached (copy-only) LoRA weight's base as its weight, its small A and B
    replicated."""
    from .models.lora import LoRAWeight

    def put(x, sh):
        if isinstance(x, LoRAWeight):
            return dataclasses.replace(x, w=jax.device_put(x.w, sh), a=jax.device_put(x.a, NamedSharding(mesh, P())),
                                       b=jax.device_put(x.b, NamedSharding(mesh, P())))
        return jax.device_put(x, sh)
    return jax.tree.map(put, params, param_shardings(cfg, mesh, rules), is_leaf=lambda x: isinstance(x, LoRAWeight))


def batch_sharding(mesh: Mesh, ndim: int = 2, batch_size: int | None = None) -> NamedSharding:
    """Leading (batch) dim by the "batch" rule (data x fsdp); replicated if the batch does not divide."""
    batch = logical_to_spec(("batch",), (mesh.size if batch_size is None else batch_size,), mesh)
    return NamedSharding(mesh, P(*batch, *([None] * (ndim - 1))))


def cache_sharding(cfg: ModelConfig, mesh: Mesh, batch_size: int) -> NamedSharding:
    """KV cache [L, B, S, K, Dh]: batch over data/fsdp, KV heads over tensor (matching wk/wv)."""
    axes, dims = (None, "batch", None, "kv_heads", None), (0, batch_size, 0, cfg.num_key_value_heads, 0)
    return NamedSharding(mesh, logical_to_spec(axes, dims, mesh))


def mesh_context(mesh: Mesh | None):
    """Context manager making `mesh` the ambient mesh (`jax.sharding.get_abstract_mesh()`) while
    tracing; usable inside `jax.jit` (unlike `jax.set_mesh`). A no-op for None. Set by the training
    step and the decoder so that `attention_impl="pallas"` runs per shard (sbd_jax/attention/sharded.py)."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
