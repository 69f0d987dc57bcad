"""Offline batch decoding of many prompts (the engine of decode.py and of the demo's evaluation).

  * Buckets: prompts sorted by length, cut into batches of `batch_size`; a batch's prompt width is its
    longest prompt rounded up to `pad_multiple` (fewer shapes, fewer compilations), capped so that
    width + max_new_tokens fits the model. The last batch is filled with copies of its first prompt that
    generate one token. A prompt's own max_new_tokens caps its row.
  * Randomness: row keys are fold_in(key(seed), crc32(id)): a prompt's output does not depend on its
    batch, its bucket or on resuming.
  * Timing: compilation (once per mode and width, ahead of time) is measured apart; tokens/s count the
    real rows' tokens over decoding time. With `compare_ar`, AR decodes the same batches in turn.
  * Sharding: params are expected on `mesh` (`shard_params`); prompts are laid out over the batch axes;
    several processes all-gather the outputs.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from .decoder import generate_jit, prepare_generate
from .prompts import Prompt
from .modes import mode_of
from .results import RowResult, row_result, row_stats
from . import checks
from .checks import check_model, check_rate, max_prompt_width
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
    compare_ar: bool = False  # also decode every batch with AR and report the speedup
    # batch_size slots, a finished row's slot taking the next prompt at once (continuous.py); False: fixed
    # batches, each waiting for its slowest row
    continuous: bool = False

    def __post_init__(self):
        check_rate("gamma", self.gamma)
        check_rate("temperature", self.temperature)
        for name in ("batch_size", "pad_multiple"):
            if getattr(self, name) < 1:
                raise DecodeError(f"{name} must be >= 1, got {getattr(self, name)}")


def check_prompts(cfg: ModelConfig, opts: DecodeOptions, prompts: list[Prompt]) -> None:
    """Every prompt fits the model's positions with max_new_tokens and asks for no more than it (a bad prompt
    is named by id and line; `checks.check_prompts` with the run's spec)."""
    checks.check_prompts(cfg, opts.spec, prompts)


def row_key(pid) -> int:
    """A stable 31-bit integer per prompt id (folded into the seed's key)."""
    return zlib.crc32(repr(pid).encode()) & 0x7FFFFFFF


def prompt_keys(seed: int, prompts: list[Prompt]):
    """Typed PRNG keys [len(prompts)]: fold_in(key(seed), row_key(id)), whatever the batch or slot."""
    return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.asarray([row_key(p.id) for p in prompts]))


