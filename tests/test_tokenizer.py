"""The one tokenizer loader (sbd_jax/io/tokenizer.py): training and decoding render a chat prompt to the same
text and ids, a list of named templates picks "default", and unusable files give errors naming them."""
import json

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
    with pytest.raises(TokenizerError, match=r"cannot read '.*tokenizer_config.json': not valid JSON"):
        Tokenizer.find(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"cannot read tokenizer '.*tokenizer.json'"):  # caught by train.py/decode.py
        Tokenizer.load(d)
    with pytest.raises(TokenizerError, match="only encodes"):
        Tokenizer.from_callable(lambda s: [1]).decode([1])
