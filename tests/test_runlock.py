"""sbd_jax/runlock.py: one writer per output. A live holder (another process on this host, this process, a fresh
lock from another host) is refused naming it; a gone one (dead or reused pid, a heartbeat older than STALE_S from
another host, an old unreadable file) is taken over with a note; racing takers of a stale lock leave one winner;
train() and decode.py refuse a locked output before writing anything."""
import importlib.util
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sbd_jax import runlock
from sbd_jax.config import ConfigError
from sbd_jax.runlock import LockError, acquire

ROOT = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: the pid names no process
    return p.pid


def write_holder(path: Path, age: float = 0.0, **fields) -> dict:
    """A lock file as another run left it: this process's record with `fields` replaced, its mtime `age` s ago."""
    rec = {**runlock.holder_record(), "argv0": "other.py", **fields}
    path.write_text(json.dumps(rec))
    os.utime(path, (time.time() - age,) * 2)
    return rec


def _parent(path: Path) -> dict:  # a live process on this host: pytest's parent
    return write_holder(path, pid=os.getppid(), pid_start=runlock._proc_stat(os.getppid())[1])


def _foreign_fresh(path: Path) -> dict:
    return write_holder(path, host="other-host", boot_id="b", pid=4242, age=5)


def _unreadable_fresh(path: Path) -> dict:
    path.write_text("")
    return {}


@pytest.mark.parametrize("holder", [_parent, _foreign_fresh, _unreadable_fresh], ids=lambda f: f.__name__.strip("_"))
def test_live_holder_is_refused_by_name(tmp_path, holder):
    path = tmp_path / "out.lock"
    rec = holder(path)
    before = path.read_bytes()
    with pytest.raises(LockError) as e:
        acquire(path, what="the output X")
    msg = str(e.value)
    assert isinstance(e.value, ConfigError) and msg.startswith("the output X is in use by another run")
    assert f"lock file {str(path)!r}" in msg, msg
    if rec:
        assert f"host {rec['host']}, pid {rec['pid']}, started {rec['started']}, other.py" in msg, msg
    else:
        assert "holder unknown" in msg
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


def test_second_acquirer_in_this_process_is_refused_and_release_removes(tmp_path):
    path = tmp_path / "out.lock"
    with acquire(path, what="X") as lock:
        assert json.loads(path.read_text())["token"] == lock.token
        with pytest.raises(LockError, match=rf"X is in use by another run \(host .*, pid {os.getpid()} - this "
                                            r"process, started "):
            acquire(path, what="X")
        assert path.exists()
    assert not path.exists()
    lock.release()  # idempotent
    with pytest.raises(RuntimeError):  # an exception inside the block releases too
        with acquire(path):
            raise RuntimeError
    assert not path.exists() and not any(lk.path == path for lk in runlock._LIVE.values())


@pytest.mark.parametrize("fields, reason", [
    (lambda: {"pid": _dead_pid()}, "the process no longer exists"),
    (lambda: {"pid": os.getppid(), "pid_start": runlock._proc_stat(os.getppid())[1] + 1},  # a reused pid
     "the process no longer exists"),
    (lambda: {"pid": os.getpid(), "token": "gone"}, "a lock this process no longer holds"),
    (lambda: {"host": "other-host", "pid": 4242, "age": 120}, r"no heartbeat for 12\d s"),
    (lambda: None, r"an unreadable lock file untouched for 12\d s"),
], ids=["dead_pid", "reused_pid", "own_pid_not_held", "foreign_stale", "unreadable_old"])
def test_stale_lock_is_taken_over_with_a_note(tmp_path, capsys, fields, reason):
    path = tmp_path / "out.lock"
    f = fields()
    if f is None:
        path.write_text("{trunc")
        os.utime(path, (time.time() - 120,) * 2)
    else:
        write_holder(path, **f)
    with acquire(path, what="X") as lock:
        err = capsys.readouterr().err
        assert re.fullmatch(rf"note: took over the stale lock {re.escape(repr(str(path)))} of X \(.*: {reason}\)\n",
                            err), err
        assert json.loads(path.read_text())["token"] == lock.token
        assert sorted(tmp_path.iterdir()) == [path]  # the stale file moved aside is gone


