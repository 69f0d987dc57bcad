"""Training data: local files through `datasets` -> tokenized documents -> packed rows of L tokens, in a
deterministic, resumable order.

- Records: plain text (`text_field`) or prompt/response, wrapped by the tokenizer's chat template when it
  has one (`sbd_jax.io.tokenizer`; or any callable text -> ids); the prompt's tokens are loss-masked out.
  Tokenized once into a memory-mapped store (store.py), reused by every later start.
- Nothing dropped in silence: the iterator's `report` counts the records used, truncated and dropped by
  reason (missing field, empty, too short, no response token inside seq_len) with the first of each; more
  than `max_drop_share` dropped is an error.
- Packing: documents in a per-epoch permutation (a pure function of (seed, epoch)) are placed whole, in
  order, into rows of L tokens; a document that does not fit the rest of a row starts the next row (the
  rest is padding, segment 0). Text longer than L is cut into L-token pieces, each its own document; a
  prompt/response pair longer than L is truncated (dropped when no response token fits). Pieces shorter
  than `min_doc_tokens` are dropped.
- `copy_len` C (SBD choice; needs response-aligned blocks): no row holds more than C tokens from a response
  start on (longer responses and text pieces are cut to C tokens), so the SBD example's copy stream
  (examples.py) needs only C slots and no prompt.
- Iterator state {epoch, cursor, offset, rows} (JSON) is saved with each checkpoint; `restore` continues
  with exactly the rows an uninterrupted run would have produced.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ..config import ConfigError
from ..io.tokenizer import Tokenizer
from .config import DataConfig
from .examples import PackedBatch


class DataError(ConfigError):
    """A dataset that cannot be used as configured (missing file/field, no usable rows...)."""


@dataclasses.dataclass(frozen=True)
class Documents:
    """Tokenized documents in one flat array: document i is values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray  # int32
    offsets: np.ndarray  # int64 [n + 1]
    n_prompt: np.ndarray  # int64 [n]: each document's loss-masked prefix

    def __len__(self) -> int:
        return len(self.n_prompt)

    @classmethod
    def from_lists(cls, docs: list[list[int]], n_prompt: list[int] | None = None) -> Documents:
        values = np.concatenate([np.asarray(d, np.int32) for d in docs]) if docs else np.zeros(0, np.int32)
        offsets = np.cumsum([0] + [len(d) for d in docs], dtype=np.int64)
        return cls(values, offsets, np.asarray(np.zeros(len(docs)) if n_prompt is None else n_prompt, np.int64))


