"""A bounds-checked walk of a GGUF file's header, run before `gguf.GGUFReader` sees the file.

gguf-py's reader trusts every count in the file: it loops once per claimed array item (about 1.4 KB and 15 us of
Python objects each), so a 49-byte file claiming 2^40 items, or a real one with a 2M-token vocabulary, exhausts
memory. `scan_header` parses the same layout as gguf-py's reader (magic, version, counts, key/values with nested
arrays, tensor infos, aligned data section) with `struct` over a read-only mmap, checks every count and length
against the bytes left in the file and the limits below before anything is built, and raises GGUFError naming the
file, the key or tensor and the value. A file that passes holds a bounded number of items whose bytes all exist.

  scan_header(path) -> GGUFHeader(version, byte_order, kv_count, tensor_count, alignment, data_offset, n_items)
"""
from __future__ import annotations

import mmap
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from .gguf_meta import GGUFError

# Real vocabularies are <= ~262k tokens (Gemma 3: 262144); with scores, token types and merges a real file holds
# <= ~0.9M array items in all (gpt-oss: ~850k). The reader's cost per item makes these bounds its memory bound.
MAX_ARRAY_ITEMS = 1 << 20  # items in one array
MAX_TOTAL_ITEMS = 1 << 21  # items in all arrays of the file together (<= ~3 GB in gguf-py's reader)
MAX_STRING_BYTES = 64 << 20  # one string (a chat template is ~10-50 KB)
MAX_KV = 1 << 16  # key/values (real files: < 100)
MAX_TENSORS = 1 << 16  # tensors (real files: < ~3000)
MAX_ARRAY_DEPTH = 3  # arrays nested in arrays (llama.cpp reads none; gguf-py recurses per level)
GGML_MAX_DIMS = 4  # ggml.h; gguf-py does not export it
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, kv count


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    byte_order: str  # struct prefix: "<" little-endian, ">" big-endian
    kv_count: int
    tensor_count: int
    alignment: int
    data_offset: int
    n_items: int  # array items in all key/values


def _value_sizes() -> dict:
    """GGUFValueType -> byte size of the fixed-size types, from the numpy types gguf-py's reader parses them as
    (its `gguf_scalar_to_np`, so a type added there is sized here too)."""
    import gguf
    import numpy as np
    return {t: np.dtype(np_type).itemsize for t, np_type in gguf.GGUFReader.gguf_scalar_to_np.items()}


class _Cursor:
    """A position in the mapped file; every read checks the bytes it needs exist."""

    def __init__(self, buf, path: Path, order: str):
        self.buf, self.path, self.order, self.pos = buf, path, order, 0

    def fail(self, msg: str):
        raise GGUFError(f"GGUF file {str(self.path)!r}: {msg}")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            self.fail(f"{what} needs {n} bytes at offset {self.pos}, but only {self.left()} remain (truncated?)")

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def skip_string(self, what: str) -> int:
        """Past one string (u64 length + bytes); returns the offset of its bytes."""
        n = self.unpack("Q", f"the length of {what}")
        if n > MAX_STRING_BYTES:
            self.fail(f"{what} claims a string of {n} bytes (limit {MAX_STRING_BYTES})")
        self.need(n, f"{what} (a string of {n} bytes)")
        self.pos += n
        return self.pos - n

    def name(self, what: str) -> str:
        """A key or tensor name: gguf-py decodes these as UTF-8 while parsing."""
        start = self.skip_string(what)
        raw = self.buf[start:self.pos]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} {raw[:80]!r} is not valid UTF-8")


