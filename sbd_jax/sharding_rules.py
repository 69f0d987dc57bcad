"""The logical-axis rules (MaxText-style): which mesh axes each logical axis name is split over. Parameters
(`ParamSpec.axes`), batches, the KV cache and the Pallas attention wrapper (sbd_jax/attention/sharded.py) all take
their layouts from here, so changing a rule changes every one of them. `sbd_jax.sharding` re-exports these names;
they live in this small module because sharding.py imports the model, which imports the attention package."""
from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

# "context" splits each training row's sequence (context parallelism, sbd_jax/attention/context.py); it sits
# next to "tensor" so both per-layer collectives stay on the fastest links. A mesh holds it only when > 1.
MESH_AXES = ("data", "fsdp", "context", "tensor")
CONTEXT_AXIS = "context"

# logical axis -> mesh axis (or axes, used together); axes not named here are replicated. Weights ("embed") are
# split over the context axis too (ZeRO-3 over fsdp x context): its devices hold the same rows, not more weights
DEFAULT_RULES: dict[str, str | tuple[str, ...]] = {
    "batch": ("data", "fsdp"), "seq": CONTEXT_AXIS, "vocab": "tensor", "embed": ("fsdp", CONTEXT_AXIS),
    "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor"}


def rule_axes(name, mesh, rules=None, skip=()) -> tuple[str, ...]:
    """The mesh axes the rule for logical axis `name` may split over: named by the rule, in `mesh` with size > 1
    and not in `skip` (e.g. axes already manual inside a shard_map). () for None or an axis without a rule."""
    target = (DEFAULT_RULES if rules is None else rules).get(name) or ()
    return tuple(a for a in ((target,) if isinstance(target, str) else target)
                 if a not in skip and mesh.shape.get(a, 1) > 1)


def logical_to_spec(axes: tuple, shape: tuple, mesh, rules=None, skip=()) -> P:
    """PartitionSpec of an array with these logical axes (None: replicated) and shape, by `rules`. A dimension
    whose size its mesh axes do not divide is replicated; a mesh axis splits at most one dimension."""
    spec, used = [], set(skip)
    for name, dim in zip(axes, shape):
        names = rule_axes(name, mesh, rules, used)
        if not names or dim % math.prod(mesh.shape[a] for a in names):
            spec.append(None)
            continue
        used.update(names)
        spec.append(spec_entry(names))
    return P(*spec)


def context_size(mesh) -> int:
    """Devices the context axis splits a row over: its size in `mesh` (a Mesh or an AbstractMesh), 1 when the mesh
    is None, has no such axis, or the axis is already manual (inside a shard_map)."""
    if mesh is None or CONTEXT_AXIS in (getattr(mesh, "manual_axes", ()) or ()):
        return 1
    return int(dict(mesh.shape).get(CONTEXT_AXIS, 1))


def spec_entry(names: tuple[str, ...]):
    """One PartitionSpec entry for these mesh axes: None, a name, or a tuple of names."""
    return None if not names else names[0] if len(names) == 1 else names