class PackedIterator:
    """Endless source of `PackedBatch` (numpy int32 [batch_size, seq_len]) over `docs`: `next_batch()`."""

    def __init__(self, docs: Documents, seq_len: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 min_doc_tokens: int = 2, source: str = "the dataset", copy_len: int | None = None):
        self.docs, self.L, self.B = docs, int(seq_len), int(batch_size)
        self.C = self.L if copy_len is None else int(copy_len)  # copy-stream tokens (from response starts) per row
        self.W = min(self.L, self.C)  # the longest text piece
        self.seed, self.shuffle, self.min_tokens = int(seed), bool(shuffle), max(int(min_doc_tokens), 1)
        self.usage = self._usage()
        if self.usage["pieces"] == 0:
            raise DataError(f"{source} has no usable rows: {len(docs)} document(s), none gives a piece of at least "
                            f"{self.min_tokens} tokens (with a response token inside seq_len={self.L} for "
                            "prompt/response data); check the field names and the data")
        self._epoch, self._cursor, self._offset, self._rows = 0, 0, 0, 0
        self._perm = self._permutation(0)

    def state(self) -> dict:
        return {"epoch": self._epoch, "cursor": self._cursor, "offset": self._offset, "rows": self._rows,
                "seed": self.seed, "seq_len": self.L, "copy_len": self.C}

    def restore(self, state: dict) -> None:
        if (state.get("seq_len", self.L), state.get("seed", self.seed), state.get("copy_len", self.L)) != (
                self.L, self.seed, self.C):
            raise DataError(f"data iterator state {state} was saved with another seq_len/seed/copy_len "
                            f"(now seq_len={self.L}, seed={self.seed}, copy_len={self.C})")
        if state.get("lookahead") or state.get("copy_reserve") or state.get("pending"):
            raise DataError(f"data iterator state {state} was saved with look-ahead packing or a copy reserve, "
                            "which this version does not have: resuming would drop or repack documents")
        self._epoch, self._cursor = int(state["epoch"]), int(state["cursor"])
        self._offset, self._rows = int(state["offset"]), int(state["rows"])
        self._perm = self._permutation(self._epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.docs)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def _usage(self, chunk: int = 1 << 20) -> dict:
        """Pieces the documents give, and the documents packing drops (text shorter than min_doc_tokens; a
        prompt/response with no response token inside seq_len) or truncates (a response cut at seq_len or
        copy_len), with the first dropped one; read in chunks (memory-mapped stores stay on disk)."""
        out = {"pieces": 0, "too_short": 0, "no_response_in_seq_len": 0, "truncated": 0, "first": {}}
        for lo in range(0, len(self.docs), chunk):
            offsets = np.asarray(self.docs.offsets[lo:lo + chunk + 1])
            lens, n_prompt = np.diff(offsets), np.asarray(self.docs.n_prompt[lo:lo + chunk])
            text = n_prompt == 0
            n_text = lens // self.W * (self.W >= self.min_tokens) + (lens % self.W >= self.min_tokens)
            kept = np.minimum(lens, np.minimum(self.L, n_prompt + self.C))
            no_resp = ~text & (n_prompt >= kept)
            short = np.where(text, n_text == 0, ~no_resp & (kept < self.min_tokens))
            out["pieces"] += int(np.sum(np.where(text, n_text, ~no_resp & ~short)))
            out["too_short"] += int(short.sum())
            out["no_response_in_seq_len"] += int(no_resp.sum())
            out["truncated"] += int(np.sum(~text & ~no_resp & ~short & (kept < lens)))
            for reason, bad in (("too_short", short), ("no_response_in_seq_len", no_resp)):
                if bad.any() and reason not in out["first"]:
                    out["first"][reason] = lo + int(np.argmax(bad))
        return out

    def _piece(self, i: int, offset: int):
        """Piece of document i starting at token `offset` -> (tokens, loss mask, next_offset); tokens is None
        for an unusable piece."""
        d, n_prompt = self.docs.values[self.docs.offsets[i]:self.docs.offsets[i + 1]], int(self.docs.n_prompt[i])
        if n_prompt == 0:
            piece = d[offset:offset + self.W]
            nxt = offset + self.W if offset + self.W < len(d) else None
            return (piece if len(piece) >= self.min_tokens else None), 1, nxt
        piece = d[:min(self.L, n_prompt + self.C)]  # at most C counted (response) tokens
        ok = n_prompt < len(piece) and len(piece) >= self.min_tokens
        return (piece if ok else None), np.arange(len(piece)) >= n_prompt, None

    def _advance(self, nxt):
        if nxt is not None:
            self._offset = nxt
            return
        self._offset = 0
        self._cursor += 1
        if self._cursor >= len(self._perm):
            self._epoch += 1
            self._cursor = 0
            self._perm = self._permutation(self._epoch)

    def _row(self):
        tokens, segment, position, loss_mask = (np.zeros(self.L, np.int32) for _ in range(4))
        used, used_copy, seg = 0, 0, 0
        while used < self.L:
            i = int(self._perm[self._cursor])
            piece, counted, nxt = self._piece(i, self._offset)
            if piece is not None:
                n, n_copy = len(piece), len(piece) - int(self.docs.n_prompt[i])  # copy tokens: from the response on
                if used + n > self.L or used_copy + n_copy > self.C:
                    break  # the piece starts the next row
                seg += 1
                tokens[used:used + n], segment[used:used + n] = piece, seg
                position[used:used + n], loss_mask[used:used + n] = np.arange(n), counted
                used, used_copy = used + n, used_copy + n_copy
            self._advance(nxt)
        self._rows += 1
        return tokens, segment, position, loss_mask

    def next_batch(self) -> PackedBatch:
        rows = [self._row() for _ in range(self.B)]
        return PackedBatch(*(np.stack(f) for f in zip(*rows)))


