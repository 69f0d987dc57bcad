"""HF `transformers` reference, run in the separate test-only venv (.venv-ref: Python 3.11, torch CPU,
transformers). Invoked as a subprocess by tests (see conftest.py `hf_ref`), never imported by sbd_jax.

  python hf_ref.py make     SPEC.json OUT_DIR       random-init HF model from SPEC -> save_pretrained
  python hf_ref.py logits   MODEL_DIR TOKENS.npy OUT.npy [LENGTHS.npy]   float32 logits [B,T,V] (right-padded rows)
  python hf_ref.py generate MODEL_DIR PROMPTS.json MAX_NEW OUT.json     greedy generate per prompt (no EOS stop)
  python hf_ref.py gguf     FILE.gguf SPEC.json OUT_DIR       transformers' own GGUF import of FILE (model and
                            tokenizer): logits, token ids, decodes, chat renders of SPEC's texts; logits of other
                            GGUF files on given token rows (one torch start for every GGUF reference of a test file)
  python hf_ref.py peft     MODEL_DIR ADAPTER_DIR TOKENS.npy OUT.npy [VOCAB]   float32 logits of the base with
                            `PeftModel.from_pretrained(base, ADAPTER_DIR)` (embeddings resized to VOCAB first if given)
  python hf_ref.py serve    the same commands as a server (one per test worker: conftest.py `run_hf`, torch and
                            transformers imported once): reads one JSON request a line on stdin, {"cmd": "make",
                            "args": [...], "cwd": DIR}, and answers each with one JSON line, {"ok": true} or
                            {"ok": false, "error": TRACEBACK}; exits when stdin closes
"""
import gc
import json
import os
import sys
import traceback

import numpy as np
import torch
import transformers


def make(spec_path, out_dir):
    spec = json.load(open(spec_path))
    arch = spec["arch"]
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[arch]
    cfg = cfg_cls(**spec["config"])
    torch.manual_seed(spec.get("seed", 0))
    model = model_cls(cfg)
    std = spec.get("std", 0.02)
    with torch.no_grad():  # larger-than-default random weights give sharper, more discriminating logits
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, std)
    model = model.to(getattr(torch, spec.get("dtype", "float32")))
    model.save_pretrained(out_dir, max_shard_size=spec.get("max_shard_size", "5GB"))


def load(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def logits(model_dir, tokens_path, out_path, lengths_path=None):
    model = load(model_dir)
    toks = torch.from_numpy(np.load(tokens_path).astype(np.int64))
    B, T = toks.shape
    lengths = np.load(lengths_path) if lengths_path else np.full((B,), T)
    mask = torch.from_numpy((np.arange(T)[None] < lengths[:, None]).astype(np.int64))
    with torch.no_grad():
        out = model(input_ids=toks, attention_mask=mask).logits.float().numpy()
    np.save(out_path, out)


def generate(model_dir, prompts_path, max_new, out_path):
    """Greedy; a config's SBD mask token is never generated (suppress_tokens), as sbd_jax's AR never emits it."""
    model = load(model_dir)
    mask = json.load(open(os.path.join(model_dir, "config.json"))).get("mask_token_id")
    results = []
    for prompt in json.load(open(prompts_path)):
        ids = torch.tensor([prompt], dtype=torch.int64)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(max_new),
                                 min_new_tokens=int(max_new), do_sample=False, eos_token_id=None,
                                 pad_token_id=0, suppress_tokens=None if mask is None else [int(mask)])
        results.append(out[0, len(prompt):].tolist())
    json.dump(results, open(out_path, "w"))


