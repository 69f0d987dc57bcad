"""Continuous batching: a fixed number of slots run the decode loop of loop.py; when a row finishes, its slot
takes the next prompt without waiting for the others and without recompiling.

  * The engine (`ContinuousDecoder`) has MaxText's contract: `init()` -> idle `Slots`; `admit(slots, entries)`
    puts prompts into free slots; `step(slots, more_waiting)` runs the decode loop; `harvest(slots, owned)`
    reads the rows that finished. `decode(requests)` is the host scheduler over these four.
  * Device side, three compiled programs per spec and slot layout, kept in a `ProgramCache` (`PROGRAMS`, shared
    by the decoders of a process unless one is given). `run_slots` is the decode loop (the same mode step as
    `generate`), left when every row is done or, while prompts wait, as soon as a row finishes. `admit_slots`
    puts new prompts into free slots: their rows of the loop state are reset (`state.put_rows` finds the fields
    by their `Row` type, the mode's own state included; the mode's `retire` first takes in the leaving rows), the
    slot's cache length set to the prompt's (what a previous row left beyond it is never attended again) and the
    prompt's K/V written in `prefill_chunk` pieces by a forward over those rows and a prompt-wide cache only
    (one program per power-of-two count of rows, at most `admit_rows`: that cache holds rows x prompt width
    tokens, 4 GiB for 16 rows of 2048 at 8B, so a larger admission runs in groups with the same prefill work).
  * A new row's first call is then the loop's ordinary step: SBD's first COPY block over the cached prompt;
    AR's prompt is prefilled but for its last token, which the first step runs to yield the first token. So a
    row makes the same calls, draws the same random numbers (fold_in(key_b, nfe)) and counts the same NFE as
    when decoded alone by `generate`; its tokens equal that up to float rounding (tested equal).
  * Results: one `RowResult` per finished row (results.py), one small device-to-host read per harvest.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..models.config import ModelConfig
from ..models.transformer import init_cache
from ..sharding import mesh_context
from .checks import check_fits, check_stream_prompt
from .loop import run_loop
from .modes import mode_of
from .prefill import write_prompt
from .results import RowResult, row_result, row_stats
from .spec import DEFAULT_GAMMA, DEFAULT_TEMPERATURE, DecodeError, DecodeSpec
from .state import LoopState, make_env, new_state, prompt_seq, put_rows


class SlotRows(NamedTuple):
    """What each slot decodes with ([slots] arrays), set when a prompt is admitted."""

    lengths: jax.Array   # prompt lengths
    max_new: jax.Array   # the row's cap on generated tokens
    gamma: jax.Array
    temp: jax.Array
    keys: jax.Array      # raw PRNG key data [slots, 2] (host-built, so admitting compiles nothing eagerly)


class Slots(NamedTuple):
    """The engine's device state: the loop state of every slot and what each slot decodes with."""

    state: LoopState
    rows: SlotRows


def _env(params, cfg, spec, rows: SlotRows, mesh):
    return make_env(params, cfg, spec, rows.lengths, rows.max_new, rows.gamma, rows.temp,
                    jax.random.wrap_key_data(rows.keys), mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "mesh", "slots", "width"))
def empty_slots(params, memory, *, cfg: ModelConfig, spec: DecodeSpec, mesh=None, slots: int, width: int):
    """The state and rows of `slots` idle slots (the mode's state starting from `memory`)."""
    rows = SlotRows(jnp.ones((slots,), jnp.int32), jnp.ones((slots,), jnp.int32), jnp.zeros((slots,), jnp.float32),
                 jnp.zeros((slots,), jnp.float32), jnp.zeros((slots, 2), jnp.uint32))
    env = _env(params, cfg, spec, rows, mesh)
    seq = prompt_seq(jnp.zeros((slots, width), jnp.int32), rows.lengths, spec, env)
    return new_state(env, seq, width, mode_of(spec).init_state(env, slots, memory), done=jnp.ones((slots,), bool)), rows


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "mesh"), donate_argnums=(1,))
def run_slots(params, state: LoopState, rows: SlotRows, stop_at_finish, *, cfg: ModelConfig,
              spec: DecodeSpec, mesh=None):
    """Decode until every row is done or (`stop_at_finish`) a row that was running finishes."""
    with mesh_context(mesh):
        return run_loop(state, _env(params, cfg, spec, rows, mesh), mode_of(spec).step, stop_at_finish)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "mesh"), donate_argnums=(1,))
