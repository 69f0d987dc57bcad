"""Offline batch decoding of many prompts (the engine of decode.py, the `Sampler` and the demos' evaluation).

One run layer over two drivers with one protocol (`Driver`): fixed batches (`BatchDecoder`) and continuous slots
(`ContinuousDriver`, over continuous.py's engine). `run` hands every finished row to `on_row` and returns one
`RunSummary`; with compare_ar, AR then decodes the same prompts with the same driver kind and each row is handed
out with AR's beside it.

  * Prompts are checked once per run: `check_prompts` returns `CheckedPrompts`, which a run of the same model and
    spec takes as checked.
  * Buckets (fixed batches): prompts sorted by length, cut into batches of `batch_size`; a batch's prompt width
    is its longest prompt rounded up to `pad_multiple` (fewer shapes, fewer compilations), capped so that
    width + max_new_tokens fits the model. The last batch is filled with copies of its first prompt that
    generate one token. A prompt's own max_new_tokens caps its row.
  * Randomness: row keys are fold_in(key(seed), crc32(id)): a prompt's output does not depend on its
    batch, its bucket, its slot or on resuming.
  * Timing: a driver counts its own decoding seconds (fixed batches: the compiled calls; continuous: the
    engine's loop), compilation (ahead of time, once per program) and the caller's row handling apart.
  * Sharding: params are expected on `mesh` (`shard_params`); prompts are laid out over the batch axes;
    several processes all-gather the outputs.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ..models.config import ModelConfig
from . import checks
from .checks import check_model, check_rate, max_prompt_width
from .decoder import GenerateCall
from .modes import mode_of
from .prompts import Prompt
from .results import RowResult, RunSummary, Totals, row_result, row_stats
from .spec import DEFAULT_GAMMA, DEFAULT_TEMPERATURE, DecodeError, DecodeSpec


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """A batch run: the decoder's `spec`, the values it decodes with, and how prompts are batched."""

    spec: DecodeSpec = DecodeSpec()
    gamma: float = DEFAULT_GAMMA
    temperature: float = DEFAULT_TEMPERATURE
    batch_size: int = 8
    pad_multiple: int = 16  # prompt widths are rounded up to a multiple of this (fewer compilations)
    seed: int = 0
    compare_ar: bool = False  # also decode every prompt with AR and report the speedup
    # batch_size slots, a finished row's slot taking the next prompt at once (continuous.py); False: fixed
    # batches, each waiting for its slowest row (what `decode_prompts` runs; a `BatchDecoder` built directly is
    # fixed batches whatever this says)
    continuous: bool = True

    def __post_init__(self):
        check_rate("gamma", self.gamma)
        check_rate("temperature", self.temperature)
        for name in ("batch_size", "pad_multiple"):
            if getattr(self, name) < 1:
                raise DecodeError(f"{name} must be >= 1, got {getattr(self, name)}")

    def baseline(self) -> DecodeOptions:
        """The same run decoded by AR (what compare_ar measures against; a verify run's baseline is plain AR)."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, mode="ar", verify=False),
                                   compare_ar=False)


class CheckedPrompts(tuple):
    """Prompts that fit a model's positions with a spec's max_new_tokens (`check_prompts`)."""

    def __new__(cls, prompts, against):
        obj = super().__new__(cls, prompts)
        obj.against = against
        return obj

    def where(self, keep: Callable[[Prompt], bool]) -> CheckedPrompts:
        """The prompts `keep` selects, still checked."""
        return CheckedPrompts([p for p in self if keep(p)], self.against)


def check_prompts(cfg: ModelConfig, opts: DecodeOptions, prompts) -> CheckedPrompts:
    """Every prompt fits the model's positions with max_new_tokens and asks for no more than it (a bad prompt
    is named by id and line; `checks.check_prompts`); prompts already checked for this model and cap pass."""
    against = (cfg, opts.spec.max_new_tokens)
    if isinstance(prompts, CheckedPrompts) and prompts.against == against:
        return prompts
    checks.check_prompts(cfg, opts.spec, prompts)
    return CheckedPrompts(prompts, against)


def row_key(pid) -> int:
    """A stable 31-bit integer per prompt id (folded into the seed's key)."""
    return zlib.crc32(repr(pid).encode()) & 0x7FFFFFFF


def prompt_keys(seed: int, prompts: Sequence[Prompt]):
    """Typed PRNG keys [len(prompts)]: fold_in(key(seed), row_key(id)), whatever the batch or slot."""
    return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.asarray([row_key(p.id) for p in prompts]))


