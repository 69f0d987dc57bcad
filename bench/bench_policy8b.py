"""Lossless SBD (verify mode, the default adaptive drafting policy) and the lossy SBD rule next to AR, on
Llama-3.1-8B shapes with random bf16 weights, through the batch runner (`BatchDecoder`), at several slot counts.

    python3 bench/bench_policy8b.py                          # slots 1,16,64: longer than one device call ("Budget")
    python3 bench/bench_policy8b.py --slots 1 --out $OUT/policy8b_s1.md        # one slot count per call
    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_policy8b.py --tiny --out /tmp/p8b.md    # CPU dry run (~40 s)

Random weights never make a draft that agrees with AR's token, so verify mode is measured on two models of the
same shapes and the same compiled program (the weights are an argument of the program, not part of it):
  * "random": the random model. Drafts fail; the policy should back off to AR calls: the goal there is
    tokens/s >= AR's at every slot count (its floor).
  * "agree": the same weights with the final RMSNorm's scale set to zero. Every layer still runs on random
    weights (the same matmuls, attention and cache traffic per call), but the logits are exactly 0, so greedy AR
    and every draft take token 0 (the first index of the maximum; the mask id is not 0): every draft agrees and
    verify can make up to a block of k tokens per wide call (its ceiling). Its tokens are checked to be AR's on
    that model (all 0), its drafts to have all stood.
There is no test hook or spec option that forces verify's drafts to agree (DecodeSpec's draft_policy only forces
the call kind, wide_cost the policy's costs); this zero-norm model is the forcing. The lossy rule ("sbd") runs on
the random model with EB gammas that force --tpf tokens per forward, as bench/bench_decode.py does (entropies
~ log V everywhere: gamma = log V (t - 1) + 1, whole blocks at t >= k).

Every prompt is --prompt tokens (random ids), --new tokens are generated with EOS ignored, greedy; one batch of
`slots` prompts per round. Each round runs every decoder once (interleaved), --rounds rounds; tokens/s from the
median round's seconds (the runner's decoding time: prefill included, compilation apart). Verify starts each run
with no draft memory (a fresh `decode_prompts` call's cold start). Its call costs are the cost model's
(modes/verify/costs.py) unless --wide-cost states them; with --calibrate, `calibrate` also times the same steps
once per slot count (apart from the rounds; 4 more programs to compile) and both are recorded, which is how the
cost model is checked on this device.

Compiled programs per slot count: AR, verify (random and agree share it), SBD (all --tpf share it: gamma is an
argument), and with --calibrate its four (an AR-step loop and one verify-step loop per draft width);
plus once per process init_params and unstack_layers' small slicing programs. (ar-agree, a check that AR on the
agreeing model gives token 0 everywhere at AR's speed, shares AR's program.)

Budget (an estimate, not measured: no GPU here): compiling an 8B program with per-layer weights takes ~23 s for
`generate` AR and ~37 s for SBD on the H100 (BENCHMARKS.md, "8B decoding on an H100"), about in proportion to the program's size.
At 8 layers (XLA:CPU's optimized HLO, lines) AR is 12k, SBD 19k, verify 64k, the cost measurement 5k + 31k: per
slot count ~11 AR-sized programs, ~250 s of compiling, of which verify + its measurement ~190 s. The full default
run (3 slot counts) is therefore ~13-16 min (compile ~750 s, the cost measurement's runs ~60 s, decoding ~110 s):
more than one 600 s device call. Run one slot count per call (--slots; a stage's finished slot counts are kept),
drop decoders (--decoders), or state the costs (--wide-cost, -68 s per slot count); --cache-dir lets a rerun on
the same machine skip what was compiled.

Output: --out (markdown, default $OUT/policy8b.md if $OUT is set, else bench/results/policy8b.md) and its JSON
twin (.json); a slot count's rows are appended as its rounds finish.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from shapes import SHAPES, describe  # noqa: E402

from sbd_jax.decoding import DecodeSpec  # noqa: E402
from bench.calibrate import calibrate  # noqa: E402
from sbd_jax.decoding.modes.verify import costs  # noqa: E402
from sbd_jax.decoding.checks import check_model  # noqa: E402
from sbd_jax.decoding.prompts import Prompt  # noqa: E402
from sbd_jax.decoding.runner import BatchDecoder, DecodeOptions, check_prompts  # noqa: E402
from sbd_jax.models import init_params, unstack_layers  # noqa: E402
from sbd_jax.models.quant import quantize_params  # noqa: E402
from sbd_jax.runtime import use_decode_xla_flags  # noqa: E402

DECODERS = ("ar", "verify", "verify-agree", "sbd", "ar-agree")  # ar-agree: AR on the agreeing model (a check)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--slots", default=None, help="batch sizes, comma list (default 1,16,64; --tiny: 1,2)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1024; --tiny: 32)")
    ap.add_argument("--new", type=int, default=None, help="new tokens per row (default 128; --tiny: 16)")
    ap.add_argument("--block", type=int, default=16, help="SBD block size k")
    ap.add_argument("--tpf", default="4,16", help="lossy SBD: tokens per forward to force (comma list)")
    ap.add_argument("--decoders", default="ar,verify,verify-agree,sbd", help=f"comma list of {DECODERS}")
    ap.add_argument("--wide-cost", default=None,
                    help="verify: state DecodeSpec.wide_cost instead of measuring it (the library's default): one "
                         "number, or per slot count '1=1.2,16=2.1,64=3' (slot counts not named: the cost model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calibrate", action="store_true",
                    help="also time verify's call costs (`calibrate`) per slot count, next to the cost model's")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "pallas"],
                    help="attention_impl (auto: Pallas on GPU/TPU, XLA on CPU)")
    ap.add_argument("--cache-dir", default=None,
                    help="JAX persistent compilation cache (a rerun on the same machine skips compiling)")
    ap.add_argument("--quantize", default=None, help="weight scheme of the projections (int8, fp8, int4; "
                    "sbd_jax/models/quant.py): the weights quantized after init")
    ap.add_argument("--kv-cache-dtype", default=None, choices=["int8"], help="the KV cache in int8")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run of the same code path)")
    ap.add_argument("--out", default=None, help="markdown file (default $OUT/policy8b.md, else bench/results/)")
    a = ap.parse_args(argv)
    a.slots = [int(s) for s in (a.slots or ("1,2" if a.tiny else "1,16,64")).split(",")]
    a.prompt = a.prompt or (32 if a.tiny else 1024)
    a.new = a.new or (16 if a.tiny else 128)
    a.decoders = a.decoders.split(",")
    wc = a.wide_cost or ""
    a.wide_cost = ({s: float(wc) for s in a.slots} if wc and "=" not in wc else
                   {int(k): float(v) for k, v in (kv.split("=") for kv in wc.split(",") if kv)})
    bad = sorted(set(a.decoders) - set(DECODERS))
    if bad:
        ap.error(f"unknown decoder(s) {bad}; choose from {DECODERS}")
    return a


def model_config(a):
    cfg = SHAPES[a.shape]
    if a.tiny:
        cfg = dataclasses.replace(cfg, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=256, mask_token_id=255)
    return dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16", attention_impl=a.attention,
                               max_position_embeddings=max(cfg.max_position_embeddings, a.prompt + a.new))


def agreeing(params: dict) -> dict:
    """The same weights with the final norm's scale zero: logits exactly 0 at every position (greedy: token 0)."""
    return {**params, "final_norm": jnp.zeros_like(params["final_norm"])}


