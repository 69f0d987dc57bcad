"""Training data: local files through `datasets` -> tokenized documents -> packed rows of L tokens, in a
deterministic, resumable order.

- Records: plain text (`text_field`) or prompt/response, wrapped by the tokenizer's chat template when it
  has one (`sbd_jax.io.tokenizer`; or any callable text -> ids); the prompt's tokens are loss-masked out.
  Tokenized once into a store on disk (store.py), read per piece, reused by every later start.
- Nothing dropped in silence: the iterator's `report` counts the records used, truncated and dropped by
  reason (missing field, empty, too short, no response token inside seq_len) with the first of each; more
  than `max_drop_share` dropped is an error.
- Packing: every row of the global batch is its own stream. Row r of source j takes the documents at positions
  r, r + B, r + 2B, ... of the concatenated epoch orders of j (epoch e: a permutation that is a pure function of
  (seed, j, e), computed per index in O(1) memory, shuffle.py) and places them whole, in order, into its rows
  of L tokens; a document that does not fit the rest of a row starts the row's next one (the rest is padding,
  segment 0). A process packs only the rows its devices train on and reads only their documents; the rows do
  not depend on how they are split over processes. Text longer than L is cut into L-token pieces, each its own
  document; a prompt/response pair longer than L is truncated (dropped when no response token fits). Pieces
  shorter than `min_doc_tokens` are dropped.
- Several sources (`data.path` a list, `data.weights`): each row draws its next document from the source whose
  share of the row's documents so far lags its weight most (a deterministic weighted round robin: document
  shares, as `datasets.interleave_datasets` probabilities are); each source keeps its own epochs.
- `copy_len` C (SBD choice; needs response-aligned blocks): no row holds more than C tokens from a response
  start on (longer responses and text pieces are cut to C tokens), so the SBD example's copy stream
  (examples.py) needs only C slots and no prompt.
- Why not Grain (MaxText's input library: per-process sharding, checkpointable iterators, an index shuffle):
  `datasets` is already the project's reader and tokenizer driver, and the packer is SBD-specific (response-
  aligned pieces, the copy_len budget per row), so Grain would add a dependency around ~100 lines of packing
  without replacing them; the two things taken from its design are the per-index shuffle and per-row streams.
- Iterator state (JSON; per row a `RowPosition`: documents taken per source, offset in the current one, rows
  packed) is saved with each checkpoint, merged over processes (`gather_state`); `restore` continues with exactly
  the rows an uninterrupted run would have produced, on any number of processes.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ..io.tokenizer import Tokenizer
from .config import DataConfig
from .documents import DataError, Documents  # importable from here too, as users do
from .examples import PackedBatch
from .shuffle import Permutation
from .store import prepare

STATE_VERSION = 2  # one packing stream per batch row


class RowPosition(NamedTuple):
    """Where one batch row's packing stream stands, which is all `restore` needs to continue it."""

    taken: tuple[int, ...]  # documents taken from each source
    offset: int  # token offset in the current document (text longer than a row is cut into pieces)
    packed: int  # rows packed

    @classmethod
    def start(cls, n_sources: int) -> RowPosition:
        return cls((0,) * n_sources, 0, 0)

    def to_json(self) -> list[int]:
        """The saved layout (iterator state "streams", by row): [taken..., offset, packed]."""
        return [*self.taken, self.offset, self.packed]

    @classmethod
    def from_json(cls, saved: Sequence[int]) -> RowPosition:
        *taken, offset, packed = (int(x) for x in saved)
        return cls(tuple(taken), offset, packed)


