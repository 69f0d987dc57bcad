"""Verify mode's own state, carried in the loop state's `mode_state`: per-row draft counts and the drafting
policy's memory. SBD and AR runs carry none of it."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...spec import DecodeError
from ...state import Row


class DraftMemory(NamedTuple):
    """What the drafting policy learned over all rows, which a later run of the same model may start from (a
    run's `GenerateOutput.mode_stats.memory`; the batch runner and the continuous engine hand it on). Scalars."""

    hits: jax.Array        # float32: decayed count of checked drafts that agreed
    trials: jax.Array      # float32: decayed count of checked drafts
    stops: jax.Array       # float32: rows stopped by an EOS, among the rows counted in `tokens`
    tokens: jax.Array      # float32: verified tokens of the rows that finished (this run's once it reports)
    since_wide: jax.Array  # int32: calls since the last drafting call (the exploration schedule)

    @classmethod
    def empty(cls) -> DraftMemory:
        """Nothing learned yet."""
        return cls(*(np.float32(0.0),) * 4, np.int32(0))

    @classmethod
    def checked(cls, memory) -> DraftMemory:
        """`memory` as the decoder's argument (the policy starts from nothing when it is None): a DraftMemory or
        its `as_dict()`; anything else is a DecodeError naming what was given."""
        if memory is None:
            return cls.empty()
        if isinstance(memory, dict) and set(memory) == set(cls._fields):  # `as_dict`, e.g. from a JSON summary
            memory = cls(**memory)
        if not isinstance(memory, DraftMemory) or any(jnp.shape(x) != () for x in memory):
            raise DecodeError(f"draft_memory must be a DraftMemory (an earlier run's `mode_stats.memory`) or its "
                              f"as_dict() {list(cls._fields)}, got {type(memory).__name__} {memory!r:.200}")
        return cls(*(jnp.asarray(x, jnp.float32) for x in memory[:4]), jnp.asarray(memory.since_wide, jnp.int32))

    def as_dict(self) -> dict:
        """Plain floats and ints, for a JSON summary."""
        return {f: float(v) if f != "since_wide" else int(v) for f, v in zip(self._fields, jax.device_get(self))}


class VerifyState(NamedTuple):
    """Verify mode's part of the loop state (B rows)."""

    proposed: Row          # [B] drafts placed
    agreed: Row            # [B] drafts that stood
    trials: Row            # [B] float32: the row's decayed count of checked drafts
    hits: Row              # [B] float32: of those, the decayed count that agreed
    memory: DraftMemory    # over all rows

    @classmethod
    def new(cls, B: int, memory: DraftMemory) -> VerifyState:
        zeros = jnp.zeros((B,), jnp.int32)
        return cls(zeros, zeros, jnp.zeros((B,), jnp.float32), jnp.zeros((B,), jnp.float32), memory)


class VerifyStats(NamedTuple):
    """What a verify run reports (`GenerateOutput.mode_stats`)."""

    drafts: jax.Array      # [B] drafts placed
    agreed: jax.Array      # [B] drafts that stood
    memory: DraftMemory    # for the next run's `draft_memory`