def make_prompts(cfg, n: int, length: int, seed: int = 0) -> list[Prompt]:
    """n random prompts of `length` ids, none of them the mask id."""
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size - 1, (n, length))
    ids = np.where(ids >= cfg.mask_token_id, ids + 1, ids)
    return [Prompt(i, i + 1, tuple(int(t) for t in row)) for i, row in enumerate(ids)]


def gamma_for(tpf: int, k: int, vocab: int) -> float:
    """bench_decode's EB gamma forcing `tpf` tokens per forward on near-uniform entropies (~log V)."""
    return 0.0 if tpf <= 1 else 1e9 if tpf >= k else round(math.log(vocab) * (tpf - 1) + 1, 1)


@dataclasses.dataclass
class Variant:
    """A row of the table: a decoder (shared compiled program) run with these weights and gamma."""

    name: str
    weights: str  # "random" | "agree"
    dec: BatchDecoder
    params: dict
    gamma: float = 0.0
    secs: list = dataclasses.field(default_factory=list)
    summary: dict | None = None
    tokens: dict | None = None

    def run(self, prompts: list[Prompt]) -> None:
        d = self.dec  # one BatchDecoder per spec: its compiled program serves every variant of the spec
        d.params, d.opts, d.draft_memory = self.params, dataclasses.replace(d.opts, gamma=self.gamma), None
        got = {}
        s = d.decode(prompts, lambda p, row: got.__setitem__(p.id, row.tokens)).to_json()
        self.secs.append(s["seconds"])
        self.summary, self.tokens = s, got


