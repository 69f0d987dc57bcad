"""Benchmark: verify mode's cost model (sbd_jax/decoding/modes/verify/costs.py) against `calibrate`'s timing of the
same loop steps on this device, over model shapes and batch sizes; with --fit, the backend constants (`Machine`)
that fit these timings best (least squares on log cost ratios and log AR-step seconds).

    .venv/bin/python bench/bench_costs.py [--fit] [--out bench/results/costs_cpu]

Random weights (timing needs no trained ones), greedy, block 16 (draft widths 16 / 8 / 4 / 2), a cache of 128 slots
(80-token prompts + 48 new, rows mid-way). Writes a markdown table and JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sbd_jax.models.config import ModelConfig  # noqa: E402
from sbd_jax.decoding import DecodeSpec  # noqa: E402
from bench import calibrate as calibration  # noqa: E402
from sbd_jax.decoding.modes.verify import costs  # noqa: E402
from sbd_jax.models.params import init_params  # noqa: E402

# (name, hidden, layers, intermediate, vocab, batches)
SHAPES = [("demo", 128, 4, 384, 192, (1, 16, 64)), ("tiny-1k", 128, 4, 384, 1024, (1, 16, 64)),
          ("small", 256, 4, 768, 2048, (1, 16)), ("medium", 512, 8, 1536, 4096, (1, 4)),
          ("smollm2-135m", 576, 30, 1536, 49153, (1, 4))]  # the real model's shape (heads: 18 of 32 for its 9 of 64)
CACHE, NEW = 128, 48


def config(hidden, layers, inter, vocab) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=hidden // 32, num_key_value_heads=max(hidden // 64, 1),
                       max_position_embeddings=512, mask_token_id=vocab - 1)


def measure(log) -> list[dict]:
    rows = []
    spec = DecodeSpec(mode="sbd", verify=True, block_size=16, max_new_tokens=NEW)
    for name, hidden, layers, inter, vocab, batches in SHAPES:
        cfg = config(hidden, layers, inter, vocab)
        params = init_params(cfg, jax.random.key(0))
        for b in batches:
            t = time.perf_counter()
            secs = calibration.step_seconds(params, cfg, spec, b, CACHE)
            rows.append({"shape": name, "cfg": cfg, "params": params, "batch": b, "ar_seconds": secs[0],
                         "timed": [s / secs[0] for s in secs[1:]]})
            log(f"{name} batch {b}: AR step {1e6 * secs[0]:.0f} us, timed {np.round(rows[-1]['timed'], 2)} "
                f"({time.perf_counter() - t:.0f} s)")
    return rows


def predicted(m: costs.Machine, r: dict, spec: DecodeSpec):
    """(AR-step seconds, per-width ratios) of the cost model with constants `m`."""
    return (costs.step_model(r["params"], r["cfg"], r["batch"], CACHE, m)(1),
            costs.estimate(r["params"], r["cfg"], spec, r["batch"], CACHE, machine=m))


def error(m, rows, spec) -> float:
    err = 0.0
    for r in rows:
        one, ratios = predicted(m, r, spec)
        err += np.sum(np.log(np.asarray(ratios) / np.asarray(r["timed"])) ** 2) + np.log(one / r["ar_seconds"]) ** 2
    return float(err)


def fit(rows, spec, log) -> costs.Machine:
    """Coordinate search in log space over the constants (f32 weights: the flops entry for itemsize 4)."""
    m = costs.MACHINES["cpu"]
    x = {"call_s": max(m.call_s, 1e-6), "layer_s": max(m.layer_s, 1e-6), "wide_s": m.wide_s, "flops": m.flops[4],
         "bandwidth": m.bandwidth, "row_layer_s": max(m.row_layer_s, 1e-7), "wide_row_s": max(m.wide_row_s, 1e-7)}

    def make(x):
        return costs.Machine(call_s=x["call_s"], layer_s=x["layer_s"], wide_s=x["wide_s"],
                             flops={2: x["flops"] / 2, 4: x["flops"]}, bandwidth=x["bandwidth"], overlap=m.overlap,
                             row_layer_s=x["row_layer_s"], wide_row_s=x["wide_row_s"])
    best = error(make(x), rows, spec)
    for step in (2.0, 1.4, 1.15, 1.05):
        improved = True
        while improved:
            improved = False
            for k in x:
                for f in (step, 1 / step):
                    y = dict(x, **{k: x[k] * f})
                    e = error(make(y), rows, spec)
                    if e < best:
                        x, best, improved = y, e, True
        log(f"step {step}: error {best:.4f} {x}")
    return make(x)


def table(rows, spec, m: costs.Machine) -> str:
    ws = " / ".join(map(str, spec.draft_widths))
    lines = [f"| shape | batch | AR step us (timed / model) | timed w={ws} | model w={ws} | worst ratio error |",
             "|---|---:|---:|---|---|---:|"]
    for r in rows:
        one, ratios = predicted(m, r, spec)
        worst = max(abs(a / b - 1) for a, b in zip(ratios, r["timed"]))
        lines.append(f"| {r['shape']} | {r['batch']} | {1e6 * r['ar_seconds']:.0f} / {1e6 * one:.0f} | "
                     f"{' / '.join(f'{c:.2f}' for c in r['timed'])} | {' / '.join(f'{c:.2f}' for c in ratios)} | "
                     f"{100 * worst:.0f}% |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="fit the backend's constants to these timings")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"costs_{jax.default_backend()}"))
    args = ap.parse_args()
    spec = DecodeSpec(mode="sbd", verify=True, block_size=16, max_new_tokens=NEW)
    rows = measure(print)
    m = costs.MACHINES[jax.default_backend()]
    out = {"device": str(jax.devices()[0]), "machine": dataclasses.asdict(m), "table": table(rows, spec, m)}
    text = f"cost model as committed ({m}):\n\n{out['table']}\n"
    if args.fit:
        fitted = fit(rows, spec, print)
        out.update(fitted=dataclasses.asdict(fitted), fitted_table=table(rows, spec, fitted))
        text += f"\nfitted ({fitted}):\n\n{out['fitted_table']}\n"
    out["rows"] = [{k: v for k, v in r.items() if k not in ("cfg", "params")} for r in rows]
    Path(args.out + ".json").write_text(json.dumps(out, indent=1, default=str))
    Path(args.out + ".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
