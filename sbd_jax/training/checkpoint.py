"""orbax checkpoints of the TrainState plus the data iterator position (JSON), keeping the last K; and the
final export to HF layout. orbax renames a step's temporary directory to `<step>` only once it is complete,
so a process killed mid-save leaves the previous step restorable (tests/test_training_loop.py, SIGKILL)."""
from __future__ import annotations

import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from ..config import ModelConfig
from ..io.hf import save_pretrained
from .step import TrainState


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` (`.manager`) with items "state" (pytree) and "data" (JSON)."""

    def __init__(self, directory: str | os.PathLike, *, every: int = 500, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def save(self, step: int, state: TrainState, data_state: dict, *, force: bool = False) -> bool:
        """Save if `step` is on the interval (or `force`). Returns whether a save started."""
        return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state._asdict()),
                                                               data=ocp.args.JsonSave(data_state)),
                                 force=force)

    def restore(self, abstract: TrainState, step: int) -> tuple[TrainState, dict]:
        """Restore `step` into the structure/shardings of `abstract` (ShapeDtypeStructs with shardings)."""
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract._asdict()), data=ocp.args.JsonRestore()))
        return TrainState(**out["state"]), dict(out["data"])

    def restore_data(self) -> dict:
        """Only the data iterator position saved with the latest step."""
        args = ocp.args.Composite(data=ocp.args.JsonRestore())
        return dict(self.manager.restore(self.manager.latest_step(), args=args)["data"])

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def export_hf(cfg: ModelConfig, params: dict, out_dir: str | os.PathLike, *, dtype: str | None = None) -> Path | None:
    """Write the params in HF layout (config.json with mask_token_id + safetensors). With several
    processes the params are gathered and process 0 writes."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        params = multihost_utils.process_allgather(params, tiled=True)
        if jax.process_index() != 0:
            return None
    return save_pretrained(cfg, params, out_dir, dtype=dtype)
