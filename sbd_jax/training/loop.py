"""The training loop shared by train.py and the demo: model + data + mesh + optimizer + checkpoints.

    result = train(train_cfg)                       # everything from the config
    result = train(train_cfg, data=my_iterator,     # or bring your own data / tokenizer / model
                   model=(model_cfg, params), out_dir="runs/x")

It resumes from the latest complete checkpoint in `<out_dir>/checkpoints`, logs metrics to
`<out_dir>/metrics.jsonl`, saves every `checkpoint.every` steps and at the end, and exports the final
weights in HF layout to `<out_dir>/hf`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from ..config import ConfigError, ModelConfig, changed_settings, to_dict
from ..io.hf import save_generation_files, save_pretrained
from ..io.tokenizer import Tokenizer
from ..models.lora import AdapterLayout, init_adapter
from ..sharding import make_mesh, param_shardings, shard_params
from .checkpoint import Checkpointer
from .config import RESUME_NEUTRAL, TrainConfig
from .data import DataError, build_iterator, format_report
from .lora import LoRARun, check_base, export_lora, prepare_lora
from .model_source import prepare_model
from .optim import make_optimizer
from .spec import StepOptions
from .step import (NONFINITE, NonFiniteStepError, TrainState, WithBase, abstract_state, jit_train_step, local_rows,
                   make_train_step, put_batch, state_initializer, state_shardings)


@dataclasses.dataclass
class TrainResult:
    model_cfg: ModelConfig
    state: TrainState
    history: list[dict]  # the logged metrics of this call
    out_dir: Path
    hf_dir: Path | None  # the HF export (None if not exported, e.g. stopped early; a LoRA run's merged model)
    resumed_from: int | None  # checkpoint step this call started from
    step_compilations: int  # programs compiled for the train step so far (1: every k shared one)
    adapter_dir: Path | None = None  # a LoRA run's adapter export (PEFT layout); state.params is the adapter

    @property
    def params(self) -> dict:
        return self.state.params

    @property
    def step(self) -> int:
        return int(self.state.step)


@functools.lru_cache(maxsize=8)
def _compiled(model_cfg: ModelConfig, opts: StepOptions, optim_cfg, total_steps: int, mesh, batch_size: int,
              layout: AdapterLayout | None = None):
    """(tx, state shardings, jitted step, jitted state init) for one setting, reused across `train`
    calls in a process (resume, the demo's several runs) instead of recompiling. With a LoRA `layout` the state
    holds the adapter and the step takes the frozen base (sharded like the full model's weights) third."""
    tx, schedule = make_optimizer(optim_cfg, total_steps)
    shardings = state_shardings(model_cfg, tx, mesh, layout=layout)
    base_sh = None if layout is None else param_shardings(model_cfg, mesh)
    step_fn = jit_train_step(make_train_step(model_cfg, opts, tx, schedule, mesh, layout), mesh, shardings,
                             batch_size, base_sh)
    return tx, shardings, step_fn, state_initializer(tx, shardings)


def train(cfg: TrainConfig, *, data=None, tokenizer=None, model: tuple[ModelConfig, dict] | None = None,
          out_dir: str | Path | None = None, stop_after: int | None = None, devices=None,
          on_log: Callable[[dict], Any] | None = None) -> TrainResult:
    """Train (or resume) until `cfg.steps`. `data`: an object with `next_batch() -> PackedBatch` (numpy
    [batch_size, L]), `state() -> dict` and `restore(dict)` (default: built from cfg.data).
    `model`: (ModelConfig, params) instead of cfg.model (ignored when resuming, except its config).
    `stop_after`: leave after this many total steps without the final save/export (as if killed)."""
    out_dir = make_out_dir(Path(out_dir or cfg.out_dir).absolute())
    mesh = make_mesh(cfg.mesh, devices)
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.batch_size // cfg.optim.grad_accum
    if micro % n_batch:
        raise ConfigError(f"batch_size / optim.grad_accum = {micro} rows per microbatch do not divide over the "
                          f"data x fsdp = {n_batch} devices of mesh {dict(mesh.shape)}")
    ckpt = Checkpointer(out_dir / "checkpoints", every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save)
    try:
        return _run(cfg, ckpt, *_setup(cfg, ckpt, data, tokenizer, model, mesh), mesh, out_dir, stop_after, on_log,
                    tokenizer)
    finally:
        ckpt.close()  # waits for in-flight saves: a Ctrl-C leaves the last started checkpoint complete


def make_out_dir(out_dir: Path) -> Path:
    """Create the run directory; a path under a regular file, or that is one, is a ConfigError naming it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out_dir {str(out_dir)!r} cannot be created: {e.strerror} ({e.filename})") from None
    if not out_dir.is_dir():
        raise ConfigError(f"out_dir {str(out_dir)!r} is not a directory")
    return out_dir


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


def _setup(cfg: TrainConfig, ckpt: Checkpointer, data, tokenizer, model, mesh):
    """Model, data iterator, compiled step and the initial (or restored) state."""
    resume = ckpt.manager.latest_step()
    if resume is not None:
        check_settings(cfg, ckpt.directory.parent, resume)
    model_cfg, params, lora = _model(cfg, model, mesh, resume is None)
    if not cfg.sbd.ntp_only and model_cfg.mask_token_id is None:
        raise ConfigError("the model has no mask token id: set model.mask_token_id to an unused id already in the "
                          "vocabulary (e.g. a reserved special token), or model.add_mask_token=true to grow the "
                          "vocabulary by one row (or train the NTP baseline with sbd.ntp_only=true)")
    if data is None:
        data = build_iterator(cfg.data, cfg.batch_size, tokenizer=tokenizer,
                              eos_id=model_cfg.eos_ids[0] if model_cfg.eos_ids else None,
                              vocab_size=model_cfg.vocab_size, rows=local_rows(mesh, cfg.batch_size),
                              mask_id=None if cfg.sbd.ntp_only else model_cfg.mask_token_id)
        if jax.process_index() == 0:
            print(format_report(data.report), flush=True)
            ckpt.directory.parent.mkdir(parents=True, exist_ok=True)
            (ckpt.directory.parent / "data_report.json").write_text(json.dumps(data.report, indent=2))
    opts, layout = cfg.step_options(model_cfg.mask_token_id), lora.layout if lora else None
    tx, shardings, step_fn, init_fn = _compiled(model_cfg, opts, cfg.optim, cfg.steps, mesh, cfg.batch_size, layout)
    if resume is not None:
        resume, state, data_state = restore_good(ckpt, abstract_state(model_cfg, tx, shardings, layout))
        if lora is not None:
            check_base(lora, ckpt.restore_meta(resume), ckpt.directory)
        data.restore(data_state)
    else:
        if lora is not None:  # A random, B zero: the run starts from the base's own outputs
            params = jax.device_put(init_adapter(model_cfg, layout, jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 2),
                                                 lora.base), shardings.params)
        state = init_fn(params, jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 1))
    return resume, model_cfg, state, data, step_fn if lora is None else WithBase(step_fn, lora.base), lora


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


def _model(cfg: TrainConfig, model, mesh, load_weights: bool) -> tuple[ModelConfig, dict | None, LoRARun | None]:
    """(ModelConfig, the weights to train or None when resuming, the LoRA run): a LoRA run always loads its frozen
    base (the checkpoints hold only the adapter)."""
    if cfg.lora is not None:
        model_cfg, run = prepare_lora(cfg, mesh, model)
        return model_cfg, None, run
    if model is not None:
        return model[0], shard_params(model[1], model[0], mesh) if load_weights else None, None
    return *prepare_model(cfg.model, cfg.seed, mesh, load_weights=load_weights), None


class FiniteGuard:
    """The `nonfinite` flags of the steps dispatched since the last check (device scalars, read only where the loop
    waits anyway: a logged step's metrics, before a checkpoint, at the end). A step that was not finite kept the
    previous parameters (step.py); `check` stops the run there with `NonFiniteStepError`."""

    def __init__(self, cfg: TrainConfig, directory: Path):
        self.cfg, self.directory, self.pending = cfg, directory, []

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, metrics))

    def check(self, last_good: int | None, upto: int | None = None) -> None:
        todo = [(s, m) for s, m in self.pending if upto is None or s <= upto]
        self.pending = self.pending[len(todo):]
        codes = jax.device_get([m["nonfinite"] for _, m in todo])
        for (step, m), code in zip(todo, codes):
            if int(code):
                raise NonFiniteStepError(self.message(step, int(code), m, last_good))

    def message(self, step: int, code: int, m: dict, last_good: int | None) -> str:
        v = {k: float(x) for k, x in jax.device_get({"loss": m["loss"], "grad_norm": m["grad_norm"]}).items()}
        where = (f"rerunning the same command resumes from the last good checkpoint, step {last_good} in "
                 f"{self.directory}" if last_good is not None else
                 "no checkpoint was written before it, so rerunning starts over")
        return (f"step {step}: {NONFINITE[code]} is not finite (loss {v['loss']:.4g}, gradient norm "
                f"{v['grad_norm']:.4g}); its update was not applied and nothing after it was saved. {where[0].upper()}"
                f"{where[1:]}; to get past it lower the learning rate, e.g. optim.lr={self.cfg.optim.lr / 10:g} "
                "allow_changes=[optim.lr] (or set optim.clip_norm, or check the data)")


class _Prefetch:
    """Packs the next batches and puts them on the devices in a background thread while the steps run. Each
    comes with the iterator state after it: what a checkpoint taken after that batch's step saves."""

    def __init__(self, data, place: Callable, scale: float = 1.0, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(data, place, scale), daemon=True, name="prefetch")
        self._thread.start()

    def _fill(self, data, place, scale):
        try:  # tokens: this process's rows' x (global / local rows), for the logged throughput
            while not self._stop.is_set():
                batch = data.next_batch()
                self._put((place(batch), data.state(), scale * float(np.sum(np.asarray(batch.segment) > 0))))
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
            self._put(e)

    def _put(self, item):
        while not self._stop.is_set():
            try:
                return self._queue.put(item, timeout=0.1)
            except queue.Full:
                continue

    def next(self):
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self._stop.set()
        self._thread.join()


def _run(cfg: TrainConfig, ckpt: Checkpointer, resume, model_cfg, state, data, step_fn, lora: LoRARun | None, mesh,
         out_dir, stop_after, on_log, tokenizer=None) -> TrainResult:
    """The step loop. Nothing waits on the host per step: batches are prefetched (`_Prefetch`), the metrics
    of a logged step are read after the next step is dispatched, checkpoints are written by orbax in the
    background; then the final save + HF export."""
    lead = jax.process_index() == 0
    if lead:
        (out_dir / "train_config.json").write_text(json.dumps(
            {"train": to_dict(cfg), "model": to_dict(model_cfg)}, indent=2, default=str))
    start = int(state.step)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    history: list[dict] = []
    metrics_path = out_dir / "metrics.jsonl"
    if lead and resume is not None and metrics_path.exists():  # drop records of steps redone after the resume
        kept = [ln for ln in metrics_path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume]
        metrics_path.write_text("".join(ln + "\n" for ln in kept))
    window_tokens, t0 = 0.0, time.perf_counter()

    rows = getattr(data, "rows", None)  # the batch rows the iterator packs (this process's), or all of them
    rows = None if rows is None or len(rows) == cfg.batch_size else rows

    def place(batch_np):
        n = cfg.batch_size if rows is None else len(rows)
        if np.ndim(batch_np.tokens) != 2 or len(batch_np.tokens) != n:
            raise DataError(f"the data iterator yields batches of shape {np.shape(batch_np.tokens)}, expected "
                            f"[{n}, L] (batch_size={cfg.batch_size}" + (")" if rows is None else
                                                                        f", {n} rows on this process)"))
        return put_batch(batch_np, mesh, cfg.batch_size, rows)

    guard = FiniteGuard(cfg, ckpt.directory)

    def log(step, m, tokens):
        nonlocal t0
        guard.check(last_saved, upto=step)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        dt, t0 = time.perf_counter() - t0, time.perf_counter()
        rec = {"step": step, **m, "k": int(m["k"]), "nonfinite": int(m["nonfinite"]),
               "tokens_per_s": tokens / max(dt, 1e-9), "time": time.time()}
        history.append(rec)
        if lead:
            with metrics_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if on_log:
            on_log(rec)
        pbar.set_postfix(loss=f"{rec['loss']:.3f}", ntp=f"{rec['ntp_loss']:.3f}", matp=f"{rec['matp_loss']:.3f}",
                         tok_s=f"{rec['tokens_per_s']:.0f}", lr=f"{rec.get('lr', 0):.2e}", refresh=False)

    last_saved, pending, data_state, meta = resume, None, None, lora.meta if lora else None
    prefetch = _Prefetch(data, place, cfg.batch_size / (cfg.batch_size if rows is None else len(rows))) \
        if start < end else None
    try:
        with tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True,
                  disable=not (cfg.progress and lead and start < end)) as pbar:
            for i in range(start, end):
                batch, data_state, tokens = prefetch.next()
                state, m = step_fn(state, batch)
                step = i + 1
                guard.add(step, m)
                window_tokens += tokens
                if pending is not None:  # the previous logged step's metrics, read while this step runs
                    log(*pending)
                    pending = None
                if step % cfg.log_every == 0 or step == end:
                    pending, window_tokens = (step, m, window_tokens), 0.0
                pbar.update(1)
                if ckpt.due(step):  # only finite state is saved
                    guard.check(last_saved)
                    last_saved = step if ckpt.save(step, state, data_state, meta=meta) else last_saved
            if pending is not None:
                log(*pending)
            guard.check(last_saved)
    finally:
        if prefetch is not None:
            prefetch.close()
    hf_dir = adapter_dir = None
    if end == cfg.steps:
        if last_saved != cfg.steps and end > start:
            ckpt.save(cfg.steps, state, data_state, force=True, meta=meta)
        if cfg.checkpoint.export_hf:
            hf_dir, adapter_dir = _export(cfg, model_cfg, state.params, lora, out_dir, tokenizer)
    return TrainResult(model_cfg, state, history, out_dir, hf_dir, resume, step_fn._cache_size(), adapter_dir)


def _export(cfg: TrainConfig, model_cfg: ModelConfig, params, lora: LoRARun | None, out_dir: Path, tokenizer):
    """The final weights in HF layout (<out_dir>/hf), or a LoRA run's adapter (<out_dir>/adapter, + hf merged on
    request), each with the run's tokenizer and stop ids, so that it decodes text as trained -> (hf, adapter)."""
    if lora is None:
        dirs = [save_pretrained(model_cfg, params, out_dir / "hf", dtype=cfg.checkpoint.export_dtype)]
    else:
        dirs = export_lora(lora, model_cfg, params, out_dir, cfg)
    if jax.process_index() == 0:
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else (
            Tokenizer.load(cfg.data.tokenizer) if cfg.data.tokenizer else None)
        for d in dirs:
            save_generation_files(d, model_cfg, tok, chat=cfg.data.chat_template and cfg.data.mode != "text")
    if lora is None:
        return dirs[0], None
    return (dirs[1] if len(dirs) > 1 else None), dirs[0]
