"""Device meshes and logical-axis sharding rules, shared by training and decoding.

Parameters carry logical axis names (`ParamSpec.axes` in sbd_jax/models/transformer.py); `DEFAULT_RULES` maps
them onto the mesh axes ("data", "fsdp", "tensor"). A dimension whose size the mesh axis does not
divide is replicated instead (so e.g. 8 KV heads on a tensor axis of 16 still works).

`mesh_context(mesh)` makes a mesh ambient while tracing (the training step and the decoder enter it
when given a mesh); the Pallas attention kernels, opaque to XLA's partitioner, read it to run per
shard inside `jax.shard_map` (sbd_jax/attention/sharded.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ConfigError, ModelConfig
from .models.transformer import param_specs

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
    "cache_len": None,
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape; -1 on one axis = all remaining devices. Same options for train.py and decode.py."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


def maybe_initialize_distributed() -> bool:
    """Call `jax.distributed.initialize()` when the environment describes a multi-process job; returns
    True if it did. Triggers: SBD_DISTRIBUTED=1 (explicit; e.g. Cloud TPU pods, which jax detects through
    the metadata server), JAX_COORDINATOR_ADDRESS (+ JAX_NUM_PROCESSES / JAX_PROCESS_ID, passed on
    explicitly), a SLURM job with more than one task, or an Open MPI / PMIx launch with more than one rank.
    SBD_DISTRIBUTED=0 disables it."""
    env = os.environ
    if env.get("SBD_DISTRIBUTED") == "0":
        return False
    multi = (env.get("SBD_DISTRIBUTED") == "1" or "JAX_COORDINATOR_ADDRESS" in env
             or int(env.get("SLURM_NTASKS", "1")) > 1
             or int(env.get("OMPI_COMM_WORLD_SIZE", env.get("PMIX_SIZE", "1"))) > 1)
    if not multi:
        return False
    kwargs = {}
    if "JAX_COORDINATOR_ADDRESS" in env:
        kwargs["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
        if "JAX_NUM_PROCESSES" in env:
            kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
        if "JAX_PROCESS_ID" in env:
            kwargs["process_id"] = int(env["JAX_PROCESS_ID"])
    jax.distributed.initialize(**kwargs)
    return True


def make_mesh(cfg: MeshConfig | None = None, devices=None) -> Mesh:
    cfg = cfg or MeshConfig()
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    shape = [cfg.data, cfg.fsdp, cfg.tensor]
    if sum(s == -1 for s in shape) > 1:
        raise ConfigError(f"mesh {shape}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in shape):
        raise ConfigError(f"mesh {shape}: axis sizes must be >= 1 (or -1 for 'the rest')")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if n % known:
            raise ConfigError(f"mesh {dict(zip(MESH_AXES, shape))} does not divide the {n} devices")
        shape[shape.index(-1)] = n // known
    if int(np.prod(shape)) != n:
        raise ConfigError(f"mesh {dict(zip(MESH_AXES, shape))} needs {int(np.prod(shape))} devices, "
                          f"but {n} are available")
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_to_spec(axes: tuple, shape: tuple, mesh: Mesh, rules=None) -> P:
    rules = DEFAULT_RULES if rules is None else rules
    spec, used = [], set()
    for name, dim in zip(axes, shape):
        target = rules.get(name) if name is not None else None
        if target is None:
            spec.append(None)
            continue
        names = (target,) if isinstance(target, str) else tuple(target)
        names = tuple(a for a in names if a not in used and mesh.shape[a] > 1)
        size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
        if not names or dim % size:
            spec.append(None)
            continue
        used.update(names)
        spec.append(names[0] if len(names) == 1 else names)
    return P(*spec)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules=None) -> dict:
    return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_spec(s.logical_axes, s.shape(cfg), mesh, rules)),
                        param_specs(cfg))


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh, rules=None) -> dict:
    return jax.device_put(params, param_shardings(cfg, mesh, rules))


def batch_sharding(mesh: Mesh, ndim: int = 2, batch_size: int | None = None) -> NamedSharding:
    """Leading (batch) dim over data x fsdp; replicated if the batch does not divide."""
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    n = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if not axes or (batch_size is not None and batch_size % n):
        return NamedSharding(mesh, P(*([None] * ndim)))
    return NamedSharding(mesh, P(axes if len(axes) > 1 else axes[0], *([None] * (ndim - 1))))


def cache_sharding(cfg: ModelConfig, mesh: Mesh, batch_size: int) -> NamedSharding:
    """KV cache [L, B, S, K, Dh]: batch over data/fsdp, KV heads over tensor (matching wk/wv)."""
    b = batch_sharding(mesh, 1, batch_size).spec[0]
    kv = logical_to_spec(("kv_heads",), (cfg.num_key_value_heads,), mesh)[0]
    return NamedSharding(mesh, P(None, b, None, kv, None))


def mesh_context(mesh: Mesh | None):
    """Context manager making `mesh` the ambient mesh (`jax.sharding.get_abstract_mesh()`) while
    tracing; usable inside `jax.jit` (unlike `jax.set_mesh`). A no-op for None. Set by the training
    step and the decoder so that `attention_impl="pallas"` runs per shard (sbd_jax/attention/sharded.py)."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
