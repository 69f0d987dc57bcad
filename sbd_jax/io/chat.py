"""Chat templates (the jinja source from tokenizer_config.json / chat_template.jinja), rendered as
`transformers` does: a sandboxed jinja2 environment with `raise_exception`. Shared by training data and decoding."""
from __future__ import annotations


class ChatTemplateError(ValueError):
    """The template is missing, cannot be rendered, or jinja2 is not installed."""


def render_chat_template(template: str, messages: list[dict], *, add_generation_prompt: bool, **special) -> str:
    """Render `messages` with `template`; `special` are the template's globals such as bos_token/eos_token
    (None becomes "")."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError("rendering a chat template needs the `jinja2` package") from None

    def raise_exception(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **{k: v or "" for k, v in special.items()})
    except TemplateError as e:
        raise ChatTemplateError(f"the tokenizer's chat template failed to render: {e}") from None
