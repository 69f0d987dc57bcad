"""The real-model demo's evaluation: every decoder completes the held-out stdlib functions and the HumanEval
problems through decode.py's batch runner, timed at `eval_batch` rows and one prompt at a time; completions are
cut where the function ends and scored (sbd_jax.demo_real.metrics)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..decoding.prompts import Prompt
from ..demo.evaluation import Decoder, decode_all, decoder_maker, sbd_decoders, suite_width
from ..io.hf import from_pretrained
from ..io.tokenizer import Tokenizer
from . import metrics, tasks
from .config import RealDemoConfig


def decoders(cfg: RealDemoConfig) -> list[Decoder]:
    """The original model, the NTP fine-tune (the baseline) and the SBD fine-tune AR, then the SBD fine-tune's
    lossless and lossy rows (as in the toy demo)."""
    return [Decoder("original model, AR", "base", "ar"), Decoder("NTP fine-tune, AR (baseline)", "ntp", "ar"),
            Decoder("SBD fine-tune, AR", "sbd", "ar"), *sbd_decoders(cfg)]


def _prompts(records: list[dict], start: int = 0) -> list[Prompt]:
    return [Prompt(r["id"], start + i + 1, tuple(r["prompt_ids"])) for i, r in enumerate(records)]


def _texts(tok: Tokenizer, rows: list[dict]) -> list[str]:
    return [tok.decode(row["tokens"]) for row in rows]


def run_decoder(d: Decoder, params, mcfg, tok: Tokenizer, held: list[dict], humaneval: list[dict],
                cfg: RealDemoConfig) -> dict:
    """Decode every prompt (held-out functions, then HumanEval) at eval_batch rows, the first latency_n held-out
    prompts again one at a time; the metrics of both sets, tokens per forward and tokens/s."""
    prompts = _prompts(held) + _prompts(humaneval, len(held))
    make = decoder_maker(d, params, mcfg, cfg, suite_width(prompts))
    rows, s = decode_all(make(batch_size=cfg.eval_batch), prompts, f"eval {d.label}")
    n_lat = min(cfg.latency_n, len(held))
    lat = decode_all(make(batch_size=1), prompts[:n_lat], f"batch-1 {d.label}")[1] if n_lat else None  # no program without rows
    held_rows, he_rows = rows[:len(held)], rows[len(held):]
    scores = metrics.heldout_scores(held, _texts(tok, held_rows))  # cut where each function ends, then scored
    cut = [tasks.cut_completion(None, text, indent=r["indent"]) for r, text in zip(humaneval, _texts(tok, he_rows))]
    passed = metrics.pass_at_1(metrics.humaneval_check(humaneval, cut, timeout=cfg.humaneval_timeout)) \
        if humaneval else float("nan")
    return {**dataclasses.asdict(d), **scores, "humaneval_pass1": passed,
            "n_heldout": len(held), "n_humaneval": len(humaneval), "outputs": [r["tokens"] for r in rows],
            "tokens": s["tokens"], "nfe": s["nfe"], "tokens_per_forward": s["tokens_per_forward"],
            "accepted_per_forward": s["accepted_per_forward"], "tokens_per_s": s["tokens"] / s["seconds"],
            "latency_n": n_lat, "latency_tokens_per_s": lat["tokens"] / lat["seconds"] if n_lat else float("nan")}


def evaluate(cfg: RealDemoConfig, models: dict[str, Path], files: dict[str, Path], log=print) -> list[dict]:
    """Every decoder of `decoders(cfg)`; speedups against the NTP fine-tune decoded AR (the paper's baseline),
    identity against the same model decoded AR."""
    tok = Tokenizer.load(models["base"])
    held, humaneval = ([json.loads(x) for x in files[n].read_text().splitlines()] for n in ("heldout", "humaneval"))
    loaded = {name: from_pretrained(path) for name, path in models.items()}
    rows = []
    for d in decoders(cfg):
        mcfg, params = loaded[d.model]
        r = run_decoder(d, params, mcfg, tok, held, humaneval, cfg)
        log(f"[eval] {d.label:48s} first-line EM {100 * r['first_line_exact']:5.1f}%  similarity "
            f"{r['similarity']:.3f}  tokens/forward {r['tokens_per_forward']:5.2f}")
        rows.append(r)
    ar = {r["model"]: r for r in rows if r["mode"] == "ar"}
    base = ar["ntp"]
    for r in rows:
        r["same_as_ar"] = metrics.identical_share(r["outputs"], ar[r["model"]]["outputs"])
    for r in rows:
        del r["outputs"]
        r["nfe_speedup"] = r["tokens_per_forward"] / base["tokens_per_forward"]
        r["wall_speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["latency_speedup"] = r["latency_tokens_per_s"] / base["latency_tokens_per_s"]
        r["first_line_delta_pts"] = 100 * (r["first_line_exact"] - base["first_line_exact"])
    return rows
