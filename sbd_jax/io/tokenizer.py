"""The one tokenizer of training data, decode.py and the demo: a local `tokenizers` tokenizer.json, with the
chat template and special tokens of tokenizer_config.json (or chat_template.jinja) next to it. Never downloads.
Chat templates render as in `transformers` (sandboxed jinja2, `raise_exception`, the special tokens as globals).
A tokenizer_config.json may hold a list of named templates ([{"name": ..., "template": ...}]): as `transformers`
does, the one named "default" is used; a list without one gives no template."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..config import ConfigError

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
CHAT_RENDER_MAX_CHARS = 4_000_000  # a rendered conversation longer than this is a broken template
CHAT_RENDER_SECONDS = 10.0  # so is one that renders for longer (a loop that never ends must not hang decode.py)


class TokenizerError(ConfigError):
    """A tokenizer that cannot be used as asked: a missing or unreadable file, no or a failing chat template."""


class Tokenizer:
    """Text <-> ids, the EOS id, and the chat template with the special-token strings it may use."""

    def __init__(self, encode: Callable[[str, bool], list[int]], decode: Callable[[list[int]], str] | None = None,
                 *, eos_id: int | None = None, chat_template: str | None = None, special_tokens: dict | None = None,
                 special_ids: frozenset[int] = frozenset(), files: tuple[Path, ...] = ()):
        self._encode, self._decode = encode, decode
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
        try:
            conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}
        except json.JSONDecodeError as e:
            raise TokenizerError(f"cannot read {str(conf_file)!r}: not valid JSON ({e})") from None
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
        return cls(lambda text, add_special_tokens: hf.encode(text, add_special_tokens=add_special_tokens).ids,
                   lambda ids: hf.decode(ids, skip_special_tokens=True), eos_id=hf.token_to_id(eos) if eos else None,
                   chat_template=template, special_tokens=special, files=files,
                   special_ids=frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special))

    @classmethod
    def find(cls, model_dir) -> Tokenizer | None:
        """The model directory's tokenizer; None when it has no tokenizer.json."""
        return cls.load(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._encode(text, add_special_tokens))

    @property
    def can_decode(self) -> bool:
        return self._decode is not None

    def decode(self, ids) -> str:
        if self._decode is None:
            raise TokenizerError("this tokenizer only encodes (it was built from a function)")
        return self._decode([int(t) for t in ids])

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not self.chat_template:
            raise TokenizerError("a chat template is asked for but the tokenizer has none (no chat_template in "
                                 "tokenizer_config.json, none named 'default' in its list, no chat_template.jinja)")
        special = {k: self.special_tokens.get(k) or "" for k in SPECIAL_TOKENS}
        return render_template(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                               **special)

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


def _guarded_env(deadline: float):
    """A sandboxed jinja2 environment (as `transformers` renders templates) whose every call and every `*` / `**`
    checks the clock: a template that loops (nearly) for ever fails at `deadline` instead of hanging."""
    import time

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def check():
        if time.monotonic() > deadline:
            raise TokenizerError(f"the tokenizer's chat template did not finish rendering within "
                                 f"{CHAT_RENDER_SECONDS:g} s (a loop that does not end?)")

    class Guarded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call(self, __context, __obj, *args, **kwargs):
            check()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            check()
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise TemplateError(f"exponent {right!r} is too large")
            if operator == "*" and any(isinstance(x, (str, list, tuple)) for x in (left, right)):
                n = right if isinstance(left, (str, list, tuple)) else left
                seq = left if isinstance(left, (str, list, tuple)) else right
                if isinstance(n, int) and n * max(len(seq), 1) > CHAT_RENDER_MAX_CHARS:
                    raise TemplateError(f"a repetition of {n} x {len(seq)} is over {CHAT_RENDER_MAX_CHARS} items")
            return super().call_binop(context, operator, left, right)

    def raise_exception(msg):
        raise TemplateError(msg)

    env = Guarded(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env, check


def render_template(template: str, **variables) -> str:
    """A chat template rendered in a sandbox, within CHAT_RENDER_MAX_CHARS characters and CHAT_RENDER_SECONDS
    seconds; a template that fails, loops or grows past them is a TokenizerError saying which."""
    import time

    from jinja2.exceptions import TemplateError
    env, check = _guarded_env(time.monotonic() + CHAT_RENDER_SECONDS)
    parts, size = [], 0
    try:
        for chunk in env.from_string(template).generate(**variables):
            parts.append(chunk)
            size += len(chunk)
            if size > CHAT_RENDER_MAX_CHARS:
                raise TokenizerError(f"the tokenizer's chat template rendered more than {CHAT_RENDER_MAX_CHARS} "
                                     "characters (a loop that does not end?)")
            check()
    except TokenizerError:
        raise
    except TemplateError as e:
        raise TokenizerError(f"the tokenizer's chat template failed to render: {e}") from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError, OverflowError) as e:
        raise TokenizerError(f"the tokenizer's chat template failed to render: {type(e).__name__}: {e}") from None
    return "".join(parts)