class _Scan:
    """The walk: key/values, then tensor infos, then the data section; `items` counts array items so far."""

    def __init__(self, cur: _Cursor):
        import gguf
        self.cur, self.gguf, self.sizes, self.items = cur, gguf, _value_sizes(), 0

    def value_type(self, raw: int, what: str):
        try:
            return self.gguf.GGUFValueType(raw)
        except ValueError:
            self.cur.fail(f"{what} has unknown value type {raw}")

    def min_size(self, vtype) -> int:
        """Fewest bytes one value of `vtype` takes (a string's length, an array's type and count)."""
        t = self.gguf.GGUFValueType
        return {t.STRING: 8, t.ARRAY: 4 + 8}.get(vtype) or self.sizes[vtype]

    def value(self, vtype, what: str) -> None:
        """Past one (top-level) value of `vtype`."""
        t = self.gguf.GGUFValueType
        if vtype == t.STRING:
            self.cur.skip_string(what)
        elif vtype == t.ARRAY:
            self.array(what, 1)
        else:
            self.cur.need(self.sizes[vtype], f"{what} ({vtype.name})")
            self.cur.pos += self.sizes[vtype]

    def array(self, what: str, depth: int) -> None:
        """Item type and count checked against the limits and the bytes left before any item is walked."""
        cur = self.cur
        if depth > MAX_ARRAY_DEPTH:
            cur.fail(f"{what} nests arrays {depth} deep (limit {MAX_ARRAY_DEPTH})")
        item = self.value_type(cur.unpack("I", f"the item type of {what}"), f"the array {what}")
        count = cur.unpack("Q", f"the item count of {what}")
        if count > MAX_ARRAY_ITEMS:
            cur.fail(f"{what} claims an array of {count} items (limit {MAX_ARRAY_ITEMS}: real vocabularies hold "
                     "<= ~262k tokens)")
        if count * self.min_size(item) > cur.left():
            cur.fail(f"{what} claims an array of {count} {item.name} items, which needs at least "
                     f"{count * self.min_size(item)} bytes, but only {cur.left()} remain at offset {cur.pos}")
        self.items += count
        if self.items > MAX_TOTAL_ITEMS:
            cur.fail(f"{what}: the file's arrays hold more than {MAX_TOTAL_ITEMS} items in all ({self.items} so "
                     "far): more than any real model file")
        if item in self.sizes:  # fixed-size items: one skip
            cur.pos += count * self.sizes[item]
        elif item == self.gguf.GGUFValueType.STRING:
            self.strings(count, what)
        else:
            for i in range(count):
                self.array(f"{what}[{i}]", depth + 1)

    def strings(self, count: int, what: str) -> None:
        """Past `count` strings: the per-item loop of a vocabulary, kept lean; a bad item re-read for its error."""
        cur, end = self.cur, len(self.cur.buf)
        unpack, pos = struct.Struct(cur.order + "Q").unpack_from, cur.pos
        for i in range(count):
            n = unpack(cur.buf, pos)[0] if pos + 8 <= end else end
            if n > MAX_STRING_BYTES or pos + 8 + n > end:
                cur.pos = pos
                cur.skip_string(f"{what}[{i}]")  # raises, naming the item
            pos += 8 + n
        cur.pos = pos

    def count(self, what: str, limit: int, min_bytes: int) -> int:
        """The tensor or key/value count, bounded by a limit and by the bytes that many entries need at least."""
        n = self.cur.unpack("Q", what)
        if n > limit:
            self.cur.fail(f"{what} {n} exceeds the limit {limit}")
        if n * min_bytes > self.cur.left():
            self.cur.fail(f"{what} {n} needs at least {n * min_bytes} bytes, but only {self.cur.left()} remain")
        return n

    def kvs(self, n: int) -> int:
        """Every key/value; returns general.alignment (gguf-py requires it UINT32, a power of two)."""
        cur, seen, alignment = self.cur, set(), self.gguf.GGUF_DEFAULT_ALIGNMENT
        for i in range(n):
            key = cur.name(f"key #{i}")
            if key in seen:
                cur.fail(f"key {key!r} appears twice")
            seen.add(key)
            vtype = self.value_type(cur.unpack("I", f"the value type of key {key!r}"), f"key {key!r}")
            if key == "general.alignment":
                alignment = self.alignment(vtype)
            else:
                self.value(vtype, f"key {key!r}")
        return alignment

    def alignment(self, vtype) -> int:
        if vtype != self.gguf.GGUFValueType.UINT32:
            self.cur.fail(f"key 'general.alignment' has type {vtype.name}, not UINT32")
        value = self.cur.unpack("I", "key 'general.alignment'")
        if value == 0 or value & (value - 1):
            self.cur.fail(f"key 'general.alignment' is {value}, not a power of two")
        return value

    def tensor_info(self, i: int, seen: set) -> tuple:
        """(name, dims, type, offset) of tensor #i, its shape and type checked."""
        cur = self.cur
        name = cur.name(f"the name of tensor #{i}")
        if name in seen:
            cur.fail(f"tensor {name!r} appears twice")
        seen.add(name)
        n_dims = cur.unpack("I", f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            cur.fail(f"tensor {name!r} has n_dims {n_dims} (must be 1..{GGML_MAX_DIMS})")
        dims = [cur.unpack("Q", f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
        if min(dims) < 1:
            cur.fail(f"tensor {name!r} has dims {dims}: each must be >= 1")
        raw = cur.unpack("I", f"the type of tensor {name!r}")
        kind = self.tensor_type(raw, name)
        block, _ = self.gguf.GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            cur.fail(f"tensor {name!r} of type {kind.name} has rows of {dims[0]} elements, not a multiple of its "
                     f"block size {block}")
        return name, dims, kind, cur.unpack("Q", f"the data offset of tensor {name!r}")

    def tensor_type(self, raw: int, name: str):
        try:
            kind = self.gguf.GGMLQuantizationType(raw)
        except ValueError:
            kind = None
        if kind not in self.gguf.GGML_QUANT_SIZES:
            self.cur.fail(f"tensor {name!r} has unknown tensor type {raw}")
        return kind

    def tensor_data(self, info: tuple, data_offset: int) -> None:
        """The tensor's bytes (element count x type size / block size, as gguf-py computes) inside the file."""
        name, dims, kind, offset = info
        n_elems = 1
        for d in dims:
            n_elems *= d
        if n_elems >= 1 << 63:  # ggml counts elements in int64
            self.cur.fail(f"tensor {name!r} has dims {dims}: {n_elems} elements, more than ggml can count")
        block, type_size = self.gguf.GGML_QUANT_SIZES[kind]
        n_bytes, start, size = n_elems * type_size // block, data_offset + offset, len(self.cur.buf)
        if start + n_bytes > size:
            self.cur.fail(f"tensor {name!r} ({kind.name}, dims {dims}) needs {n_bytes} bytes at offset {start} "
                          f"(data offset {offset}), past the end of the file ({size} bytes)")


def _byte_order(buf, path: Path) -> tuple[str, int]:
    """(struct prefix, version) as gguf-py decides: a version whose low 16 bits are 0 is byte-swapped."""
    import gguf
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS
    magic = struct.unpack_from("<I", buf, 0)[0]
    if magic != gguf.GGUF_MAGIC:
        raise GGUFError(f"GGUF file {str(path)!r}: magic {buf[:4]!r} is not b'GGUF' (not a GGUF file?)")
    host = "<" if sys.byteorder == "little" else ">"
    order = host if struct.unpack_from(host + "I", buf, 4)[0] & 0xFFFF else {"<": ">", ">": "<"}[host]
    version = struct.unpack_from(order + "I", buf, 4)[0]
    if version not in READER_SUPPORTED_VERSIONS:
        raise GGUFError(f"GGUF file {str(path)!r}: version {version} is not supported "
                        f"(supported: {READER_SUPPORTED_VERSIONS})")
    return order, version


def _walk(buf, path: Path) -> GGUFHeader:
    order, version = _byte_order(buf, path)
    cur = _Cursor(buf, path, order)
    cur.pos = 8
    scan = _Scan(cur)
    n_tensors = scan.count("tensor count", MAX_TENSORS, _MIN_TENSOR_BYTES)
    n_kv = scan.count("key/value count", MAX_KV, _MIN_KV_BYTES)
    alignment = scan.kvs(n_kv)
    seen: set = set()
    infos = [scan.tensor_info(i, seen) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    for info in infos:
        scan.tensor_data(info, data_offset)
    return GGUFHeader(version, order, n_kv, n_tensors, alignment, data_offset, scan.items)


def scan_header(path) -> GGUFHeader:
    """Walk the header of the GGUF file at `path`; GGUFError on anything gguf-py's reader would choke or blow up
    on. Reads through a read-only mmap: nothing the size of a count in the file is allocated."""
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < _HEADER_BYTES:
            raise GGUFError(f"GGUF file {str(path)!r} has {size} bytes, fewer than a GGUF header's "
                            f"{_HEADER_BYTES} (truncated or not a GGUF file?)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _walk(mm, path)
