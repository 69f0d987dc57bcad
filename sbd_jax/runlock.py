"""An exclusive lock on an output (a training run's out_dir, decode.py's --output): a second writer is refused at
once, naming the holder, instead of both writing and both reporting success.

    with acquire(out_dir / "train.lock", what=f"training run {out_dir}"):
        ...  # LockError (a ConfigError: the CLIs print it as `error: ...`, exit 2) when another run holds it

The lock is a file created with O_CREAT | O_EXCL holding JSON {host, pid, started, argv0, ...}; a daemon thread
touches its mtime every HEARTBEAT_S seconds. It is removed by `release()` (the `with` block's end, on return or
exception; Ctrl-C and a SIGTERM the CLI turns into an exception take that path), with atexit as a backstop.
A lock whose holder is gone is stale and taken over with a one-line note on stderr:
  * same machine (hostname, boot id and pid namespace all equal): stale at once when the holder's pid no longer
    exists, or now names another process (its start time differs), or is this process without holding it;
  * another machine: stale once the heartbeat (the file's mtime) is older than STALE_S seconds.
Taking over is race-safe between takers: the stale file is renamed aside (one rename wins), a file found there that
is not the one judged stale is put back, and only the O_EXCL create decides who holds the lock.

What is and is not guaranteed on shared filesystems:
  * O_EXCL creation and rename are atomic on local filesystems and on NFSv3+ (not on NFSv2, nor on some FUSE or
    object-store mounts): two runs on such a filesystem can both create the lock.
  * A lock's age compares this host's clock to the mtime the file server recorded: clock skew between hosts
    shortens or stretches the STALE_S window by the skew (keep clocks in sync, e.g. NTP).
  * A holder that is alive but cut off from the filesystem (a partitioned host) or stalled for over STALE_S seconds
    is taken over after the stale window; its heartbeat then finds the lock gone or another's and warns on stderr,
    but it is not stopped. The same holds for a lock file deleted by hand.
  * A holder killed without cleanup (SIGKILL, a crash, a lost host) leaves the file behind: on the same machine the
    next run takes it over at once, from another machine after STALE_S seconds.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from .config import ConfigError

HEARTBEAT_S = 10.0  # how often a holder touches its lock file
STALE_S = 60.0  # a lock from another machine without a heartbeat for this long is stale
ATTEMPTS = 5  # create / take-over rounds before giving up on a contended lock
_LIVE: dict[str, "Lock"] = {}  # this process's held locks, by token (registered before the file is created)


class LockError(ConfigError):
    """The output is locked by another live run (or the lock cannot be created)."""


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _machine() -> dict:
    """What tells this machine and pid space apart from others sharing the filesystem (None where unknown)."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pidns": pidns}


