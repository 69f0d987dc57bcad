"""Benchmark: lossless SBD (verify mode) next to AR on this machine, tokens/s from the batch runner
(compilation apart), greedy; the policy's call costs are the cost model's (printed).

    .venv/bin/python bench/bench_adaptive.py --demo results        # the demo's models (make demo's out_dir)
    .venv/bin/python bench/bench_adaptive.py --skip-demo           # the random model only

  1. A random model (the demo's shape) whose drafts fail: AR vs verify never drafting (`draft_policy="never"`: the
     same forwards as AR, so what verify mode's own loop costs) vs verify (adaptive policy, the default) vs verify
     with every call 2k-wide (`draft_policy="always"`) at batch 1 and 64; 64 new tokens, EOS ignored.
  2. The demo's SBD fine-tune on its held-out problems: its own AR (what verify reproduces), verify adaptive and
     every call at one draft width (always = k, w8 = k/2, w4 = k/4 at k = 16: the fixed choices the policy picks
     among), at --demo-batches (default 1 and 100);
     also the NTP fine-tune's AR (the demo's baseline).
  3. Continuous batching (16 and 100 slots) on the same problems: verify adaptive vs AR.
Every decoder is timed `--rounds` times, interleaved; tokens/s from the median round. Tokens are checked equal to
AR's on every row. Writes JSON and a markdown table (bench/results/adaptive_policy_cpu.*).
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

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sbd_jax.decoding import DecodeSpec  # noqa: E402
from bench.calibrate import calibrate  # noqa: E402
from sbd_jax.decoding.modes.verify import costs  # noqa: E402
from sbd_jax.decoding.prompts import Prompt  # noqa: E402
from sbd_jax.decoding.runner import BatchDecoder, DecodeOptions, decode_prompts  # noqa: E402
from sbd_jax.io.hf import from_pretrained  # noqa: E402
from sbd_jax.io.tokenizer import Tokenizer  # noqa: E402
from sbd_jax.models.params import init_params  # noqa: E402

K = 16


def spec_of(kind: str, max_new: int, eos_ids=None) -> DecodeSpec:
    """"ar"; "verify" (adaptive, k = K); "always" (every call 2k-wide); "never" (verify mode's 1-wide AR calls only:
    the same forwards as AR mode); "w<n>" (k = K, every call at draft width n: the fixed choices the adaptive policy
    picks among, forced by stated costs)."""
    if kind == "ar":
        return DecodeSpec(mode="ar", max_new_tokens=max_new, eos_ids=eos_ids)
    spec = DecodeSpec(mode="sbd", verify=True, block_size=K, max_new_tokens=max_new, eos_ids=eos_ids,
                      draft_policy=kind if kind in ("always", "never") else "adaptive")
    if kind.startswith("w"):
        spec = DecodeSpec.make(spec, wide_cost=tuple(1e-3 if w == int(kind[1:]) else 1e9 for w in spec.draft_widths))
    return spec


def timed(decoders: dict, prompts: list[Prompt], rounds: int, log) -> dict:
    """Decode with every decoder `rounds` times, interleaved -> {name: summary with median seconds}."""
    out, secs = {}, {n: [] for n in decoders}
    rows = {}
    for _ in range(rounds):
        for name, dec in decoders.items():
            got = {}
            s = dec.decode(prompts, lambda p, row: got.__setitem__(p.id, row.tokens)).to_json()
            secs[name].append(s["seconds"])
            out[name], rows[name] = s, got
    ar = rows[next(iter(decoders))]
    for name, s in out.items():
        s["seconds"] = statistics.median(secs[name])
        s["tokens_per_s"] = s["tokens"] / s["seconds"]
        s["same_as_first"] = float(np.mean([rows[name][i] == ar[i] for i in ar]))
        log(f"  {name:28s} {s['tokens_per_s']:9.1f} tok/s  tokens/forward {s['tokens_per_forward']:.2f}  "
            f"calls {s['model_calls']}  same {s['same_as_first']:.3f}"
            + (f"  drafts {s['drafts']} agreed {s['drafts_agreed']}" if "drafts" in s else ""))
    return out


COSTS: dict = {}  # batch -> the call costs verify's policy used (the cost model's estimate) and calibrate's


def batch_decoders(params, cfg, kinds, batch, width, max_new, eos_ids=None) -> dict:
    """A decoder per kind; "verify-calibrated": verify with the costs `calibrate` times on this machine, stated."""
    spec = spec_of("verify", max_new, eos_ids)
    if "verify" in kinds:
        COSTS[batch] = {"model": costs.call_costs(params, cfg, spec, batch, width + max_new)}
    if "verify-calibrated" in kinds:
        COSTS[batch]["calibrated"] = calibrate(params, cfg, spec, batch, width + max_new)

    def spec_for(kind):
        if kind == "verify-calibrated":
            return DecodeSpec.make(spec, wide_cost=COSTS[batch]["calibrated"])
        return spec_of(kind, max_new, eos_ids)
    return {kind: BatchDecoder(params, cfg, DecodeOptions(spec=spec_for(kind), batch_size=batch, pad_multiple=width))
            for kind in kinds}


def random_model(args, log) -> list[dict]:
    demo = Path(args.demo) / "ft_sbd" / "hf" if args.demo else None
    cfg = from_pretrained(demo)[0] if demo and demo.exists() else None
    if cfg is None:
        from sbd_jax.models.config import ModelConfig
        cfg = ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                          mask_token_id=1023)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    out = []
    for batch in (1, 64):
        n = max(batch, 8)
        prompts = [Prompt(i, i + 1, tuple(int(t) for t in rng.integers(2, cfg.vocab_size - 2, 24))) for i in range(n)]
        log(f"random model, batch {batch}, {n} prompts x 64 new tokens")
        kinds = ("ar", "never", "verify", "always")
        res = timed(batch_decoders(params, cfg, kinds, batch, 32, 64, eos_ids=()), prompts, args.rounds, log)
        out.append({"section": "random", "batch": batch, **{k: v for k, v in res.items()}})
    return out


def demo_problems(args, n=None):
    d = Path(args.demo)
    tok = Tokenizer.load(d / "data" / "tokenizer")
    problems = [json.loads(line) for line in (d / "data" / "test.jsonl").read_text().splitlines()]
    prompts = [Prompt(i, i + 1, tuple(tok.encode(p["prompt"], add_special_tokens=False)))
               for i, p in enumerate(problems[:n])]
    return prompts, -(-max(len(p.ids) for p in prompts) // 16) * 16


def demo_model(args, log) -> list[dict]:
    cfg, params = from_pretrained(Path(args.demo) / "ft_sbd" / "hf")
    ncfg, nparams = from_pretrained(Path(args.demo) / "ft_ntp" / "hf")
    out = []
    for batch in args.demo_batches:
        n = args.latency_n if batch == 1 else None
        prompts, width = demo_problems(args, n)
        log(f"demo SBD model, batch {batch}, {len(prompts)} problems x {args.max_new} new tokens")
        decs = batch_decoders(params, cfg, ("ar", "verify", "verify-calibrated", "always", "w8", "w4"), batch, width,
                              args.max_new)
        decs["ntp_ar"] = batch_decoders(nparams, ncfg, ("ar",), batch, width, args.max_new)["ar"]
        out.append({"section": "demo", "batch": batch, **timed(decs, prompts, args.rounds, log)})
    return out


def continuous(args, log) -> list[dict]:
    cfg, params = from_pretrained(Path(args.demo) / "ft_sbd" / "hf")
    prompts, width = demo_problems(args)
    out = []
    for slots in (16, 100):
        log(f"continuous batching, {slots} slots, {len(prompts)} problems")
        row = {"section": "continuous", "batch": slots}
        kinds = ("ar", "verify")
        opts = {k: DecodeOptions(spec=spec_of(k, args.max_new), batch_size=slots, pad_multiple=width, continuous=True)
                for k in kinds}
        secs = {k: [] for k in kinds}
        for _ in range(args.rounds):  # interleaved, as `timed`
            for kind in kinds:
                row[kind] = decode_prompts(params, cfg, prompts, opts[kind]).to_json()
                secs[kind].append(row[kind]["seconds"])
        for kind in kinds:
            s = row[kind]
            s["seconds"] = statistics.median(secs[kind])
            s["tokens_per_s"] = s["tokens"] / s["seconds"]
            log(f"  {kind:28s} {s['tokens_per_s']:9.1f} tok/s  tokens/forward {s['tokens_per_forward']:.2f}")
        out.append(row)
    return out


def table(results: list[dict]) -> str:
    lines = ["| section | batch | decoder | tokens/s | vs AR | tokens / forward | drafts agreed / placed | same as AR |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ar = r["ar"]["tokens_per_s"]
        for name, s in r.items():
            if not isinstance(s, dict):
                continue
            drafts = f"{s['drafts_agreed']} / {s['drafts']}" if "drafts" in s else ""
            lines.append(f"| {r['section']} | {r['batch']} | {name} | {s['tokens_per_s']:.1f} | "
                         f"{s['tokens_per_s'] / ar:.2f}x | {s['tokens_per_forward']:.2f} | {drafts} | "
                         f"{s.get('same_as_first', float('nan')):.3f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", default="results", help="the demo's out_dir (ft_sbd, ft_ntp, data)")
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--sections", default="random,demo,continuous", help="which sections to run (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency-n", type=int, default=30)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--demo-batches", default="1,100", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "adaptive_policy_cpu"))
    args = ap.parse_args()
    t0 = time.time()
    sections = set(args.sections.split(",")) - ({"demo", "continuous"} if args.skip_demo else set())
    results = [r for name, run in (("random", random_model), ("demo", demo_model), ("continuous", continuous))
               if name in sections for r in run(args, print)]
    used = {f"batch={b}": {k: [round(c, 2) for c in x] for k, x in v.items()} for b, v in COSTS.items()}
    print("the policy's call costs (2w-wide call / 1-wide call, w = 16 / 8 / 4; the cost model's, calibrate's):", used)
    Path(args.out + ".json").write_text(json.dumps({"results": results, "call_costs": used,
                                                    "device": str(jax.devices()[0]), "seconds": time.time() - t0},
                                                   indent=1, default=float))
    Path(args.out + ".md").write_text(table(results) + "\n\nthe policy's call costs (the cost model's; calibrate's): "
                                      + json.dumps(used) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