def variants(params, agree, cfg, a, slots: int) -> list[Variant]:
    k, N = a.block, a.new
    kv = a.kv_cache_dtype
    specs = {"ar": DecodeSpec(mode="ar", max_new_tokens=N, eos_ids=(), kv_cache_dtype=kv),
             "verify": verify_spec(a, slots),
             "sbd": DecodeSpec(mode="sbd", block_size=k, max_new_tokens=N, eos_ids=(), kv_cache_dtype=kv)}
    decs = {}

    def dec(kind):
        if kind not in decs:
            check_model(cfg, specs[kind])
            decs[kind] = BatchDecoder(params, cfg, DecodeOptions(spec=specs[kind], batch_size=slots))
        return decs[kind]

    out = []
    for name in a.decoders:
        if name == "sbd":
            out += [Variant(f"sbd tpf={t}", "random", dec("sbd"), params, gamma_for(t, k, cfg.vocab_size))
                    for t in map(int, a.tpf.split(","))]
        else:
            kind, _, w = name.partition("-")
            out.append(Variant(name, w or "random", dec(kind), agree if w else params))
    return out


def verify_spec(a, slots: int) -> DecodeSpec:
    """Verify mode, the default adaptive policy; wide_cost the cost model's unless --wide-cost states it for
    `slots`."""
    return DecodeSpec(mode="sbd", verify=True, block_size=a.block, max_new_tokens=a.new, eos_ids=(),
                      wide_cost=a.wide_cost.get(slots), kv_cache_dtype=a.kv_cache_dtype)


def measure_costs(params, cfg, a, slots: int) -> dict | None:
    """The policy's call costs at this slot count (what verify's programs use: stated, else the cost model's
    estimate) next to `calibrate`'s timing of the same steps (what validates the cost model on this device)."""
    if "verify" not in {n.split("-")[0] for n in a.decoders}:
        return None
    spec = verify_spec(a, slots)
    t = time.perf_counter()
    timed = calibrate(params, cfg, spec, slots, a.prompt + a.new) if a.calibrate else None
    return {"widths": list(spec.draft_widths),
            "costs": [round(float(x), 3) for x in costs.call_costs(params, cfg, spec, slots, a.prompt + a.new)],
            "stated": spec.wide_cost is not None, "calibrated": timed and list(timed),
            "calibrate_seconds": round(time.perf_counter() - t, 2)}


