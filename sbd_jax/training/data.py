"""Training data: local files through `datasets` -> tokenized documents -> packed rows of L tokens, in a
deterministic, resumable order.

- Records: plain text (`text_field`) or prompt/response, wrapped by the tokenizer's chat template when it
  has one (`sbd_jax.io.tokenizer`; or any callable text -> ids); the prompt's tokens are loss-masked out.
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
import glob
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..config import ConfigError
from ..io.tokenizer import Tokenizer
from .config import DataConfig
from .examples import PackedBatch


class DataError(ConfigError):
    """A dataset that cannot be used as configured (missing file/field, no usable rows...)."""


_EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # a `save_to_disk` directory


def load_records(cfg: DataConfig):
    """-> a `datasets.Dataset` of raw records."""
    import datasets
    if not cfg.path:
        raise DataError("data.path is not set (a local jsonl/json/parquet/arrow file or a saved dataset dir)")
    p = Path(cfg.path)
    if cfg.format == "disk" or (p.is_dir() and any((p / f).exists() for f in _SAVED_MARKERS)):
        if not p.is_dir():
            raise DataError(f"data.path {cfg.path!r} is not a saved dataset directory")
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise DataError(f"split {cfg.split!r} is not in {cfg.path!r} (splits: {sorted(ds)})")
            ds = ds[cfg.split]
        return ds
    files = sorted(str(f) for f in p.iterdir() if f.suffix in _EXT) if p.is_dir() else sorted(glob.glob(str(p)))
    if not files:
        raise DataError(f"data.path {cfg.path!r} does not exist or holds no jsonl/json/parquet/arrow files")
    fmt = cfg.format
    if fmt == "auto":
        kinds = {_EXT.get(Path(f).suffix) for f in files}
        if None in kinds or len(kinds) != 1:
            raise DataError(f"data.path {cfg.path!r}: cannot infer one format from {files[:5]}; set data.format")
        fmt = kinds.pop()
    return datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=cfg.cache_dir)


def _resolve_mode(cfg: DataConfig, columns: list[str]) -> str:
    if cfg.mode == "text" or (cfg.mode == "auto" and cfg.text_field in columns):
        if cfg.text_field not in columns:
            raise DataError(f"data.text_field {cfg.text_field!r} is not a column of {cfg.path!r} "
                            f"(columns: {columns})")
        return "text"
    missing = [f for f in (cfg.prompt_field, cfg.response_field) if f not in columns]
    if missing:
        raise DataError(f"{cfg.path!r} has neither the text field {cfg.text_field!r} nor the prompt/response "
                        f"fields {[cfg.prompt_field, cfg.response_field]} (columns: {columns})")
    return "sft"


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


def tokenize_records(ds, cfg: DataConfig, tok: Tokenizer) -> Documents:
    """Tokenize a `datasets.Dataset` into `Documents` (batched `map`, in memory)."""
    columns = list(ds.column_names)
    mode = _resolve_mode(cfg, columns)
    use_template = mode == "sft" and cfg.chat_template and tok.chat_template
    eos = tok.eos_id if cfg.add_eos and not use_template else None

    def text_fn(batch):
        ids = []
        for t in batch[cfg.text_field]:
            x = tok.encode(t) if isinstance(t, str) and t else []
            if x and eos is not None and x[-1] != eos:
                x.append(eos)
            ids.append(x)
        return {"input_ids": ids, "n_prompt": [0] * len(ids)}

    def sft_fn(batch):
        ids, n_prompt = [], []
        for pr, re in zip(batch[cfg.prompt_field], batch[cfg.response_field]):
            if not isinstance(pr, str) or not isinstance(re, str) or not re:
                ids.append([])
                n_prompt.append(0)
                continue
            if use_template:
                user = [{"role": "user", "content": pr}]
                p_text = tok.render_chat(user, True)
                full = tok.render_chat(user + [{"role": "assistant", "content": re}], False)
                if not full.startswith(p_text):
                    raise DataError("the chat template's rendering of [user, assistant] does not start with "
                                    "its rendering of [user] + generation prompt; set data.chat_template=false")
                p_ids, r_ids = tok.encode(p_text, False), tok.encode(full[len(p_text):], False)
            else:
                p_ids, r_ids = tok.encode(pr), tok.encode(re, False) + ([] if eos is None else [eos])
            ids.append(p_ids + r_ids)
            n_prompt.append(len(p_ids))
        return {"input_ids": ids, "n_prompt": n_prompt}

    keep_in_memory = cfg.cache_dir is None
    out = ds.map(text_fn if mode == "text" else sft_fn, batched=True, remove_columns=columns,
                 keep_in_memory=keep_in_memory, num_proc=cfg.num_proc, desc="tokenizing",
                 load_from_cache_file=not keep_in_memory)
    table = out.with_format("arrow")[:]
    col = table.column("input_ids").combine_chunks()
    offsets = col.offsets.to_numpy().astype(np.int64)
    values = col.values.to_numpy(zero_copy_only=False).astype(np.int32)
    return Documents(values, offsets - offsets[0], table.column("n_prompt").to_numpy().astype(np.int64))


class PackedIterator:
    """Endless source of `PackedBatch` (numpy int32 [batch_size, seq_len]) over `docs`: `next_batch()`."""

    def __init__(self, docs: Documents, seq_len: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 min_doc_tokens: int = 2, source: str = "the dataset", copy_len: int | None = None):
        self.docs, self.L, self.B = docs, int(seq_len), int(batch_size)
        self.C = self.L if copy_len is None else int(copy_len)  # copy-stream tokens (from response starts) per row
        self.W = min(self.L, self.C)  # the longest text piece
        self.seed, self.shuffle, self.min_tokens = int(seed), bool(shuffle), max(int(min_doc_tokens), 1)
        if self._count_usable() == 0:
            raise DataError(f"{source} has no usable rows: {len(docs)} record(s), none gives a piece of at least "
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

    def _count_usable(self) -> int:
        lens, n_prompt = np.diff(self.docs.offsets), self.docs.n_prompt
        n_text = lens // self.W * (self.W >= self.min_tokens) + (lens % self.W >= self.min_tokens)
        sft_ok = (n_prompt < np.minimum(self.L, lens)) & (np.minimum(lens, self.L) >= self.min_tokens)
        return int(np.sum(np.where(n_prompt == 0, n_text, sft_ok)))

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
                   eos_id: int | None = None) -> PackedIterator:
    """DataConfig -> PackedIterator. `tokenizer` overrides cfg.tokenizer (a Tokenizer or a callable
    text -> ids); `eos_id` is used when the tokenizer does not name its EOS token."""
    if tokenizer is None:
        if not cfg.tokenizer:
            raise DataError("data.tokenizer is not set (a tokenizer.json or a directory that holds one)")
        tokenizer = Tokenizer.load(cfg.tokenizer)
    elif not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_callable(tokenizer)
    if tokenizer.eos_id is None:
        tokenizer.eos_id = eos_id
    ds = load_records(cfg)
    if len(ds) == 0:
        raise DataError(f"dataset {cfg.path!r} has no usable rows: it holds no records")
    return PackedIterator(tokenize_records(ds, cfg, tokenizer), cfg.seq_len, batch_size, seed=cfg.seed,
                          shuffle=cfg.shuffle, min_doc_tokens=cfg.min_doc_tokens, source=f"dataset {cfg.path!r}",
                          copy_len=cfg.copy_len)
