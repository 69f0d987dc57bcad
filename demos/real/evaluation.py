"""The real-model demo's evaluation: every decoder completes the held-out stdlib functions and the HumanEval
problems through decode.py's batch runner, timed at `eval_batch` rows and one prompt at a time; completions are
cut where the function ends and scored (demos.real.metrics)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from sbd_jax.decoding.prompts import Prompt
from sbd_jax.decoding.results import Totals
from ..toy.evaluation import Decoder, decode_all, decoder_maker, sbd_decoders, suite_width
from sbd_jax.io.hf import from_pretrained
from sbd_jax.io.peft import apply_adapter
from sbd_jax.io.tokenizer import Tokenizer
from . import metrics, tasks
from .config import RealDemoConfig


def decoders(cfg: RealDemoConfig) -> list[Decoder]:
    """The base model's AR (the reference: lossless output equals it), then the adapter's lossless rows (one per
    drafting policy; "always" once per `cfg.always_blocks` when set) and its lossy EB and threshold rows (as in the toy
    demo)."""
    return [Decoder("base model, AR", "base", "ar"),
            *sbd_decoders(cfg, name="adapter", model="lora", always_blocks=cfg.always_blocks)]


def _prompts(records: list[dict], start: int = 0) -> list[Prompt]:
    return [Prompt(r["id"], start + i + 1, tuple(r["prompt_ids"])) for i, r in enumerate(records)]


def _texts(tok: Tokenizer, rows: list) -> list[str]:
    return [tok.decode(row.tokens) for row in rows]


def run_decoder(d: Decoder, params, mcfg, tok: Tokenizer, held: list[dict], humaneval: list[dict],
                cfg: RealDemoConfig) -> tuple[dict, object]:
    """Decode every prompt (held-out functions, then HumanEval) at eval_batch rows: the metrics of both sets, tokens
    per forward and tokens/s (compilation excluded), the outputs (for the identity columns). -> (the row, a maker of
    this decoder's batch-1 runner when the first latency_n held-out prompts are to be timed one at a time, lossy rows
    only with `latency_lossy`, else None; `batch1_rounds` times them)."""
    prompts = _prompts(held) + _prompts(humaneval, len(held))
    make = decoder_maker(d, params, mcfg, cfg, suite_width(prompts))
    rows, s = decode_all(make(batch_size=cfg.eval_batch), prompts, f"eval {d.label}")
    timed = bool(held) and cfg.latency_n > 0 and (cfg.latency_lossy or d.mode == "ar" or d.verify)
    held_rows, he_rows = rows[:len(held)], rows[len(held):]
    scores = metrics.heldout_scores(held, _texts(tok, held_rows))  # cut where each function ends, then scored
    cut = [tasks.cut_completion(None, text, indent=r["indent"]) for r, text in zip(humaneval, _texts(tok, he_rows))]
    passed = metrics.pass_at_1(metrics.humaneval_check(humaneval, cut, timeout=cfg.humaneval_timeout)) \
        if humaneval else float("nan")
    return {**dataclasses.asdict(d), **scores, "humaneval_pass1": passed,
            "n_heldout": len(held), "n_humaneval": len(humaneval), "outputs": [r.tokens for r in rows],
            "tokens": s.tokens, "nfe": s.nfe, "tokens_per_forward": s.tokens_per_forward,
            "accepted_per_forward": s.accepted.tolist(), "tokens_per_s": s.tokens_per_s,
            "compile_seconds": s.compile_seconds,
            **{k: v for k, v in s.to_json().items() if k in ("drafts", "drafts_agreed", "draft_acceptance")},
            "latency_n": 0, "latency_tokens_per_s": float("nan"), "latency_tokens_per_forward": float("nan")}, \
        (make if timed else None)


def batch1_rounds(makers: dict, prompts: list[Prompt], log=print) -> dict:
    """Each decoder's batch-1 runner (label -> maker) over `prompts`, interleaved: prompt i by every decoder before
    prompt i + 1, so that a CPU whose speed drifts over minutes times every decoder on the same machine state.
    -> label -> (Totals of the decoding: tokens, NFE, seconds, compilation apart; compile seconds)."""
    decs = {label: make(batch_size=1) for label, make in makers.items()}
    totals = {label: Totals() for label in decs}
    for i, p in enumerate(prompts):
        log(f"[batch 1] prompt {i + 1} of {len(prompts)}")
        for label, dec in decs.items():
            for row in decode_all(dec, [p])[0]:
                totals[label].add(row)
    for label, dec in decs.items():
        totals[label].seconds = dec.seconds  # the runner's own decoding seconds over all its calls
    return {label: (totals[label], decs[label].compile_s) for label in decs}


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
             humaneval: list[dict], log=print, on_row=None, select=None) -> list[dict]:
    """Every decoder of `decoders(cfg)` whose model is in `models` (and that `select(decoder)` keeps, when given),
    in order, on the held-out and HumanEval records; `on_row(row)`: called after each row (e.g. to save it). The
    tokenizer is the base model's."""
    tok = Tokenizer.load(models["base"])
    todo = [d for d in decoders(cfg) if d.model in models and (select is None or select(d))]
    loaded = load_models({k: v for k, v in models.items() if any(d.model == k for d in todo)})
    rows, makers = [], {}
    for d in todo:
        mcfg, params = loaded[d.model]
        r, make = run_decoder(d, params, mcfg, tok, held, humaneval, cfg)
        log(f"[eval] {d.label:52s} first-line EM {100 * r['first_line_exact']:5.1f}%  similarity "
            f"{r['similarity']:.3f}  tokens/forward {r['tokens_per_forward']:5.2f}  {r['tokens_per_s']:7.0f} tok/s "
            f"(compiled in {r['compile_seconds']:.0f}s)")
        rows.append(r)
        if make is not None:
            makers[d.label] = make
    n_lat = min(cfg.latency_n, len(held))
    timed = batch1_rounds(makers, _prompts(held)[:n_lat], log) if makers else {}
    for r in rows:
        if r["label"] in timed:
            t, compile_s = timed[r["label"]]
            r.update(latency_n=n_lat, latency_tokens_per_s=t.tokens_per_s, latency_tokens_per_forward=t.tokens_per_forward,
                     compile_seconds=r["compile_seconds"] + compile_s)
        if on_row is not None:
            on_row(r)
    return rows
