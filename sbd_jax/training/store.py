"""Tokenize once, to disk: the data files -> a store of tokenized documents that training reads piece by piece.

A store is a directory named by a fingerprint of (the files' paths, sizes and modification times, the tokenizer
files' contents, the tokenization settings): a restart, another run or another host with the same inputs reuses
it and never calls the tokenizer. Files are read one at a time through `datasets` (`map` with `num_proc`, Arrow
on disk) and appended as flat arrays, so memory stays bounded whatever the corpus size:
  tokens.bin int32 (all documents back to back), offsets.bin int64 [n + 1], n_prompt.bin int64 [n] (each
  document's loss-masked prefix), record.bin int64 [n] (its record in its file), counts.bin int64 [max_id + 1]
  (how often each token id occurs: the mask id must not), meta.json (counts, drops, a digest of the content).
A store is written aside and renamed into place: it is complete or absent.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np

from ..jsonlines import parse_object
from .config import DataConfig
from .distill import id_records
from .documents import ContentDigest, DataError, Documents

STORE_VERSION = 3  # 2: counts.bin; 3: meta "content", a digest of the documents
_EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # a `save_to_disk` directory
# why a record gives no document at tokenize time (status codes of the map; 0 = used)
RECORD_DROPS = {1: "missing_field", 2: "empty"}


def sources(cfg: DataConfig) -> tuple[str, list[str]]:
    """(format, files) of `cfg.path`; format "disk" for a `save_to_disk` directory (one source)."""
    if not cfg.path:
        raise DataError("data.path is not set (a local jsonl/json/parquet/arrow file or a saved dataset dir)")
    p = Path(cfg.path)
    if cfg.format == "disk" or (p.is_dir() and any((p / f).exists() for f in _SAVED_MARKERS)):
        if not p.is_dir():
            raise DataError(f"data.path {cfg.path!r} is not a saved dataset directory")
        return "disk", [str(p)]
    files = sorted(str(f) for f in p.iterdir() if f.suffix in _EXT) if p.is_dir() else sorted(glob.glob(str(p)))
    if not files:
        raise DataError(f"data.path {cfg.path!r} does not exist or holds no jsonl/json/parquet/arrow files")
    fmt = cfg.format
    if fmt == "auto":
        kinds = {_EXT.get(Path(f).suffix) for f in files}
        if None in kinds or len(kinds) != 1:
            raise DataError(f"data.path {cfg.path!r}: cannot infer one format from {files[:5]}; set data.format")
        fmt = kinds.pop()
    return fmt, files


def load_source(cfg: DataConfig, fmt: str, source: str):
    """One file (or saved directory) as a `datasets.Dataset`; a file that is empty or not in its format is a
    clear error naming it."""
    import datasets
    if fmt == "disk":
        ds = datasets.load_from_disk(source)
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise DataError(f"split {cfg.split!r} is not in {source!r} (splits: {sorted(ds)})")
            ds = ds[cfg.split]
    else:
        if os.path.getsize(source) == 0:
            raise DataError(f"data file {source!r} is empty")
        if fmt == "json":
            check_utf8(source)
        quiet = logging.getLogger(f"datasets.packaged_modules.{fmt}.{fmt}")  # it logs the error + traceback
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            ds = datasets.load_dataset(fmt, data_files=[source], split="train", cache_dir=cfg.cache_dir)
        except Exception as e:  # noqa: BLE001 - datasets wraps the reader's error in its own types
            if fmt == "json":
                check_json_lines(source)  # names the file's line (the reader counts rows)
            cause = e.__cause__ or e.__context__ or e
            raise DataError(f"data file {source!r} cannot be read as {fmt}: {type(cause).__name__}: "
                         f"{str(cause)[:200]}") from None
        finally:
            quiet.setLevel(level)
    if len(ds) == 0:
        raise DataError(f"data file {source!r} holds no records (empty)")
    return ds


def check_utf8(source: str, chunk: int = 1 << 24) -> None:
    """A text data file with bytes that are not UTF-8 is a DataError naming its line and column."""
    import codecs
    dec, done = codecs.getincrementaldecoder("utf-8")(), 0
    with open(source, "rb") as f:
        while True:
            data = f.read(chunk)
            try:
                dec.decode(data, final=not data)
            except UnicodeDecodeError as e:
                pos = done + max(e.start, 0)
                _raise_at(source, pos, f"is not UTF-8 text (byte 0x{data[e.start]:02x})" if e.start < len(data)
                          else "ends inside a UTF-8 character")
            if not data:
                return
            done += len(data)


def _raise_at(source: str, pos: int, what: str):
    with open(source, "rb") as f:
        head = f.read(pos)
    line, col = head.count(b"\n") + 1, pos - (head.rfind(b"\n") + 1) + 1
    raise DataError(f"data file {source!r} line {line} column {col} {what}; re-encode the file as UTF-8")


def check_json_lines(source: str) -> None:
    """A json-lines file whose line is not a JSON object: a DataError naming the file's line (blank lines
    counted). A file that is one JSON document (not one object per line) is left to the reader's error."""
    with open(source, encoding="utf-8") as f:
        first = next((ln for ln in f if ln.strip()), "")
    if not first.lstrip().startswith("{"):
        return
    with open(source, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                _json_object(source, n, line)


def _json_object(source: str, n: int, line: str) -> None:
    parse_object(line, f"data file {source!r} line {n}", DataError)


def resolve_mode(cfg: DataConfig, columns: list[str], source: str) -> str:
    if cfg.mode == "text" or (cfg.mode == "auto" and cfg.text_field in columns):
        if cfg.text_field not in columns:
            raise DataError(f"data.text_field {cfg.text_field!r} is not a column of {source!r} (columns: {columns})")
        return "text"
    missing = [f for f in (cfg.prompt_field, cfg.response_field) if f not in columns]
    if missing:
        raise DataError(f"{source!r} has neither the text field {cfg.text_field!r} nor the prompt/response fields "
                     f"{[cfg.prompt_field, cfg.response_field]} (columns: {columns})")
    return "sft"


def record_fn(cfg: DataConfig, mode: str, tok):
    """The batched `map` function: records -> {"input_ids", "n_prompt", "status"} (status: RECORD_DROPS)."""
    use_template = mode == "sft" and cfg.chat_template and tok.chat_template
    eos = tok.eos_id if cfg.add_eos and not use_template else None

    def text_fn(batch):
        texts = batch[cfg.text_field]
        encoded = iter(tok.encode_batch([t for t in texts if isinstance(t, str) and t]))
        ids, status = [], []
        for t in texts:
            x = next(encoded) if isinstance(t, str) and t else []
            if x and eos is not None and x[-1] != eos:
                x.append(eos)
            ids.append(x)
            status.append(0 if x else 1 if not isinstance(t, str) else 2)
        return {"input_ids": ids, "n_prompt": [0] * len(ids), "status": status}

    def sft_fn(batch):
        pairs = list(zip(batch[cfg.prompt_field], batch[cfg.response_field]))
        if any(isinstance(re, list) for _, re in pairs):  # token ids, e.g. a model's own outputs (distill.py)
            return id_records(pairs)
        usable = [isinstance(pr, str) and isinstance(re, str) and bool(re) for pr, re in pairs]
        kept = [p for p, u in zip(pairs, usable) if u]
        if use_template:  # the prompt as rendered with the generation prompt, the response as the rest
            rendered = _render_pairs(tok, kept)
            p_texts, fulls = rendered[0::2], rendered[1::2]
            if any(not f.startswith(p) for p, f in zip(p_texts, fulls)):
                raise DataError("the chat template's rendering of [user, assistant] does not start with its "
                                "rendering of [user] + generation prompt; set data.chat_template=false")
            p_ids = tok.encode_batch(p_texts, False)
            r_ids = tok.encode_batch([f[len(p):] for p, f in zip(p_texts, fulls)], False)
        else:
            p_ids = tok.encode_batch([pr for pr, _ in kept])
            r_ids = [r + ([] if eos is None else [eos]) for r in tok.encode_batch([re for _, re in kept], False)]
        encoded = iter(zip(p_ids, r_ids))
        ids, n_prompt, status = [], [], []
        for (pr, re), ok in zip(pairs, usable):
            if not ok:
                ids.append([])
                n_prompt.append(0)
                status.append(1 if not isinstance(pr, str) or not isinstance(re, str) else 2)
                continue
            p, r = next(encoded)
            ids.append(p + r)
            n_prompt.append(len(p))
            status.append(0)
        return {"input_ids": ids, "n_prompt": n_prompt, "status": status}

    return text_fn if mode == "text" else sft_fn


def _render_pairs(tok, pairs: list) -> list[str]:
    """[user] + generation prompt, then [user, assistant], of each (prompt, response): one exchange with the chat
    template renderer (sbd_jax/io/chat_worker.py) for the whole batch."""
    chats = []
    for pr, re in pairs:
        user = [{"role": "user", "content": pr}]
        chats += [(user, True), (user + [{"role": "assistant", "content": re}], False)]
    return tok.render_chats(chats)


def _file_id(path: str) -> list:
    st = os.stat(path)
    return [str(Path(path).resolve()), st.st_size, st.st_mtime_ns]


def fingerprint(cfg: DataConfig, tok, fmt: str, files: list[str]) -> str | None:
    """The store's name; None for a tokenizer that is a bare function (nothing identifies it: no store kept)."""
    if not tok.files:
        return None
    settings = {k: getattr(cfg, k) for k in ("mode", "text_field", "prompt_field", "response_field", "chat_template",
                                             "add_eos", "split")}
    h = hashlib.sha256(json.dumps({
        "version": STORE_VERSION, "format": fmt, "settings": settings, "eos": tok.eos_id,
        "files": [_file_id(f) if os.path.isfile(f) else [_file_id(str(g)) for g in sorted(Path(f).rglob("*"))
                                                          if g.is_file()] for f in files],
        "tokenizer": [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in tok.files]}).encode())
    return h.hexdigest()[:24]


def default_store_dir() -> Path:
    return Path(os.environ.get("SBD_DATA_STORE") or Path.home() / ".cache" / "sbd_jax" / "data")


class FileArray:
    """A read-only 1-D array in a file, read with `os.pread` per item or slice. Nothing is mapped into the
    process: its memory does not grow with how much of the store it has read (the OS page cache holds it)."""

    def __init__(self, path: Path, dtype, count: int):
        self.path, self.dtype, self._n = Path(path), np.dtype(dtype), int(count)
        self._fd = os.open(self.path, os.O_RDONLY)  # open now: a process-only store's files are removed later

    def __len__(self) -> int:
        return self._n

    def _read(self, lo: int, hi: int) -> np.ndarray:
        size, parts = self.dtype.itemsize, []
        for a in range(lo, hi, 1 << 26):  # a pread returns at most ~2 GiB
            b = min(hi, a + (1 << 26))
            parts.append(np.frombuffer(os.pread(self._fd, (b - a) * size, a * size), self.dtype))
        out = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, self.dtype)
        if len(out) != hi - lo:
            raise DataError(f"{self.path} is shorter than its meta.json says: the store is damaged; delete it")
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(self._n)
            if step != 1:
                raise IndexError("FileArray slices take no step")
            return self._read(lo, max(lo, hi))
        i = int(key) + (self._n if int(key) < 0 else 0)
        if not 0 <= i < self._n:
            raise IndexError(f"index {key} outside {self._n} items of {self.path}")
        return self._read(i, i + 1)[0]

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


