"""The training loop shared by train.py and the demo: model + data + mesh + optimizer + checkpoints.

    result = train(train_cfg)                       # everything from the config
    result = train(train_cfg, data=my_iterator,     # or bring your own data / tokenizer / model
                   model=(model_cfg, params), out_dir="runs/x")

It resumes from the latest complete checkpoint in `<out_dir>/checkpoints`, logs metrics to
`<out_dir>/metrics.jsonl`, saves every `checkpoint.every` steps and at the end, and exports the final
weights in HF layout to `<out_dir>/hf`. While it runs, process 0 holds `<out_dir>/train.lock` (sbd_jax/runlock.py):
a second run on the same out_dir is refused, naming the first."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm import tqdm

from ..config import ConfigError, to_dict
from ..models.config import ModelConfig
from ..io.hf import save_generation_files, save_pretrained
from ..io.tokenizer import Tokenizer
from ..models.lora import AdapterLayout, attach, init_adapter
from ..runlock import acquire
from ..sharding import make_mesh, param_shardings, shard_params
from .checkpoint import Checkpointer
from .config import TrainConfig
from .data import DataError, build_iterator, format_report
from .draft_quality import DraftEval
from .lora import LoRARun, check_base, export_lora, prepare_lora
from .model_source import prepare_model
from .monitor import FiniteGuard, MetricsLog, trim_metrics
from .optim import make_optimizer
from .resume import SETTINGS_FILE, check_settings, restore_good
from .spec import StepOptions
from .step import (NonFiniteStepError, TrainState, WithBase, abstract_state, jit_train_step, local_rows,
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


class Traces:
    """Counts the traces of the function it wraps (`wrap`). jit traces, then compiles, a function once per new
    argument signature, so under jit this is how many programs were compiled for it."""

    def __init__(self):
        self.count = 0

    def wrap(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def traced(*args):
            self.count += 1  # runs while tracing only: the compiled program does not call back into Python
            return fn(*args)
        return traced


class CompiledStep(NamedTuple):
    tx: optax.GradientTransformation
    shardings: TrainState  # of the state
    step: Callable  # jitted (state, batch[, base]) -> (state, metrics)
    init: Callable  # jitted (params, rng) -> the initial state
    traces: Traces  # of `step`: TrainResult.step_compilations


@functools.lru_cache(maxsize=8)
def _compiled(model_cfg: ModelConfig, opts: StepOptions, optim_cfg, total_steps: int, mesh, batch_size: int,
              layout: AdapterLayout | None = None) -> CompiledStep:
    """The jitted step and state init for one setting, reused across `train` calls in a process (resume, the demo's
    several runs) instead of recompiling. With a LoRA `layout` the state holds the adapter and the step takes the
    frozen base (sharded like the full model's weights) third."""
    tx, schedule = make_optimizer(optim_cfg, total_steps)
    shardings, traces = state_shardings(model_cfg, tx, mesh, layout=layout), Traces()
    base_sh = None if layout is None else param_shardings(model_cfg, mesh)
    step_fn = jit_train_step(traces.wrap(make_train_step(model_cfg, opts, tx, schedule, mesh, layout)), mesh,
                             shardings, batch_size, base_sh)
    return CompiledStep(tx, shardings, step_fn, state_initializer(tx, shardings), traces)


class Given(NamedTuple):
    """What a `train` caller brought instead of what the config names."""
    data: Any = None  # the data iterator
    tokenizer: Any = None  # a Tokenizer or a callable text -> ids
    model: tuple[ModelConfig, dict] | None = None  # (ModelConfig, params)


@dataclasses.dataclass
class Run:
    """What one `train` call works with, built by `_setup` (the state, which the steps replace, travels apart)."""
    cfg: TrainConfig
    ckpt: Checkpointer
    mesh: Mesh
    out_dir: Path
    model_cfg: ModelConfig
    data: Any  # next_batch() -> PackedBatch, state() -> dict, restore(dict)
    step_fn: Callable  # (state, batch) -> (state, metrics)
    traces: Traces
    lora: LoRARun | None
    resume: int | None  # the checkpoint step this call started from
    tokenizer: Any = None  # as given to `train`, for the export

    @property
    def meta(self) -> dict | None:
        """What each checkpoint records besides the state and data position (a LoRA run's base)."""
        return self.lora.meta if self.lora else None


def train(cfg: TrainConfig, *, data=None, tokenizer=None, model: tuple[ModelConfig, dict] | None = None,
          out_dir: str | Path | None = None, stop_after: int | None = None, devices=None,
          on_log: Callable[[dict], Any] | None = None) -> TrainResult:
    """Train (or resume) until `cfg.steps`. `data`: an object with `next_batch() -> PackedBatch` (numpy
    [batch_size, L]), `state() -> dict` and `restore(dict)` (default: built from cfg.data).
    `model`: (ModelConfig, params) instead of cfg.model (ignored when resuming, except its config).
    `stop_after`: leave after this many total steps without the final save/export (as if killed)."""
    out_dir = make_out_dir(Path(out_dir or cfg.out_dir).absolute())
    with lock_out_dir(out_dir):  # before anything is written there; held until the last save completes
        mesh = make_mesh(cfg.mesh, devices)
        check_batch_split(cfg, mesh)
        ckpt = Checkpointer(out_dir / "checkpoints", every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                            async_save=cfg.checkpoint.async_save)
        try:
            return _run(*_setup(cfg, ckpt, mesh, out_dir, Given(data, tokenizer, model)), stop_after, on_log)
        finally:
            ckpt.close()  # waits for in-flight saves: a Ctrl-C leaves the last started checkpoint complete


LOCK_FILE = "train.lock"


def lock_out_dir(out_dir: Path):
    """The run's exclusive lock, `<out_dir>/train.lock` (a LockError naming a live holder). Process 0 takes it for
    the job: the other processes of a multi-process run share out_dir."""
    if jax.process_index() != 0:
        return contextlib.nullcontext()
    return acquire(out_dir / LOCK_FILE, what=f"the training run {str(out_dir)!r}")


def check_batch_split(cfg: TrainConfig, mesh: Mesh) -> None:
    """Each microbatch's rows must divide over the devices the batch is split over."""
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.batch_size // cfg.optim.grad_accum
    if micro % n_batch:
        raise ConfigError(f"batch_size / optim.grad_accum = {micro} rows per microbatch do not divide over the "
                          f"data x fsdp = {n_batch} devices of mesh {dict(mesh.shape)}")


def make_out_dir(out_dir: Path) -> Path:
    """Create the run directory; a path under a regular file, or that is one, is a ConfigError naming it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out_dir {str(out_dir)!r} cannot be created: {e.strerror} ({e.filename})") from None
    if not out_dir.is_dir():
        raise ConfigError(f"out_dir {str(out_dir)!r} is not a directory")
    return out_dir


def _setup(cfg: TrainConfig, ckpt: Checkpointer, mesh: Mesh, out_dir: Path, given: Given) -> tuple[Run, TrainState]:
    """The run (model, data iterator, compiled step) and its initial or restored state."""
    resume = ckpt.manager.latest_step()
    if resume is not None:
        check_settings(cfg, out_dir, resume)
    model_cfg, params, lora = _model(cfg, given.model, mesh, resume is None)
    check_mask_token(cfg, model_cfg)
    data = given.data if given.data is not None else _data(cfg, model_cfg, mesh, given.tokenizer, out_dir)
    layout = lora.layout if lora else None
    compiled = _compiled(model_cfg, cfg.step_options(model_cfg.mask_token_id), cfg.optim, cfg.steps, mesh,
                         cfg.batch_size, layout)
    if resume is None:
        state = _initial_state(cfg, model_cfg, compiled, params, lora)
    else:
        resume, state = _restore(ckpt, abstract_state(model_cfg, compiled.tx, compiled.shardings, layout), lora, data)
    step_fn = compiled.step if lora is None else WithBase(compiled.step, lora.base)
    return Run(cfg, ckpt, mesh, out_dir, model_cfg, data, step_fn, compiled.traces, lora, resume,
               given.tokenizer), state


def check_mask_token(cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """An SBD run needs the model's mask token id."""
    if not cfg.sbd.ntp_only and model_cfg.mask_token_id is None:
        raise ConfigError("the model has no mask token id: set model.mask_token_id to an unused id already in the "
                          "vocabulary (e.g. a reserved special token), or model.add_mask_token=true to grow the "
                          "vocabulary by one row (or train the NTP baseline with sbd.ntp_only=true)")


def _data(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh, tokenizer, out_dir: Path):
    """The data iterator cfg.data names, packing this process's rows; its report is printed and written to
    <out_dir>/data_report.json."""
    data = build_iterator(cfg.data, cfg.batch_size, tokenizer=tokenizer,
                          eos_id=model_cfg.eos_ids[0] if model_cfg.eos_ids else None,
                          vocab_size=model_cfg.vocab_size, rows=local_rows(mesh, cfg.batch_size),
                          mask_id=None if cfg.sbd.ntp_only else model_cfg.mask_token_id)
    if jax.process_index() == 0:
        print(format_report(data.report), flush=True)
        (out_dir / "data_report.json").write_text(json.dumps(data.report, indent=2))
    return data


def _initial_state(cfg: TrainConfig, model_cfg: ModelConfig, compiled: CompiledStep, params,
                   lora: LoRARun | None) -> TrainState:
    """The state of a fresh run: `params` (the weights, sharded), or a LoRA run's new adapter (A random, B zero:
    the run starts from the base's own outputs)."""
    if lora is not None:
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 2)
        params = jax.device_put(init_adapter(model_cfg, lora.layout, key, lora.base), compiled.shardings.params)
    return compiled.init(params, jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 1))


