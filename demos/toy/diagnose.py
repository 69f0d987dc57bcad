"""`python -m demos.toy.diagnose [RESULTS_DIR] [--n N] [mode:block:gamma:rule ...]`: where the SBD model
of a finished demo run loses accuracy, decoded several ways on the first N held-out problems (greedy).

The default decodings separate a weak MATP stream (`ar:1:0:eb`, AR on the NTP logits, vs `sbd:1:0:eb`, the
copy-stream logits one position at a time), the cost of decoding in entropy order (`sbd:16:0:eb`, one
lowest-entropy position per step) and the cost of accepting several positions per step (the EB and threshold
rules at their gammas). For each: accuracy, tokens per forward, per-family accuracy, and where the wrong
answers first leave the worked solution (`first_error_kind`)."""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np

DEFAULT_SPECS = ("ar:1:0:eb", "sbd:1:0:eb", "sbd:16:0:eb", "sbd:16:0.1:eb", "sbd:16:0.1:threshold",
                 "sbd:16:0.35:threshold")


def parse_spec(spec: str) -> tuple[str, int, float, str]:
    try:
        mode, k, gamma, rule = spec.split(":")
        return mode, int(k), float(gamma), rule
    except ValueError:
        raise SystemExit(f"bad decoding spec {spec!r}: expected mode:block:gamma:rule, e.g. sbd:16:0.1:eb") from None


ERROR_KINDS = ("computed value", "copied number", "final answer", "structure", "stopped early", "ran on")


def first_error_kind(got: list[int], gold: list[int], tokens: list[str]) -> str:
    """Where the decoded ids `got` first differ from the worked solution's ids `gold` (EOS excluded from
    both); `tokens` are the solution's token strings. One of ERROR_KINDS."""
    j = next((i for i, (a, b) in enumerate(zip(got, gold)) if a != b), None)
    if j is None:
        return "stopped early" if len(got) < len(gold) else "ran on"
    eqs = [i for i, t in enumerate(tokens) if t.strip() == "="]
    if j > (eqs[-1] if eqs else len(tokens)):
        return "final answer"
    if j > 0 and tokens[j - 1].strip() == "=":
        return "computed value"
    return "copied number" if tokens[j].strip().isdigit() else "structure"


def error_breakdown(tok, outputs: list[list[int]], problems: list[dict], correct: list[bool], eos_ids) -> dict[str, int]:
    """Counts of `first_error_kind` over the rows whose answer is wrong."""
    counts = collections.Counter({kind: 0 for kind in ERROR_KINDS})
    for out, p, ok in zip(outputs, problems, correct):
        if ok:
            continue
        gold = tok.encode(p["response"], add_special_tokens=False)
        got = [t for t in out if t not in eos_ids]
        counts[first_error_kind(got, gold, [tok.decode([t]) for t in gold])] += 1
    return dict(counts)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m demos.toy.diagnose", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", default="results", help="a finished demo's output directory")
    ap.add_argument("specs", nargs="*", help=f"decodings (default: {' '.join(DEFAULT_SPECS)})")
    ap.add_argument("--n", type=int, default=300, help="held-out problems to decode (default 300)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_intermixed_args(argv)
    specs = [parse_spec(s) for s in (args.specs or DEFAULT_SPECS)]
    root = Path(args.results)
    model_dir, test_file = root / "ft_sbd" / "hf", root / "data" / "test.jsonl"
    for f in (model_dir / "config.json", test_file, root / "data" / "tokenizer" / "tokenizer.json"):
        if not f.exists():
            raise SystemExit(f"{f} does not exist: run the demo first (make demo) or pass its output directory")

    from sbd_jax.io.hf import from_pretrained
    from sbd_jax.io.tokenizer import Tokenizer
    from .evaluation import batch_decoder, decode_all, per_family, problem_prompts, score, suite_width
    tok = Tokenizer.load(root / "data" / "tokenizer")
    problems = [json.loads(line) for line in test_file.read_text().splitlines()][: args.n]
    cfg, params = from_pretrained(model_dir)
    prompts = problem_prompts(tok, problems)
    for (mode, k, gamma, rule), name in zip(specs, args.specs or DEFAULT_SPECS):
        dec = batch_decoder(params, cfg, mode=mode, block_size=k, gamma=gamma, rule=rule,
                            max_new_tokens=args.max_new_tokens, batch_size=len(prompts), prompt_width=suite_width(prompts))
        rows, summary = decode_all(dec, prompts)
        outputs = [r.tokens for r in rows]
        ok = score(tok, outputs, problems)
        errs = error_breakdown(tok, outputs, problems, ok, set(cfg.eos_ids))
        print(f"{name:24s} accuracy {100 * np.mean(ok):5.1f}%  tokens/forward {summary.tokens_per_forward:5.2f}  " +
              "  ".join(f"{f} {100 * v:.0f}%" for f, v in per_family(ok, problems).items()), flush=True)
        print(f"{'':24s} first wrong token of the {sum(errs.values())} wrong answers: " +
              ", ".join(f"{kind} {n}" for kind, n in errs.items()), flush=True)


if __name__ == "__main__":
    main()
