"""Training data: local files through `datasets` -> tokenized documents -> packed rows of L tokens,
in a deterministic, resumable order.

- Sources: jsonl/json, parquet, arrow files (a path, a glob, or a directory of such files), or a
  directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (`load_from_disk`).
- Records: plain text (`text_field`) or prompt/response (`prompt_field`, `response_field`). For
  prompt/response the tokenizer's chat template (tokenizer_config.json `chat_template` or
  chat_template.jinja) wraps the pair when present; the prompt's tokens are loss-masked out.
- Tokenizer: a `tokenizers` tokenizer.json (or a directory with one), or any callable text -> ids.
- Packing: documents in a per-epoch permutation (a pure function of (seed, epoch)) are placed whole,
  one after another, into rows of L tokens; a document that does not fit the rest of a row starts
  the next row (the rest is padding, segment 0). Text longer than L is cut into L-token pieces, each
  its own document (positions restart); a prompt/response pair longer than L is truncated (the
  pair is dropped when no response token fits). Pieces shorter than `min_doc_tokens` are dropped.
- `eos_padding` (SBD choice): that many extra EOS tokens follow each document's end, loss-counted.
  Documents are isolated (segments), so without them the copy stream's last block of a document is
  cut at its end, and the number of `<m>` left in it tells the model where the answer ends; at
  inference the block holding the EOS is always k masks wide. With k_max - 1 extra EOS the last
  block is never cut, and the positions after the end learn to be EOS (generation stops at the first
  one). Default 0: measured in the demo (eos_padding=15, same pretrain) it made SBD decoding much
  worse (38.8% vs 48.2% at gamma 0.1, same tasks and steps; reversal 74% vs 88%): the model then places an early, confident
  EOS that cuts the answer. Kept as an option for data where the answer length is not predictable.
- `block_tail` (SBD choice): that many `<m>` tokens follow each document's end, never counted by a loss
  (and never unmasked in the copy stream). Without them a document's last copy block is cut at its end:
  it is narrower than k exactly when it holds the end, so training teaches the model that the block's
  width tells where the answer stops, and that a full-width block never holds an EOS - while at inference
  every block is k positions wide, with masks after the EOS. With k_max - 1 of them the last block is
  always full width and the positions after the end are `<m>`, as at inference; unlike `eos_padding`
  nothing teaches the model to predict EOS there. Costs k_max - 1 tokens of row space per document.
- `copy_len` C (SBD choice, an efficiency; needs response-aligned blocks): with C < L no row holds more
  than C tokens from a response start on (a prompt/response pair with a longer response is truncated
  to C response tokens, a text piece to C tokens); the SBD example then lays out only those tokens in
  its copy stream (examples.py), not the prompts, which the copy stream never uses. For SFT data
  C ~ L x (response share) keeps the rows about as full as without it.
- `copy_reserve` R (for `sbd.block_fill`, examples.py): every placed document takes R copy slots beyond its
  own copy tokens, so the fill of its last block (k - 1 at most, ~(k - 1)/2 on average) usually has room;
  responses and text pieces are cut to C - R tokens.
- `pack_lookahead` W: a document that does not fit the rest of a row is set aside (at most W at a time)
  while the next ones fill the row; set-aside documents are placed first, oldest first, in the next rows
  (the first always fits an empty row), so none is lost or repeated and none waits long.
- Iterator state {epoch, cursor, offset, rows, pending} (JSON) is saved with each checkpoint; `restore`
  continues with exactly the rows an uninterrupted run would have produced.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..config import ConfigError
from .config import DataConfig
from .examples import PackedBatch
from ..io.chat import ChatTemplateError, render_chat_template


class DataError(ConfigError):
    """A dataset that cannot be used as configured (missing file/field, no usable rows...)."""


# ----------------------------------------------------------------------------------------------
# tokenizer


class Tokenizer:
    """Minimal tokenizer interface used by the pipeline: `encode(text, special) -> list[int]`,
    `eos_id`, and the chat template (jinja source) with its bos/eos strings when there is one."""

    def __init__(self, encode: Callable[..., list[int]], *, eos_id: int | None = None,
                 chat_template: str | None = None, bos_token: str = "", eos_token: str = ""):
        self._encode = encode
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self._encode(text, special))

    @classmethod
    def from_callable(cls, fn: Callable[[str], list[int]], **kw) -> Tokenizer:
        return cls(lambda text, special: fn(text), **kw)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError as e:
            raise DataError(str(e)) from None


def _token_str(v) -> str:
    if isinstance(v, dict):
        return v.get("content", "")
    return v or ""


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A local tokenizer.json (or a directory holding tokenizer.json, optionally tokenizer_config.json
    and chat_template.jinja). Never downloads."""
    from tokenizers import Tokenizer as HFTok
    p = Path(path)
    tok_file = p / "tokenizer.json" if p.is_dir() else p
    if not tok_file.is_file():
        raise DataError(f"tokenizer file {str(tok_file)!r} does not exist (pass a tokenizer.json or a "
                        "directory that contains one; hub names are not downloaded)")
    try:
        tk = HFTok.from_file(str(tok_file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception on a bad file
        raise DataError(f"cannot read tokenizer {str(tok_file)!r}: {e}") from None
    conf = {}
    conf_file = tok_file.parent / "tokenizer_config.json"
    if conf_file.is_file():
        conf = json.loads(conf_file.read_text())
    template = conf.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = tok_file.parent / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    bos, eos = _token_str(conf.get("bos_token")), _token_str(conf.get("eos_token"))
    eos_id = tk.token_to_id(eos) if eos else None
    return Tokenizer(lambda text, special: tk.encode(text, add_special_tokens=special).ids,
                     eos_id=eos_id, chat_template=template, bos_token=bos, eos_token=eos)


# ----------------------------------------------------------------------------------------------
# records


_EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def load_records(cfg: DataConfig):
    """-> a `datasets.Dataset` of raw records."""
    import datasets
    if not cfg.path:
        raise DataError("data.path is not set (a local jsonl/json/parquet/arrow file or a saved dataset dir)")
    p = Path(cfg.path)
    fmt = cfg.format
    files: list[str] = []
    if fmt == "auto" or fmt != "disk":
        if p.is_dir():
            if any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
                fmt = "disk"
            else:
                files = sorted(str(f) for f in p.iterdir() if f.suffix in _EXT)
        else:
            files = sorted(glob.glob(str(p))) if any(c in str(p) for c in "*?[") else (
                [str(p)] if p.is_file() else [])
        if fmt != "disk" and not files:
            raise DataError(f"data.path {cfg.path!r} does not exist or holds no jsonl/json/parquet/arrow files")
        if fmt == "auto" and files:
            kinds = {_EXT.get(Path(f).suffix) for f in files}
            if None in kinds or len(kinds) != 1:
                raise DataError(f"data.path {cfg.path!r}: cannot infer one format from {files[:5]}; "
                                "set data.format")
            fmt = kinds.pop()
    if fmt == "disk":
        if not p.is_dir():
            raise DataError(f"data.path {cfg.path!r} is not a saved dataset directory")
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise DataError(f"split {cfg.split!r} is not in {cfg.path!r} (splits: {sorted(ds)})")
            ds = ds[cfg.split]
        return ds
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


class Documents:
    """Tokenized documents as one flat int32 array + offsets; `n_prompt[i]` = loss-masked prefix,
    `n_tail[i]` = loss-masked suffix (the `block_tail` positions; default none)."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray, n_prompt: np.ndarray, n_tail: np.ndarray | None = None):
        self.values = np.asarray(values, np.int32)
        self.offsets = np.asarray(offsets, np.int64)
        self.n_prompt = np.asarray(n_prompt, np.int64)
        self.n_tail = np.zeros_like(self.n_prompt) if n_tail is None else np.asarray(n_tail, np.int64)

    def __len__(self) -> int:
        return len(self.n_prompt)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    @classmethod
    def from_lists(cls, docs: list[list[int]], n_prompt: list[int] | None = None) -> Documents:
        lens = np.array([len(d) for d in docs], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)])
        values = np.concatenate([np.asarray(d, np.int32) for d in docs]) if docs else np.zeros(0, np.int32)
        return cls(values, offsets, np.zeros(len(docs), np.int64) if n_prompt is None else n_prompt)


def tokenize_records(ds, cfg: DataConfig, tok: Tokenizer, mask_id: int | None = None) -> Documents:
    """Tokenize a `datasets.Dataset` into `Documents` (batched `map`, in memory). `mask_id`: the `<m>` id,
    needed for `cfg.block_tail`."""
    columns = list(ds.column_names)
    mode = _resolve_mode(cfg, columns)
    use_template = mode == "sft" and cfg.chat_template and tok.chat_template
    eos = tok.eos_id if cfg.add_eos and not use_template else None
    if cfg.eos_padding and tok.eos_id is None:
        raise DataError("data.eos_padding needs an EOS token, but the tokenizer names none")
    if cfg.block_tail and mask_id is None:
        raise DataError("data.block_tail needs the model's mask token id (model.mask_token_id)")
    # see DataConfig.eos_padding / block_tail and the module docstring
    tail = [tok.eos_id] * cfg.eos_padding + [mask_id] * cfg.block_tail

    def text_fn(batch):
        ids = []
        for t in batch[cfg.text_field]:
            x = tok.encode(t, True) if isinstance(t, str) and t else []
            if x and eos is not None and x[-1] != eos:
                x.append(eos)
            ids.append(x + tail if x else x)
        return {"input_ids": ids, "n_prompt": [0] * len(ids)}

    def sft_fn(batch):
        ids, n_prompt = [], []
        for pr, re in zip(batch[cfg.prompt_field], batch[cfg.response_field]):
            if not isinstance(pr, str) or not isinstance(re, str) or not re:
                ids.append([])
                n_prompt.append(0)
                continue
            if use_template:
                p_text = tok.render_chat([{"role": "user", "content": pr}], True)
                full = tok.render_chat([{"role": "user", "content": pr}, {"role": "assistant", "content": re}],
                                       False)
                if not full.startswith(p_text):
                    raise DataError("the chat template's rendering of [user, assistant] does not start with "
                                    "its rendering of [user] + generation prompt; set data.chat_template=false")
                p_ids, r_ids = tok.encode(p_text, False), tok.encode(full[len(p_text):], False)
            else:
                p_ids, r_ids = tok.encode(pr, True), tok.encode(re, False)
                if eos is not None:
                    r_ids = r_ids + [eos]
            ids.append(p_ids + r_ids + tail)
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
    n_prompt = table.column("n_prompt").to_numpy().astype(np.int64)
    lens = np.diff(offsets)
    return Documents(values, offsets - offsets[0], n_prompt, np.where(lens > 0, cfg.block_tail, 0))


# ----------------------------------------------------------------------------------------------
# packing


class PackedIterator:
    """Endless iterator of `PackedBatch` (numpy int32 [batch_size, seq_len]) over `docs`."""

    def __init__(self, docs: Documents, seq_len: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 min_doc_tokens: int = 2, source: str = "the dataset", copy_len: int | None = None,
                 lookahead: int = 0, copy_reserve: int = 0):
        self.docs, self.L, self.B = docs, int(seq_len), int(batch_size)
        self.lookahead = int(lookahead)  # pieces that may wait for a later row (0: strictly in order)
        if self.lookahead < 0:
            raise DataError(f"pack_lookahead must be >= 0, got {lookahead}")
        self.C = self.L if copy_len is None else int(copy_len)  # copy-stream tokens (from response starts) per row
        if not 1 <= self.C <= self.L:
            raise DataError(f"copy_len must be in [1, seq_len={self.L}], got {copy_len}")
        self.R = int(copy_reserve)  # copy slots kept free per document (sbd.block_fill)
        if not 0 <= self.R < self.C:
            raise DataError(f"copy_reserve must be in [0, copy_len={self.C}), got {copy_reserve}")
        self.seed, self.shuffle, self.min_tokens = int(seed), bool(shuffle), max(int(min_doc_tokens), 1)
        n_usable = self._count_usable()
        if n_usable == 0:
            raise DataError(f"{source} has no usable rows: {len(docs)} record(s), none gives a piece of at least "
                            f"{self.min_tokens} tokens (with a response token inside seq_len={self.L} for "
                            "prompt/response data); check the field names and the data")
        self.n_usable_pieces = n_usable
        self._epoch, self._cursor, self._offset, self._rows = 0, 0, 0, 0
        self._pending: list[tuple[int, int]] = []  # (document, offset) of pieces set aside, oldest first
        self._perm = self._permutation(0)

    # -- state --------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"epoch": self._epoch, "cursor": self._cursor, "offset": self._offset, "rows": self._rows,
                "seed": self.seed, "seq_len": self.L, "copy_len": self.C, "lookahead": self.lookahead,
                "copy_reserve": self.R,
                "pending": [list(p) for p in self._pending]}

    def restore(self, state: dict) -> None:
        if (state.get("seq_len", self.L) != self.L or state.get("seed", self.seed) != self.seed
                or state.get("copy_len", self.L) != self.C or state.get("lookahead", 0) != self.lookahead
                or state.get("copy_reserve", 0) != self.R):
            raise DataError(f"data iterator state {state} was saved with another seq_len/seed/copy_len/lookahead/"
                            f"copy_reserve (now seq_len={self.L}, seed={self.seed}, copy_len={self.C}, "
                            f"lookahead={self.lookahead}, copy_reserve={self.R})")
        self._epoch, self._cursor = int(state["epoch"]), int(state["cursor"])
        self._offset, self._rows = int(state["offset"]), int(state["rows"])
        self._pending = [(int(i), int(o)) for i, o in state.get("pending", [])]
        self._perm = self._permutation(self._epoch)

    # -- pieces -------------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.docs)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _count_usable(self) -> int:
        lens, n_prompt = self.docs.lengths(), self.docs.n_prompt
        text = n_prompt == 0
        W = min(self.L, self.C - self.R)  # text piece width
        full, rest = lens // W, lens % W
        n_text = full * (W >= self.min_tokens) + (rest >= self.min_tokens)
        end = lens - self.docs.n_tail
        sft_ok = (n_prompt < np.minimum(self.L, end)) & (np.minimum(lens, self.L) >= self.min_tokens)
        return int(np.sum(np.where(text, n_text, sft_ok)))

    def _piece(self, i: int, offset: int):
        """Piece of document i starting at token `offset` -> (tokens, loss mask, next_offset); tokens is None
        for an unusable piece."""
        d, n_prompt = self.docs.doc(i), int(self.docs.n_prompt[i])
        end = len(d) - int(self.docs.n_tail[i])  # the uncounted tail starts here
        if n_prompt == 0:
            W = min(self.L, self.C - self.R)
            piece = d[offset:offset + W]
            nxt = offset + W if offset + W < len(d) else None
            counted = offset + np.arange(len(piece)) < end
            return (piece if len(piece) >= self.min_tokens else None), counted, nxt
        piece = d[:min(self.L, n_prompt + self.C - self.R)]  # at most C - R counted (response) tokens
        ok = n_prompt < min(len(piece), end) and len(piece) >= self.min_tokens
        idx = np.arange(len(piece))
        return (piece if ok else None), (idx >= n_prompt) & (idx < end), None

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
        L = self.L
        tokens = np.zeros(L, np.int32)
        segment = np.zeros(L, np.int32)
        position = np.zeros(L, np.int32)
        loss_mask = np.zeros(L, np.int32)
        used, used_copy, seg = 0, 0, 0

        def place(i, piece, counted):
            nonlocal used, used_copy, seg
            n, n_copy = len(piece), len(piece) - int(self.docs.n_prompt[i])  # copy tokens: from the response on
            if used + n > L or used_copy + n_copy + self.R > self.C:
                return False
            seg += 1
            tokens[used:used + n] = piece
            segment[used:used + n] = seg
            position[used:used + n] = np.arange(n)
            loss_mask[used:used + n] = counted
            used, used_copy = used + n, used_copy + n_copy + self.R
            return True

        # pieces set aside by earlier rows go first, oldest first (the first one always fits an empty row)
        j = 0
        while j < len(self._pending) and used < L:
            i, offset = self._pending[j]
            piece, counted, nxt = self._piece(i, offset)
            if piece is None:  # a text document's last piece, too short to use
                del self._pending[j]
            elif place(i, piece, counted):
                if nxt is None:
                    del self._pending[j]
                else:  # the document's next piece takes its place in the queue
                    self._pending[j] = (i, nxt)
            else:
                j += 1
        while used < L:
            i = int(self._perm[self._cursor])
            piece, counted, nxt = self._piece(i, self._offset)
            if piece is None:
                self._advance(nxt)
                continue
            if place(i, piece, counted):
                self._advance(nxt)
            elif len(self._pending) < self.lookahead:
                # set the rest of this document aside for a later row, look at the next one
                self._pending.append((i, self._offset))
                self._advance(None)
            else:
                break
        self._rows += 1
        return tokens, segment, position, loss_mask

    def next_batch(self) -> PackedBatch:
        rows = [self._row() for _ in range(self.B)]
        return PackedBatch(*(np.stack(f) for f in zip(*rows)))

    def __iter__(self):
        return self

    def __next__(self) -> PackedBatch:
        return self.next_batch()


def build_iterator(cfg: DataConfig, batch_size: int, *, tokenizer: Tokenizer | Callable | None = None,
                   eos_id: int | None = None, mask_id: int | None = None) -> PackedIterator:
    """DataConfig -> PackedIterator. `tokenizer` overrides cfg.tokenizer (a Tokenizer or a callable
    text -> ids); `eos_id` is used when the tokenizer does not name its EOS token; `mask_id` (the
    model's `<m>`) fills `cfg.block_tail`."""
    if tokenizer is None:
        if not cfg.tokenizer:
            raise DataError("data.tokenizer is not set (a tokenizer.json or a directory that holds one)")
        tokenizer = load_tokenizer(cfg.tokenizer)
    elif not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_callable(tokenizer, eos_id=eos_id)
    if tokenizer.eos_id is None and eos_id is not None:
        tokenizer.eos_id = eos_id
    ds = load_records(cfg)
    if len(ds) == 0:
        raise DataError(f"dataset {cfg.path!r} has no usable rows: it holds no records")
    docs = tokenize_records(ds, cfg, tokenizer, mask_id)
    return PackedIterator(docs, cfg.seq_len, batch_size, seed=cfg.seed, shuffle=cfg.shuffle,
                          min_doc_tokens=cfg.min_doc_tokens, source=f"dataset {cfg.path!r}", copy_len=cfg.copy_len,
                          lookahead=cfg.pack_lookahead, copy_reserve=cfg.copy_reserve)
