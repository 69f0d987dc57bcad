#!/usr/bin/env python
"""Batch decoding of a file of prompts with SBD (or AR): `python decode.py --model DIR --input prompts.jsonl
--output out.jsonl [options] [mesh.tensor=2 ...]`.

DIR is a local HF-layout checkpoint (config.json with mask_token_id for SBD, safetensors, tokenizer.json for
text prompts). Input lines: {"id", "prompt"}, {"id", "prompt_ids"} or {"id", "messages"} (chat template;
sbd_jax/decoding/prompts.py). Each completed prompt is appended to the output as one JSON line; --resume skips
ids already there, and refuses other settings, a changed model or a written id that now names other prompt content
(the record `<output>.settings.json`, sbd_jax/decoding/resume.py). The summary (tokens/s, tokens per forward,
with --compare-ar the measured speedup over AR on the same prompts) is printed and, with --summary FILE, written
as JSON. The mesh takes train.py's options (params laid out by the training rules, the batch over data x fsdp);
on several hosts start the same command on each (jax.distributed is initialised from the environment); process 0
writes the output. While it does, it holds `<output>.lock` (sbd_jax/runlock.py): a second decode.py on the same
--output is refused, naming the first; a lock left by a run that is gone is taken over.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

# Set by Ctrl-C (or a scheduler's SIGTERM). The handler raises KeyboardInterrupt as Python's own does; a native
# library that swallows that exception (it can arrive inside one) cannot lose the interrupt: the next written row
# raises it again.
INTERRUPTED = threading.Event()


def on_sigint(signum, frame):
    INTERRUPTED.set()
    raise KeyboardInterrupt


# the flags that are fields of DecodeSpec / DecodeOptions (same names, defaults read from the dataclasses: each
# default is defined once); DecodeSpec's other fields come from --eos-id / --ignore-eos (eos_ids) or are API-only
SPEC_FLAGS = ("mode", "verify", "block_size", "rule", "max_new_tokens", "commit_quorum", "draft_policy", "wide_cost",
              "top_k", "top_p", "tempered_entropy", "kv_cache_dtype")
OPTION_FLAGS = ("gamma", "temperature", "batch_size", "pad_multiple", "seed", "compare_ar")
SPEC_NOT_FLAGS = ("eos_ids", "pad_id", "prefill_chunk", "finalize_cache", "return_cache")


def _defaults() -> dict:
    import dataclasses

    from sbd_jax.decoding.runner import DecodeOptions
    from sbd_jax.decoding.spec import DecodeSpec
    fields = {f.name: f.default for cls in (DecodeSpec, DecodeOptions) for f in dataclasses.fields(cls)}
    return {name: fields[name] for name in SPEC_FLAGS + OPTION_FLAGS}


def build_parser() -> argparse.ArgumentParser:
    from sbd_jax.decoding.spec import DRAFT_POLICIES, KV_CACHE_DTYPES, MODES, RULES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local HF-layout model directory")
    ap.add_argument("--adapter", default=None,
                    help="a LoRA adapter directory in PEFT's layout (train.py's <out_dir>/adapter), merged into the "
                         "model's weights at load; refused unless it was trained on this base")
    ap.add_argument("--input", required=True, help="prompts, JSON lines")
    ap.add_argument("--output", required=True, help="results, JSON lines (appended as rows complete)")
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--gamma", type=float, help="acceptance threshold (SBD)")
    ap.add_argument("--rule", choices=RULES)
    ap.add_argument("--verify", action="store_true",
                    help="lossless SBD: every draft checked against AR's tokens (output == --mode ar's, same --seed)")
    ap.add_argument("--draft-policy", choices=DRAFT_POLICIES,
                    help="--verify: per call, a 1-wide AR call or a width-w check-and-draft call; 'adaptive' drafts "
                         "where the rows' acceptance pays for the wider call on this device ('always' / 'never' force "
                         "it). Speed only: the tokens are AR's whatever it chooses")
    ap.add_argument("--wide-cost", type=float,
                    help="--verify: the widest call's cost in 1-wide calls (default: the cost model's estimate for this "
                         "model, batch and device; bench/calibrate.py measures it)")
    ap.add_argument("--block-size", type=int, help="SBD block size k")
    ap.add_argument("--batch-size", type=int, help="rows decoded at once (continuous slots)")
    ap.add_argument("--static", action="store_true",
                    help="fixed batches that wait for their slowest row, instead of continuous batching (a finished "
                         "row's slot takes the next prompt at once; the default in one process)")
    ap.add_argument("--commit-quorum", type=float,
                    help="SBD: share of the running rows that must have a finished block before a call carries the "
                         "commits (the 2k window); the others wait. 0 = at once (small batches on a GPU). Speed only")
    ap.add_argument("--max-new-tokens", type=int,
                    help="cap (and cache size); a line may ask for less")
    ap.add_argument("--temperature", type=float, help="0 = greedy")
    ap.add_argument("--top-k", type=int, help="0 = off")
    ap.add_argument("--top-p", type=float, help="1 = off")
    ap.add_argument("--tempered-entropy", action="store_true",
                    help="entropies on the tempered distribution (T > 0 only)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--eos-id", type=int, action="append", help="EOS id(s) (default: the model's)")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    ap.add_argument("--chat", action="store_true", help="apply the chat template to every text prompt")
    ap.add_argument("--compare-ar", action="store_true", help="also decode AR and report the speedup")
    ap.add_argument("--resume", action="store_true", help="append to --output, skipping ids already there")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    ap.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                    help="--resume: accept this changed setting (e.g. spec.max_new_tokens; model_files: the model's "
                         "files changed; prompts: a written row's id now names other content; settings: the "
                         "<output>.settings.json record is missing)")
    ap.add_argument("--pad-multiple", type=int, help="prompt widths are rounded up to this")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="weights and compute dtype (default float32, whatever the checkpoint stores)")
    ap.add_argument("--quantize", default=None, metavar="SCHEME",
                    help="weight-only quantization of the projections at load: int8 | fp8 | int4 (groups of 32 "
                         "inputs; int4-g<N> for N) - less memory and weight traffic per step, tokens near the "
                         "full-precision model's (BENCHMARKS.md: quality per scheme); --verify stays exactly the "
                         "quantized model's AR")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                    help="the KV cache's storage (default: the compute dtype); int8: half of bf16's bytes per token, "
                         "a scale per position and head (--verify stays exactly AR's on the same cache)")
    ap.add_argument("--mesh-data", type=int, default=None, help="mesh data axis (-1 = the remaining devices)")
    ap.add_argument("--mesh-fsdp", type=int, default=None)
    ap.add_argument("--mesh-tensor", type=int, default=None, help="tensor-parallel degree")
    ap.add_argument("overrides", nargs="*", help="mesh overrides in train.py's syntax: mesh.data=4 mesh.tensor=2")
    ap.add_argument("--summary", default=None, help="also write the summary JSON here")
    ap.add_argument("--bandwidth", action="store_true",
                    help="report the achieved weight bandwidth and peak memory (default on GPU/TPU, off on CPU)")
    ap.add_argument("--no-progress", action="store_true")
    ap.set_defaults(**_defaults())
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sbd_jax.runtime import use_decode_xla_flags
    use_decode_xla_flags()  # before jax creates its backend
    from sbd_jax.config import ConfigError
    from sbd_jax.decoding import DecodeError
    from sbd_jax.io.hf import CheckpointError
    INTERRUPTED.clear()
    own = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # an ignored SIGINT (a background job)
    if own:                                                               # stays ignored
        signal.signal(signal.SIGINT, on_sigint)
    own_term = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # SIGTERM ends like Ctrl-C: complete rows, and
    if own_term:                                                  # the output's lock released for a requeued job
        signal.signal(signal.SIGTERM, on_sigint)
    try:
        return run(args)
    except (DecodeError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the message short
        print(f"interrupted: every row in {args.output} is complete; rerun with --resume to continue",
              file=sys.stderr)
        return 130
    finally:
        if own:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if own_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run(args) -> int:
    """The options checked, then the output locked (process 0, which writes it) before the model loads."""
    import jax

    from sbd_jax.decoding import DecodeError, DecodeSpec
    from sbd_jax.decoding.resume import lock_output
    from sbd_jax.models.quant import Quantization
    from sbd_jax.sharding import maybe_initialize_distributed

    if args.resume and args.overwrite:
        raise DecodeError("--resume and --overwrite exclude each other")
    spec = DecodeSpec(**{f: getattr(args, f) for f in SPEC_FLAGS},
                      eos_ids=() if args.ignore_eos else (tuple(args.eos_id) if args.eos_id else None))
    quantization = Quantization.of(args.quantize)  # a bad scheme is refused before anything loads
    mesh_cfg = mesh_config(args)
    check_summary_path(args.summary)
    maybe_initialize_distributed()
    writer = jax.process_index() == 0
    with lock_output(args.output) if writer else contextlib.nullcontext():
        return decode_all(args, spec, quantization, mesh_cfg, writer)


def decode_all(args, spec, quantization, mesh_cfg, writer: bool) -> int:
    """Load the model, decode the pending prompts into the output (`writer`: this process writes it), summarise."""
    import jax

    from sbd_jax.decoding import DecodeError, DecodeSpec
    from sbd_jax.decoding.prompts import check_output_settings, open_output, read_prompts, write_row
    from sbd_jax.decoding.resume import model_fingerprint
    from sbd_jax.decoding.runner import check_prompts
    from sbd_jax.decoding.sampler import Sampler
    from sbd_jax.sharding import make_mesh

    mesh = make_mesh(mesh_cfg)
    sampler = Sampler.load(args.model, dtype=args.dtype, mesh=mesh, adapter=args.adapter,  # each process: its shards
                           quantize=args.quantize)
    opts = sampler.options(spec=spec, **{f: getattr(args, f) for f in OPTION_FLAGS},
                           continuous=not args.static and jax.process_count() == 1)  # checked before any prompt
    prompts = read_prompts(args.input, sampler.tokenizer, chat=args.chat, vocab_size=sampler.cfg.vocab_size)
    prompts = check_prompts(sampler.cfg, opts, prompts)  # once, before the output is opened
    done, out = open_output(args.output, resume=args.resume, overwrite=args.overwrite) if writer else (set(), None)
    if writer:  # what the rows depend on (not how they are batched or shown)
        settings = {"model": str(Path(args.model).resolve()), "input": str(Path(args.input).resolve()),
                    "adapter": args.adapter and str(Path(args.adapter).resolve()),
                    "spec": {k: v for k, v in dataclasses.asdict(opts.spec).items()
                             if k not in DecodeSpec.SPEED_ONLY}, "gamma": args.gamma, "temperature": args.temperature,
                    "seed": args.seed, "compare_ar": args.compare_ar, "chat": args.chat, "dtype": args.dtype,
                    "model_files": model_fingerprint(args.model),
                    "adapter_files": args.adapter and model_fingerprint(args.adapter),
                    "quantize": quantization and quantization.name}  # (None reads as absent in older records)
        try:
            check_output_settings(args.output, settings, resume=args.resume, allowed=tuple(args.allow_change),
                                  prompts=prompts, done=done)
        except DecodeError:
            out.close()
            raise
    pending = prompts.where(lambda p: p.id not in done)
    if done:
        print(f"resume: {len(prompts) - len(pending)} of {len(prompts)} prompts already in {args.output}",
              file=sys.stderr)

    def on_row(p, r):
        if out is not None:
            write_row(out, {"id": p.id, **r.to_json()})
        if INTERRUPTED.is_set():
            raise KeyboardInterrupt

    from tqdm import tqdm
    with tqdm(total=len(pending), unit="prompt", desc=f"decode ({args.mode})", file=sys.stderr,
              disable=args.no_progress or not writer) as progress:
        try:
            summary = sampler.decode(pending, opts, on_row=on_row, progress=progress) if pending else None
        finally:
            if out is not None:
                with contextlib.suppress(OSError):  # every row was flushed: only a failed write's remains
                    out.close()
    if summary is None:
        print("nothing to do: every prompt is already in the output")
        return 0
    summary = {**summary.to_json(), "command": " ".join(["python", "decode.py", *args.argv])}
    if args.bandwidth or jax.default_backend() != "cpu":
        from sbd_jax.decoding.roofline import bandwidth_report, copy_bandwidth
        copy_bw = copy_bandwidth()
        for s in (summary, summary.get("ar")):
            if s and s["model_calls"] and s["seconds"]:
                s["bandwidth"] = bandwidth_report(sampler.params, s["model_calls"], s["seconds"], copy_bw)
    if writer:
        print(format_summary(summary))
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(summary, f, indent=2)
    return 0


def check_summary_path(summary) -> None:
    """--summary FILE can be written once decoding is done: checked before it starts."""
    from sbd_jax.decoding import DecodeError
    if summary is None:
        return
    p = Path(summary)
    if p.is_dir():
        raise DecodeError(f"--summary {summary!r} is a directory: give a file path")
    if not p.parent.is_dir():
        raise DecodeError(f"--summary {summary!r}: its directory {str(p.parent)!r} does not exist (or is not a "
                          "directory); create it first")


def mesh_config(args):
    """MeshConfig from `mesh.x=N` overrides (train.py's syntax) and --mesh-x flags (flags win)."""
    from sbd_jax.config import ConfigError, apply_overrides, from_dict
    from sbd_jax.sharding import MeshConfig
    bad = [o for o in args.overrides if not o.startswith("mesh.")]
    if bad:
        raise ConfigError(f"unknown argument(s) {bad}: only mesh.data=/mesh.fsdp=/mesh.tensor= overrides are accepted")
    d = apply_overrides({}, args.overrides).get("mesh", {})
    if d.get("context", 1) != 1:  # a training axis: decoding would repeat the same work on those devices
        raise ConfigError(f"mesh.context={d['context']}: context parallelism is for training (train.py); decode.py "
                          "splits rows over mesh.data / mesh.fsdp and heads over mesh.tensor")
    for axis in ("data", "fsdp", "tensor"):
        if getattr(args, f"mesh_{axis}") is not None:
            d[axis] = getattr(args, f"mesh_{axis}")
    return from_dict(MeshConfig, d, where="mesh")


def format_summary(s: dict) -> str:
    lines = [(f"{s['rows']} prompts, {s['tokens']} tokens generated in {s['seconds']:.3f} s "
              f"(+ {s['compile_seconds']:.1f} s compilation)"),
             (f"{s['mode']}: {s['tokens_per_s']:.1f} tokens/s, {s['tokens_per_forward']:.3f} tokens per forward "
              f"({s['nfe']} forwards)" + (" [verify: lossless]" if s.get("verify") else ""))]
    from sbd_jax.decoding.roofline import format_bandwidth
    if "bandwidth" in s:
        lines.append(f"{s['mode']}: {format_bandwidth(s['bandwidth'])}")
    hist = s["accepted_per_forward"]
    if s["mode"] == "sbd" and sum(hist):
        shares = ", ".join(f"{n}: {100 * c / sum(hist):.0f}%" for n, c in enumerate(hist) if c)
        lines.append(f"tokens accepted per forward (share of forwards): {shares}")
    if s.get("verify"):
        lines.append(f"drafts: {s['drafts_agreed']} of {s['drafts']} stood ({100 * s['draft_acceptance']:.1f}%); "
                     f"{s['tokens_per_forward']:.2f} tokens per forward of a ceiling of "
                     f"{s['tokens_per_forward_ceiling']:.0f} (every draft standing)")
    if "ar" in s:
        a = s["ar"]
        lines.append(f"ar:  {a['tokens_per_s']:.1f} tokens/s, {a['tokens_per_forward']:.3f} tokens per forward "
                     f"({a['nfe']} forwards, {a['tokens']} tokens)")
        if "bandwidth" in a:
            lines.append(f"ar:  {format_bandwidth(a['bandwidth'])}")
        lines.append(f"measured speedup over AR (tokens/s): {s['speedup_tokens_per_s']:.2f}x; "
                     f"NFE ratio for the same output length: {s['tokens_per_forward']:.2f}x; "
                     f"rows identical to AR: {s['rows'] - s['n_rows_differing_from_ar']} of {s['rows']} "
                     f"({100 * s['same_tokens_as_ar']:.1f}%)")
        if s["n_rows_differing_from_ar"]:
            lines.append(f"rows differing from AR (ids, first 20): {s['rows_differing_from_ar']}"
                         + (" - verify mode differs from AR only at float near-ties of the two forward shapes"
                            if s.get("verify") else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    code = main()
    if code == 130:  # interrupted: a native (XLA, tokenizer) thread may still run; leave without the interpreter's
        sys.stdout.flush()  # teardown, which aborts on a running native thread ("terminate called ...")
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
