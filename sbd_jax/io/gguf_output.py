"""The output directory of a GGUF conversion: the marker each directory the converter writes holds (the files it
wrote, the converting process), what `overwrite` may replace (only the converter's own output, never the input nor
files it did not write), the atomic publish, and the removal of the temporary directories of killed conversions."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path

from ..runlock import pid_alive
from .gguf_meta import GGUFError

# In every directory convert() writes: the files it wrote (what `overwrite` may replace) and, in its temporary
# directory, the pid and host converting into it (what tells a killed conversion's leftovers from a running one).
MARKER = ".sbd_jax_gguf.json"


def write_marker(d: Path, **fields) -> None:
    record = {"writer": "sbd_jax.io.gguf", "pid": os.getpid(), "host": socket.gethostname(), **fields}
    (d / MARKER).write_text(json.dumps(record, indent=1) + "\n")


def read_marker(d: Path) -> dict | None:
    """The marker's record; None when absent, unreadable or not ours."""
    try:
        record = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("writer") == "sbd_jax.io.gguf" else None


def entries(d: Path) -> list[str]:
    """Every file, directory and link under `d` (not following links), as relative POSIX paths."""
    out = []
    for root, dirs, files in os.walk(d):
        rel = Path(root).relative_to(d)
        out += [(rel / n).as_posix() for n in dirs + files]
    return sorted(out)


def _inside(path: Path, d: Path) -> bool:
    """`path` is `d` or lies under it, as written (`..` folded) or with links resolved."""
    pairs = ((Path(os.path.abspath(path)), Path(os.path.abspath(d))), (path.resolve(), d.resolve()))
    return any(p.is_relative_to(q) for p, q in pairs)


def check_replaceable(out_dir: Path, src: Path) -> None:
    """`overwrite` replaces only a directory this converter wrote that holds nothing else and not the input."""
    where = f"output directory {str(out_dir)!r}"
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise GGUFError(f"{str(out_dir)!r} exists and is not a directory (a file or a link): not replacing it; "
                        "remove it yourself or choose another OUT_DIR")
    if _inside(src, out_dir):
        raise GGUFError(f"{where} holds the input GGUF {str(src)!r}: replacing it would delete the input; choose "
                        "another OUT_DIR")
    record = read_marker(out_dir)
    if record is None or not isinstance(record.get("files"), list):
        raise GGUFError(f"{where} was not written by this converter (no {MARKER} listing its files): not "
                        "replacing it; remove it yourself or choose another OUT_DIR")
    extra = sorted(set(entries(out_dir)) - set(record["files"]) - {MARKER})
    if extra:
        raise GGUFError(f"{where} holds files this converter did not write ({extra[:5]}): not replacing it; move "
                        "them elsewhere or choose another OUT_DIR")


def publish(tmp: Path, out_dir: Path, src: Path, overwrite: bool) -> bool:
    """Rename the finished `tmp` to `out_dir`. False when `out_dir` exists and may not be replaced."""
    if out_dir.exists() and overwrite:
        check_replaceable(out_dir, src)  # again: files may have appeared there while converting
        old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
        write_marker(old)  # a kill before the rmtree below leaves it to remove_leftovers
        os.replace(out_dir, old / "x")
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
        return True
    try:
        os.rename(tmp, out_dir)  # atomic; fails if another process published a (complete) directory first
        return True
    except OSError:
        if out_dir.is_dir() and any(out_dir.iterdir()):
            return False
        raise


def _alive(pid) -> bool:
    """Whether process `pid` may exist on this host (unknown counts as alive: its directory is kept)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or os.name != "posix":
        return True
    return pid_alive(pid)


def remove_leftovers(out_dir: Path) -> None:
    """Remove the temporary directories (`.{name}.tmp-*`, `.{name}.old-*`) of conversions into `out_dir` killed
    on this host: their marker names a pid that no longer exists. A running one's, or one without a marker (just
    created, or not ours), is kept."""
    prefixes, host = (f".{out_dir.name}.tmp-", f".{out_dir.name}.old-"), socket.gethostname()
    try:
        candidates = [d for d in out_dir.parent.iterdir() if d.name.startswith(prefixes)]
    except OSError:
        return
    for d in candidates:
        record = None if d.is_symlink() or not d.is_dir() else read_marker(d)
        if record is not None and record.get("host") == host and not _alive(record.get("pid")):
            shutil.rmtree(d, ignore_errors=True)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Terminated(BaseException):
    """SIGTERM as an exception: unwinds through `finally` (the temporary directory's removal) and past the
    `except Exception` of the reading code."""


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise Terminated


@contextlib.contextmanager
def sigterm_unwinds():
    """SIGTERM raises Terminated while the block runs (main thread only: signal handlers live there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
