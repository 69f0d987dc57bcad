"""Benchmark: chat SFT rendering throughput (records/s; a record is two renders, as sbd_jax/training/store.py does:
[user] + generation prompt, then [user, assistant]) with the SmolLM2 ChatML and the Qwen2.5 (tool calling) templates.

    .venv/bin/python bench/bench_chat_render.py [--records 200,3000,20000]

Rows: `compile per call` is the former in-process path (a guarded environment built and the template compiled for
every render); `render_chat` is the per-record call (one pipe round trip to the renderer process per render,
template compiled once there); `render_chats` sends a batch of records (1000, a `datasets` map batch) per exchange;
`in-process, compiled once` is the lower bound (no process boundary, no limits) for reference. Last, the whole SFT
map function of the store, `store.record_fn(cfg, "sft", tok)` (rendering and tokenizing, a WordLevel tokenizer),
on 1000-record batches as store.py calls it now, against the same with the former rendering patched in. Times:
the best of 3 runs; every output is checked against jinja2's (the first table) or the former path's (the last).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sbd_jax.io import chat_worker, tokenizer  # noqa: E402
from sbd_jax.io.tokenizer import Tokenizer, render_template  # noqa: E402

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 - Qwen2.5-Instruct's template (tool calling), as its tokenizer_config.json holds it
TEMPLATES = {"chatml": CHATML, "qwen2.5": QWEN25}
SPECIAL = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": ""}
BATCH = 1000  # records per render_chats call (the `datasets` map batch of store.py)
WORDS = [f"w{i}" for i in range(5000)]
REPEATS = 3


def records(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, response) pairs of ~40 and ~160 words."""
    rng = random.Random(seed)
    return [(" ".join(rng.choices(WORDS, k=40)) + " ?", " ".join(rng.choices(WORDS, k=160)) + " .")
            for _ in range(n)]


def old_render(template: str, **variables) -> str:
    """The former render_template: a guarded environment and a compiled template per call."""
    env = chat_worker.guarded_env()
    env.deadline, env.seconds, env.max_chars = time.monotonic() + 10.0, 10.0, tokenizer.CHAT_RENDER_MAX_CHARS
    return "".join(env.from_string(template).generate(**variables))


def chats(pr: str, re: str) -> list[tuple[list[dict], bool]]:
    user = [{"role": "user", "content": pr}]
    return [(user, True), (user + [{"role": "assistant", "content": re}], False)]


def run_old(template, recs) -> list[str]:
    return [old_render(template, messages=m, add_generation_prompt=g, **SPECIAL)
            for pr, re in recs for m, g in chats(pr, re)]


def run_per_call(tok, recs) -> list[str]:
    return [tok.render_chat(m, g) for pr, re in recs for m, g in chats(pr, re)]


def run_batched(tok, recs) -> list[str]:
    out = []
    for i in range(0, len(recs), BATCH):
        out += tok.render_chats([c for pr, re in recs[i:i + BATCH] for c in chats(pr, re)])
    return out


def run_in_process(template, recs) -> list[str]:
    env = chat_worker.guarded_env()
    env.deadline, env.max_chars = float("inf"), tokenizer.CHAT_RENDER_MAX_CHARS
    t = env.from_string(template)
    return ["".join(t.generate(messages=m, add_generation_prompt=g, **SPECIAL))
            for pr, re in recs for m, g in chats(pr, re)]


def timed(fn, repeats: int = 1) -> tuple[float, list]:
    """The best time of `repeats` runs (the machine may be shared), and the output."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def table(rows, want) -> None:
    """(name, records, fn) rows: records/s (best of REPEATS) and the speedup over the first row; every output
    checked against `want`."""
    base = None
    print(f"  {'path':38s} {'records':>8s} {'seconds':>8s} {'records/s':>10s} {'ms/render':>10s} {'speedup':>8s}")
    for name, n, fn in rows:
        gc.collect()  # the garbage of one row (a class per render, before) is not collected in the next
        sec, out = timed(fn, REPEATS)
        assert out[:len(want)] == want[:len(out)], f"{name}: output differs"
        rate = n / sec
        base = base or rate
        print(f"  {name:38s} {n:8d} {sec:8.2f} {rate:10.0f} {sec / (2 * n) * 1e3:10.4f} {rate / base:7.1f}x")


def render_tables(recs, n_old, n_call, n_batch) -> None:
    for name, template in TEMPLATES.items():
        tok = Tokenizer(lambda text, add: [], chat_template=template, special_tokens=SPECIAL)
        tok.render_chat([{"role": "user", "content": "warm up"}], True)
        print(f"template {name} ({len(template)} chars)")
        table([("compile per call (before)", n_old, lambda: run_old(template, recs[:n_old])),
               ("render_chat, per record (after)", n_call, lambda: run_per_call(tok, recs[:n_call])),
               (f"render_chats, {BATCH}-record batches", n_batch, lambda: run_batched(tok, recs[:n_batch])),
               ("in-process, compiled once (bound)", n_batch, lambda: run_in_process(template, recs[:n_batch]))],
              run_in_process(template, recs[:n_old]))


def wordlevel_tokenizer(d: Path, template: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    hf = HFTokenizer(WordLevel({t: i for i, t in enumerate(specials + WORDS)}, unk_token="<unk>"))
    hf.pre_tokenizer = WhitespaceSplit()
    hf.add_special_tokens(specials)
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    return Tokenizer.load(d)


def store_table(recs, n_old, n_new) -> None:
    """store.record_fn('sft') as store.py runs it, and with the former rendering patched into render_chats."""
    from sbd_jax.training import store
    from sbd_jax.training.config import DataConfig
    with tempfile.TemporaryDirectory() as d:
        tok = wordlevel_tokenizer(Path(d), CHATML)
        cfg = DataConfig(path=str(Path(d) / "sft.jsonl"), tokenizer=d)
        fn = store.record_fn(cfg, "sft", tok)

        def run(n):
            out = []
            for i in range(0, n, BATCH):
                part = recs[i:min(n, i + BATCH)]
                out += fn({cfg.prompt_field: [p for p, _ in part], cfg.response_field: [r for _, r in part]})["input_ids"]
            return out

        def former(chats):  # the former rendering: every render compiles the template anew
            return [old_render(CHATML, messages=m, add_generation_prompt=g, **SPECIAL) for m, g in chats]

        def run_former(n):
            tok.render_chats, now = former, tok.render_chats
            try:
                return run(n)
            finally:
                tok.render_chats = now

        print("store.record_fn(cfg, 'sft', tok): rendering + tokenizing (template chatml; ms/render: per record / 2)")
        table([("compile per call (before)", n_old, lambda: run_former(n_old)),
               ("store.py's call site as it is", n_new, lambda: run(n_new))], run(n_old))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", default="200,3000,20000", help="records for: compile per call, render_chat, "
                                                                   "render_chats and in-process")
    n_old, n_call, n_batch = (int(x) for x in ap.parse_args().records.split(","))
    print(f"# {platform.node()} python {platform.python_version()} cores {os.cpu_count()} "
          f"load {os.getloadavg()[0]:.2f}")
    start, _ = timed(lambda: render_template("{{ x }}", x=1))
    print(f"renderer process start + first render: {start * 1e3:.1f} ms (pid {tokenizer.renderer_pid()})")
    pid = tokenizer.renderer_pid()
    recs = records(max(n_old, n_call, n_batch))
    render_tables(recs, n_old, n_call, n_batch)
    store_table(recs, n_old, n_call)
    print(f"renderer pid after all renders: {tokenizer.renderer_pid()} (started as {pid})")


if __name__ == "__main__":
    main()
