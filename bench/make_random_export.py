"""A random-weight HF export of a named shape (bench/shapes.py) for end-to-end decode.py runs without a
checkpoint, plus a prompts file of random ids:

    python3 bench/make_random_export.py --shape llama3.2-1b --dtype bfloat16 --out /tmp/m --prompts 64
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sbd_jax  # noqa: E402
from shapes import add_model_args, model_config  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", default="16,512", help="prompt lengths drawn uniformly from [lo, hi]")
    ap.add_argument("--max-new", default="16,256", help="per-prompt max_new_tokens drawn uniformly from [lo, hi]")
    a = ap.parse_args(argv)
    cfg = model_config(a, 4096)
    params = jax.jit(lambda k: sbd_jax.init_params(cfg, k))(jax.random.key(0))
    out = Path(a.out)
    sbd_jax.save_pretrained(cfg, params, out)
    rng = np.random.default_rng(0)
    (plo, phi), (nlo, nhi) = (map(int, s.split(",")) for s in (a.prompt_len, a.max_new))
    rows = [{"id": i, "prompt_ids": rng.integers(0, cfg.vocab_size - 1, int(rng.integers(plo, phi + 1))).tolist(),
             "max_new_tokens": int(rng.integers(nlo, nhi + 1))} for i in range(a.prompts)]
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out} ({sum(x.size for x in jax.tree.leaves(params)) / 1e6:.0f}M params) and {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