def holder_record() -> dict:
    """This process as a lock file records it (a new token per call)."""
    return {**_machine(), "pid": os.getpid(), "pid_start": (_proc_stat(os.getpid()) or (None, None))[1],
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv0": sys.argv[0] if sys.argv else "", "token": uuid.uuid4().hex}


class Seen:
    """A lock file as read: its inode and bytes (what it is, to tell it from a newer one), mtime, record."""

    def __init__(self, st: os.stat_result, data: bytes):
        self.ident, self.mtime = (st.st_dev, st.st_ino, data), st.st_mtime
        try:
            rec = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            rec = None
        self.record = rec if isinstance(rec, dict) else None

    @property
    def age(self) -> float:
        return time.time() - self.mtime


def _read(path: Path, tries: int = 3) -> Seen | None:
    """The lock file, or None when there is none. A file just created and not yet written reads empty: re-read."""
    for i in range(tries):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            seen = Seen(os.fstat(fd), _read_all(fd))
        except OSError as e:  # e.g. a directory in its place
            raise LockError(f"cannot read the lock file {str(path)!r}: {e.strerror or e}") from None
        finally:
            os.close(fd)
        if seen.record is not None or i == tries - 1:
            return seen
        time.sleep(0.05)
    return None


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, from /proc (Linux; None elsewhere)."""
    text = _read_text(f"/proc/{pid}/stat")
    try:
        fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return fields[0], int(fields[19])
    except (AttributeError, IndexError, ValueError):
        return None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether `pid` names a live process on this machine (the same one, when its start time is known); a zombie
    is not alive. Also what tells a killed GGUF conversion's leftovers (io/gguf_output.py)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # exists, owned by another user / not a pid: counted alive
        pass
    stat = _proc_stat(pid)
    if stat is None:
        return True
    return stat[0] not in "ZX" and (start is None or stat[1] == start)


def stale_reason(seen: Seen) -> str | None:
    """Why the lock `seen` is stale, or None while its holder may be alive."""
    rec = seen.record
    if rec is None:  # unreadable (a crash between create and write, or not a lock of ours): judged by its age
        return f"an unreadable lock file untouched for {seen.age:.0f} s" if seen.age > STALE_S else None
    here = _machine()
    if os.name == "posix" and all(rec.get(k) == here[k] for k in here):
        pid = rec.get("pid")
        if not isinstance(pid, int):
            return "no pid recorded"
        if pid == os.getpid():
            return None if rec.get("token") in _LIVE else "a lock this process no longer holds"
        return None if pid_alive(pid, rec.get("pid_start")) else "the process no longer exists"
    return f"no heartbeat for {seen.age:.0f} s" if seen.age > STALE_S else None


def describe(rec: dict | None) -> str:
    if rec is None:
        return "holder unknown: the lock file is unreadable"
    me = " - this process" if rec.get("pid") == os.getpid() and rec.get("host") == socket.gethostname() else ""
    return (f"host {rec.get('host')}, pid {rec.get('pid')}{me}, started {rec.get('started')}"
            + (f", {rec['argv0']}" if rec.get("argv0") else ""))


def _refusal(path: Path, what: str, seen: Seen) -> LockError:
    return LockError(f"{what} is in use by another run ({describe(seen.record)}); lock file {str(path)!r}. Two "
                     f"writers would mix their output: wait for that run or stop it. A holder that is gone is taken "
                     f"over by the next run (from another host once its heartbeat, the file's mtime, is {STALE_S:.0f} "
                     "s old); delete the lock file only if you are sure it is gone")


def _create(path: Path, data: bytes) -> bool:
    """Create the lock file holding `data`; False if one exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError as e:
        raise LockError(f"cannot create the lock file {str(path)!r}: {e.strerror or e}") from None
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return True


def _take_over(path: Path, seen: Seen) -> Path | None:
    """Move the stale lock `seen` aside -> the aside path (deleted once a new lock is in place), or None when
    another taker moved it first, or when the file found there is a newer lock (then put back)."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    moved = _read(aside, tries=1)
    if moved is not None and moved.ident == seen.ident:
        return aside
    _put_back(aside, path)
    return None


def _put_back(aside: Path, path: Path) -> None:
    """Return a lock moved aside by mistake, unless a newer one took its place (its holder's heartbeat warns)."""
    try:
        os.link(aside, path)  # never replaces an existing file
    except FileExistsError:
        pass
    except OSError:  # no hard links on this filesystem
        if not path.exists():
            os.rename(aside, path)
            return
    aside.unlink(missing_ok=True)


def acquire(path, what: str = "this output") -> Lock:
    """Take the lock file `path` for `what` (named in messages): a stale lock is taken over (a note on stderr), a
    live holder's refused with a LockError naming it."""
    lock = Lock(Path(path).absolute(), what, holder_record())
    _LIVE[lock.token] = lock  # before the file exists: a thread of this process reading it sees a live holder
    try:
        taken = _claim(lock.path, what, json.dumps(lock.record, indent=1).encode())
    except BaseException:
        _LIVE.pop(lock.token, None)
        raise
    if taken is not None:
        print(f"note: took over the stale lock {str(lock.path)!r} of {what} ({describe(taken[0].record)}: "
              f"{taken[1]})", file=sys.stderr, flush=True)
    lock.start()
    return lock


def _claim(path: Path, what: str, data: bytes) -> tuple[Seen, str] | None:
    """Create the lock file, taking a stale one over -> (the stale lock, why) or None when there was none."""
    taken = None
    for _ in range(ATTEMPTS):
        if _create(path, data):
            return taken
        seen = _read(path)
        if seen is None:  # released meanwhile
            continue
        reason = stale_reason(seen)
        if reason is None:
            raise _refusal(path, what, seen)
        aside = _take_over(path, seen)
        taken = (seen, reason)
        if aside is not None:
            try:
                if _create(path, data):
                    return taken
            finally:  # deleted only now: its inode is not reused by the new lock meanwhile
                aside.unlink(missing_ok=True)
    raise LockError(f"cannot take the lock {str(path)!r} of {what}: other runs keep taking it ({ATTEMPTS} tries)")


class Lock:
    """A held lock (`acquire`); `release()` or the end of a `with` block removes its file."""

    def __init__(self, path: Path, what: str, record: dict):
        self.path, self.what, self.record = path, what, record
        self.token, self.pid = record["token"], record["pid"]
        self.lost = False  # set by the heartbeat when the file is gone or another's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"runlock {path.name}")

    def start(self) -> None:
        self._thread.start()

    def _ours(self) -> bool:
        try:
            seen = _read(self.path, tries=1)
        except LockError:
            return False
        return seen is not None and seen.record is not None and seen.record.get("token") == self.token

    def _beat(self) -> None:
        """Touch the file every HEARTBEAT_S seconds while it is ours; warn once when it is not."""
        while not self._stop.wait(HEARTBEAT_S):
            if not self._ours():
                self.lost = True
                print(f"warning: the lock {str(self.path)!r} of {self.what} was removed or taken over: another run "
                      "may now write it too", file=sys.stderr, flush=True)
                return
            try:
                os.utime(self.path)
            except OSError:
                pass  # gone meanwhile: the next beat tells

    def release(self) -> None:
        """Stop the heartbeat and remove the file if it is still this lock's (idempotent; no-op in a forked
        child, which does not hold its parent's lock)."""
        if os.getpid() != self.pid or _LIVE.pop(self.token, None) is None:
            return
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._ours():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@atexit.register
def _release_all() -> None:
    for lock in list(_LIVE.values()):
        lock.release()


__all__ = ["HEARTBEAT_S", "STALE_S", "Lock", "LockError", "acquire", "holder_record", "stale_reason"]
