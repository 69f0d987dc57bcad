"""The one tokenizer loader (sbd_jax/io/tokenizer.py): training and decoding render a chat prompt to the same
text and ids, a list of named templates picks "default", and unusable files give errors naming them."""
import json
from pathlib import Path

import pytest

from sbd_jax.config import ConfigError
from sbd_jax.decoding.prompts import PromptFileError, read_prompts
from demos.toy import tokenizer as demo_tok
from sbd_jax.io.tokenizer import Tokenizer, TokenizerError
from sbd_jax.training.config import DataConfig
from sbd_jax.training.data import build_iterator

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
OTHER = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
PROMPT = "Q:sum 4 7"


def _model_dir(tmp_path, templates):
    d = tmp_path / "model"
    demo_tok.save(demo_tok.build_tokenizer(["Q:sum 4 7\nA:11", "Q:rev 1 2 3\nA:3 2 1"], vocab_size=128), d)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": templates}))
    return d


def test_training_and_decoding_render_a_chat_prompt_alike(tmp_path):
    d = _model_dir(tmp_path, [{"name": "tool_use", "template": OTHER}, {"name": "default", "template": TEMPLATE}])
    tok = Tokenizer.load(d)
    text = tok.render_chat([{"role": "user", "content": PROMPT}], True)
    assert text == f"<bos><|user|>{PROMPT}<eos><|assistant|>"  # the template named "default", not the first
    want = tok.encode(text, add_special_tokens=False)
    assert want[0] == tok.encode("<bos>", add_special_tokens=False)[0] and tok.decode(want) == text.replace(
        "<bos>", "").replace("<eos>", "")
    # training: the SFT prompt's ids are the loss-masked prefix of the packed document
    (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": PROMPT, "response": "A:11"}) + "\n")
    cfg = DataConfig(path=str(tmp_path / "sft.jsonl"), tokenizer=str(d), seq_len=64, shuffle=False,
                     cache_dir=str(tmp_path / "c"))
    b = build_iterator(cfg, 1).next_batch()
    train_ids = b.tokens[0][(b.segment[0] == 1) & (b.loss_mask[0] == 0)].tolist()
    # decoding: a messages prompt and a text prompt marked chat
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"messages": [{"role": "user", "content": PROMPT}]}, {"prompt": PROMPT, "chat": True})))
    decoded = [list(p.ids) for p in read_prompts(tmp_path / "in.jsonl", Tokenizer.find(d))]
    assert train_ids == decoded[0] == decoded[1] == want


def test_a_template_list_without_default_gives_no_template(tmp_path):
    d = _model_dir(tmp_path, [{"name": "tool_use", "template": OTHER}])
    tok = Tokenizer.load(d)
    assert tok.chat_template is None
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": PROMPT, "chat": True}) + "\n")
    with pytest.raises(PromptFileError, match="line 1: .*the tokenizer has none"):
        read_prompts(tmp_path / "in.jsonl", tok)


def test_unusable_files_name_the_file(tmp_path):
    d = _model_dir(tmp_path, TEMPLATE)
    assert Tokenizer.find(tmp_path) is None  # no tokenizer.json there: decode.py takes ids only
    with pytest.raises(TokenizerError, match=r"tokenizer file '.*/tokenizer.json' does not exist"):
        Tokenizer.load(tmp_path)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"'.*tokenizer_config.json' is not valid JSON"):
        Tokenizer.find(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"cannot read tokenizer '.*tokenizer.json'"):  # caught by train.py/decode.py
        Tokenizer.load(d)
    with pytest.raises(TokenizerError, match="only encodes"):
        Tokenizer.from_callable(lambda s: [1]).decode([1])


CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
STRUCTURED = ("{{- bos_token }}\n{%- set ns = namespace(n=0) %}\n{%- for m in messages %}\n  {%- set ns.n = ns.n + 1 %}\n"
              "  {{ m['role'] | upper }}: {{ m['content'] | trim }} {{ m | tojson }}\n{%- endfor %}\n"
              "{% if add_generation_prompt %}  [{{ ns.n }}] {{ eos_token }}\n{% endif %}")
MESSAGES = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "héllo \ud83d\ude00 \ud800 \"q\"\n"},
            {"role": "assistant", "content": "<b>&</b>"}]
