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
    """What the drafting policy learned over all rows, which a later run of the same model and block size may start
    from (a run's `GenerateOutput.mode_stats.memory`; the batch runner and the continuous engine hand it on).
    J = block_size - 1 draft offsets: a draft's offset is its place in its block after the block's first token."""

    hits: jax.Array        # [J] float32: per offset, decayed count of checked drafts that agreed
    trials: jax.Array      # [J] float32: per offset, decayed count of checked drafts (their earlier ones agreed)
    stops: jax.Array       # float32: rows stopped by an EOS, among the rows counted in `tokens`
    tokens: jax.Array      # float32: verified tokens of the rows that finished (this run's once it reports)
    since_wide: jax.Array  # int32: calls since the last drafting call (the exploration schedule)

    @classmethod
    def empty(cls, offsets: int) -> DraftMemory:
        """Nothing learned yet."""
        zeros = np.zeros((offsets,), np.float32)
        return cls(zeros, zeros, np.float32(0.0), np.float32(0.0), np.int32(0))

    @classmethod
    def checked(cls, memory, offsets: int) -> DraftMemory:
        """`memory` as the decoder's argument for `offsets` draft offsets (block_size - 1; the policy starts from
        nothing when it is None): a DraftMemory or its `as_dict()`; anything else is a DecodeError naming it."""
        if memory is None:
            return cls.empty(offsets)
        if isinstance(memory, dict) and set(memory) == set(cls._fields):  # `as_dict`, e.g. from a JSON summary
            memory = cls(**{f: np.asarray(v) for f, v in memory.items()})
        shapes = ((offsets,), (offsets,), (), (), ())
        if not isinstance(memory, DraftMemory) or tuple(jnp.shape(x) for x in memory) != shapes:
            raise DecodeError(f"draft_memory must be a DraftMemory of a run with block_size {offsets + 1} (an "
                              f"earlier run's `mode_stats.memory`, or its as_dict() {list(cls._fields)}; shapes "
                              f"{shapes}), got {type(memory).__name__} {memory!r:.200}")
        if not any(isinstance(x, jax.core.Tracer) for x in memory):  # (traced inside a user's jit: not checkable)
            host = {f: np.asarray(x, np.float64) for f, x in zip(cls._fields, memory)}
            bad = [f"{f}={v.tolist()!r:.80}" for f, v in host.items() if not np.all(np.isfinite(v) & (v >= 0))]
            if not bad and (np.any(host["hits"] > host["trials"] + 1e-3) or host["stops"] > host["tokens"] + 1e-3):
                bad = ["hits above trials or stops above tokens"]
            if bad:
                raise DecodeError(f"draft_memory holds values no run produces ({'; '.join(bad)}): counts are finite, "
                                  ">= 0, hits <= trials and stops <= tokens; pass an earlier run's memory or None")
        return cls(*(jnp.asarray(x, jnp.float32) for x in memory[:4]), jnp.asarray(memory.since_wide, jnp.int32))

    def as_dict(self) -> dict:
        """Plain numbers and lists, for a JSON summary."""
        host = jax.device_get(self)
        return {"hits": np.asarray(host.hits).tolist(), "trials": np.asarray(host.trials).tolist(),
                "stops": float(host.stops), "tokens": float(host.tokens), "since_wide": int(host.since_wide)}


class VerifyState(NamedTuple):
    """Verify mode's part of the loop state (B rows; step.py: what the commit window holds)."""

    # generated indices [commit_start, commit_start + commit_len): AR's verified token, then the drafts the next call
    # checks; the next block (its positions not drafted yet) starts at block_offset
    commit_start: Row      # [B]
    commit_len: Row        # [B]
    block_offset: Row      # [B]
    proposed: Row          # [B] drafts placed
    agreed: Row            # [B] drafts that stood
    trials: Row            # [B, J] float32: per draft offset, the row's decayed count of checked drafts
    hits: Row              # [B, J] float32: of those, the decayed count that agreed
    opened: Row            # [B] generated index of the first token of the block the waiting drafts belong to
    memory: DraftMemory    # over all rows

    @classmethod
    def new(cls, B: int, memory: DraftMemory) -> VerifyState:
        zeros, counts = jnp.zeros((B,), jnp.int32), jnp.zeros((B, memory.hits.shape[0]), jnp.float32)
        return cls(zeros, zeros, zeros, zeros, zeros, counts, counts, zeros, memory)


class VerifyStats(NamedTuple):
    """What a verify run reports (`GenerateOutput.mode_stats`)."""

    drafts: jax.Array      # [B] drafts placed
    agreed: jax.Array      # [B] drafts that stood
    memory: DraftMemory    # for the next run's `draft_memory`
