"""The real-model demo's evaluation: every decoder completes the held-out stdlib functions and the HumanEval
problems through decode.py's batch runner, timed at `eval_batch` rows and one prompt at a time; completions are
cut where the function ends and scored (demos.real.metrics)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from sbd_jax.decoding.prompts import Prompt
from ..toy.evaluation import Decoder, decode_all, decoder_maker, sbd_decoders, suite_width
from sbd_jax.io.hf import from_pretrained
from sbd_jax.io.peft import apply_adapter
from sbd_jax.io.tokenizer import Tokenizer
from . import metrics, tasks
from .config import RealDemoConfig


def decoders(cfg: RealDemoConfig) -> list[Decoder]:
    """The original model, the NTP fine-tune (the baseline) and the SBD fine-tune AR, then the SBD fine-tune's
    lossless and lossy rows (as in the toy demo), then the same rows of the SBD LoRA adapter (`lora_rank`)."""
    rows = [Decoder("original model, AR", "base", "ar"), Decoder("NTP fine-tune, AR (baseline)", "ntp", "ar"),
            Decoder("SBD fine-tune, AR", "sbd", "ar"), *sbd_decoders(cfg)]
    if cfg.lora_rank:
        name = f"SBD LoRA r{cfg.lora_rank}"
        rows += [dataclasses.replace(d, label=d.label.replace("SBD fine-tune", name), model="lora")
                 for d in (Decoder("SBD fine-tune, AR", "sbd", "ar"), *sbd_decoders(cfg))]
    return rows


def eval_order(rows: list[Decoder]) -> list[int]:
    """The order rows are evaluated in, most needed first, so that a run stopped by a time limit leaves the
    table's core: the baseline, the SBD fine-tune lossless (default policy) and AR (its reference), its lossy EB
    rows, then the adapter's rows in the same order, the original model, the rest (other policies, the threshold
    rule)."""
    def rank(d: Decoder) -> tuple[int, int]:
        kind = (0 if d.model == "ntp" else
                1 if d.verify and d.policy == "adaptive" else 2 if d.mode == "ar" else
                3 if d.rule == "eb" and not d.verify else 5)
        group = {"ntp": 0, "sbd": 0, "lora": 1, "base": 2}[d.model]
        return (group if kind < 5 else 3, kind)
    return sorted(range(len(rows)), key=lambda i: rank(rows[i]))


def _prompts(records: list[dict], start: int = 0) -> list[Prompt]:
    return [Prompt(r["id"], start + i + 1, tuple(r["prompt_ids"])) for i, r in enumerate(records)]


def _texts(tok: Tokenizer, rows: list) -> list[str]:
    return [tok.decode(row.tokens) for row in rows]


def run_decoder(d: Decoder, params, mcfg, tok: Tokenizer, held: list[dict], humaneval: list[dict],
                cfg: RealDemoConfig) -> dict:
    """Decode every prompt (held-out functions, then HumanEval) at eval_batch rows, the first latency_n held-out
    prompts again one at a time (lossy rows only with `latency_lossy`); the metrics of both sets, tokens per forward
    and tokens/s (compilation excluded), the outputs (for the identity columns)."""
    prompts = _prompts(held) + _prompts(humaneval, len(held))
    make = decoder_maker(d, params, mcfg, cfg, suite_width(prompts))
    rows, s = decode_all(make(batch_size=cfg.eval_batch), prompts, f"eval {d.label}")
    n_lat = min(cfg.latency_n, len(held)) if (cfg.latency_lossy or d.mode == "ar" or d.verify) else 0
    lat = decode_all(make(batch_size=1), prompts[:n_lat], f"batch-1 {d.label}")[1] if n_lat else None  # no program without rows
    held_rows, he_rows = rows[:len(held)], rows[len(held):]
    scores = metrics.heldout_scores(held, _texts(tok, held_rows))  # cut where each function ends, then scored
    cut = [tasks.cut_completion(None, text, indent=r["indent"]) for r, text in zip(humaneval, _texts(tok, he_rows))]
    passed = metrics.pass_at_1(metrics.humaneval_check(humaneval, cut, timeout=cfg.humaneval_timeout)) \
        if humaneval else float("nan")
    return {**dataclasses.asdict(d), **scores, "humaneval_pass1": passed,
            "n_heldout": len(held), "n_humaneval": len(humaneval), "outputs": [r.tokens for r in rows],
            "tokens": s.tokens, "nfe": s.nfe, "tokens_per_forward": s.tokens_per_forward,
            "accepted_per_forward": s.accepted.tolist(), "tokens_per_s": s.tokens_per_s,
            "compile_seconds": s.compile_seconds + (lat.compile_seconds if n_lat else 0.0),
            **{k: v for k, v in s.to_json().items() if k in ("drafts", "drafts_agreed", "draft_acceptance")},
            "latency_n": n_lat, "latency_tokens_per_s": lat.tokens_per_s if n_lat else float("nan")}


def load_models(models: dict[str, Path | tuple[Path, Path]]) -> dict:
    """name -> (ModelConfig, params); a (base, adapter) pair is the base with the LoRA adapter merged in."""
    loaded = {}
    for name, path in models.items():
        if isinstance(path, tuple):
            base, adapter = path
            loaded[name] = apply_adapter(*from_pretrained(base), adapter, model_dir=base)
        else:
            loaded[name] = from_pretrained(path)
    return loaded


def read_records(path: Path) -> list[dict]:
    """The records of a data stage's jsonl file (heldout.jsonl, humaneval.jsonl)."""
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def evaluate(cfg: RealDemoConfig, models: dict[str, Path | tuple[Path, Path]], held: list[dict],
             humaneval: list[dict], log=print, done: dict[str, dict] | None = None, on_row=None,
             select=None) -> list[dict]:
    """Every decoder of `decoders(cfg)` whose model is in `models` (and that `select(decoder)` keeps, when given),
    in `eval_order`, on the held-out and HumanEval records. `done`: rows finished earlier by label (not decoded
    again); `on_row(row)`: called after each row (e.g. to save it). The tokenizer is the base model's."""
    tok = Tokenizer.load(models["base"])
    todo = [d for d in decoders(cfg) if d.model in models and (select is None or select(d))]
    loaded = load_models({k: v for k, v in models.items() if any(d.model == k for d in todo)})
    rows: list[dict | None] = [None] * len(todo)
    for i in eval_order(todo):
        d = todo[i]
        if done and d.label in done:
            rows[i] = done[d.label]
            continue
        mcfg, params = loaded[d.model]
        r = run_decoder(d, params, mcfg, tok, held, humaneval, cfg)
        log(f"[eval] {d.label:52s} first-line EM {100 * r['first_line_exact']:5.1f}%  similarity "
            f"{r['similarity']:.3f}  tokens/forward {r['tokens_per_forward']:5.2f}  {r['tokens_per_s']:7.0f} tok/s "
            f"(compiled in {r['compile_seconds']:.0f}s)")
        rows[i] = r
        if on_row is not None:
            on_row(r)
    return [r for r in rows if r is not None]


def compare(rows: list[dict]) -> list[dict]:
    """The rows with their comparisons (copies, outputs dropped): identity with the same model's AR rows and
    speedups over the NTP fine-tune's AR row, where those rows exist (NaN where not)."""
    nan = float("nan")
    ar = {r["model"]: r for r in rows if r["mode"] == "ar"}
    base = ar.get("ntp")
    out = []
    for r in rows:
        r = dict(r)
        ref = ar.get(r["model"])
        r["same_as_ar"] = metrics.identical_share(r["outputs"], ref["outputs"]) if ref else nan
        del r["outputs"]
        for key, num in (("nfe_speedup", "tokens_per_forward"), ("wall_speedup", "tokens_per_s"),
                         ("latency_speedup", "latency_tokens_per_s")):
            r[key] = r[num] / base[num] if base else nan
        r["first_line_delta_pts"] = 100 * (r["first_line_exact"] - base["first_line_exact"]) if base else nan
        out.append(r)
    return out
