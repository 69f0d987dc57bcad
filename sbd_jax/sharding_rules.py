"""The logical-axis rules (MaxText-style): which mesh axes each logical axis name is split over. Parameters
(`ParamSpec.axes`), batches, the KV cache and the Pallas attention wrapper (sbd_jax/attention/sharded.py) all take
their layouts from here, so changing a rule changes every one of them. `sbd_jax.sharding` re-exports these names;
they live in this small module because sharding.py imports the model, which imports the attention package."""
from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes, used together); axes not named here are replicated
DEFAULT_RULES: dict[str, str | tuple[str, ...]] = {
    "batch": ("data", "fsdp"), "vocab": "tensor", "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor",
    "mlp": "tensor"}


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


def spec_entry(names: tuple[str, ...]):
    """One PartitionSpec entry for these mesh axes: None, a name, or a tuple of names."""
    return None if not names else names[0] if len(names) == 1 else names
