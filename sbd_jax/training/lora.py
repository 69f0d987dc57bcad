"""A LoRA run's pieces for the training loop: the frozen base with its fingerprint (`LoRARun`), the check that a
checkpoint's adapter was trained on this base, and the export (the adapter in PEFT's layout, on request the merged
model). The adapter itself and how the forward reads it: sbd_jax/models/lora.py."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from ..config import ConfigError
from ..models.config import ModelConfig
from ..io.hf import save_pretrained
from ..io.peft import save_adapter
from ..models.fingerprint import base_fingerprint
from ..models.lora import AdapterLayout, merge
from ..sharding import shard_params
from .config import TrainConfig
from .model_source import prepare_base


@dataclasses.dataclass(frozen=True)
class LoRARun:
    base: dict  # the frozen weights, sharded, in lora.base_dtype (with the added mask row, model.add_mask_token)
    layout: AdapterLayout
    fingerprint: str  # of the base as loaded (sbd_jax/models/fingerprint.py)
    source: str  # where the base came from, for messages

    @property
    def meta(self) -> dict:
        """What every checkpoint of the run records of its base."""
        return {"base_fingerprint": self.fingerprint, "base": self.source}


def prepare_lora(cfg: TrainConfig, mesh, model: tuple[ModelConfig, dict] | None = None) -> tuple[ModelConfig, LoRARun]:
    """The run's ModelConfig (master dtype: the adapter's) and its frozen base: from cfg.model, or `model` (the
    parameters given to `train(model=...)`)."""
    if model is None:
        model_cfg, base, fingerprint = prepare_base(cfg.model, cfg.seed, mesh, cfg.lora.base_dtype)
        mask_row = model_cfg.mask_token_id if cfg.model.add_mask_token else None
        source = cfg.model.init_from or f"model.config, random init with seed {cfg.seed}"
        return model_cfg, LoRARun(base, cfg.lora.layout(mask_row), fingerprint, source)
    model_cfg, params = model
    dtype = cfg.lora.base_dtype or model_cfg.param_dtype
    base = shard_params(jax.tree.map(lambda x: jnp.asarray(x, dtype), params), model_cfg, mesh)
    return model_cfg, LoRARun(base, cfg.lora.layout(), base_fingerprint(base), "the parameters given to train()")


def check_base(run: LoRARun, meta: dict | None, where: Path) -> None:
    """Refuse to resume a checkpoint whose adapter was trained on another base (or that holds no adapter)."""
    if meta is None or "base_fingerprint" not in meta:
        raise ConfigError(f"the checkpoint in {str(where)!r} holds no LoRA adapter (a full fine-tune's?): resume it "
                          "without lora settings, or use another out_dir")
    if meta["base_fingerprint"] != run.fingerprint:
        raise ConfigError(f"the LoRA checkpoint in {str(where)!r} was trained on base weights "
                          f"{meta['base_fingerprint']} ({meta.get('base')}); this run's base ({run.source}) is "
                          f"{run.fingerprint}: resume with the base it was trained on, or use another out_dir")


def export_lora(run: LoRARun, model_cfg: ModelConfig, adapter: dict, out_dir: Path, cfg: TrainConfig) -> list[Path]:
    """<out_dir>/adapter (PEFT layout + the base's fingerprint) and, with lora.export_merged, <out_dir>/hf (the
    merged full model, `save_pretrained`). Every process must call it."""
    dtype = cfg.checkpoint.export_dtype
    base_name = cfg.model.init_from
    if base_name is None:  # a random base exists nowhere else: without it the adapter could not be used
        base_name = str(save_pretrained(*_base_as_loaded(run, model_cfg), out_dir / "base", dtype=dtype))
        if jax.process_index() == 0:
            print(f"LoRA on a randomly initialised base (no model.init_from): the base is saved to {base_name}, "
                  "the one model its adapter applies to", flush=True)
    dirs = [save_adapter(out_dir / "adapter", model_cfg, run.layout, adapter, fingerprint=run.fingerprint,
                         base_name=base_name, dtype=dtype)]
    if cfg.lora.export_merged:
        dirs.append(save_pretrained(model_cfg, merge(run.base, adapter, run.layout), out_dir / "hf", dtype=dtype))
    return dirs


def _base_as_loaded(run: LoRARun, model_cfg: ModelConfig) -> tuple[ModelConfig, dict]:
    """The frozen base as its fingerprint was taken: without the `<m>` row the run added (model.add_mask_token)."""
    base = run.base
    if run.layout.mask_row is None:
        return model_cfg, base
    row = run.layout.mask_row
    base = {**base, "embed": base["embed"][:row]} | ({"lm_head": base["lm_head"][:, :row]} if "lm_head" in base else {})
    return dataclasses.replace(model_cfg, vocab_size=row, mask_token_id=None), base