def gguf(gguf_path, spec_path, out_dir):
    """transformers' GGUF path (`from_pretrained(dir, gguf_file=...)`) on one file. SPEC: {"texts": [...],
    "logit_texts": [...], "digit_texts": [...], "chats": [messages, ...], "other_files": [FILE.gguf, ...],
    "other_tokens": rows} (all optional). Writes OUT_DIR/other{i}.npy (float32 logits of other_files[i]'s model on
    other_tokens, unpadded), OUT_DIR/logits.npy
    (float32 [B,T,V]: the model on the ids of logit_texts, right-padded with 0 and masked) and OUT_DIR/out.json:
    "logit_ids" (those ids), "ids" (texts, no special tokens added), "decoded" (their decodes), "ids_digits"
    (digit_texts after setting the pre-tokenizer to llama.cpp's SMOLLM one, Digits(individual) + ByteLevel, which
    transformers' GGUF tokenizer lacks), "chat" (apply_chat_template(..., tokenize=False, add_generation_prompt=True)
    of each chat)."""
    import os
    from tokenizers import pre_tokenizers

    spec = json.load(open(spec_path))
    d, name = os.path.split(os.path.abspath(gguf_path))
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    out = {"ids": [tok(t, add_special_tokens=False).input_ids for t in spec.get("texts", [])],
           "chat": [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                    for m in spec.get("chats", [])]}
    out["decoded"] = [tok.decode(ids) for ids in out["ids"]]
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    out["ids_digits"] = [tok(t, add_special_tokens=False).input_ids for t in spec.get("digit_texts", [])]
    if spec.get("logit_texts"):
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
        rows = out["logit_ids"] = [tok(t, add_special_tokens=False).input_ids for t in spec["logit_texts"]]
        lengths = np.array([len(r) for r in rows])
        toks = torch.tensor([r + [0] * (lengths.max() - len(r)) for r in rows], dtype=torch.int64)
        mask = torch.from_numpy((np.arange(toks.shape[1])[None] < lengths[:, None]).astype(np.int64))
        with torch.no_grad():
            np.save(os.path.join(out_dir, "logits.npy"), model(input_ids=toks, attention_mask=mask).logits.float().numpy())
    for i, f in enumerate(spec.get("other_files", [])):
        od, oname = os.path.split(os.path.abspath(f))
        model = transformers.AutoModelForCausalLM.from_pretrained(od, gguf_file=oname, dtype=torch.float32).eval()
        toks = torch.tensor(spec["other_tokens"], dtype=torch.int64)
        with torch.no_grad():
            logits = model(input_ids=toks, attention_mask=torch.ones_like(toks)).logits.float().numpy()
        np.save(os.path.join(out_dir, f"other{i}.npy"), logits)
    json.dump(out, open(os.path.join(out_dir, "out.json"), "w"))


def peft(model_dir, adapter_dir, tokens_path, out_path, vocab=None):
    import peft as peft_lib
    base = load(model_dir)
    if vocab:  # the adapter's run added a token (its rows come from the adapter's trainable_token_indices)
        base.resize_token_embeddings(int(vocab))
    model = peft_lib.PeftModel.from_pretrained(base, adapter_dir).eval()
    toks = torch.from_numpy(np.load(tokens_path).astype(np.int64))
    with torch.no_grad():
        np.save(out_path, model(input_ids=toks, attention_mask=torch.ones_like(toks)).logits.float().numpy())


COMMANDS = {"make": make, "logits": logits, "generate": generate, "gguf": gguf, "peft": peft}


def serve():
    """The request loop of `hf_ref.py serve`. The answers go to a private copy of the original stdout; fd 1 itself
    (Python's prints and any library's C-level writes) goes to stderr, so nothing a command prints can corrupt the
    protocol. Each request runs as in a fresh interpreter as far as the commands can tell: `make` seeds torch
    itself, the others use no randomness, tokenizers and models are loaded anew each call, and torch's process-wide
    switches (default dtype, grad mode) are put back after every request."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    for n, line in enumerate(sys.stdin):
        try:
            req = json.loads(line)
            print(f"--- hf_ref.py serve request {n}:", req["cmd"], *req["args"], file=sys.stderr, flush=True)
            if req.get("cwd"):
                os.chdir(req["cwd"])
            COMMANDS[req["cmd"]](*req["args"])
            answer = {"ok": True}
        except Exception:
            answer = {"ok": False, "error": traceback.format_exc()}
            traceback.print_exc()  # also in the server's stderr, with the library warnings that led to it
        finally:
            torch.set_default_dtype(dtype)
            torch.set_grad_enabled(grad)
            gc.collect()
        sys.stderr.flush()
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    serve() if cmd == "serve" else COMMANDS[cmd](*args)
