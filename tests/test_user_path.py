"""A new user's path with a real tokenizer (Qwen2's vocabulary and ChatML template, tests/fixtures/qwen2_tokenizer):
prompt/response jsonl -> train.py (SFT on the chat template, SBD) -> the export -> the README's decode.py command
on `messages` prompts, and the text API -> rows stop at the template's end of turn (`<|im_end|>`, which the model
was trained until it emits) and the text round-trips."""
import json
import lzma
import re
import shlex
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import sbd_jax
from subproc import ROOT, compilation_cache_env

sys.path.insert(0, str(ROOT))
import decode  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "qwen2_tokenizer"
ENDOFTEXT, IM_END, MASK = 151643, 151645, 151935  # MASK: one of the tokenizer's unused [PAD...] ids
ANSWERS = {"hi": "Hi there, friend!", "bye": "Goodbye."}


def real_tokenizer(d):
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_bytes(lzma.decompress((FIXTURE / "tokenizer.json.xz").read_bytes()))
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURE / f, d / f)
    return d


def readme_command(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(section):], re.S).group(1)
    return shlex.split(" ".join(ln.rstrip("\\").strip() for ln in block.splitlines() if not ln.lstrip().startswith("#")))


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny Llama with the real 151936-id vocabulary, fine-tuned by train.py on chat-template SFT data until it
    answers; returns the HF export directory."""
    d = tmp_path_factory.mktemp("user_path")
    base = real_tokenizer(d / "base")
    cfg = sbd_jax.ModelConfig(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                              eos_token_id=ENDOFTEXT, bos_token_id=ENDOFTEXT, rope_theta=10000.0)
    sbd_jax.save_pretrained(cfg, jax.tree.map(np.asarray, sbd_jax.init_params(cfg, jax.random.key(0))), base)
    rows = [{"prompt": f"Say {w} to friend number {i}", "response": ANSWERS[w]} for i in range(32) for w in ANSWERS]
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["train.py", "--config", "configs/tiny_sbd.yaml", "model.config=null", f"model.init_from={base}",
            f"model.mask_token_id={MASK}", f"data.path={d / 'sft.jsonl'}", f"data.tokenizer={base}", "data.seq_len=36",
            "sbd.block_align=response", "data.copy_len=16", "batch_size=4", "steps=120", "optim.lr=1e-2",
            "optim.warmup_steps=5", "checkpoint.every=1000", f"out_dir={d / 'run'}"]
    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PATH": "", **compilation_cache_env()}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "done: step 120" in proc.stdout
    return d / "run" / "hf"


def test_the_fixture_is_qwen2s_tokenizer(tmp_path):
    from sbd_jax.io.tokenizer import Tokenizer
    tok = Tokenizer.load(real_tokenizer(tmp_path / "tok"))
    assert tok.eos_id == ENDOFTEXT and tok.end_of_turn_id() == IM_END
    text = "Grüße, 世界! 3.14 <|im_end|>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == "Grüße, 世界! 3.14 "  # specials left out
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.render_chat([{"role": "user", "content": "hi"}], True).endswith("<|im_start|>assistant\n")
    assert ids[0] == 151644 and IM_END in ids  # <|im_start|> ... the system turn's <|im_end|>


def test_export_is_a_complete_model_directory(export):
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {f.name for f in export.iterdir()}
    gen = json.loads((export / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {ENDOFTEXT, IM_END}
    cfg, _ = sbd_jax.from_pretrained(export)
    assert cfg.mask_token_id == MASK and cfg.vocab_size == 151936


def test_readme_generate_command_stops_at_the_end_of_turn(export, tmp_path, capsys):
    argv = readme_command("## Generating")
    assert argv[:2] == [".venv/bin/python", "decode.py"], argv
    swap = {"--model": str(export), "--input": str(tmp_path / "prompts.jsonl"), "--output": str(tmp_path / "out.jsonl")}
    args = [swap.get(argv[i - 1], a) for i, a in enumerate(argv) if i >= 2]
    assert set(swap) <= set(args)
    prompts = [{"id": "a", "messages": [{"role": "user", "content": "Say hi to friend number 3"}]},
               {"id": "b", "messages": [{"role": "user", "content": "Say bye to friend number 7"}]},
               {"id": "c", "prompt": "Say hi to friend number 30", "chat": True}]  # a text prompt, chat-rendered
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    assert decode.main([*args, "--summary", str(tmp_path / "s.json"), "--no-progress"]) == 0
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for pid, want in (("a", ANSWERS["hi"]), ("b", ANSWERS["bye"]), ("c", ANSWERS["hi"])):
        for r in (rows[pid], rows[pid]["ar"]):
            assert r["stop"] == "eos" and r["tokens"][-1] == IM_END and r["text"] == want, (pid, r)
        assert rows[pid]["tokens"] == rows[pid]["ar"]["tokens"]
    s = json.loads((tmp_path / "s.json").read_text())
    hist = s["accepted_per_forward"]  # counts only what the rows keep, though blocks ran past the end of turn
    assert s["tokens"] == sum(len(r["tokens"]) for r in rows.values()) == sum(n * c for n, c in enumerate(hist))
    assert s["nfe"] < s["ar"]["nfe"]


def test_text_api(export):
    from sbd_jax.decoding.sampler import Sampler
    sampler = Sampler.load(export)
    assert sampler.eos_ids == (ENDOFTEXT, IM_END)
    half = Sampler.load(export, dtype="bfloat16")  # weights in the decoding dtype, not float32 master copies
    assert {x.dtype for x in jax.tree.leaves(half.params)} == {jax.numpy.dtype("bfloat16")}
    assert half.cfg.dtype == "bfloat16"
    del half
    inputs = [[{"role": "user", "content": "Say bye to friend number 11"}], "Say hi to friend number 5"]
    for mode in ("sbd", "ar"):
        out = sampler(inputs, chat=True, mode=mode, max_new_tokens=64, block_size=16, gamma=0.35)
        assert [o.text for o in out] == [ANSWERS["bye"], ANSWERS["hi"]], mode
        assert all(o.stop == "eos" and o.tokens[-1] == IM_END for o in out)
        assert out[0].prompt_tokens == len(sampler.tokenizer.apply_chat_template(inputs[0]))
    assert out[0].nfe == len(out[0].tokens)  # AR: one forward per token
    seen = []  # lossless SBD: AR's answers; what its drafting policy learned carries from call to call
    for _ in range(2):
        out = sampler(inputs, chat=True, verify=True, wide_cost=1.5, max_new_tokens=64, block_size=16)
        assert [o.text for o in out] == [ANSWERS["bye"], ANSWERS["hi"]]
        seen.append(sampler.draft_memory)
    assert seen[1].tokens == seen[0].tokens + sum(len(o.tokens) for o in out)  # tokens of the rows so far


def test_decode_verify_mode_equals_ar_in_fewer_forwards(export, tmp_path, capsys):
    """decode.py --verify --compare-ar on the fine-tuned model, sampled: every row identical to AR's (the summary
    counts and shows them), in fewer forwards than AR (a stated cost of the wide call, so the policy's choices do
    not move with the cost model's constants), with the drafts placed and agreed."""
    prompts = [{"id": f"{w}{i}", "messages": [{"role": "user", "content": f"Say {w} to friend number {i}"}]}
               for i in (3, 8, 21, 40) for w in ANSWERS]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    assert decode.main(["--model", str(export), "--input", str(tmp_path / "p.jsonl"), "--output",
                        str(tmp_path / "o.jsonl"), "--verify", "--compare-ar", "--temperature", "0.7", "--wide-cost", "1.5",
                        "--block-size", "8", "--max-new-tokens", "32", "--batch-size", "3",
                        "--summary", str(tmp_path / "s.json"), "--no-progress"]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["verify"] and s["n_rows_differing_from_ar"] == 0 and s["same_tokens_as_ar"] == 1.0
    assert s["nfe"] < s["ar"]["nfe"] and sum(s["accepted_per_forward"]) > 0
    assert 0 < s["drafts_agreed"] <= s["drafts"] and s["tokens_per_forward_ceiling"] == 8.0
    shown = capsys.readouterr().out
    assert "rows identical to AR: 8 of 8 (100.0%)" in shown and f"drafts: {s['drafts_agreed']} of" in shown
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["tokens"] == r["ar"]["tokens"] and r["nfe"] <= r["ar"]["nfe"]
    assert sum(r["drafts"] for r in rows) == s["drafts"] and sum(r["agreed"] for r in rows) == s["drafts_agreed"]