@dataclasses.dataclass
class Store:
    """A tokenized store on disk (its arrays read with pread, `FileArray`)."""

    path: Path
    meta: dict
    _tmp: object = None  # the TemporaryDirectory of a store kept only for this process

    def documents(self) -> Documents:
        n = self.meta["documents"]
        return Documents(FileArray(self.path / "tokens.bin", np.int32, self.meta["tokens"]),
                         FileArray(self.path / "offsets.bin", np.int64, n + 1),
                         FileArray(self.path / "n_prompt.bin", np.int64, n), digest=self.meta["content"])

    def count(self, token: int) -> int:
        """How many times `token` occurs in the store's documents."""
        counts = np.fromfile(self.path / "counts.bin", np.int64)
        return int(counts[token]) if 0 <= token < len(counts) else 0

    def first(self, token: int) -> str | None:
        """Where `token` first occurs ('FILE line N'), or None."""
        docs, step = self.documents(), 1 << 22
        for lo in range(0, len(docs.values), step):
            hit = np.flatnonzero(docs.values[lo:lo + step] == token)
            if len(hit):
                pos = lo + int(hit[0])
                return self.record(int(np.searchsorted(docs.offsets[:], pos, side="right")) - 1)
        return None

    def record(self, doc: int) -> str:
        """Where document `doc` came from: 'FILE line N' (jsonl) or 'FILE record N'."""
        starts = self.meta["file_doc_starts"]
        f = int(np.searchsorted(starts, doc, side="right")) - 1
        rec = int(np.memmap(self.path / "record.bin", dtype=np.int64, mode="r", shape=(self.meta["documents"],))[doc])
        return where(self.meta["files"][f], self.meta["format"], rec)


