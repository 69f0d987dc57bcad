"""optax AdamW with linear warmup + cosine/linear/constant decay and global-norm clipping. Weight decay only
on matrices and embeddings (`ParamSpec.init` "normal"), not norms or biases. Gradient accumulation is done in
the train step (a scan over microbatches with exact global-token means, see step.py), not by the optimizer."""
from __future__ import annotations

import jax
import optax

from ..models.params import PARAM_SPECS
from .config import OptimConfig

_NO_DECAY = frozenset(s.name.split("/")[-1] for s in PARAM_SPECS if s.init != "normal")


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    decay_steps = max((total_steps if cfg.decay_steps is None else cfg.decay_steps) - cfg.warmup_steps, 1)
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.lr, cfg.lr * cfg.min_lr_ratio, decay_steps)
    else:
        decay = optax.constant_schedule(cfg.lr)
    if cfg.warmup_steps == 0:
        return decay
    # warmup reaches lr at step `warmup_steps` (step 0 uses lr / (warmup+1), never 0)
    warm = optax.linear_schedule(cfg.lr / (cfg.warmup_steps + 1), cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warm, decay], [cfg.warmup_steps])


def decay_mask(params):
    return jax.tree.map_with_path(lambda path, _: str(getattr(path[-1], "key", path[-1])) not in _NO_DECAY, params)


def make_optimizer(cfg: OptimConfig, total_steps: int):
    """-> (optax.GradientTransformation, schedule)."""
    schedule = make_schedule(cfg, total_steps)
    clip = [] if cfg.clip_norm is None else [optax.clip_by_global_norm(cfg.clip_norm)]
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.chain(*clip, adamw), schedule