@pytest.mark.parametrize("delay", [0.0, 0.05], ids=["together", "second_after_first_won"])
def test_racing_takers_of_a_stale_lock_leave_one_winner(tmp_path, monkeypatch, delay):
    """Both judge the lock stale before either moves it; with `delay` the second moves the first's new lock aside,
    finds it is not the stale one and puts it back."""
    path = tmp_path / "out.lock"
    write_holder(path, pid=_dead_pid())
    barrier, take = threading.Barrier(2), runlock._take_over
    order = iter([0.0, delay])

    def synced(p, seen):
        barrier.wait()
        time.sleep(next(order))
        return take(p, seen)

    monkeypatch.setattr(runlock, "_take_over", synced)
    won, refused = [], []

    def taker():
        try:
            won.append(acquire(path, what="X"))
        except LockError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=taker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(won) == 1 and len(refused) == 1, (won, refused)
    assert json.loads(path.read_text())["token"] == won[0].token and "this process" in refused[0]
    won[0].release()
    assert list(tmp_path.iterdir()) == []


def test_heartbeat_touches_and_warns_when_taken(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.02)
    path = tmp_path / "out.lock"
    with acquire(path, what="X") as lock:
        os.utime(path, (time.time() - 100,) * 2)
        deadline = time.time() + 5
        while time.time() - path.stat().st_mtime > 50 and time.time() < deadline:
            time.sleep(0.01)
        assert time.time() - path.stat().st_mtime < 50  # touched
        write_holder(path, host="other-host")  # taken over behind its back
        while not lock.lost and time.time() < deadline:
            time.sleep(0.01)
        assert lock.lost and "warning: the lock" in capsys.readouterr().err
    assert json.loads(path.read_text())["host"] == "other-host"  # release leaves another's lock alone


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_cli_runlock", ROOT / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_py_on_a_locked_out_dir_is_refused_before_writing(tmp_path, capsys):
    from test_reliability import write_inputs
    cfg = write_inputs(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    rec = _foreign_fresh(run / "train.lock")
    capsys.readouterr()
    assert _load("train").main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert re.match(rf"error: the training run {re.escape(repr(str(run)))} is in use by another run \(host "
                    rf"other-host, pid 4242, started {re.escape(rec['started'])}, other.py\); lock file ", err), err
    assert list(run.iterdir()) == [run / "train.lock"] and not (tmp_path / "store").exists()


def test_decode_py_on_a_locked_output_is_refused_before_loading(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    rec = _foreign_fresh(tmp_path / "out.jsonl.lock")
    capsys.readouterr()  # the model and input need not exist: the lock is taken before either is read
    assert _load("decode").main(["--model", str(tmp_path / "m"), "--input", str(tmp_path / "in.jsonl"),
                                 "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.match(rf"error: the decode output {re.escape(repr(str(out)))} is in use by another run \(host "
                    rf"other-host, pid 4242, started {re.escape(rec['started'])}, other.py\); lock file "
                    rf"{re.escape(repr(str(out) + '.lock'))}", err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl.lock"]


def test_an_output_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """A read-only run directory (resuming on a filesystem mounted read-only, say): the lock, the first thing a run
    writes, fails by name before anything else is tried."""
    real_open = os.open

    def read_only(path, flags, *a, **k):
        if flags & os.O_CREAT:
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(runlock.os, "open", read_only)
    with pytest.raises(LockError, match=r"cannot create the lock file '.*train\.lock': Read-only file system"):
        acquire(tmp_path / "train.lock", what="the training run")


def test_a_link_to_a_locked_output_is_refused(tmp_path, capsys):
    """Two paths to one file (a symbolic link to the output, or to its directory) share one lock: the second
    decode.py is refused before it loads anything, naming the file the link leads to."""
    out = tmp_path / "real" / "out.jsonl"
    out.parent.mkdir()
    _foreign_fresh(tmp_path / "real" / "out.jsonl.lock")
    (tmp_path / "link.jsonl").symlink_to(out)
    (tmp_path / "dir").symlink_to(out.parent)
    for given in (tmp_path / "link.jsonl", tmp_path / "dir" / "out.jsonl"):
        capsys.readouterr()
        assert _load("decode").main(["--model", str(tmp_path / "m"), "--input", str(tmp_path / "in.jsonl"),
                                     "--output", str(given), "--overwrite", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"-> {out}" in err and "is in use by another run (host other-host, pid 4242" in err, err
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl.lock"]
