"""Tiny GGUF model files for tests, written with llama.cpp's own writer (`gguf.GGUFWriter`) the way llama.cpp's
convert_hf_to_gguf.py writes them: HF weights renamed to GGUF names, the q/k rows of the `llama` architecture
permuted for ggml's RoPE, 2-D weights quantized with `gguf.quants.quantize`, norms and biases in F32, tied
embeddings as a missing `output.weight`. Independent of sbd_jax (it is what sbd_jax.io.gguf is tested against).

  make_tiny_gguf(path, arch=..., quant=..., tokenizer_from=..., seed=..., **model)   -> path
  tiny_weights(tiny_spec(arch, **model), vocab_size, seed)                          -> the HF weights it holds

Stable API (the real-model demo pipeline's tiny-scale CI run uses it): keyword arguments may be added, none
removed or renamed.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

_SPEC = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5, context_length=512,
             attention_bias=None, rope_scaling=None, std=0.05)


def tiny_spec(arch: str = "llama", **model) -> dict:
    """The model hyperparameters of a tiny file (defaults: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, ffn 128,
    tied embeddings; `attention_bias` defaults to True for qwen2, which has q/k/v biases, else False).
    `rope_scaling`: None or {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    (Llama-3 scaling, written as llama.cpp does: a `rope_freqs.weight` tensor)."""
    unknown = set(model) - set(_SPEC)
    if unknown:
        raise TypeError(f"unknown tiny model argument(s) {sorted(unknown)} (known: {sorted(_SPEC)})")
    spec = {**_SPEC, **model, "arch": arch}
    if spec["attention_bias"] is None:
        spec["attention_bias"] = arch == "qwen2"
    return spec


def tiny_weights(spec: dict, vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights in HF layout (Linear weights [out, in]), deterministic in (spec, vocab, seed)."""
    rng = np.random.default_rng(seed)
    d, f, hd, std = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"], spec["std"]
    q, kv = spec["num_heads"] * hd, spec["num_kv_heads"] * hd
    normal = lambda *shape: (rng.standard_normal(shape) * std).astype(np.float32)  # noqa: E731
    norm = lambda n: rng.uniform(0.5, 1.5, n).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": normal(vocab_size, d), "model.norm.weight": norm(d)}
    if not spec["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(vocab_size, d)
    for i in range(spec["num_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
              p + "self_attn.q_proj.weight": normal(q, d), p + "self_attn.k_proj.weight": normal(kv, d),
              p + "self_attn.v_proj.weight": normal(kv, d), p + "self_attn.o_proj.weight": normal(d, q),
              p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d),
              p + "mlp.down_proj.weight": normal(d, f)}
        if spec["attention_bias"]:
            w |= {p + "self_attn.q_proj.bias": normal(q), p + "self_attn.k_proj.bias": normal(kv),
                  p + "self_attn.v_proj.bias": normal(kv)}
        if spec["arch"] == "qwen3":
            w |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
    return w


_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_LAYER[module]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows (and bias entries) go from HF's rotate-half
    order to ggml's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(spec: dict) -> np.ndarray:
    """The `rope_freqs.weight` convert_hf_to_gguf.py writes for Llama-3 RoPE scaling (per-frequency divisors)."""
    rs, dim = spec["rope_scaling"], spec["head_dim"]
    freqs = 1.0 / (spec["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    orig, low, high = rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(rs["factor"])
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    return np.array(out, np.float32)


def _encode(w: np.ndarray, quant: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor. A type gguf cannot quantize (Q8_1, ...) is written as zero
    blocks of its size, so that files with it exist for error tests."""
    import gguf
    if w.ndim == 1 or quant == "F32":
        return w.astype(np.float32), None
    if quant == "F16":
        return w.astype(np.float16), None
    kind = gguf.GGMLQuantizationType[quant]
    try:
        return gguf.quants.quantize(w, kind), kind
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        return np.zeros((*w.shape[:-1], w.shape[-1] // block * size), np.uint8), kind


def _put(writer, key: str, value) -> None:
    """A metadata value with a type from its Python type (bool, int -> UINT32, float -> FLOAT32, str, lists)."""
    import gguf
    t = gguf.GGUFValueType
    kinds = [(bool, t.BOOL), (int, t.UINT32), (float, t.FLOAT32), (str, t.STRING)]
    if isinstance(value, (list, tuple)):
        sub = t.INT32 if key.endswith("token_type") else next(k for py, k in kinds if isinstance(value[0], py))
        writer.add_key_value(key, list(value), t.ARRAY, sub)
    else:
        writer.add_key_value(key, value, next(k for py, k in kinds if isinstance(value, py)))


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet, byte b spelled as entry b."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _synthetic_tokenizer() -> dict:
    """A small byte-level BPE: 3 control tokens, the 256 bytes, a few merges; ChatML template; pre=smollm."""
    merges = ["h i", "Ġ t", "Ġt h", "Ġth e", "i n", "o n"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_tokens(), *(m.replace(" ", "") for m in merges)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3), "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 2,
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML}


def _tokenizer_fields(source) -> dict:
    """Every `tokenizer.*` key of another GGUF file, with its GGUF value types: {key: (value, type, subtype)}."""
    import gguf
    reader = gguf.GGUFReader(str(source))
    return {k: (f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
            for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def make_tiny_gguf(path, *, arch: str = "llama", quant: str = "Q8_0", tokenizer_from=None, seed: int = 0,
                   metadata: dict | None = None, extra_tensors: dict | None = None, **model) -> Path:
    """Write a tiny random model as a GGUF file at `path` and return it.

    arch: GGUF architecture ("llama": q/k rows permuted as llama.cpp does; "qwen3": + q/k norms; "qwen2": + q/k/v
      biases; any other name writes a Llama-shaped file under that architecture, for error tests).
    quant: GGML type of the 2-D weights ("F32", "F16", "Q8_0", "Q4_1", "Q4_K", ...); norms and biases stay F32.
    tokenizer_from: a GGUF whose tokenizer metadata (vocabulary, merges, pre-tokenizer, token types, special ids,
      chat template: every `tokenizer.*` key) is copied, e.g. the real SmolLM2 file; the vocabulary size follows
      it. None: a small synthetic byte-level BPE with ChatML control tokens (262 + 6 merges = 265 tokens).
    seed: the weights (`tiny_weights(tiny_spec(arch, **model), vocab_size, seed)` gives them back in HF layout).
    metadata: keys to add or override (e.g. {"tokenizer.ggml.pre": "x"}); extra_tensors: {GGUF name: float32
      array} written as F32 besides the model's. **model: tiny_spec's hyperparameters.
    """
    import gguf
    spec = tiny_spec(arch, **model)
    fields = _tokenizer_fields(tokenizer_from) if tokenizer_from else None
    tokens = fields["tokenizer.ggml.tokens"][0] if fields else _synthetic_tokenizer()["tokenizer.ggml.tokens"]
    weights = tiny_weights(spec, len(tokens), seed)
    metadata = dict(metadata or {})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(spec["num_layers"])
    w.add_context_length(spec["context_length"])
    w.add_embedding_length(spec["hidden_size"])
    w.add_feed_forward_length(spec["intermediate_size"])
    w.add_head_count(spec["num_heads"])
    w.add_head_count_kv(spec["num_kv_heads"])
    w.add_key_length(spec["head_dim"])
    w.add_value_length(spec["head_dim"])
    w.add_rope_dimension_count(spec["head_dim"])
    w.add_rope_freq_base(spec["rope_theta"])
    w.add_layer_norm_rms_eps(spec["rms_norm_eps"])
    w.add_vocab_size(len(tokens))
    if fields:
        for key, (value, kind, sub) in fields.items():
            if key not in metadata:
                w.add_key_value(key, value, kind, sub)
    else:
        metadata = {**_synthetic_tokenizer(), **metadata}
    for key, value in metadata.items():
        _put(w, key, value)
    for name, t in weights.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            t = llamacpp_permute(t, spec["num_heads"] if ".q_proj." in name else spec["num_kv_heads"])
        data, raw = _encode(t, quant)
        w.add_tensor(gguf_name(name), data, raw_dtype=raw)
    if spec["rope_scaling"]:
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(spec))
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