class PackedIterator:
    """Endless source of `PackedBatch` (numpy int32 [len(rows), seq_len]) over one or several sources of
    documents, mixed by `weights`: `next_batch()`. `rows`: the global batch rows this process packs (default
    all of them); every row is its own packing stream, so any split of the rows over processes packs the same
    rows as one process does."""

    def __init__(self, docs: Documents | Sequence[Documents], seq_len: int, batch_size: int, *,
                 weights: Sequence[float] | None = None, rows: Sequence[int] | None = None, seed: int = 0,
                 shuffle: bool = True, min_doc_tokens: int = 2, source: str | Sequence[str] = "the dataset",
                 copy_len: int | None = None):
        self.sources = [docs] if isinstance(docs, Documents) else list(docs)
        names = [source] if isinstance(source, str) else list(source)
        if len(names) != len(self.sources):
            names = [f"source {j}" for j in range(len(self.sources))]
        w = [1.0] * len(self.sources) if weights is None else [float(x) for x in weights]
        if len(w) != len(self.sources) or not all(x > 0 for x in w):
            raise DataError(f"weights {list(w)} must be one positive number per source ({len(self.sources)})")
        self.weights = [x / sum(w) for x in w]
        self.L, self.B = int(seq_len), int(batch_size)
        self.rows = tuple(range(self.B)) if rows is None else tuple(sorted(int(r) for r in rows))
        if not self.rows or len(set(self.rows)) != len(self.rows) or not 0 <= self.rows[0] <= self.rows[-1] < self.B:
            raise DataError(f"rows {list(self.rows)} must be distinct batch rows in [0, batch_size={self.B})")
        self.C = self.L if copy_len is None else int(copy_len)  # copy-stream tokens (from response starts) per row
        self.W = min(self.L, self.C)  # the longest text piece
        self.seed, self.shuffle, self.min_tokens = int(seed), bool(shuffle), max(int(min_doc_tokens), 1)
        self.usages = [self._usage(d) for d in self.sources]
        for name, d, u in zip(names, self.sources, self.usages):
            if u["pieces"] == 0:
                raise DataError(f"{name} has no usable rows: {len(d)} document(s), none gives a piece of at least "
                                f"{self.min_tokens} tokens (with a response token inside seq_len={self.L} for "
                                "prompt/response data); check the field names and the data")
        self._streams = {r: RowPosition.start(len(self.sources)) for r in self.rows}
        self._perms: dict = {}

    @property
    def docs(self) -> Documents:
        return self.sources[0]

    def epoch(self, source: int = 0) -> int:
        """The epoch of `source` every local row has reached (rows move through their shares at their own pace)."""
        n = len(self.sources[source])
        return min((p.taken[source] * self.B + r) // n for r, p in self._streams.items())

    def state(self) -> dict:
        """JSON-able position of the local rows (`streams`, by row), which `restore` continues from."""
        return {"version": STATE_VERSION, "seed": self.seed, "seq_len": self.L, "copy_len": self.C,
                "batch_size": self.B, "shuffle": self.shuffle, "weights": self.weights,
                "documents": [len(d) for d in self.sources], "content": [d.digest for d in self.sources],
                "rows": sum(p.packed for p in self._streams.values()),
                "streams": {str(r): p.to_json() for r, p in self._streams.items()}}

    def restore(self, state: dict) -> None:
        if state.get("lookahead") or state.get("copy_reserve") or state.get("pending"):
            raise DataError(f"data iterator state {state} was saved with look-ahead packing or a copy reserve, "
                            "which this version does not have: resuming would drop or repack documents")
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data iterator state {_short(state)} was saved by another version of the packer (one "
                            "order for all rows); resuming it here would not continue the same rows")
        now = self.state()
        keys = ("seed", "seq_len", "copy_len", "batch_size", "shuffle", "weights", "documents")
        diff = [f"{k} {state.get(k)!r} there, {now[k]!r} now" for k in keys if state.get(k) != now[k]]
        if "content" in state and state["content"] != now["content"] and not diff:  # (states saved before: none)
            diff = [f"the documents' content digests {state['content']} there, {now['content']} now (the same "
                    "number of records, edited)"]
        if diff:
            raise DataError(f"the data iterator state was saved with other settings or data ({'; '.join(diff)}); "
                            "resuming would not continue the same rows")
        missing = [r for r in self.rows if str(r) not in state["streams"]]
        if missing:
            raise DataError(f"the data iterator state has no position for rows {missing[:8]} (saved rows: "
                            f"{sorted(state['streams'], key=int)[:8]}...)")
        self._streams = {r: RowPosition.from_json(state["streams"][str(r)]) for r in self.rows}

    def _document(self, r: int, taken: Sequence[int]) -> tuple[int, int]:
        """The current (source, document) of row r's stream, which took `taken` documents from each source: the
        source whose share of the draws so far lags its weight most (deterministic weighted round robin), and in it
        position taken * B + r of the concatenated epoch orders (epoch e: a permutation that is a pure function of
        (seed, source, e))."""
        j = min(range(len(self.sources)), key=lambda j: (taken[j] + 1) / self.weights[j])
        n = len(self.sources[j])
        epoch, i = divmod(taken[j] * self.B + r, n)
        if not self.shuffle:
            return j, i
        perm = self._perms.get((j, epoch))
        if perm is None:
            if len(self._perms) > 4 * len(self.sources):
                self._perms.clear()
            perm = self._perms[(j, epoch)] = Permutation(n, self.seed, j, epoch)
        return j, perm(i)

    def _usage(self, docs: Documents, chunk: int = 1 << 20) -> dict:
        """Pieces the documents give, and the documents packing drops (text shorter than min_doc_tokens; a
        prompt/response with no response token inside seq_len) or truncates (a response cut at seq_len or
        copy_len), with the first dropped one; read in chunks (a store stays on disk)."""
        out = {"pieces": 0, "too_short": 0, "no_response_in_seq_len": 0, "truncated": 0, "first": {}}
        for lo in range(0, len(docs), chunk):
            offsets = np.asarray(docs.offsets[lo:lo + chunk + 1])
            lens, n_prompt = np.diff(offsets), np.asarray(docs.n_prompt[lo:lo + chunk])
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

    def _piece(self, docs: Documents, i: int, offset: int):
        """Piece of document i starting at token `offset` -> (tokens, loss mask, next_offset, copy tokens);
        tokens is None for an unusable piece. Reads only the piece."""
        lo, hi = (int(x) for x in docs.offsets[i:i + 2])
        n_prompt = int(docs.n_prompt[i])
        if n_prompt == 0:
            piece = docs.values[lo + offset:min(hi, lo + offset + self.W)]
            nxt = offset + self.W if lo + offset + self.W < hi else None
            return (piece if len(piece) >= self.min_tokens else None), 1, nxt, len(piece)
        piece = docs.values[lo:min(hi, lo + self.L, lo + n_prompt + self.C)]  # at most C counted (response) tokens
        ok = n_prompt < len(piece) and len(piece) >= self.min_tokens
        return (piece if ok else None), np.arange(len(piece)) >= n_prompt, None, len(piece) - n_prompt

    def _row(self, r: int):
        tokens, segment, position, loss_mask = (np.zeros(self.L, np.int32) for _ in range(4))
        pos = self._streams[r]
        taken, offset = list(pos.taken), pos.offset
        used, used_copy, seg, skipped = 0, 0, 0, 0
        while used < self.L:
            j, i = self._document(r, taken)
            docs = self.sources[j]
            piece, counted, nxt, n_copy = self._piece(docs, i, offset)  # copy tokens: from the response on
            if piece is not None:
                n = len(piece)
                if used + n > self.L or used_copy + n_copy > self.C:
                    break  # the piece starts the next row
                seg += 1
                tokens[used:used + n], segment[used:used + n] = piece, seg
                position[used:used + n], loss_mask[used:used + n] = np.arange(n), counted
                used, used_copy, skipped = used + n, used_copy + n_copy, 0
            else:
                skipped += 1
                if skipped > sum(map(len, self.sources)) + self.B:
                    raise DataError(f"batch row {r} met no usable document in {skipped} draws: too few usable "
                                    "documents for this batch size without shuffling (see the data report)")
            if nxt is not None:
                offset = nxt
            else:
                offset = 0
                taken[j] += 1
        self._streams[r] = RowPosition(tuple(taken), offset, pos.packed + 1)
        return tokens, segment, position, loss_mask

    def next_batch(self) -> PackedBatch:
        rows = [self._row(r) for r in self.rows]
        return PackedBatch(*(np.stack(f) for f in zip(*rows)))


def _short(state: dict) -> str:
    return json.dumps({k: v for k, v in state.items() if k != "streams"})[:300]


def gather_state(state: dict) -> dict:
    """The iterator states of every process merged into one (all rows): what a checkpoint saves, so that any
    process (or another process count) restores its own rows. A collective: every process calls it."""
    import jax
    if jax.process_count() == 1 or "streams" not in state:
        return state
    from jax.experimental import multihost_utils
    B, width = state["batch_size"], len(next(iter(state["streams"].values())))
    table = np.full((B, width), -1, np.int64)
    for r, s in state["streams"].items():
        table[int(r)] = s
    if table.max() >= 2 ** 31:
        raise DataError("data iterator position beyond int32: cannot be gathered across processes")
    every = np.asarray(multihost_utils.process_allgather(table.astype(np.int32))).max(axis=0)
    if (every < 0).any():
        raise DataError(f"batch rows {np.flatnonzero((every < 0).any(axis=1))[:8].tolist()} are packed by no process")
    return {**state, "rows": int(every[:, -1].sum()), "streams": {str(r): every[r].tolist() for r in range(B)}}


def build_iterator(cfg: DataConfig, batch_size: int, *, tokenizer: Tokenizer | Callable | None = None,
                   eos_id: int | None = None, vocab_size: int | None = None,
                   rows: Sequence[int] | None = None, mask_id: int | None = None) -> PackedIterator:
    """DataConfig -> PackedIterator over the tokenized stores of its sources (`store.prepare`: made once, then
    reused), packing the batch `rows` of this process (default all). `tokenizer` overrides cfg.tokenizer (a
    Tokenizer or a callable text -> ids); `eos_id` is used when the tokenizer does not name its EOS token;
    `vocab_size`: token ids must be below it; `mask_id` (the SBD mask token) must occur in no document and be no
    special token of the chat template. The iterator's `report` says what was used, dropped and truncated,
    and why, per source (`sources`) and in all; more than `cfg.max_drop_share` of a source dropped is an error."""
    if tokenizer is None:
        if not cfg.tokenizer:
            raise DataError("data.tokenizer is not set (a tokenizer.json or a directory that holds one)")
        tokenizer = Tokenizer.load(cfg.tokenizer)
    elif not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_callable(tokenizer)
    if tokenizer.eos_id is None:
        tokenizer.eos_id = eos_id
    paths = cfg.paths()
    stores = [prepare(dataclasses.replace(cfg, path=p, weights=None), tokenizer) for p in paths]
    if mask_id is not None:
        check_mask_id(cfg, tokenizer, int(mask_id), paths, stores)
    for p, store in zip(paths, stores):
        meta = store.meta
        if vocab_size is not None and meta["max_id"] >= vocab_size:
            raise DataError(f"dataset {p!r}: token id {meta['max_id']} is outside the model's vocabulary "
                            f"(vocab_size {vocab_size}): the tokenizer {cfg.tokenizer!r} does not match the model")
        if meta["documents"] == 0:
            raise DataError(f"dataset {p!r} has no usable rows: none of its {meta['records']} record(s) has the "
                            f"fields and a non-empty value ({_drops(meta['dropped'])})")
    it = PackedIterator([s.documents() for s in stores], cfg.seq_len, batch_size, weights=cfg.weights, rows=rows,
                        seed=cfg.seed, shuffle=cfg.shuffle, min_doc_tokens=cfg.min_doc_tokens,
                        source=[f"dataset {p!r}" for p in paths], copy_len=cfg.copy_len)
    reports = [_source_report(p, store, u, cfg.max_drop_share) for p, store, u in zip(paths, stores, it.usages)]
    if len(reports) == 1:
        it.report = reports[0]
    else:
        dropped = {k: {"count": sum(r["dropped"][k]["count"] for r in reports),
                       "first": next((r["dropped"][k]["first"] for r in reports if r["dropped"][k]["first"]), None)}
                   for k in reports[0]["dropped"]}
        it.report = {"store": ", ".join(r["store"] for r in reports), "dropped": dropped, "sources": reports,
                     **{k: sum(r[k] for r in reports) for k in ("records", "used", "truncated", "tokens")}}
    return it


def check_mask_id(cfg: DataConfig, tokenizer: Tokenizer, mask_id: int, paths: Sequence[str], stores) -> None:
    """The mask token must be no special token the chat template writes and occur in no document: a model that
    sees it as text can no longer tell the mask from the word."""
    fix = ("set model.mask_token_id to an id the data never uses (e.g. a reserved special token), or "
           "model.add_mask_token=true to add one")
    if cfg.chat_template and cfg.mode != "text" and tokenizer.chat_template:
        for name, text in tokenizer.special_tokens.items():
            used = name in tokenizer.chat_template or (isinstance(text, str) and text in tokenizer.chat_template)
            if used and isinstance(text, str) and text and tokenizer.encode(text, False) == [mask_id]:
                raise DataError(f"model.mask_token_id {mask_id} is {text!r}, the tokenizer's {name} that the chat "
                                f"template (data.chat_template=true) uses; {fix}")
        sample = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        if mask_id in tokenizer.encode(tokenizer.render_chat(sample, False), False):
            raise DataError(f"model.mask_token_id {mask_id} is a token the chat template (data.chat_template=true) "
                            f"writes into every conversation; {fix}")
    for p, store in zip(paths, stores):
        if n := store.count(mask_id):
            raise DataError(f"model.mask_token_id {mask_id} occurs {n} time(s) in the training data of dataset "
                            f"{p!r} (first: {store.first(mask_id)}); the model could not tell the mask from that "
                            f"token; {fix}")


def _source_report(path: str, store, u: dict, max_drop_share: float) -> dict:
    meta = store.meta
    dropped = dict(meta["dropped"])
    for reason in ("too_short", "no_response_in_seq_len"):
        dropped[reason] = {"count": u[reason], "first": store.record(u["first"][reason]) if u[reason] else None}
    n_dropped = sum(d["count"] for d in dropped.values())
    share = n_dropped / meta["records"]
    if share > max_drop_share:
        raise DataError(f"dataset {path!r}: {100 * share:.1f}% of the records are unusable ({n_dropped} of "
                        f"{meta['records']}: {_drops(dropped)}), more than data.max_drop_share="
                        f"{max_drop_share}; fix the data or raise data.max_drop_share")
    return {"path": path, "store": str(store.path), "records": meta["records"], "used": meta["records"] - n_dropped,
            "truncated": u["truncated"], "dropped": dropped, "tokens": meta["tokens"]}


def _drops(dropped: dict) -> str:
    parts = [f"{k} {d['count']}" + (f" (first: {d['first']})" if d["first"] else "") for k, d in dropped.items()
             if d["count"]]
    return ", ".join(parts) or "none dropped"


def format_report(r: dict) -> str:
    return (f"data: {r['used']} of {r['records']} records used ({r['tokens']} tokens, store {r['store']}); "
            f"{r['truncated']} truncated; dropped: {_drops(r['dropped'])}")