def finish(vs: list[Variant], slots: int, a) -> list[dict]:
    """The rows of one slot count: medians, ratios to AR, and the checks (verify == AR's tokens)."""
    ar = next((v for v in vs if v.name == "ar"), None)
    ar_tps = None if ar is None else ar.summary["tokens"] / statistics.median(ar.secs)
    rows = []
    for v in vs:
        s, secs = v.summary, statistics.median(v.secs)
        tps = s["tokens"] / secs
        if v.name.startswith("verify") or v.name.startswith("ar-"):
            if v.weights == "random":
                want = None if ar is None else ar.tokens
            else:  # the agreeing model's AR output: token 0 everywhere (argmax of all-zero logits)
                want = {i: [0] * len(t) for i, t in v.tokens.items()}
            same = None if want is None else float(np.mean([v.tokens[i] == want[i] for i in want]))
        else:
            same = None  # lossy: not meant to equal AR
        rows.append({
            "slots": slots, "decoder": v.name, "weights": v.weights, "gamma": v.gamma if v.name.startswith("sbd") else None,
            "tokens": s["tokens"], "seconds_median": secs, "seconds_rounds": [round(x, 4) for x in v.secs],
            "tokens_per_s": tps, "vs_ar": None if ar_tps is None else tps / ar_tps,
            "tokens_per_forward": s["tokens_per_forward"], "model_calls": s["model_calls"],
            "ms_per_call": 1e3 * secs / max(s["model_calls"], 1),
            "weights_gb_s": a.weight_bytes / (secs / max(s["model_calls"], 1)) / 1e9,
            "drafts": s.get("drafts"), "drafts_agreed": s.get("drafts_agreed"), "same_as_ar": same,
            "accepted_per_forward": s["accepted_per_forward"], "compile_s": v.dec.compile_s,
            "draft_memory": s.get("draft_memory")})
    return rows


def md_row(r: dict) -> str:
    drafts = "" if r["drafts"] is None else f"{r['drafts_agreed']} / {r['drafts']}"
    same = "" if r["same_as_ar"] is None else f"{100 * r['same_as_ar']:.0f}%"
    vs = "" if r["vs_ar"] is None else f"{r['vs_ar']:.2f}x"
    name = r["decoder"] + ("" if r["gamma"] is None else f" (gamma {r['gamma']:g})")
    return (f"| {r['slots']} | {name} | {r['weights']} | {r['tokens_per_s']:.0f} | {vs} | "
            f"{r['tokens_per_forward']:.2f} | {r['model_calls']} | {r['ms_per_call']:.2f} | {r['weights_gb_s']:.0f} | "
            f"{drafts} | {same} | "
            f"{' / '.join(f'{x:.3f}' for x in r['seconds_rounds'])} | {r['compile_s']:.1f} |")