def where(source: str, fmt: str, record: int) -> str:
    """'FILE line N' for a json-lines file (blank lines counted, as an editor shows them), else 'FILE record N'."""
    if fmt == "json" and os.path.isfile(source):
        seen = -1
        with open(source, "rb") as f:
            for n, line in enumerate(f, 1):
                seen += bool(line.strip())
                if seen == record:
                    return f"{source} line {n}"
    return f"{source} record {record + 1}"


def prepare(cfg: DataConfig, tok, *, store_dir=None) -> Store:
    """The store for (cfg, tok): reused when present, else tokenized now (written aside, renamed into place)."""
    fmt, files = sources(cfg)
    fp = fingerprint(cfg, tok, fmt, files)
    if fp is None:  # an anonymous tokenizer: a store for this process only
        tmp = tempfile.TemporaryDirectory(prefix="sbd_store_")
        final = Path(tmp.name) / "store"
        _write(cfg, tok, fmt, files, final, fp)
        return Store(final, json.loads((final / "meta.json").read_text()), tmp)
    root = Path(store_dir or cfg.store_dir or default_store_dir())
    final = root / fp
    if not (final / "meta.json").is_file():
        part = root / f".{fp}.part-{uuid.uuid4().hex[:8]}"
        try:  # before tokenizing: a store that cannot be written is named at once
            part.mkdir(parents=True)
        except OSError as e:
            raise DataError(f"data.store_dir {str(root)!r} cannot be written ({e.strerror or e}): set it to a writable "
                            "directory (tokenized stores are kept there)") from None
        try:
            _write(cfg, tok, fmt, files, part, fp)
            os.rename(part, final)
        except OSError:  # another process (host) finished the same store first: theirs is identical
            if not (final / "meta.json").is_file():
                raise
        finally:
            shutil.rmtree(part, ignore_errors=True)
    return Store(final, json.loads((final / "meta.json").read_text()))