def admit_slots(params, state: LoopState, rows: SlotRows, slot_R, prompt_RP, new: SlotRows, *, cfg: ModelConfig,
           spec: DecodeSpec, mesh=None):
    """Start prompts `prompt_RP` (right-padded, lengths `new.lengths`) in slots `slot_R` (a slot index equal to
    the slot count marks an unused entry): reset their rows of the state and write their prompts' K/V, in as many
    `prefill_chunk` pieces as the longest of them needs."""
    with mesh_context(mesh):
        B = state.done.shape[0]
        R, P = prompt_RP.shape
        put = lambda a, v: a.at[slot_R].set(v, mode="drop")  # noqa: E731 - rows of the slots
        rows = SlotRows(*(put(a, v) for a, v in zip(rows, new)))
        env, new_env, mode = _env(params, cfg, spec, rows, mesh), _env(params, cfg, spec, new, None), mode_of(spec)
        fresh = mode.admit(new_state(new_env, prompt_seq(prompt_RP, new.lengths, spec, env), P,
                                     mode.init_state(new_env, R, None)), new_env)
        # the prompts' K/V (AR and verify mode leave the last prompt token to the first step) in a cache of the
        # prompt width only (attention over P slots, not P + max_new), then copied into these rows' slots [0, P)
        C = min(spec.prefill_chunk, P)
        width = -(-P // C) * C
        upto = jnp.where(slot_R < B, new.lengths - (not mode.prefills_last_token), 0)
        cache, _ = write_prompt(params, cfg, init_cache(cfg, R, width, spec.kv_cache_dtype),
                                jnp.pad(prompt_RP, ((0, 0), (0, width - P))), upto,
                                -(-jnp.max(upto) // C), C)  # only the pieces these prompts reach
        state = put_rows(mode.retire(state, slot_R), fresh, slot_R)  # the leaving rows retire, the new ones reset
        state = state._replace(
            seq=env.constrain(state.seq),
            cache=env.constrain(state.cache.with_arrays(
                tuple(a.at[:, slot_R, :P].set(b[:, :, :P], mode="drop")
                      for a, b in zip(state.cache.arrays(), cache.arrays())), put(state.cache.lengths, cache.lengths))))
        return state, rows


def admission_rows(n: int) -> int:
    """Rows of the admission program that admits `n` prompts (one program per power of two)."""
    return 1 << (n - 1).bit_length()


class ProgramCache:
    """Compiled programs by key (model layout, spec, mesh, slot layout, program name): a decoder compiles a
    program once and later decoders with the same key (another call, another timing round) reuse it. `PROGRAMS`
    is the one shared by the process's decoders; `clear()` drops its programs (their memory goes with them)."""

    def __init__(self):
        self._compiled: dict = {}

    def get(self, key, compile_fn):
        """-> (the program of `key`, seconds spent compiling it now: 0 when it was cached)."""
        if key in self._compiled:
            return self._compiled[key], 0.0
        t = time.perf_counter()
        self._compiled[key] = compile_fn()
        return self._compiled[key], time.perf_counter() - t

    def clear(self) -> None:
        self._compiled.clear()

    def __len__(self) -> int:
        return len(self._compiled)


PROGRAMS = ProgramCache()


class Request(NamedTuple):
    """One prompt for the continuous decoder: token ids, its PRNG key (typed, or raw uint32[2]), its cap (None:
    the spec's)."""

    ids: tuple[int, ...]
    key: jax.Array | np.ndarray
    max_new_tokens: int | None = None


def _key_data(key) -> np.ndarray:
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key, np.uint32)


class ContinuousDecoder:
    """The continuous batching engine: `slots` rows decoding prompts of at most `prompt_width` tokens, at most
    `admit_rows` prompts prefilled per admission call, programs from `programs` (default the shared `PROGRAMS`).

        slots = dec.init()                                     every slot idle
        slots = dec.admit(slots, [(slot, request), ...])       prompts into free slots
        slots = dec.step(slots, more_waiting)                  decode until a row finishes (or all are done)
        finished = dec.harvest(slots, owned_slots)             [(slot, RowResult)] of the finished ones

    `decode(requests)` schedules a stream over these and yields `(index, RowResult)` as rows finish (index: the
    request's place in the stream)."""

    def __init__(self, params, cfg: ModelConfig, spec: DecodeSpec, *, slots: int, prompt_width: int,
                 gamma=DEFAULT_GAMMA, temperature=DEFAULT_TEMPERATURE, mesh=None, admit_rows: int = 16,
                 programs: ProgramCache | None = None, draft_memory=None):
        if admit_rows < 1:
            raise DecodeError(f"admit_rows must be >= 1, got {admit_rows}")
        if spec.finalize_cache or spec.return_cache:
            raise DecodeError("continuous batching returns no cache (finalize_cache / return_cache are off)")
        check_fits(cfg, prompt_width, spec.max_new_tokens, "the decoder's prompt_width")
        self.params, self.cfg, self.spec, self.mesh = params, cfg, spec, mesh
        self.slots, self.width, self.gamma, self.temperature = slots, prompt_width, gamma, temperature
        self.admit_rows = admit_rows
        self.programs = PROGRAMS if programs is None else programs
        self.compile_s = 0.0
        self.calls = 0  # batched model calls of the decode loop so far (admissions' prefills apart)
        self._programs: dict = {}  # name -> the compiled program this decoder uses
        self._layout = tuple((a.shape, a.dtype, getattr(a, "sharding", None)) for a in jax.tree.leaves(params))
        # verify mode: what the drafting policy learned (`GenerateOutput.mode_stats.memory`; None in the other
        # modes); `init` starts from it, `decode` leaves what it learned here
        self.draft_memory = mode_of(spec).start_from(draft_memory, spec)

    def _program(self, name: str, fn, *args, **static):
        """`fn` compiled ahead of time (its compile time kept apart from decoding time), once per program cache
        for a model layout, spec, mesh and slot layout."""
        if name not in self._programs:
            key = (name, self._layout, self.cfg, self.spec, self.mesh, self.slots, self.width)
            self._programs[name], seconds = self.programs.get(
                key, lambda: fn.lower(*args, cfg=self.cfg, spec=self.spec, mesh=self.mesh, **static).compile())
            self.compile_s += seconds
        return self._programs[name]

    def init(self) -> Slots:
        """Every slot idle (the drafting policy starting from `draft_memory`)."""
        args = (self.params, mode_of(self.spec).start_from(self.draft_memory, self.spec))
        return Slots(*self._program("empty", empty_slots, *args, slots=self.slots, width=self.width)(*args))

    def admit(self, slots: Slots, entries: list[tuple[int, Request]]) -> Slots:
        """Start each request in its (free) slot, `admit_rows` prompts per admission call."""
        for g in range(0, len(entries), self.admit_rows):
            slots = self._admit_group(slots, entries[g:g + self.admit_rows])
        return slots

    def _admit_group(self, slots: Slots, entries: list[tuple[int, Request]]) -> Slots:
        reqs = [r for _, r in entries]
        R = admission_rows(len(reqs))
        ids = np.zeros((R, self.width), np.int32)
        for i, r in enumerate(reqs):
            ids[i, :len(r.ids)] = r.ids
        pad = R - len(reqs)
        cap = self.spec.max_new_tokens
        new = SlotRows(np.asarray([len(r.ids) for r in reqs] + [1] * pad, np.int32),
                       np.asarray([r.max_new_tokens or cap for r in reqs] + [1] * pad, np.int32),
                       np.full((R,), self.gamma, np.float32), np.full((R,), self.temperature, np.float32),
                       np.asarray([_key_data(r.key) for r in reqs] + [_key_data(reqs[0].key)] * pad, np.uint32))
        slot_R = np.asarray([b for b, _ in entries] + [self.slots] * pad, np.int32)
        args = (self.params, slots.state, slots.rows, slot_R, ids, new)
        return Slots(*self._program(f"admit{R}", admit_slots, *args)(*args))

    def step(self, slots: Slots, more_waiting: bool) -> Slots:
        """Decode until every row is done or, when `more_waiting` (prompts wait for a slot), a row finishes."""
        args = (self.params, slots.state, slots.rows, np.bool_(more_waiting))
        return slots._replace(state=self._program("run", run_slots, *args)(*args))

    def harvest(self, slots: Slots, owned) -> list[tuple[int, RowResult]]:
        """The results of the finished rows among the slots `owned` (one device-to-host read)."""
        state = slots.state
        done, n, nfe, eos, accepted, lengths, seq, iters, stats = jax.device_get(
            (state.done, state.n_generated, state.nfe, state.eos, state.accepted, slots.rows.lengths, state.seq,
             state.iters, mode_of(self.spec).report(state)))
        self.calls = int(iters)
        return [(b, row_result(seq[b, lengths[b]:lengths[b] + n[b]].tolist(), int(nfe[b]), bool(eos[b]),
                               accepted[b].tolist(), row_stats(stats, b)))
                for b in owned if done[b]]

    def decode(self, requests: Iterable[Request]) -> Iterator[tuple[int, RowResult]]:
        """Decode a stream of requests; a finished row's slot takes the next request at once."""
        pending: Iterator = enumerate(requests)
        slots = self.init()
        owner: dict[int, int] = {}  # slot -> index of the request it decodes
        waiting = next(pending, None)
        while owner or waiting is not None:
            free = [b for b in range(self.slots) if b not in owner]
            batch = []
            while free and waiting is not None:
                batch.append((free.pop(0), waiting))
                waiting = next(pending, None)
            for b, (i, r) in batch:
                check_stream_prompt(self.cfg, i, r.ids, self.width)
                owner[b] = i
            if batch:
                slots = self.admit(slots, [(b, r) for b, (_, r) in batch])
            slots = self.step(slots, waiting is not None)
            for b, result in self.harvest(slots, list(owner)):
                yield owner.pop(b), result
        memory = mode_of(self.spec).memory(slots.state)
        if memory is not None:
            self.draft_memory = jax.device_get(memory)


def decode_stream(params, cfg: ModelConfig, prompts: Iterable, spec: DecodeSpec, *, slots: int, prompt_width: int,
                  gamma=DEFAULT_GAMMA, temperature=DEFAULT_TEMPERATURE, key=None, mesh=None,
                  on_row: Callable[[int, RowResult], None] | None = None) -> Iterator[tuple[int, RowResult]]:
    """Continuous batching over a stream of prompts (lists of token ids, or `Request`s); yields `(index,
    RowResult)` as rows finish. Request i's key is fold_in(key, i) unless it brings its own."""
    base = jax.random.key(0) if key is None else key
    reqs = (p if isinstance(p, Request) else Request(tuple(p), jax.random.fold_in(base, i))
            for i, p in enumerate(prompts))
    for i, result in ContinuousDecoder(params, cfg, spec, slots=slots, prompt_width=prompt_width, gamma=gamma,
                                       temperature=temperature, mesh=mesh).decode(reqs):
        if on_row is not None:
            on_row(i, result)
        yield i, result
