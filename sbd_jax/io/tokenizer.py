"""The one tokenizer of training data, decode.py and the demo: a local `tokenizers` tokenizer.json, with the
chat template and special tokens of tokenizer_config.json (or chat_template.jinja) next to it. Never downloads.
Chat templates render as in `transformers` (sandboxed jinja2, `raise_exception`, the special tokens as globals), in a
separate renderer process (chat_worker.py) with bounded memory and time, as an untrusted template must be.
A tokenizer_config.json may hold a list of named templates ([{"name": ..., "template": ...}]): as `transformers`
does, the one named "default" is used; a list without one gives no template."""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from ..config import ConfigError
from ..jsonlines import read_object
from .chat_worker import timeout_message
from .long_text import PieceEncoder

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
CHAT_RENDER_MAX_CHARS = 4_000_000  # a rendered conversation longer than this is a broken template
CHAT_RENDER_SECONDS = 10.0  # so is one that renders for longer (a loop that never ends must not hang decode.py)
CHAT_RENDER_MAX_BYTES = 1 << 30  # the renderer's address space: a 2e9-character string fails at once, not at 4 GB
CHAT_RENDER_START_SECONDS = 60.0  # for the renderer process to start (import jinja2), on a loaded machine too
KILL_GRACE_SECONDS = 0.5  # past CHAT_RENDER_SECONDS the renderer is killed (its own clock check ends loops sooner)
REQUEST_CHARS = 8 << 20  # render_many sends items in requests of about this much JSON (the renderer stays small)


class TokenizerError(ConfigError):
    """A tokenizer that cannot be used as asked: a missing or unreadable file, no or a failing chat template."""