def prompt_width(cfg: ModelConfig, opts: DecodeOptions, prompts: Sequence[Prompt]) -> int:
    """The padded prompt width for `prompts`: the longest rounded up to pad_multiple (fewer compilations), capped
    so that width + max_new_tokens fits the model."""
    longest = max(len(p.ids) for p in prompts)
    cap = max_prompt_width(cfg, opts.spec.max_new_tokens)
    return max(longest, min(-(-longest // opts.pad_multiple) * opts.pad_multiple, cap))


class Driver(Protocol):
    """What `run` drives: rows decoded as they finish, and the driver's running counts."""

    opts: DecodeOptions
    compile_s: float  # seconds compiling so far
    seconds: float  # seconds decoding so far (compilation and the consumer's time apart)
    calls: int  # batched model calls of the decode loops so far
    draft_memory: object  # verify mode: what the drafting policy learned (each pass starts from it); else None

    def rows(self, prompts: Sequence[Prompt]) -> Iterator[tuple[int, RowResult]]:
        """(index into `prompts`, its row) for every prompt, as rows finish."""


class BatchDecoder:
    """Fixed batches: one compiled program per prompt width, kept for later runs."""

    def __init__(self, params, cfg: ModelConfig, opts: DecodeOptions, mesh=None, draft_memory=None):
        self.params, self.cfg, self.opts, self.mesh = params, cfg, opts, mesh
        self._compiled: dict = {}
        self._baseline: BatchDecoder | None = None
        self.compile_s = self.seconds = 0.0
        self.calls = 0
        self.draft_memory = mode_of(opts.spec).start_from(draft_memory, opts.spec)

    def arrays(self, batch: list[Prompt]):
        B, P = self.opts.batch_size, prompt_width(self.cfg, self.opts, batch)
        rows = list(batch) + [batch[0]] * (B - len(batch))
        lens = np.array([len(p.ids) for p in rows], np.int32)
        caps = np.array([p.max_new_tokens or self.opts.spec.max_new_tokens for p in batch] + [1] * (B - len(batch)),
                        np.int32)
        ids = np.zeros((B, P), np.int32)
        for i, p in enumerate(rows):
            ids[i, :lens[i]] = p.ids
        keys = prompt_keys(self.opts.seed, rows)
        if self.mesh is not None:
            from ..sharding import batch_sharding
            ids = _global(ids, batch_sharding(self.mesh, 2, B))
            lens, caps = (_global(x, batch_sharding(self.mesh, 1, B)) for x in (lens, caps))
        return ids, lens, keys, caps

    def run_batch(self, batch: list[Prompt]) -> list[RowResult]:
        """Decode one batch (compiling its program the first time its width is seen) -> its real rows."""
        o = self.opts
        ids, lens, keys, caps = self.arrays(batch)
        call = GenerateCall.build(self.params, self.cfg, ids, lens, o.spec, gamma=o.gamma, temperature=o.temperature,
                                  key=keys, row_max_new_tokens=caps, mesh=self.mesh, draft_memory=self.draft_memory)
        if ids.shape not in self._compiled:
            t = time.perf_counter()
            self._compiled[ids.shape] = call.lower().compile()
            self.compile_s += time.perf_counter() - t
        t = time.perf_counter()
        out = jax.block_until_ready(self._compiled[ids.shape](*call.args))
        self.seconds += time.perf_counter() - t
        self.calls += int(out.iterations)
        stats = jax.tree.map(_host, out.mode_stats)
        if stats is not None:
            self.draft_memory = stats.memory
        tokens, n, nfe, eos, accepted = (_host(x) for x in (out.tokens, out.lengths, out.nfe, out.stopped_by_eos,
                                                             out.accepted))
        return [row_result(tokens[i, :n[i]], nfe[i], eos[i], accepted[i], row_stats(stats, i))
                for i in range(len(batch))]

    def rows(self, prompts: Sequence[Prompt]) -> Iterator[tuple[int, RowResult]]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))  # length buckets
        B = self.opts.batch_size
        for part in (order[i:i + B] for i in range(0, len(order), B)):
            yield from zip(part, self.run_batch([prompts[i] for i in part]))

    def decode(self, prompts: Sequence[Prompt], on_row: Callable[[Prompt, RowResult], None] = lambda p, r: None,
               progress=None) -> RunSummary:
        """`run` with this decoder (and, with compare_ar, an AR one kept beside it)."""
        with_ar = self.opts.compare_ar and self.opts.spec.mode != "ar"
        if with_ar and self._baseline is None:
            self._baseline = BatchDecoder(self.params, self.cfg, self.opts.baseline(), self.mesh)
        return run(self, check_prompts(self.cfg, self.opts, prompts), on_row, progress,
                   self._baseline if with_ar else None)


class ContinuousDriver:
    """Continuous slots (continuous.py's engine, one per prompt width); the longest caps first, so the rows still
    running when the stream runs dry are short ones (less idle tail)."""

    def __init__(self, params, cfg: ModelConfig, opts: DecodeOptions, mesh=None, draft_memory=None):
        self.params, self.cfg, self.opts, self.mesh = params, cfg, opts, mesh
        self._engines: dict = {}
        self.seconds, self.calls = 0.0, 0
        self.draft_memory = mode_of(opts.spec).start_from(draft_memory, opts.spec)

    @property
    def compile_s(self) -> float:
        return sum(e.compile_s for e in self._engines.values())

    def rows(self, prompts: Sequence[Prompt]) -> Iterator[tuple[int, RowResult]]:
        from .continuous import ContinuousDecoder, Request
        o = self.opts
        width = prompt_width(self.cfg, o, prompts)
        if width not in self._engines:
            self._engines[width] = ContinuousDecoder(self.params, self.cfg, o.spec, slots=o.batch_size,
                                                     prompt_width=width, gamma=o.gamma, temperature=o.temperature,
                                                     mesh=self.mesh)
        engine = self._engines[width]
        engine.draft_memory = self.draft_memory
        keys = np.asarray(jax.random.key_data(prompt_keys(o.seed, prompts)))
        order = sorted(range(len(prompts)), key=lambda i: -(prompts[i].max_new_tokens or o.spec.max_new_tokens))
        stream = engine.decode(Request(prompts[i].ids, keys[i], prompts[i].max_new_tokens) for i in order)
        while True:
            t, c = time.perf_counter(), engine.compile_s
            item = next(stream, None)
            self.seconds += time.perf_counter() - t - (engine.compile_s - c)
            if item is None:
                break
            yield order[item[0]], item[1]
        self.calls += engine.calls
        self.draft_memory = engine.draft_memory


def driver(params, cfg: ModelConfig, opts: DecodeOptions, mesh=None, draft_memory=None) -> Driver:
    """The driver `opts` asks for: continuous slots or fixed batches."""
    kind = ContinuousDriver if opts.continuous else BatchDecoder
    return kind(params, cfg, opts, mesh, draft_memory)


def run(main: Driver, prompts: Sequence[Prompt], on_row: Callable[[Prompt, RowResult], None] = lambda p, r: None,
        progress=None, baseline: Driver | None = None) -> RunSummary:
    """Decode `prompts` with `main`, each finished row handed to `on_row(prompt, row)`; with `baseline` (AR), the
    same prompts again, each row handed out once both are done (AR's as `row.ar`). -> the run's summary."""
    differ: list = []

    def hand(i, row):
        on_row(prompts[i], row)
        if progress is not None:
            progress.update(1)

    held: dict = {}
    totals = _pass(main, prompts, hand if baseline is None else held.__setitem__)
    ar = None
    if baseline is not None:
        def pair(i, ar_row):
            row = dataclasses.replace(held.pop(i), ar=ar_row)
            if row.tokens != ar_row.tokens:
                differ.append(prompts[i].id)
            hand(i, row)
        ar = _pass(baseline, prompts, pair)
    spec = main.opts.spec
    return RunSummary(**vars(totals), mode=spec.mode, verify=spec.verify, continuous=isinstance(main, ContinuousDriver),
                      block_size=spec.block_size, draft_memory=main.draft_memory, ar=ar, differing=differ,
                      compile_seconds=main.compile_s + (baseline.compile_s if baseline is not None else 0.0))


def _pass(d: Driver, prompts: Sequence[Prompt], sink: Callable[[int, RowResult], None]) -> Totals:
    """One driver over the prompts -> its totals (seconds and calls: what the driver counted meanwhile)."""
    totals = Totals()
    seconds, calls = d.seconds, d.calls
    for i, row in d.rows(prompts):
        totals.add(row)
        sink(i, row)
    totals.seconds, totals.model_calls = d.seconds - seconds, d.calls - calls
    return totals


def decode_prompts(params, cfg: ModelConfig, prompts: Sequence[Prompt], opts: DecodeOptions, *, mesh=None,
                   on_row: Callable[[Prompt, RowResult], None] = lambda p, r: None, progress=None,
                   draft_memory=None) -> RunSummary:
    """Decode `prompts` (fixed batches or continuous slots, by `opts`); call `on_row(prompt, row)` for every
    finished row; return the run's summary. `draft_memory`: verify mode's drafting policy starts from it (an
    earlier summary's `draft_memory`; the summary has this run's)."""
    check_model(cfg, opts.spec)
    prompts = check_prompts(cfg, opts, prompts)
    opts = slots_for(cfg, opts, prompts, mesh)
    baseline = driver(params, cfg, opts.baseline(), mesh) if opts.compare_ar and opts.spec.mode != "ar" else None
    return run(driver(params, cfg, opts, mesh, draft_memory), prompts, on_row, progress, baseline)


def slots_for(cfg: ModelConfig, opts: DecodeOptions, prompts: Sequence[Prompt], mesh=None) -> DecodeOptions:
    """`opts` with batch_size capped by the number of prompts (more slots would only decode copies), the KV cache
    of that many slots checked against the free memory."""
    slots = min(opts.batch_size, max(len(prompts), 1))
    if prompts:
        length = prompt_width(cfg, opts, prompts) + opts.spec.max_new_tokens + opts.spec.block_size
        checks.check_cache_fits(cfg, opts.spec, slots, length, mesh.size if mesh is not None else 1)
    return opts if slots == opts.batch_size else dataclasses.replace(opts, batch_size=slots)


def _global(x: np.ndarray, sharding):
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _host(x) -> np.ndarray:
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
