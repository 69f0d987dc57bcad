"""Benchmark: the training input pipeline at corpus scale on this machine (synthetic text, a WordLevel
tokenizer from the `tokenizers` package).

    .venv/bin/python bench/bench_data.py --tokens 20e6,200e6

For each corpus size: the one-time `prepare` (tokenize into a fresh store: tokens/s, num_proc = the cores), then
a fresh process that builds the iterator over the existing store for its share of the global batch (one host of
`--hosts`: batch/hosts rows) and packs its first batch (seconds from the call to the batch; its RSS), then the
packing throughput of that process (tokens/s of packed rows) against what an 8B step consumes (the paper's
batch: 2M tokens per step) with every host packing its own rows.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from sbd_jax.training.config import DataConfig
from sbd_jax.training.data import build_iterator
t1 = time.perf_counter()
cfg = DataConfig(**json.loads(sys.argv[1]))
B, hosts = int(sys.argv[2]), int(sys.argv[4])
it = build_iterator(cfg, B, rows=range(B // hosts))  # host 0 of `hosts`
it.next_batch()
t2 = time.perf_counter()
first_rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
n, t = 0, time.perf_counter()
while time.perf_counter() - t < float(sys.argv[3]):
    n += int((it.next_batch().segment > 0).sum())
rate = n / (time.perf_counter() - t)
status = dict(ln.split(":", 1) for ln in open("/proc/self/status").read().splitlines() if ":" in ln)
kb = lambda k: int(status[k].split()[0]) / 1024  # noqa: E731
print("RESULT" + json.dumps({"import_s": t1 - t0, "first_batch_s": t2 - t1, "pack_tokens_per_s": rate,
                             "first_batch_rss_mb": first_rss,
                             "peak_rss_mb": kb("VmHWM"),  # this process's peak (ru_maxrss keeps the parent's)
                             "anon_mb": kb("RssAnon"), "file_mb": kb("RssFile"),
                             "records": it.report["records"], "tokens": it.report["tokens"]}))
"""


def make_corpus(path: Path, tokens: int, vocab: list[str], rng) -> None:
    """JSON lines of {"text"}: documents of 200-1000 words drawn from `vocab` (one token per word)."""
    with path.open("w") as f:
        left = tokens
        while left > 0:
            lens = rng.integers(200, 1001, 1000)
            words = rng.integers(0, len(vocab), int(lens.sum()))
            for piece in np.split(words, np.cumsum(lens)[:-1]):
                f.write(json.dumps({"text": " ".join(vocab[i] for i in piece)}) + "\n")
            left -= int(lens.sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="20e6,200e6")
    ap.add_argument("--dir", default="/tmp/sbd_bench_data")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64, help="rows of the global batch")
    ap.add_argument("--hosts", type=int, default=8, help="processes sharing the batch (the bench runs one of them)")
    ap.add_argument("--pack-seconds", type=float, default=10.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data_cpu.md"))
    a = ap.parse_args(argv)
    from tokenizers import Tokenizer, models, pre_tokenizers
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    vocab = [f"w{i}" for i in range(20000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "</s>"] + vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    rows = []
    for n in (int(float(x)) for x in a.tokens.split(",")):
        corpus = d / f"corpus_{n}.jsonl"
        if not corpus.exists():
            make_corpus(corpus, n, vocab, np.random.default_rng(n))
        data = {"path": str(corpus), "tokenizer": str(d), "seq_len": a.seq_len, "store_dir": str(d / "store"),
                "num_proc": os.cpu_count(), "cache_dir": str(d / "hf_cache")}
        from sbd_jax.training.config import DataConfig
        from sbd_jax.training.store import prepare
        from sbd_jax.io.tokenizer import Tokenizer as SbdTokenizer
        for cached in ("store", "hf_cache"):  # time a fresh tokenization (no store, no datasets cache)
            shutil.rmtree(d / cached, ignore_errors=True)
        t = time.perf_counter()
        store = prepare(DataConfig(**data), SbdTokenizer.load(d))
        prep_s = time.perf_counter() - t
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(data), str(a.batch), str(a.pack_seconds),
                               str(a.hosts)],
                              capture_output=True, text=True, env=env, check=True)
        r = json.loads(proc.stdout.split("RESULT", 1)[1])
        rows.append({"corpus_tokens": store.meta["tokens"], "corpus_mb": corpus.stat().st_size / 2**20,
                     "prepare_s": prep_s, "tokenize_tokens_per_s": store.meta["tokens"] / prep_s, **r})
        print(rows[-1], flush=True)
    step = 2 * 2**20  # tokens an 8B step consumes at the paper's batch
    lines = [f"command: `python bench/bench_data.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             f"machine: {os.cpu_count()} cores; seq_len {a.seq_len}, a global batch of {a.batch} rows over {a.hosts} "
             f"hosts: this process packs {a.batch // a.hosts} rows; synthetic text, 200-1000 one-token words per "
             "document, WordLevel tokenizer", "",
             "| corpus tokens | jsonl MB | prepare s (once) | tokenize tokens/s | start -> first batch s (store present) "
             "| imports s | RSS at first batch MB | peak RSS MB | at the end: anonymous / file-backed MB "
             f"| packing tokens/s (one host) | 8B steps (2M tokens) per second, {a.hosts} hosts packing |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['corpus_tokens'] / 1e6:.0f}M | {r['corpus_mb']:.0f} | {r['prepare_s']:.0f} | "
                     f"{r['tokenize_tokens_per_s'] / 1e6:.2f}M | {r['first_batch_s']:.2f} | {r['import_s']:.1f} | "
                     f"{r['first_batch_rss_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['anon_mb']:.0f} / {r['file_mb']:.0f} | "
                     f"{r['pack_tokens_per_s'] / 1e6:.2f}M | "
                     f"{r['pack_tokens_per_s'] * a.hosts / step:.1f} |")
    Path(a.out).write_text("# bench_data\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
