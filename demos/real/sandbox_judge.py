"""The judge: the process that runs a HumanEval problem's tests (demos/real/sandbox.py `judge` sends this module's
source, after sandbox_child's, as an interpreter's `-c` program, then calls `_judge_main`). The candidate's code
runs in another, confined process; the tests here call it through a pipe, its answers come back as text and are
read as plain values only (`_literal`), and the verdict goes to this process's stdout, which only the harness
holds: the candidate cannot write a verdict, and no object of its making reaches the tests."""


def _judge_main():
    """Read the job (stdin: prompt, test, entry point), run the tests against the candidate, print the verdict."""
    import json
    import os
    import sys
    config = json.loads(sys.argv[1])
    job = json.loads(sys.stdin.read())
    verdict = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the tests' own prints go nowhere
        os.dup2(null, fd)
    candidate = _remote(config["req_fd"], config["resp_fd"], config["max_bytes"])
    try:
        scope = {}
        exec(compile(job["prompt"], "<prompt>", "exec"), scope)  # the problem's helpers (trusted)
        scope[job["entry_point"]] = candidate
        exec(compile(job["test"], "<test>", "exec"), scope)
        scope["check"](candidate)
        result, exception = "passed", None
    except BaseException as e:  # noqa: BLE001 - every failure is a verdict
        try:
            message = str(e)
        except BaseException:  # noqa: BLE001
            message = f"<{type(e).__name__}>"
        result, exception = f"failed: {message}", type(e).__name__
    verdict.write(json.dumps({"result": result, "exception": exception}) + "\n")
    verdict.flush()
    os._exit(0)


def _remote(req_fd, resp_fd, max_bytes):
    """The candidate as the tests see it: a function whose positional arguments go to the candidate process as
    `repr` text and whose answer comes back as text read by `_literal`."""
    import json
    import os
    req, resp = os.fdopen(req_fd, "w"), os.fdopen(resp_fd, "rb")

    class CandidateError(Exception):
        """The candidate raised, ended, or answered with something that is not a plain value."""

    def candidate(*args, **kwargs):
        if kwargs:
            raise CandidateError("keyword arguments are not sent to the candidate")
        try:
            req.write(json.dumps(repr(args)) + "\n")
            req.flush()
        except BrokenPipeError:
            raise CandidateError("the candidate process has ended") from None
        line = resp.readline(max_bytes + 1)
        if not line.endswith(b"\n"):
            raise CandidateError("the candidate process has ended" if len(line) <= max_bytes else
                                 f"the candidate's answer is longer than {max_bytes} bytes")
        try:
            answer = json.loads(line)
            if "error" in answer:
                raise CandidateError(f"the candidate raised {answer['error']}: {answer['message']}")
            return _literal(answer["value"])  # noqa: F821 (sandbox_child.py, whose source the judge boots with)
        except CandidateError:
            raise
        except Exception as e:  # noqa: BLE001 - malformed or not a plain value
            raise CandidateError(f"the candidate's answer is not a plain value ({type(e).__name__}: {e})") from None

    return candidate
