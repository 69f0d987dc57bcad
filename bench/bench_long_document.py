"""Benchmark: peak memory of tokenizing one very long training document (one jsonl record of `--mb` MB of words)
into a training store with SmolLM2-135M-Instruct's tokenizer, next to a small file; run each size in its own process
(peak RSS is per process). Long texts are tokenized in pieces (sbd_jax/io/long_text.py); the token count is printed
so that runs with and without piecing can be compared.

    .venv/bin/python bench/bench_long_document.py --mb 20
    .venv/bin/python bench/bench_long_document.py --mb 0     # 100 small records: the baseline
"""
import argparse
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demos.real_model import model_dir  # noqa: E402
from sbd_jax.training.config import DataConfig  # noqa: E402
from sbd_jax.training.data import build_iterator  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=20)
    args = ap.parse_args()
    base = model_dir()
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)] + ["def", "return", "self", "the", "of", "and", "\n", "    "]
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "doc.jsonl"
        if args.mb:
            text = " ".join(rng.choice(words) for _ in range(args.mb * 1_000_000 // 5))[:args.mb * 1_000_000]
            data.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "a small document"}) + "\n")
        else:
            data.write_text("".join(json.dumps({"text": "a small document " * 10}) + "\n" for _ in range(100)))
        t = time.time()
        it = build_iterator(DataConfig(path=str(data), tokenizer=str(base), seq_len=512, store_dir=str(Path(d) / "s")), 4)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"mb": args.mb, "seconds": round(time.time() - t, 1), "peak_rss_mb": round(peak),
                          "tokens": it.report["tokens"]}))


if __name__ == "__main__":
    main()