class Tokenizer:
    """Text <-> ids, the EOS id, and the chat template with the special-token strings it may use."""

    def __init__(self, encode: Callable[[str, bool], list[int]], decode: Callable[[list[int]], str] | None = None,
                 *, eos_id: int | None = None, chat_template: str | None = None, special_tokens: dict | None = None,
                 special_ids: frozenset[int] = frozenset(), files: tuple[Path, ...] = (),
                 encode_many: Callable[[list[str], bool], list[list[int]]] | None = None):
        self._encode, self._decode, self._encode_many = encode, decode, encode_many
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}
        self.special_ids = special_ids  # ids of the special (added) tokens
        self.files = files  # the files it was loaded from (what a model directory needs to carry it)

    @classmethod
    def from_callable(cls, fn: Callable[[str], list[int]], eos_id: int | None = None) -> Tokenizer:
        """Any text -> ids function (no chat template, no decoding)."""
        return cls(lambda text, add_special_tokens: fn(text), eos_id=eos_id)

    @classmethod
    def load(cls, path) -> Tokenizer:
        """A tokenizer.json, or a directory holding one (+ optionally tokenizer_config.json, chat_template.jinja)."""
        from tokenizers import Tokenizer as HFTokenizer
        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        if not tok_file.is_file():
            raise TokenizerError(f"tokenizer file {str(tok_file)!r} does not exist (pass a tokenizer.json or a "
                                 "directory that contains one; hub names are not downloaded)")
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception on a bad file
            raise TokenizerError(f"cannot read tokenizer {str(tok_file)!r}: {e}") from None
        conf_file = tok_file.parent / "tokenizer_config.json"
        conf = read_object(conf_file, TokenizerError) if conf_file.is_file() else {}
        template = conf.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = tok_file.parent / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        special = {k: conf[k].get("content") if isinstance(conf[k], dict) else conf[k]
                   for k in SPECIAL_TOKENS if conf.get(k)}
        eos = special.get("eos_token")
        files = tuple(f for f in (tok_file, conf_file, jinja_file, tok_file.parent / "special_tokens_map.json")
                      if f.is_file())
        enc = PieceEncoder(hf)  # a very long text in pieces (bounded memory), where that gives the same ids
        return cls(enc.encode, lambda ids: hf.decode(ids, skip_special_tokens=True),
                   eos_id=hf.token_to_id(eos) if eos else None, chat_template=template, special_tokens=special,
                   files=files, special_ids=frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special),
                   encode_many=enc.encode_batch)

    @classmethod
    def find(cls, model_dir) -> Tokenizer | None:
        """The model directory's tokenizer; None when it has no tokenizer.json."""
        return cls.load(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._encode(text, add_special_tokens))

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text (tokenizers' batch call where there is one: ~1.5x faster on 2 cores)."""
        if self._encode_many is None:
            return [self.encode(t, add_special_tokens) for t in texts]
        return [list(ids) for ids in self._encode_many(list(texts), add_special_tokens)]

    @property
    def can_decode(self) -> bool:
        return self._decode is not None

    def decode(self, ids) -> str:
        if self._decode is None:
            raise TokenizerError("this tokenizer only encodes (it was built from a function)")
        return self._decode([int(t) for t in ids])

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.render_chats([(messages, add_generation_prompt)])[0]

    def render_chats(self, chats: Sequence[tuple[list[dict], bool]]) -> list[str]:
        """`render_chat` of each (messages, add_generation_prompt), in one exchange with the renderer process (per
        REQUEST_CHARS of them): what tokenizing many records should call."""
        if not self.chat_template:
            raise TokenizerError("a chat template is asked for but the tokenizer has none (no chat_template in "
                                 "tokenizer_config.json, none named 'default' in its list, no chat_template.jinja)")
        special = {k: self.special_tokens.get(k) or "" for k in SPECIAL_TOKENS}
        return render_many(self.chat_template, [{"messages": m, "add_generation_prompt": g, **special}
                                                for m, g in chats])

    def end_of_turn_id(self) -> int | None:
        """The special token the chat template writes right after an assistant turn (`<|im_end|>`, `<|eot_id|>`),
        where a model trained on the template stops; None without a template or such a token."""
        if not self.chat_template:
            return None
        marker = "sbdturnend"
        text = self.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], False)
        after = text[text.rfind(marker) + len(marker):] if marker in text else ""
        return next((t for t in self.encode(after, add_special_tokens=False) if t in self.special_ids), None)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The ids of `messages` and the generation prompt (the template writes its own BOS)."""
        return self.encode(self.render_chat(messages, True), add_special_tokens=False)


def render_template(template: str, **variables) -> str:
    """A chat template rendered in a sandbox in the renderer process, within CHAT_RENDER_MAX_CHARS characters,
    CHAT_RENDER_SECONDS seconds and CHAT_RENDER_MAX_BYTES of memory; a template that fails, loops or grows past
    them is a TokenizerError saying which."""
    return render_many(template, [variables])[0]


def render_many(template: str, items: Sequence[dict]) -> list[str]:
    """`render_template(template, **variables)` of each item, the limits holding per item; the first item that
    fails is the TokenizerError. Variables must be JSON values (strings, numbers, lists, dicts)."""
    texts = []
    with _RENDERER_LOCK:
        for data, n in _requests(template, items, CHAT_RENDER_SECONDS, CHAT_RENDER_MAX_CHARS):
            texts += _exchange(data, n, CHAT_RENDER_SECONDS)
    return texts


def _requests(template: str, items: Sequence[dict], seconds: float, max_chars: int):
    """(request line, number of items) of about REQUEST_CHARS each, as chat_worker.py reads them."""
    head = json.dumps({"template": template, "seconds": seconds, "max_chars": max_chars}, ensure_ascii=False)[:-1]
    head += ', "items": ['
    chunk, size = [], 0
    for variables in items:
        try:
            item = json.dumps(variables, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise TokenizerError(f"the chat template's variables cannot be sent to its renderer: {e}") from None
        if chunk and size + len(item) > REQUEST_CHARS:
            yield _utf8(head + ",".join(chunk) + "]}\n"), len(chunk)
            chunk, size = [], 0
        chunk.append(item)
        size += len(item)
    if chunk:
        yield _utf8(head + ",".join(chunk) + "]}\n"), len(chunk)


def _utf8(text: str) -> bytes:
    """UTF-8 that keeps lone and paired surrogates as they are (JSON's \\u escapes would join a pair into one
    character), as chat_worker.py decodes it."""
    return text.encode("utf-8", "surrogatepass")


def _exchange(data: bytes, n: int, seconds: float) -> list[str]:
    """One request's n texts. A renderer that overruns is killed; one that ended (killed, crashed) is replaced
    by the next call; one found ended before its first reply, after serving earlier requests, is retried once
    (it may have been killed while idle)."""
    for attempt in (0, 1):
        worker = _worker()
        texts, served_before = [], worker.served
        try:
            worker.send(data)
            for _ in range(n):
                reply = worker.reply(time.monotonic() + seconds + KILL_GRACE_SECONDS)
                worker.served = True
                if "error" in reply:  # the renderer skipped the rest of the request: it is ready for the next
                    raise TokenizerError(reply["error"])
                texts.append(reply["text"])
            return texts
        except TimeoutError:
            _discard_worker()
            raise TokenizerError(timeout_message(seconds)) from None
        except (EOFError, BrokenPipeError):
            why = worker.ended()
            _discard_worker()
            if attempt == 0 and served_before and not texts:
                continue
            raise TokenizerError(why) from None
        except TokenizerError:
            raise
        except BaseException:  # e.g. KeyboardInterrupt mid-exchange: the renderer's state is unknown
            _discard_worker()
            raise
    raise AssertionError("unreachable")


class _Renderer:
    """One chat_worker.py process; requests are written to its stdin, replies (JSON lines) read from its stdout
    with a deadline."""

    def __init__(self, max_bytes: int):
        cmd = [sys.executable, "-P", str(Path(__file__).with_name("chat_worker.py")), str(max_bytes)]
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, bufsize=0)
        except OSError as e:
            raise TokenizerError(f"cannot start the chat template renderer ({' '.join(cmd)}): {e}") from None
        self.max_bytes, self.served = max_bytes, False
        self._lines, self._partial = deque(), []
        self._poll = select.poll()
        self._poll.register(self.proc.stdout.fileno(), select.POLLIN)
        try:
            ready = self.reply(time.monotonic() + CHAT_RENDER_START_SECONDS)
        except TimeoutError:
            ready = {"error": f"it did not start within {CHAT_RENDER_START_SECONDS:g} s"}
        except EOFError:
            ready = {"error": f"it exited at start ({self.exit_status()})"}
        if "error" in ready:
            self.kill()
            raise TokenizerError(f"cannot start the chat template renderer ({' '.join(cmd)}): {ready['error']}")

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self.proc.stdin.write(view):]

    def reply(self, deadline: float) -> dict:
        """The next reply; TimeoutError past `deadline`, EOFError when the process closed its output."""
        fd = self.proc.stdout.fileno()
        while not self._lines:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(max(1, int(left * 1000))):
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            self._take(chunk)
        return json.loads(self._lines.popleft().decode("utf-8", "surrogatepass"))

    def _take(self, chunk: bytes) -> None:
        if b"\n" not in chunk:
            self._partial.append(chunk)
            return
        *lines, rest = (b"".join(self._partial) + chunk if self._partial else chunk).split(b"\n")
        self._lines.extend(lines)
        self._partial = [rest] if rest else []

    def exit_status(self) -> str:
        """How the process, which closed its output, ended: "exit status 1", "killed by SIGKILL"."""
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return "it closed its output but did not exit"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def ended(self) -> str:
        """The error of a process that ended while rendering."""
        how = self.exit_status()
        if how == "killed by SIGXCPU":
            return timeout_message(CHAT_RENDER_SECONDS) + " (its CPU time limit)"
        return f"the chat template renderer process ended while rendering the tokenizer's chat template ({how})"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.close_pipes()

    def close(self) -> None:
        """End of input: the process exits; killed if it does not within a second."""
        self.close_pipes()
        try:
            self.proc.wait(1)
        except subprocess.TimeoutExpired:
            self.kill()

    def close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


_RENDERER: _Renderer | None = None
_RENDERER_LOCK = threading.Lock()  # one request/reply exchange at a time


def _worker() -> _Renderer:
    """The renderer process, started on first use and after one was discarded or ended."""
    global _RENDERER
    if _RENDERER is not None and (_RENDERER.proc.poll() is not None or _RENDERER.max_bytes != CHAT_RENDER_MAX_BYTES):
        _discard_worker()
    if _RENDERER is None:
        _RENDERER = _Renderer(CHAT_RENDER_MAX_BYTES)
    return _RENDERER


def renderer_pid() -> int | None:
    """The process id of the running renderer (None before the first render)."""
    return None if _RENDERER is None else _RENDERER.proc.pid


def _discard_worker() -> None:
    global _RENDERER
    if _RENDERER is not None:
        _RENDERER.kill()
        _RENDERER = None


@atexit.register
def _close_worker() -> None:
    global _RENDERER
    if _RENDERER is not None:
        _RENDERER.close()
        _RENDERER = None


def _forget_worker_in_child() -> None:
    """A forked child starts its own renderer: the parent's pipes are closed here (the parent keeps using them) and
    the lock, possibly held by a parent thread at the fork, is new."""
    global _RENDERER, _RENDERER_LOCK
    if _RENDERER is not None:
        _RENDERER.close_pipes()
        _RENDERER.proc.returncode = 0  # not this process's child: never waited for or killed from here
        _RENDERER = None
    _RENDERER_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_worker_in_child)