def _restore(ckpt: Checkpointer, abstract: TrainState, lora: LoRARun | None, data) -> tuple[int, TrainState]:
    """(step, state) of the newest checkpoint that restores (`restore_good`), `data` moved to its position; a LoRA
    run's checkpoint must hold an adapter of this base."""
    step, state, data_state = restore_good(ckpt, abstract)
    if lora is not None:
        check_base(lora, ckpt.restore_meta(step), ckpt.directory)
    data.restore(data_state)
    return step, state


def _model(cfg: TrainConfig, model, mesh, load_weights: bool) -> tuple[ModelConfig, dict | None, LoRARun | None]:
    """(ModelConfig, the weights to train or None when resuming, the LoRA run): a LoRA run always loads its frozen
    base (the checkpoints hold only the adapter)."""
    if cfg.lora is not None:
        model_cfg, run = prepare_lora(cfg, mesh, model)
        return model_cfg, None, run
    if model is not None:
        return model[0], shard_params(model[1], model[0], mesh) if load_weights else None, None
    return *prepare_model(cfg.model, cfg.seed, mesh, load_weights=load_weights), None


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


def _run(run: Run, state: TrainState, stop_after: int | None, on_log: Callable[[dict], Any] | None) -> TrainResult:
    """The step loop (`_steps`), then the final save and export (`_finish`)."""
    cfg, lead = run.cfg, jax.process_index() == 0
    start, end = int(state.step), cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    metrics_path = run.out_dir / "metrics.jsonl"
    if lead:
        (run.out_dir / SETTINGS_FILE).write_text(json.dumps(
            {"train": to_dict(cfg), "model": to_dict(run.model_cfg)}, indent=2, default=str))
        if run.resume is not None:
            trim_metrics(metrics_path, run.resume)
    with tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True,
              disable=not (cfg.progress and lead and start < end)) as bar:
        log = MetricsLog(cfg, end, FiniteGuard(cfg, run.ckpt.directory), metrics_path if lead else None, on_log, bar)
        evaluator = DraftEval(cfg.draft_eval, run.model_cfg, run.out_dir, run.resume, lead) if cfg.draft_eval.path else None
        state, data_state, last_saved = _steps(run, state, start, end, log, evaluator)
    hf_dir = adapter_dir = None
    if end == cfg.steps:
        hf_dir, adapter_dir = _finish(run, state, data_state, last_saved, ran=end > start)
    return TrainResult(run.model_cfg, state, log.history, run.out_dir, hf_dir, run.resume, run.traces.count,
                       adapter_dir)


