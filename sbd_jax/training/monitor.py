"""What the training loop reads back from the steps it dispatched, without waiting on the host per step:
`FiniteGuard` (the steps' non-finite flags) and `MetricsLog` (the logged steps' metrics)."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from .config import TrainConfig
from .step import NONFINITE, NonFiniteStepError


class FiniteGuard:
    """The `nonfinite` flags of the steps dispatched since the last check (device scalars, read only where the loop
    waits anyway: a logged step's metrics, before a checkpoint, at the end). A step that was not finite kept the
    previous parameters (step.py); `check` stops the run there with `NonFiniteStepError`."""

    def __init__(self, cfg: TrainConfig, directory: Path):
        self.cfg, self.directory, self.pending = cfg, directory, []
        self.failed: tuple | None = None  # (step, NONFINITE code, metrics) of the step that stopped the run

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, metrics))

    def check(self, last_good: int | None, upto: int | None = None) -> None:
        todo = [(s, m) for s, m in self.pending if upto is None or s <= upto]
        self.pending = self.pending[len(todo):]
        codes = jax.device_get([m["nonfinite"] for _, m in todo])
        for (step, m), code in zip(todo, codes):
            if int(code):
                self.failed = (step, int(code), m)
                raise NonFiniteStepError(self.message(last_good), step)

    def message(self, last_good: int | None, note: str = "") -> str:
        """What failed (`self.failed`), `note`, and where a rerun resumes (`last_good`: a checkpoint step)."""
        step, code, m = self.failed
        v = {k: float(x) for k, x in jax.device_get({"loss": m["loss"], "grad_norm": m["grad_norm"]}).items()}
        where = (f"rerunning the same command resumes from the last good checkpoint, step {last_good} in "
                 f"{self.directory}" if last_good is not None else
                 "no checkpoint was written before it, so rerunning starts over")
        return (f"step {step}: {NONFINITE[code]} is not finite (loss {v['loss']:.4g}, gradient norm "
                f"{v['grad_norm']:.4g}); its update was not applied and nothing after it was saved. {note}"
                f"{where[0].upper()}{where[1:]}; to get past it lower the learning rate, e.g. "
                f"optim.lr={self.cfg.optim.lr / 10:g} allow_changes=[optim.lr] (or set optim.clip_norm, or check the "
                "data)")


class MetricsLog:
    """The metrics of every `log_every`-th step and of the `end` step: read once the next step is dispatched (they
    are ready while it runs), checked finite (`guard`), kept in `history`, appended to `path` (None: not written,
    e.g. on processes other than 0), passed to `on_log` and shown on the progress `bar`."""

    def __init__(self, cfg: TrainConfig, end: int, guard: FiniteGuard, path: Path | None,
                 on_log: Callable[[dict], Any] | None, bar):
        self.every, self.end, self.guard, self.path, self.on_log, self.bar = cfg.log_every, end, guard, path, on_log, bar
        self.history: list[dict] = []
        self.pending: tuple | None = None  # (step, metrics, tokens) of the logged step not read yet
        self.tokens, self.t0 = 0.0, time.perf_counter()  # since the last logged step

    def after_step(self, step: int, metrics: dict, tokens: float, last_saved: int | None) -> None:
        """A step was dispatched (`tokens`: the tokens of its batch): read the pending logged step's metrics, and
        hold this step's when it is logged."""
        self.guard.add(step, metrics)
        self.tokens += tokens
        self.flush(last_saved)
        if step % self.every == 0 or step == self.end:
            self.pending, self.tokens = (step, metrics, self.tokens), 0.0
        self.bar.update(1)

    def flush(self, last_saved: int | None) -> None:
        """Log the pending step, if any (`last_saved`: the last checkpoint, named when a step was not finite)."""
        if self.pending is not None:
            (step, metrics, tokens), self.pending = self.pending, None
            self.guard.check(last_saved, upto=step)
            self.write(self.record(step, metrics, tokens))

    def record(self, step: int, metrics: dict, tokens: float) -> dict:
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        dt, self.t0 = now - self.t0, now
        return {"step": step, **m, "k": int(m["k"]), "nonfinite": int(m["nonfinite"]),
                "tokens_per_s": tokens / max(dt, 1e-9), "time": time.time()}

    def write(self, rec: dict) -> None:
        self.history.append(rec)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if self.on_log:
            self.on_log(rec)
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", ntp=f"{rec['ntp_loss']:.3f}", matp=f"{rec['matp_loss']:.3f}",
                             tok_s=f"{rec['tokens_per_s']:.0f}", lr=f"{rec.get('lr', 0):.2e}", refresh=False)


def trim_metrics(path: Path, last: int) -> None:
    """Drop the records of steps after `last` from a metrics.jsonl (a resumed run redoes them)."""
    if path.exists():
        kept = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last]
        path.write_text("".join(ln + "\n" for ln in kept))