def build_iterator(cfg: DataConfig, batch_size: int, *, tokenizer: Tokenizer | Callable | None = None,
                   eos_id: int | None = None, vocab_size: int | None = None) -> PackedIterator:
    """DataConfig -> PackedIterator over the tokenized store (`store.prepare`: made once, then reused).
    `tokenizer` overrides cfg.tokenizer (a Tokenizer or a callable text -> ids); `eos_id` is used when the
    tokenizer does not name its EOS token; `vocab_size`: token ids must be below it. The iterator's `report`
    says what was used, dropped and truncated, and why; more than `cfg.max_drop_share` dropped is an error."""
    from .store import prepare
    if tokenizer is None:
        if not cfg.tokenizer:
            raise DataError("data.tokenizer is not set (a tokenizer.json or a directory that holds one)")
        tokenizer = Tokenizer.load(cfg.tokenizer)
    elif not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_callable(tokenizer)
    if tokenizer.eos_id is None:
        tokenizer.eos_id = eos_id
    store = prepare(cfg, tokenizer)
    meta = store.meta
    if vocab_size is not None and meta["max_id"] >= vocab_size:
        raise DataError(f"dataset {cfg.path!r}: token id {meta['max_id']} is outside the model's vocabulary "
                        f"(vocab_size {vocab_size}): the tokenizer {cfg.tokenizer!r} does not match the model")
    docs = store.documents()
    if len(docs) == 0:
        raise DataError(f"dataset {cfg.path!r} has no usable rows: none of its {meta['records']} record(s) has the "
                        f"fields and a non-empty value ({_drops(meta['dropped'])})")
    it = PackedIterator(docs, cfg.seq_len, batch_size, seed=cfg.seed, shuffle=cfg.shuffle,
                        min_doc_tokens=cfg.min_doc_tokens, source=f"dataset {cfg.path!r}", copy_len=cfg.copy_len)
    u = it.usage
    dropped = dict(meta["dropped"])
    for reason in ("too_short", "no_response_in_seq_len"):
        dropped[reason] = {"count": u[reason], "first": store.record(u["first"][reason]) if u[reason] else None}
    n_dropped = sum(d["count"] for d in dropped.values())
    it.report = {"store": str(store.path), "records": meta["records"], "used": meta["records"] - n_dropped,
                 "truncated": u["truncated"], "dropped": dropped, "tokens": meta["tokens"]}
    share = n_dropped / meta["records"]
    if share > cfg.max_drop_share:
        raise DataError(f"dataset {cfg.path!r}: {100 * share:.1f}% of the records are unusable ({n_dropped} of "
                        f"{meta['records']}: {_drops(dropped)}), more than data.max_drop_share="
                        f"{cfg.max_drop_share}; fix the data or raise data.max_drop_share")
    return it


def _drops(dropped: dict) -> str:
    parts = [f"{k} {d['count']}" + (f" (first: {d['first']})" if d["first"] else "") for k, d in dropped.items()
             if d["count"]]
    return ", ".join(parts) or "none dropped"


def format_report(r: dict) -> str:
    return (f"data: {r['used']} of {r['records']} records used ({r['tokens']} tokens, store {r['store']}); "
            f"{r['truncated']} truncated; dropped: {_drops(r['dropped'])}")
