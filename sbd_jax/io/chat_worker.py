"""The chat template renderer process: `sbd_jax/io/tokenizer.py` starts it (`python -P <this file>`: by path, so that
neither `sbd_jax` nor jax is imported, and without this directory on sys.path) and sends it render requests. It
renders in a sandboxed jinja2 environment (as `transformers` does) under an address-space limit, so that one
operation of an untrusted template (`center(2000000000)`, `'%01999999999d' % 1`) fails with MemoryError here instead
of filling the parent's memory; the parent kills it when a render overruns its time (one C-level operation, e.g.
`lipsum(n=3000000)`, cannot be interrupted otherwise).

Protocol, one JSON object per line, in UTF-8 with surrogates passed through (a string's surrogates, lone or paired,
arrive as they were): the worker first writes {"ready": pid} or {"error": why}; then for each request {"template",
"items": [variables, ...], "seconds", "max_chars"} it writes {"text": ...} per item, or {"error": message} for the
first item that fails and skips the rest. It exits at the end of its input (the parent closed the pipe or ended)."""
import json
import os
import signal
import sys
import time

TEMPLATE_CACHE_SIZE = 32  # distinct templates kept compiled (a process renders one or two in practice)
CPU_SLACK_SECONDS = 5  # RLIMIT_CPU per item beyond its wall-clock limit: the backstop should the parent be gone
FLUSH_SECONDS = 0.05  # replies are sent at least this often (the parent's clock per reply lags by no more)


class RenderError(Exception):
    """A render that fails with this message, as the parent raises it."""


def limit_memory(max_bytes: int) -> int:
    """The address space of this process (soft limit, never above the hard one): the limit that holds."""
    import resource  # POSIX only: imported here so that tokenizer.py imports this module anywhere
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = max_bytes if hard == resource.RLIM_INFINITY else min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return soft


def limit_cpu(seconds: float) -> None:
    """SIGXCPU ends this process once it has used `seconds` (+ slack) more CPU time (renewed at every flush): the
    backstop for a render nobody waits for any more (the parent exited while it ran)."""
    import resource
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(time.process_time() + seconds) + CPU_SLACK_SECONDS
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def guarded_env():
    """A sandboxed jinja2 environment whose every call and every `*` / `**` checks the clock and the sizes of the
    render in progress (`env.deadline`, `env.max_chars`, set per item): a template that loops (nearly) for ever
    fails at the deadline, and `'x' * 10**12` before it is built."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Guarded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])
        deadline, seconds, max_chars = float("inf"), 0.0, 0

        def check(self):
            if time.monotonic() > self.deadline:
                raise RenderError(timeout_message(self.seconds))

        def call(self, __context, __obj, *args, **kwargs):
            self.check()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            self.check()
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise TemplateError(f"exponent {right!r} is too large")
            if operator == "*" and any(isinstance(x, (str, list, tuple)) for x in (left, right)):
                n = right if isinstance(left, (str, list, tuple)) else left
                seq = left if isinstance(left, (str, list, tuple)) else right
                if isinstance(n, int) and n * max(len(seq), 1) > self.max_chars:
                    raise TemplateError(f"a repetition of {n} x {len(seq)} is over {self.max_chars} items")
            return super().call_binop(context, operator, left, right)

    def raise_exception(msg):
        raise TemplateError(msg)

    env = Guarded(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


def timeout_message(seconds: float) -> str:
    return f"the tokenizer's chat template did not finish rendering within {seconds:g} s (a loop that does not end?)"


def memory_message(max_bytes: int) -> str:
    return (f"the tokenizer's chat template used more than {max_bytes / 2**30:g} GiB of memory while rendering "
            "(a string or list too large to build?)")


class Renderer:
    """Compiled templates (by text) and the rendering of one item within the limits of its request."""

    def __init__(self, max_bytes: int):
        self.env, self.max_bytes, self.compiled = guarded_env(), max_bytes, {}

    def template(self, text: str):
        t = self.compiled.pop(text, None) or self.env.from_string(text)
        self.compiled[text] = t  # most recently used last
        if len(self.compiled) > TEMPLATE_CACHE_SIZE:
            del self.compiled[next(iter(self.compiled))]
        return t

    def render(self, text: str, variables: dict, seconds: float, max_chars: int) -> str:
        """The rendered text; RenderError naming the problem for any failure of the template."""
        from jinja2.exceptions import TemplateError
        env = self.env
        env.deadline, env.seconds, env.max_chars = time.monotonic() + seconds, seconds, max_chars
        parts, size = [], 0
        try:
            for chunk in self.template(text).generate(**variables):
                parts.append(chunk)
                size += len(chunk)
                if size > max_chars:
                    raise RenderError(f"the tokenizer's chat template rendered more than {max_chars} characters "
                                      "(a loop that does not end?)")
                env.check()
            return "".join(parts)
        except RenderError:
            raise
        except MemoryError:
            raise RenderError(memory_message(self.max_bytes)) from None
        except TemplateError as e:
            raise RenderError(f"the tokenizer's chat template failed to render: {e}") from None
        except Exception as e:  # noqa: BLE001 - any error of an untrusted template is its failure, not a crash
            raise RenderError(f"the tokenizer's chat template failed to render: {type(e).__name__}: {e}") from None


def write(out, obj) -> None:
    out.write(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")


def serve(renderer: Renderer, inp, out) -> None:
    """Requests until the end of the input. Replies are flushed at the end of a request and whenever FLUSH_SECONDS
    passed since the last flush, so the parent, which times each reply, sees an item start at most FLUSH_SECONDS
    before its clock starts; the CPU limit is renewed at each flush."""
    for line in inp:
        req = json.loads(line.decode("utf-8", "surrogatepass"))
        last = time.monotonic()
        limit_cpu(req["seconds"])
        for variables in req["items"]:
            try:
                reply = {"text": renderer.render(req["template"], variables, req["seconds"], req["max_chars"])}
            except RenderError as e:
                reply = {"error": str(e)}
            try:
                write(out, reply)
            except MemoryError:  # a reply too large to encode within the limit
                reply = {"error": memory_message(renderer.max_bytes)}
                write(out, reply)
            if "error" in reply:
                break
            if time.monotonic() - last > FLUSH_SECONDS:
                out.flush()
                last = time.monotonic()
                limit_cpu(req["seconds"])
        out.flush()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then closes the pipe
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        renderer = Renderer(limit_memory(int(argv[1])))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which names it
        write(out, {"error": f"{type(e).__name__}: {e}"})
        out.flush()
        return 1
    write(out, {"ready": os.getpid()})
    out.flush()
    serve(renderer, inp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