def _steps(run: Run, state: TrainState, start: int, end: int, log: MetricsLog, evaluator: DraftEval | None):
    """Steps start + 1 .. end, with a checkpoint on the interval (only of finite state) and the draft metric on its
    own (`evaluator`). Nothing waits on the host per step: batches are prefetched (`_Prefetch`), a logged step's
    metrics are read after the next one is dispatched, orbax saves in the background. -> (state, data position, last saved)."""
    last_saved, data_state = run.resume, None
    if start >= end:
        return state, data_state, last_saved
    place, scale = _placement(run.cfg, run.mesh, run.data)
    prefetch = _Prefetch(run.data, place, scale)
    try:
        for step in range(start + 1, end + 1):
            batch, data_state, tokens = prefetch.next()
            state, metrics = run.step_fn(state, batch)
            run.ckpt.check_saves()  # a failed background save stops the run here, named
            log.after_step(step, metrics, tokens, last_saved)
            if evaluator is not None and evaluator.due(step, end):
                evaluator.run(step, attach(run.lora.base, state.params, run.lora.layout) if run.lora else state.params)
            if run.ckpt.due(step):
                log.guard.check(last_saved)
                last_saved = step if run.ckpt.save(step, state, data_state, meta=run.meta) else last_saved
        log.flush(last_saved)
        log.guard.check(last_saved)
    except NonFiniteStepError as e:
        if run.resume is None or e.step != run.resume + 1 or log.guard.failed[1] != 1:
            raise
        raise _diverged(run, log.guard) from None
    finally:
        prefetch.close()
    return state, data_state, last_saved


