"""Benchmark: AR decoding speed of SmolLM2-135M-Instruct per weight scheme on this CPU, next to llama.cpp on the same
GGUF (the `xllamacpp` wheel: `pip install xllamacpp`, a benchmark-only dependency), and lossless SBD with the
committed SmolLM2 adapter per scheme.

    .venv/bin/python bench/bench_quant_speed.py              # -> bench/results/quant_speed_cpu.{md,json}

Batch 1 and `--batch` rows, a `--prompt`-token prompt (held-out stdlib code), `--new` new tokens, greedy, EOS
ignored; sbd_jax through the batch runner (compilation apart), tokens/s from the median of `--rounds` rounds;
llama.cpp with `--threads` threads (its own timing of the generated tokens, median of the rounds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from demos.real_model import gguf_path, model_dir  # noqa: E402
from sbd_jax.decoding import DecodeSpec  # noqa: E402
from sbd_jax.decoding.prompts import Prompt  # noqa: E402
from sbd_jax.decoding.runner import BatchDecoder, DecodeOptions  # noqa: E402
from sbd_jax.io.hf import from_pretrained  # noqa: E402
from sbd_jax.io.tokenizer import Tokenizer  # noqa: E402

ADAPTER = ROOT / "adapters" / "smollm2-135m-sbd-lora-r16"


def prompt_ids(tok: Tokenizer, n: int, width: int) -> list[list[int]]:
    from demos.real import corpus
    out = []
    for m in corpus.load().heldout:
        ids = tok.encode(m.source, add_special_tokens=False)
        if len(ids) >= width:
            out.append(ids[:width])
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} held-out modules have {width} tokens")


def llama_cpp(gguf: Path, ids: list[int], new: int, threads: int, rounds: int) -> dict:
    import xllamacpp as xl
    p = xl.CommonParams()
    p.model.path = str(gguf)
    p.n_ctx = len(ids) + new + 16
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
    p.n_parallel = 1
    server = xl.Server(p)
    speeds = []
    for _ in range(rounds + 1):  # the first round warms up
        r = server.handle_completions({"prompt": ids, "n_predict": new, "temperature": 0.0, "ignore_eos": True,
                                       "cache_prompt": False})
        r = json.loads(r) if isinstance(r, str) else r
        speeds.append(r["timings"]["predicted_per_second"])
    return {"tokens_per_s": statistics.median(speeds[1:]), "rounds": speeds[1:]}


def sbd_jax_speed(params, cfg, prompts: list[list[int]], spec: DecodeSpec, batch: int, rounds: int) -> dict:
    dec = BatchDecoder(params, cfg, DecodeOptions(spec=spec, batch_size=batch, pad_multiple=16))
    ps = [Prompt(i, i + 1, tuple(p)) for i, p in enumerate(prompts[:batch])]
    dec.decode(ps)  # compiles
    secs, tokens, tpf = [], 0, 0.0
    for _ in range(rounds):
        s = dec.decode(ps).to_json()
        secs.append(s["seconds"])
        tokens, tpf = s["tokens"], s["tokens_per_forward"]
    return {"tokens_per_s": tokens / statistics.median(secs), "tokens_per_forward": tpf,
            "rounds": [tokens / x for x in secs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="float32,bfloat16,int8,fp8,int4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--verify", action="store_true", help="also lossless SBD with the committed adapter, batch 1")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant_speed_cpu"))
    args = ap.parse_args()
    d = model_dir()
    tok = Tokenizer.load(d)
    prompts = prompt_ids(tok, args.batch, args.prompt)
    rows = [{"engine": "llama.cpp (xllamacpp, Q4_1 GGUF)", "batch": 1,
             **llama_cpp(gguf_path(), prompts[0], args.new, args.threads, args.rounds)}]
    print(rows[-1], flush=True)
    ar = DecodeSpec(mode="ar", max_new_tokens=args.new, eos_ids=())
    for name in args.schemes.split(","):
        dtype = name if name in ("float32", "bfloat16") else None
        quantize = None if dtype else name
        t = time.perf_counter()
        cfg, params = from_pretrained(d, param_dtype=dtype, dtype=dtype, quantize=quantize)
        load_s = time.perf_counter() - t
        for batch in (1, args.batch):
            rows.append({"engine": f"sbd_jax AR, {name}", "batch": batch, "load_s": load_s,
                         **sbd_jax_speed(params, cfg, prompts, ar, batch, args.rounds)})
            print(rows[-1], flush=True)
        if args.verify:
            from sbd_jax.io.peft import apply_adapter
            from sbd_jax.models.quant import quantize_params
            cfg_a, p_a = apply_adapter(*from_pretrained(d, param_dtype=dtype, dtype=dtype), ADAPTER, model_dir=d)
            p_a = quantize_params(p_a, cfg_a, quantize) if quantize else p_a
            lossless = DecodeSpec(mode="sbd", verify=True, block_size=16, max_new_tokens=args.new, eos_ids=())
            rows.append({"engine": f"sbd_jax lossless SBD (adapter), {name}", "batch": 1,
                         **sbd_jax_speed(p_a, cfg_a, prompts, lossless, 1, args.rounds)})
            print(rows[-1], flush=True)
    ref = rows[0]["tokens_per_s"]
    lines = [f"{args.prompt}-token prompt, {args.new} new tokens, greedy, EOS ignored; llama.cpp with {args.threads} "
             "threads; tokens/s from the median of the rounds", "",
             "| engine | batch | tokens/s | vs llama.cpp (batch 1) | tokens / forward |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / ref:.2f}x | "
                     f"{r.get('tokens_per_forward', 1.0):.2f} |")
    md = "\n".join(lines) + "\n"
    Path(args.out + ".md").write_text(md)
    Path(args.out + ".json").write_text(json.dumps(rows, indent=1))
    print(md)
    return 0 if np.isfinite(ref) else 1


if __name__ == "__main__":
    main()