def prompt_width(cfg: ModelConfig, opts: DecodeOptions, prompts: list[Prompt]) -> int:
    """The padded prompt width for `prompts`: the longest rounded up to pad_multiple (fewer compilations), capped
    so that width + max_new_tokens fits the model."""
    longest = max(len(p.ids) for p in prompts)
    cap = max_prompt_width(cfg, opts.spec.max_new_tokens)
    return max(longest, min(-(-longest // opts.pad_multiple) * opts.pad_multiple, cap))


class BatchDecoder:
    """Decodes fixed-shape batches with one compiled program per (mode, prompt width)."""

    def __init__(self, params, cfg: ModelConfig, opts: DecodeOptions, mesh=None, draft_memory=None):
        self.params, self.cfg, self.opts, self.mesh = params, cfg, opts, mesh
        self._compiled: dict = {}
        self.compile_s = 0.0
        # verify mode: what the drafting policy learned (each batch starts from it; None in the other modes)
        self.draft_memory = mode_of(opts.spec).start_from(draft_memory)

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

    def run(self, batch: list[Prompt], mode: str):
        """-> (dict of numpy arrays for the real rows, seconds of decoding excluding compilation)."""
        o = self.opts
        ids, lens, keys, caps = self.arrays(batch)
        args, static = prepare_generate(self.params, self.cfg, ids, lens, o.spec, gamma=o.gamma,
                                        temperature=o.temperature, key=keys, row_max_new_tokens=caps, mesh=self.mesh,
                                        check=False, draft_memory=self.draft_memory if mode == o.spec.mode else None,
                                        **_mode(o.spec, mode))
        sig = (mode, ids.shape)
        if sig not in self._compiled:
            t = time.perf_counter()
            self._compiled[sig] = generate_jit.lower(*args, **static).compile()
            self.compile_s += time.perf_counter() - t
        t = time.perf_counter()
        out = jax.block_until_ready(self._compiled[sig](*args))
        secs = time.perf_counter() - t
        stats = jax.tree.map(_host, out.mode_stats)
        if mode == o.spec.mode and stats is not None:
            self.draft_memory = stats.memory
        n = len(batch)
        res = {f: _host(getattr(out, f))[:n] for f in ("tokens", "lengths", "nfe", "stopped_by_eos", "accepted")}
        res["calls"] = int(out.iterations)
        res["stats"] = [row_stats(stats, i) for i in range(n)]
        return res, secs

    def decode(self, prompts: list[Prompt], on_row: Callable[[Prompt, dict], None] = lambda p, r: None,
               progress=None) -> dict:
        """Decode `prompts` in length buckets, call `on_row(prompt, result)` per finished row, return the
        summary. result: tokens (list, EOS included), n_tokens, nfe, tokens_per_forward, stop ("eos" |
        "length") and, with compare_ar, "ar": the same for AR. Compiled programs are kept for later calls."""
        opts = self.opts
        with_ar = opts.compare_ar and opts.spec.mode != "ar"
        main, ar = Totals(), Totals()
        differ: list = []
        order = sorted(prompts, key=lambda p: len(p.ids))  # length buckets
        for batch in (order[i:i + opts.batch_size] for i in range(0, len(order), opts.batch_size)):
            res, secs = self.run(batch, opts.spec.mode)
            main.add(res, secs)
            if with_ar:
                ares, asecs = self.run(batch, "ar")
                ar.add(ares, asecs)
            for i, p in enumerate(batch):
                row = _row(res, i)
                if with_ar:
                    row["ar"] = _row(ares, i)
                    if row["ar"]["tokens"] != row["tokens"]:
                        differ.append(p.id)
                on_row(p, row)
                if progress is not None:
                    progress.update(1)
        summary = dict(mode=opts.spec.mode, verify=opts.spec.verify, **main.as_dict(opts.spec),
                       compile_seconds=round(self.compile_s, 3))
        if self.draft_memory is not None:
            summary["draft_memory"] = self.draft_memory.as_dict()
        if with_ar:
            _compare(summary, ar, differ)
        return summary


def _mode(spec, mode: str) -> dict:
    """The spec fields of `mode` (the AR baseline of a verify-mode run is plain AR)."""
    return {"mode": mode, "verify": spec.verify and mode == "sbd"}


def _compare(summary: dict, ar: Totals, differ: list) -> None:
    """The AR comparison of a summary: AR's totals, the speedup, the rows whose tokens differ from AR's."""
    summary["ar"] = ar.as_dict()
    summary["speedup_tokens_per_s"] = summary["tokens_per_s"] / summary["ar"]["tokens_per_s"]
    summary["same_tokens_as_ar"] = 1 - len(differ) / max(summary["rows"], 1)
    summary["rows_differing_from_ar"] = differ[:20]
    summary["n_rows_differing_from_ar"] = len(differ)


def _global(x: np.ndarray, sharding):
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _host(x) -> np.ndarray:
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


@dataclasses.dataclass
class Totals:
    """Sums over the decoded batches."""

    rows: int = 0
    tokens: int = 0
    nfe: int = 0
    calls: int = 0  # batched model calls of the decode loops (prefill pieces apart)
    seconds: float = 0.0
    accepted: np.ndarray | None = None  # model calls that decoded 0, 1, ... tokens (summed over rows)
    stats: dict = dataclasses.field(default_factory=dict)  # sums of the rows' mode stats (verify: drafts, agreed)

    def add(self, res, secs):
        self.rows += len(res["lengths"])
        self.tokens += int(res["lengths"].sum())
        self.nfe += int(res["nfe"].sum())
        for row in res.get("stats", ()):
            for f, v in row.items():
                self.stats[f] = self.stats.get(f, 0) + v
        self.calls += res.get("calls", 0)
        self.seconds += secs
        hist = res["accepted"].sum(0)
        self.accepted = hist if self.accepted is None else self.accepted + hist

    def add_row(self, row: dict):
        self.add({"lengths": np.asarray([row["n_tokens"]]), "nfe": np.asarray([row["nfe"]]),
                  "accepted": np.asarray([row["accepted"]]),
                  "stats": [{f: row[f] for f in ("drafts", "agreed") if f in row}]}, 0.0)

    def as_dict(self, spec: DecodeSpec | None = None):
        """The totals; for verify mode (`spec`) also the drafts and the ceiling: tokens per forward if every
        draft stood (a block of k per call)."""
        out = {"rows": self.rows, "tokens": self.tokens, "nfe": self.nfe, "model_calls": self.calls,
               "seconds": round(self.seconds, 4),
               "tokens_per_s": self.tokens / self.seconds if self.seconds else float("nan"),
               "tokens_per_forward": self.tokens / self.nfe if self.nfe else float("nan"),
               "accepted_per_forward": [] if self.accepted is None else self.accepted.tolist()}
        if spec is not None and spec.verify:
            drafts, agreed = self.stats.get("drafts", 0), self.stats.get("agreed", 0)
            out.update(drafts=drafts, drafts_agreed=agreed, draft_acceptance=agreed / drafts if drafts else 0.0,
                       tokens_per_forward_ceiling=float(spec.block_size))
        return out


def decode_prompts(params, cfg: ModelConfig, prompts: list[Prompt], opts: DecodeOptions, *, mesh=None,
                   on_row: Callable[[Prompt, dict], None] = lambda p, r: None, progress=None, checked: bool = False,
                   draft_memory=None) -> dict:
    """Decode `prompts` (batched, bucketed); call `on_row(prompt, result)` for every finished row;
    return the summary (see `BatchDecoder.decode`). `checked`: the caller has run `check_model` and
    `check_prompts` (decode.py does, before and after reading the prompts). `draft_memory`: verify mode's
    drafting policy starts from it (an earlier summary's "draft_memory"; the summary has the run's)."""
    if not checked:
        check_model(cfg, opts.spec)
        check_prompts(cfg, opts, prompts)
    if opts.continuous:
        return _decode_continuous(params, cfg, prompts, opts, mesh, on_row, progress, draft_memory)
    return BatchDecoder(params, cfg, opts, mesh, draft_memory).decode(prompts, on_row, progress)


def _decode_continuous(params, cfg: ModelConfig, prompts: list[Prompt], opts: DecodeOptions, mesh, on_row,
                       progress, draft_memory=None) -> dict:
    """`decode_prompts` with `opts.batch_size` continuous slots; with compare_ar, AR then runs the same prompts
    on the same slots and each row is handed out once both are done."""
    from .continuous import ContinuousDecoder, Request
    width = prompt_width(cfg, opts, prompts)
    keys = np.asarray(jax.random.key_data(prompt_keys(opts.seed, prompts)))
    # longest caps first: the rows still running when the stream runs dry are short ones (less idle tail)
    order = sorted(range(len(prompts)), key=lambda i: -(prompts[i].max_new_tokens or opts.spec.max_new_tokens))
    reqs = [Request(prompts[i].ids, keys[i], prompts[i].max_new_tokens) for i in order]
    modes = [opts.spec.mode] + (["ar"] if opts.compare_ar and opts.spec.mode != "ar" else [])
    totals, results, compile_s, differ = {}, {}, 0.0, []
    for mode in modes:
        dec = ContinuousDecoder(params, cfg, dataclasses.replace(opts.spec, **_mode(opts.spec, mode)), slots=opts.batch_size,
                                prompt_width=width, gamma=opts.gamma, temperature=opts.temperature, mesh=mesh,
                                draft_memory=draft_memory if mode == modes[0] else None)
        totals[mode] = t = Totals()
        start = time.perf_counter()
        for i, row in dec.decode(reqs):
            i = order[i]
            t.add_row(row)
            del row["accepted"]  # in the summary's histogram; a row reads as in static batches
            if mode == modes[-1]:
                if len(modes) > 1:
                    row = dict(results.pop(i), ar=row)
                    if row["ar"]["tokens"] != row["tokens"]:
                        differ.append(prompts[i].id)
                on_row(prompts[i], row)
                if progress is not None:
                    progress.update(1)
            else:
                results[i] = row
        t.seconds = time.perf_counter() - start - dec.compile_s
        t.calls = dec.calls
        compile_s += dec.compile_s
        if mode == modes[0] and dec.draft_memory is not None:
            draft_memory = dec.draft_memory
    main = totals[modes[0]]
    summary = dict(mode=opts.spec.mode, verify=opts.spec.verify, **main.as_dict(opts.spec), compile_seconds=round(compile_s, 3),
                   continuous=True)
    if draft_memory is not None:
        summary["draft_memory"] = draft_memory.as_dict()
    if len(modes) > 1:
        _compare(summary, totals["ar"], differ)
    return summary


def _row(res, i) -> RowResult:
    n = int(res["lengths"][i])
    return row_result(res["tokens"][i, :n].tolist(), int(res["nfe"][i]), bool(res["stopped_by_eos"][i]),
                      stats=res["stats"][i] if "stats" in res else None)