def _write(cfg: DataConfig, tok, fmt: str, files: list[str], out: Path, fp) -> None:
    out.mkdir(parents=True, exist_ok=True)
    n_docs, n_tokens, n_records, max_id, counts = 0, 0, 0, -1, np.zeros(0, np.int64)
    drops = {name: {"count": 0, "first": None} for name in RECORD_DROPS.values()}
    file_doc_starts, mode, content = [], None, ContentDigest()
    with (open(out / "tokens.bin", "wb") as f_tok, open(out / "offsets.bin", "wb") as f_off,
          open(out / "n_prompt.bin", "wb") as f_np, open(out / "record.bin", "wb") as f_rec):
        np.zeros(1, np.int64).tofile(f_off)
        for source in files:
            ds = load_source(cfg, fmt, source)
            columns = list(ds.column_names)
            m = resolve_mode(cfg, columns, source)
            if mode is not None and m != mode:
                raise DataError(f"{source!r} holds {m} records but the files before it {mode} records")
            mode = m
            keep_in_memory = cfg.cache_dir is None
            mapped = ds.map(record_fn(cfg, mode, tok), batched=True, remove_columns=columns, num_proc=cfg.num_proc,
                            keep_in_memory=keep_in_memory, load_from_cache_file=not keep_in_memory,
                            desc=f"tokenizing {Path(source).name}")
            file_doc_starts.append(n_docs)
            start = 0
            for batch in mapped.with_format("arrow").iter(batch_size=65536):
                status = batch.column("status").to_numpy()
                ids = batch.column("input_ids").combine_chunks()
                lens = np.diff(ids.offsets.to_numpy()).astype(np.int64)
                for code, name in RECORD_DROPS.items():
                    hit = np.flatnonzero(status == code)
                    drops[name]["count"] += len(hit)
                    if len(hit) and drops[name]["first"] is None:
                        drops[name]["first"] = where(source, fmt, start + int(hit[0]))
                keep = np.flatnonzero(status == 0)
                values = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
                values.tofile(f_tok)  # dropped records have no tokens
                max_id = max(max_id, int(values.max(initial=-1)))
                counts = _add_counts(counts, values)
                (n_tokens + np.cumsum(lens[keep])).astype(np.int64).tofile(f_off)
                (n_prompt := batch.column("n_prompt").to_numpy().astype(np.int64)[keep]).tofile(f_np)
                content.add(lens[keep], values, n_prompt)
                (start + keep).astype(np.int64).tofile(f_rec)
                n_tokens += int(lens[keep].sum())
                n_docs += len(keep)
                start += len(status)
            n_records += start
    counts.tofile(out / "counts.bin")
    meta = {"version": STORE_VERSION, "fingerprint": fp, "format": fmt, "files": files, "mode": mode,
            "records": n_records, "documents": n_docs, "tokens": n_tokens, "max_id": max_id,
            "file_doc_starts": file_doc_starts, "dropped": drops, "content": content.hexdigest()}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))


def _add_counts(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`counts` (per token id) plus the occurrences in `values` (non-negative ids)."""
    add = np.bincount(values[values >= 0], minlength=len(counts)).astype(np.int64)
    add[:len(counts)] += counts
    return add