def _diverged(run: Run, guard: FiniteGuard) -> NonFiniteStepError:
    """The loss of the first step after resuming is not finite, so the checkpoint resumed from is not good: its
    weights are finite, its forward pass is not (a learning rate too high shows in the update, not the loss). It is
    set aside (<checkpoints>.diverged/<step>): a rerun resumes from the one before it instead of failing here again
    whatever the learning rate."""
    step = run.resume
    where = run.ckpt.set_aside(step, "diverged") if jax.process_index() == 0 else None
    run.ckpt.manager.reload()
    note = (f"It is the first step after resuming from checkpoint step {step}, whose weights are finite but whose "
            f"forward pass is not: that checkpoint is not good{f' (moved to {where})' if where else ''}. ")
    return NonFiniteStepError(guard.message(run.ckpt.manager.latest_step(), note), guard.failed[0])


def _placement(cfg: TrainConfig, mesh: Mesh, data) -> tuple[Callable, float]:
    """(host batch -> global device arrays, batch_size / the rows each host batch holds). An iterator with `rows`
    packs only those rows of the global batch (this process's)."""
    rows = getattr(data, "rows", None)
    rows = None if rows is None or len(rows) == cfg.batch_size else rows
    n = cfg.batch_size if rows is None else len(rows)

    def place(batch_np):
        if np.ndim(batch_np.tokens) != 2 or len(batch_np.tokens) != n:
            raise DataError(f"the data iterator yields batches of shape {np.shape(batch_np.tokens)}, expected "
                            f"[{n}, L] (batch_size={cfg.batch_size}" + (")" if rows is None else
                                                                        f", {n} rows on this process)"))
        return put_batch(batch_np, mesh, cfg.batch_size, rows)
    return place, cfg.batch_size / n


def _finish(run: Run, state: TrainState, data_state: dict | None, last_saved: int | None, ran: bool):
    """At cfg.steps: the final checkpoint (when this call ran steps the interval did not save) and the export
    -> (hf_dir, adapter_dir)."""
    if last_saved != run.cfg.steps and ran:
        run.ckpt.save(run.cfg.steps, state, data_state, force=True, meta=run.meta)
    if not run.cfg.checkpoint.export_hf:
        return None, None
    return _export(run, state.params)


def _export(run: Run, params) -> tuple[Path | None, Path | None]:
    """The final weights in HF layout (<out_dir>/hf), or a LoRA run's adapter (<out_dir>/adapter, + hf merged on
    request), each with the run's tokenizer and stop ids, so that it decodes text as trained -> (hf, adapter)."""
    cfg, model_cfg, lora = run.cfg, run.model_cfg, run.lora
    if lora is None:
        dirs = [save_pretrained(model_cfg, params, run.out_dir / "hf", dtype=cfg.checkpoint.export_dtype)]
    else:
        dirs = export_lora(lora, model_cfg, params, run.out_dir, cfg)
    if jax.process_index() == 0:
        tok = run.tokenizer if isinstance(run.tokenizer, Tokenizer) else (
            Tokenizer.load(cfg.data.tokenizer) if cfg.data.tokenizer else None)
        for d in dirs:
            save_generation_files(d, model_cfg, tok, chat=cfg.data.chat_template and cfg.data.mode != "text")
    if lora is None:
        return dirs[0], None
    return (dirs[1] if len(dirs) > 1 else None), dirs[0]
