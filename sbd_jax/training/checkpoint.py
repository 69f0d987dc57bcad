"""orbax checkpoints of the TrainState plus the data iterator position (JSON), keeping the last K. orbax renames
a step's temporary directory to `<step>` only once it is complete, so a process killed mid-save leaves the
previous step restorable (tests/test_training_loop.py, SIGKILL)."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from .data import gather_state
from .step import TrainState


_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata", "process_0")


def _is_json(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
        return True
    except (ValueError, OSError):
        return False


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and its causes, outermost first (a reader's error wraps the one naming the file)."""
    out = [error]
    while (nxt := out[-1].__cause__ or out[-1].__context__) is not None and nxt not in out and len(out) < 8:
        out.append(nxt)
    return out


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (disk full, no permission...): names the step, the cause and the last
    complete checkpoint; its partial files are removed."""


class _QuietOrbaxErrors(logging.Filter):
    """orbax logs a failed background save as many ERROR records with tracebacks; `Checkpointer` reports the failure
    itself, once, as a CheckpointSaveError."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


_QUIET = _QuietOrbaxErrors()


def _join_by(thread: threading.Thread, deadline: float) -> None:
    """Join `thread` by `deadline`; one just started (listed, not yet running) is joined once it runs."""
    while True:
        try:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
            return
        except RuntimeError:  # "cannot join thread before it is started": it starts within microseconds
            if time.monotonic() >= deadline:
                return
            time.sleep(0.001)


def _remove_partial(directory: Path) -> None:
    """Remove the temporary directories of saves that did not finish (orbax's `*.orbax-checkpoint-tmp*`)."""
    for tmp in directory.glob("*.orbax-checkpoint-tmp*"):
        shutil.rmtree(tmp, ignore_errors=True)


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` (`.manager`) with items "state" (pytree), "data" (JSON) and, for a
    LoRA run, "meta" (JSON: the fingerprint of the frozen base the adapter belongs to). A save that fails (also in
    the background, async) is a CheckpointSaveError at the next `check_saves`, `save` or `close`."""

    def __init__(self, directory: str | os.PathLike, *, every: int = 500, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every, create=True,
                                               enable_async_checkpointing=async_save)
        if jax.process_index() == 0:  # a save cut short before (SIGKILL, a signal mid-write): never complete
            _remove_partial(self.directory)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))
        self.saving: int | None = None  # the step of the save in flight (or last started)
        self._threads: set = set()
        logging.getLogger("absl").addFilter(_QUIET)

    def check_saves(self) -> None:
        """Raise CheckpointSaveError if the save in flight has failed (cheap: waits only on a finished save)."""
        if self.saving is not None and not self.manager.is_saving_in_progress():
            self._finish()

    def _finish(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - whatever the filesystem raised, in orbax's thread
            raise self._failed(e) from None

    def _failed(self, error: BaseException) -> CheckpointSaveError:
        """The error of the failed save of `self.saving`, once its partial (tmp) directories are removed (after the
        save's other writer threads, which orbax does not stop, have ended)."""
        deadline = time.monotonic() + 30.0
        for t in set(threading.enumerate()) - self._threads - {threading.current_thread()}:
            _join_by(t, deadline)
        _remove_partial(self.directory)
        step, self.saving = self.saving, None
        done = sorted(int(p.name) for p in self.directory.iterdir() if p.is_dir() and p.name.isdigit()) \
            if self.directory.is_dir() else []
        root = _chain(error)[-1]
        last = (f"the last complete checkpoint is step {done[-1]} in {self.directory}: rerunning the same command "
                "resumes from it" if done else "no checkpoint is complete: rerunning starts over")
        return CheckpointSaveError(f"the checkpoint of step {step} could not be written ({type(root).__name__}: "
                                   f"{root}); its partial files were removed; {last}")

    def due(self, step: int, force: bool = False) -> bool:
        """Whether `save(step)` would write a checkpoint (on the interval, or `force`)."""
        return force or self.manager.should_save(step)

    def save(self, step: int, state: TrainState, data_state: dict, *, force: bool = False,
             meta: dict | None = None) -> bool:
        """Save if `step` is on the interval (or `force`), with the data position of every process's rows
        (`gather_state`: all processes call this at the same steps) and `meta` when given. Returns whether a save
        started."""
        if not self.due(step, force):
            return False
        data_state = gather_state(data_state)
        extra = {} if meta is None else {"meta": ocp.args.JsonSave(meta)}
        if self.saving is not None:
            self._finish()  # the previous save's failure is its own error, not this one's
        self.saving = step
        self._threads = set(threading.enumerate())  # those after are the save's
        try:
            return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state._asdict()),
                                                                   data=ocp.args.JsonSave(data_state), **extra),
                                     force=force)
        except Exception as e:  # noqa: BLE001 - a synchronous save's (or its directory's) failure, as the
            raise self._failed(e) from None  # filesystem or tensorstore raised it (an OSError, or a ValueError)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (train.py) inside a synchronous save: no partial files left
            self._failed(KeyboardInterrupt())
            raise

    def restore(self, abstract: TrainState, step: int) -> tuple[TrainState, dict]:
        """Restore `step` into the structure/shardings of `abstract` (ShapeDtypeStructs with shardings)."""
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract._asdict()), data=ocp.args.JsonRestore()))
        return TrainState(**out["state"]), dict(out["data"])

    def damage(self, step: int, error: BaseException) -> str:
        """What is wrong with checkpoint `step`, which failed to restore with `error`: an empty directory, a missing
        item, an empty file, or the file the reader names (else the reader's first line)."""
        d = self.directory / str(step)
        files = [f for f in d.rglob("*") if f.is_file()] if d.is_dir() else []
        if not files:
            return f"{d} is empty"
        missing = [i for i in ("state", "data") if not (d / i).is_dir()]
        if missing:
            return f"{d} lacks its {' and '.join(missing)} item"
        empty = [f for f in files if f.stat().st_size == 0]
        if empty:
            return f"file {empty[0]} is empty"
        bad_json = next((f for f in files if f.name in _JSON_FILES and not _is_json(f)), None)
        if bad_json is not None:
            return f"file {bad_json} is not valid JSON (damaged)"
        chain = _chain(error)
        named = next((m.group(0) for e in chain if (m := re.search(re.escape(str(d)) + r"[^\s'\"]*", str(e)))), None)
        root = chain[-1]
        first = next((ln.strip() for ln in str(root).splitlines() if ln.strip()), "")[:400]
        return f"{f'file {named}' if named else d} is unreadable ({type(root).__name__}: {first})"

    def set_aside(self, step: int, why: str = "damaged") -> Path:
        """Move checkpoint `step` out of the way (to <dir>.<why>/<step>, so a later save of that step can happen)
        and forget it -> where it went."""
        dest = self.directory.parent / f"{self.directory.name}.{why}" / str(step)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(self.directory / str(step), dest)
        self.manager.reload()
        return dest

    def restore_meta(self, step: int) -> dict | None:
        """The "meta" item saved with `step` (None when that checkpoint has none: a full fine-tune's)."""
        try:
            return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        except KeyError:
            return None

    def restore_data(self) -> dict:
        """Only the data iterator position saved with the latest step."""
        args = ocp.args.Composite(data=ocp.args.JsonRestore())
        return dict(self.manager.restore(self.manager.latest_step(), args=args)["data"])

    def close(self) -> None:
        try:
            self._finish()
        finally:
            self.manager.close()