def main(argv=None) -> int:
    use_decode_xla_flags()  # what decode.py runs with (CUDA graphs for the loop); before jax creates its backend
    a = parse(argv)
    if a.cache_dir:
        jax.config.update("jax_compilation_cache_dir", a.cache_dir)
    t_start = time.perf_counter()
    cfg = model_config(a)
    t = time.perf_counter()
    params = jax.jit(lambda key: init_params(cfg, key))(jax.random.key(0))
    if a.quantize:
        params = quantize_params(params, cfg, a.quantize, delete=True)
    params = unstack_layers(params, delete=True)
    agree = agreeing(params)
    jax.block_until_ready((params, agree))
    init_s = time.perf_counter() - t
    dev = jax.devices()[0]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    weight_bytes = a.weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    out = Path(a.out or (Path(os.environ["OUT"]) / "policy8b.md" if os.environ.get("OUT") else
                         Path(__file__).resolve().parent / "results" / "policy8b.md"))
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python bench/bench_policy8b.py " + " ".join(sys.argv[1:] if argv is None else argv)
    k = a.block
    header = [
        "# Lossless SBD (verify, adaptive policy) and lossy SBD next to AR, batch runner", "",
        f"Command: `{cmd.strip()}`  ",
        f"Date: {datetime.date.today()}; device: {dev.platform} ({dev.device_kind}); jax {jax.__version__}; "
        f"XLA_FLAGS `{os.environ.get('XLA_FLAGS', '')}`  ",
        f"Model: {a.shape}{' (tiny)' if a.tiny else ''}, random weights, {describe(cfg, n_params)}; per-layer "
        f"weights (init + unstack {init_s:.1f} s); projections {a.quantize or 'bf16'}, KV cache "
        f"{a.kv_cache_dtype or 'bf16'}: {weight_bytes / 2**30:.2f} GiB of weights (achieved bandwidth: these bytes "
        "per model call / ms per call, a lower bound)  ",
        f"Prompts: {a.prompt} random ids each, one batch of `slots` prompts; {a.new} new tokens, EOS ignored, "
        f"greedy; block k={k}; verify: draft widths {DecodeSpec(block_size=k).draft_widths}, wide_cost "
        f"{'stated ' + str(a.wide_cost) + ', else ' if a.wide_cost else ''}the cost model's (costs.py; calibrate's "
        "timing of the same steps recorded beside it), each run from no "
        "draft memory.  ",
        f"tokens/s: the median of {a.rounds} interleaved rounds (decoding seconds incl. the prefill, compilation "
        "apart). weights \"agree\": the random weights with the final norm's scale 0 (logits 0: every draft agrees "
        "with AR's token 0; same per-call compute); \"same as AR\": rows whose tokens equal AR's on that model "
        "(random: the AR row's; agree: all token 0). sbd: the lossy EB rule, gamma forcing tpf tokens/forward on "
        "random weights (speed mechanics, not quality). ms/call: decoding seconds / model calls (prefill included).",
        "", "| slots | decoder | weights | tokens/s | vs AR | tokens / forward | model calls | ms / call | weights GB/s | "
        "drafts agreed / placed | same as AR | seconds per round | compile s (spec's program) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    out.write_text("\n".join(header) + "\n")
    print("\n".join(header), flush=True)
    record = {"command": cmd.strip(), "device": dev.device_kind, "platform": dev.platform, "shape": a.shape,
              "tiny": a.tiny, "prompt": a.prompt, "new": a.new, "block": k, "rounds": a.rounds,
              "init_s": init_s, "costs": {}, "rows": []}
    costs_lines = []
    for slots in a.slots:
        prompts = make_prompts(cfg, slots, a.prompt)
        vs = variants(params, agree, cfg, a, slots)
        for v in vs:
            check_prompts(cfg, v.dec.opts, prompts)
        c = measure_costs(params, cfg, a, slots)
        if c is not None:
            record["costs"][str(slots)] = c
            costs_lines.append(f"slots {slots}: widths {c['widths']} cost {c['costs']} (1-wide calls; "
                               f"{'stated' if c['stated'] else 'estimated'}; calibrate timed {c['calibrated']} "
                               f"in {c['calibrate_seconds']} s)")
            print(f"[slots {slots}] call costs: {costs_lines[-1]}", flush=True)
        for r in range(a.rounds):
            for v in vs:
                v.run(prompts)
                s = v.summary
                print(f"[slots {slots} round {r + 1}] {v.name:16s} {v.weights:6s} {s['seconds']:.3f} s "
                      f"{s['tokens'] / s['seconds']:9.1f} tok/s  calls {s['model_calls']}  "
                      f"tokens/forward {s['tokens_per_forward']:.2f}"
                      + (f"  drafts {s['drafts_agreed']}/{s['drafts']}" if "drafts" in s else "")
                      + (f"  (compiled in {v.dec.compile_s:.1f} s)" if r == 0 else ""), flush=True)
        rows = finish(vs, slots, a)
        record["rows"] += rows
        with out.open("a") as f:
            f.write("".join(md_row(r) + "\n" for r in rows))
        out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=float))
        print("\n".join(md_row(r) for r in rows), flush=True)
    record["total_s"] = time.perf_counter() - t_start
    with out.open("a") as f:
        f.write("\n" + "".join(f"Call costs, {line}  \n" for line in costs_lines)
                + f"Total wall time {record['total_s']:.0f} s.\n")
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=float))
    bad = [r for r in record["rows"] if r["same_as_ar"] is not None and r["same_as_ar"] < 1.0]
    bad += [r for r in record["rows"] if r["weights"] == "agree" and r["drafts"] and r["drafts_agreed"] != r["drafts"]]
    for r in bad:
        print(f"CHECK FAILED: slots {r['slots']} {r['decoder']} ({r['weights']}): same as AR {r['same_as_ar']}, "
              f"drafts {r['drafts_agreed']} / {r['drafts']}")
    print(f"written to {out} and {out.with_suffix('.json')} in {record['total_s']:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