MEMORY = r"used more than 1 GiB of memory while rendering"
TIME = r"did not finish rendering within 0\.5 s"
HOSTILE = {  # one operation each, unless said otherwise
    "center_2e9": ("{{ 'a' | center(2000000000) }}", MEMORY),
    "percent_width_2e9": ("{{ '%01999999999d' % 1 }}", MEMORY),
    "format_width_2e9": ("{{ '{:>2000000000}'.format(1) }}", MEMORY),
    "lipsum_3e6": ("{{ lipsum(n=3000000) }}", TIME),  # minutes inside one call: the renderer is killed
    "power_tower": ("{{ (((9 ** 64) ** 64) ** 64) ** 64 }}", TIME),  # ~30 s of C-level big-int work, killed
    "nested_loop": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", TIME),
    "writing_loop": ("{% for a in range(100000) %}{% for b in range(100000) %}{{ messages }}{% endfor %}{% endfor %}",
                     r"rendered more than 100000 characters"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", r"failed to render: RecursionError"),
}


@pytest.fixture
def quick_limits(monkeypatch):
    from sbd_jax.io import tokenizer
    monkeypatch.setattr(tokenizer, "CHAT_RENDER_SECONDS", 0.5)
    monkeypatch.setattr(tokenizer, "KILL_GRACE_SECONDS", 0.25)
    monkeypatch.setattr(tokenizer, "CHAT_RENDER_MAX_CHARS", 100_000)
    return tokenizer


def _jinja2_render(template, **variables):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(**variables)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_fail_by_name_within_the_limits(quick_limits, name):
    """Memory (the renderer's address space), time (its clock check, or a kill for one long operation) and size:
    each a TokenizerError well before the default 10 s, and the next render works."""
    import time
    template, match = HOSTILE[name]
    t = time.monotonic()
    with pytest.raises(TokenizerError, match=r"^the tokenizer's chat template .*" + match):
        quick_limits.render_template(template, messages=MESSAGES)
    assert time.monotonic() - t < 3.0
    assert quick_limits.render_template("{{ x }}!", x="ok") == "ok!"


@pytest.mark.parametrize("template", [TEMPLATE, CHATML, STRUCTURED], ids=["plain", "chatml", "structured"])
def test_render_matches_jinja2(template):
    """Whitespace control, filters, namespace, tojson, unicode (lone surrogates too): as jinja2 renders it."""
    tok = Tokenizer(lambda text, add: [], chat_template=template,
                    special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "", "unk_token": ""}
    chats = [(MESSAGES[:k], bool(k % 2)) for k in range(1, 4)]
    want = [_jinja2_render(template, messages=m, add_generation_prompt=g, **special) for m, g in chats]
    assert [tok.render_chat(m, g) for m, g in chats] == tok.render_chats(chats) == want


def test_template_errors_keep_their_messages():
    from sbd_jax.io.tokenizer import render_template
    for template, match in [("{{ raise_exception('no system role') }}", "failed to render: no system role$"),
                            ("{% if %}", "failed to render: Expected an expression"),
                            ("{{ messages.x.y }}", "failed to render: 'list object' has no attribute 'x'"),
                            ("{{ 1 / 0 }}", "failed to render: ZeroDivisionError: division by zero")]:
        with pytest.raises(TokenizerError, match=r"^the tokenizer's chat template " + match):
            render_template(template, messages=[])
    with pytest.raises(TokenizerError, match="variables cannot be sent to its renderer: .*set is not JSON"):
        render_template("{{ x }}", x={1, 2})


def test_renderer_process_is_reused_and_replaced(quick_limits):
    """One process for every render; one killed (here from outside, or for overrunning) is replaced by the next
    render; a forked child (a `datasets` map worker) starts its own and leaves the parent's alone."""
    import os
    import signal
    import warnings
    r = quick_limits.render_template
    assert r("a") == "a"
    pid = quick_limits.renderer_pid()
    maps = Path(f"/proc/{pid}/maps")
    assert not maps.is_file() or "jaxlib" not in maps.read_text()  # the renderer imports jinja2 only
    assert [r("b"), *quick_limits.render_many("{{ x }}", [{"x": i} for i in range(50)])][:2] == ["b", "0"]
    assert quick_limits.renderer_pid() == pid
    os.kill(pid, signal.SIGKILL)
    assert r("c") == "c" and quick_limits.renderer_pid() not in (pid, None)
    pid = quick_limits.renderer_pid()
    with pytest.raises(TokenizerError, match="within 0.5 s"):
        r("{{ lipsum(n=3000000) }}")
    assert quick_limits.renderer_pid() is None and r("d") == "d" and quick_limits.renderer_pid() != pid
    pid = quick_limits.renderer_pid()
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pytest process holds JAX threads; the child only renders
        child = os.fork()
    if child == 0:
        os.close(read)
        os.write(write, f"{r('e')} {quick_limits.renderer_pid()}".encode())
        os._exit(0)
    os.close(write)
    text, child_renderer = os.read(read, 100).decode().split()
    os.waitpid(child, 0)
    assert text == "e" and int(child_renderer) != pid
    assert r("f") == "f" and quick_limits.renderer_pid() == pid


def test_a_long_text_is_encoded_in_pieces_with_the_same_ids(tmp_path, monkeypatch):
    """A text past PIECE_CHARS (here lowered to 2000 characters) is encoded piece by piece (peak memory of a piece,
    not of a 20 MB document: 7.0 -> 1.2 GB, bench/bench_long_document.py), to the same ids as whole, specials
    included, with Qwen2's tokenizer; a tokenizer whose pieces would differ (a prefix space added to each) is
    probed, refused, and encodes the whole text as before."""
    import lzma
    import random

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from sbd_jax.io import long_text
    monkeypatch.setattr(long_text, "PIECE_CHARS", 2000)
    d = tmp_path / "qwen2"
    d.mkdir()
    fixture = Path(__file__).parent / "fixtures" / "qwen2_tokenizer" / "tokenizer.json.xz"
    (d / "tokenizer.json").write_bytes(lzma.decompress(fixture.read_bytes()))
    rng = random.Random(0)
    words = ["def", "f(x):", "return", "x", "  ", "\n", "\n\n", "Grüße", "中文", "3.14", "<|im_end|>", "\t", "a_b", "é"]
    text = " ".join(rng.choice(words) for _ in range(20_000))
    hf = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    tok = Tokenizer.load(d)
    assert len(long_text.pieces(text, ())) > 20
    for add in (False, True):
        assert tok.encode(text, add) == hf.encode(text, add_special_tokens=add).ids
    assert tok.encode_batch(["short", text], False) == [hf.encode(t, add_special_tokens=False).ids for t in ("short", text)]
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=True), decoders.ByteLevel()
    bpe.train_from_iterator(list(long_text.PROBES) * 4, trainers.BpeTrainer(vocab_size=300))
    enc = long_text.PieceEncoder(bpe)
    assert enc.encode(text, False) == bpe.encode(text, add_special_tokens=False).ids and enc.by_pieces() is False
