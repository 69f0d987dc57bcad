"""Resuming a run from its directory: the settings it was started with must still hold (`check_settings`), and the
newest checkpoint that restores is the one resumed, damaged newer ones set aside (`restore_good`)."""
from __future__ import annotations

import json
from pathlib import Path

import jax

from ..config import ConfigError, changed_settings
from .checkpoint import Checkpointer
from .config import RESUME_NEUTRAL, TrainConfig
from .step import TrainState

SETTINGS_FILE = "train_config.json"


def check_settings(cfg: TrainConfig, run_dir: Path, resume: int) -> None:
    """A resumed run keeps the settings it was started with (train_config.json), but for RESUME_NEUTRAL keys and
    `cfg.allow_changes`. A missing or unreadable train_config.json is refused too (the check would be off) unless
    allow_changes names it."""
    saved = run_dir / SETTINGS_FILE
    if SETTINGS_FILE in cfg.allow_changes:
        return
    hint = (f"restore it, resume without the settings check with allow_changes=[{SETTINGS_FILE}], or use another "
            "out_dir")
    if not saved.is_file():
        raise ConfigError(f"{run_dir} holds checkpoints (up to step {resume}) but no {SETTINGS_FILE}, so the "
                          f"settings cannot be checked against the run's; {hint}")
    try:
        train = json.loads(saved.read_text())["train"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ConfigError(f"{saved} is unreadable ({type(e).__name__}: {str(e)[:200]}); {hint}") from None
    diff = changed_settings(train, cfg, RESUME_NEUTRAL + cfg.allow_changes)
    if diff:
        raise ConfigError(f"{run_dir} holds a run with other settings ({'; '.join(diff)}): resume it with the same "
                          "ones, allow a change on purpose with allow_changes=[key, ...], or use another out_dir")


def restore_good(ckpt: Checkpointer, abstract: TrainState) -> tuple[int, TrainState, dict]:
    """(step, state, data position) of the newest checkpoint that restores. A newer one that does not is reported
    (which step, which file), set aside to <checkpoints>.damaged/ and skipped, saying so; when none restores, the
    newest one's problem is a ConfigError (a damaged checkpoint, or one of another configuration)."""
    steps = sorted(ckpt.manager.all_steps(), reverse=True)
    failed = []
    for step in steps:
        try:
            state, data_state = ckpt.restore(abstract, step)
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for a damaged file
            failed.append((step, e))
            continue
        for bad, err in failed:
            problem = ckpt.damage(bad, err)
            where = ckpt.set_aside(bad) if jax.process_index() == 0 else None
            print(f"warning: checkpoint step {bad} cannot be restored: {problem}; "
                  f"{f'moved it to {where}; ' if where else ''}resuming from the previous good one, step {step}",
                  flush=True)
        return step, state, data_state
    step, e = failed[0]
    problem = ckpt.damage(step, e)
    if problem.startswith(f"{ckpt.directory / str(step)} is unreadable"):  # no sign of damage: another config
        problem = (f"it does not match this model/optimizer configuration ({type(e).__name__}: {str(e)[:300]})"
                   + (f", nor do the {len(failed) - 1} older one(s)" if len(failed) > 1 else ""))
    raise ConfigError(f"cannot resume from checkpoint step {step} in {str(ckpt.directory)!r}: {problem}; use the "
                      "configuration it was written with, move the damaged checkpoint away, or use another out_dir")
