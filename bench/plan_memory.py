"""Memory plan: compile the SBD train step or the decoder ahead of time from abstract shapes (no weights
exist) on a mesh of fake CPU devices and print XLA's per-device memory analysis (arguments / temporaries /
outputs).

    .venv/bin/python bench/plan_memory.py                                   # the training table in BENCHMARKS.md
    .venv/bin/python bench/plan_memory.py --models llama3-8b --seq-len 4096 --losses sbd --remat none
    .venv/bin/python bench/plan_memory.py decode                            # the decoding table (generate)
    .venv/bin/python bench/plan_memory.py continuous                        # decode.py's continuous decoder
    .venv/bin/python bench/plan_memory.py lora                              # a LoRA step on one device
    .venv/bin/python bench/plan_memory.py quant                             # quantized decoding, one device
    .venv/bin/python bench/plan_memory.py --models llama3-8b --seq-len 131072 --losses sbd --context 8  # long rows

The fake devices are CPU devices, so the numbers are XLA:CPU's buffer assignment of the same program a
GPU/TPU runs (same shapes, shardings, remat and loss chunking); attention "pallas" is the flash kernel in
interpret mode, whose scores live per tile as on a GPU. Treat them as a plan (within ~10-20% of a GPU's
peak), not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

DEVICES = int(os.environ.get("PLAN_DEVICES", "64"))
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from shapes import SHAPES  # noqa: E402

from sbd_jax.models.config import ModelConfig  # noqa: E402
from sbd_jax.decoding import DecodeSpec  # noqa: E402
from sbd_jax.decoding import continuous  # noqa: E402
from sbd_jax.decoding.decoder import decode_batch  # noqa: E402
from sbd_jax.models.lora import LORA_TARGETS, AdapterLayout  # noqa: E402
from sbd_jax.models.quant import quantize_params  # noqa: E402
from sbd_jax.models.params import param_specs  # noqa: E402
from sbd_jax.sharding import MeshConfig, make_mesh, param_shardings  # noqa: E402
from sbd_jax.training.config import ModelSource, OptimConfig  # noqa: E402
from sbd_jax.training.examples import PackedBatch  # noqa: E402
from sbd_jax.training.optim import make_optimizer  # noqa: E402
from sbd_jax.training.spec import StepOptions  # noqa: E402
from sbd_jax.training.step import (abstract_state, batch_shardings, jit_train_step, make_train_step,  # noqa: E402
                                   state_shardings)

GiB = 1024 ** 3
def train_step_memory(cfg: ModelConfig, *, seq_len: int, rows_per_device: int, mesh_cfg: MeshConfig,
                      ntp_only: bool, devices, grad_accum: int = 1) -> dict:
    """AOT-compile one optimizer step (AdamW, f32 master weights; `rows_per_device` rows per device in each of
    `grad_accum` microbatches) and return its memory analysis in bytes."""
    mesh = make_mesh(mesh_cfg, devices)
    batch = rows_per_device * mesh.shape["data"] * mesh.shape["fsdp"] * grad_accum
    tx, schedule = make_optimizer(OptimConfig(), 1000)
    sh = state_shardings(cfg, tx, mesh)
    state = abstract_state(cfg, tx, sh)
    rows = jax.ShapeDtypeStruct((batch, seq_len), "int32", sharding=batch_shardings(mesh, batch).tokens)
    opts = StepOptions(cfg.mask_token_id, ntp_only=ntp_only, block_align="document", grad_accum=grad_accum)
    step = jit_train_step(make_train_step(cfg, opts, tx, schedule, mesh), mesh, sh, batch)
    t0 = time.perf_counter()
    compiled = step.lower(state, PackedBatch(rows, rows, rows, rows)).compile()
    ma = compiled.memory_analysis()
    return {"args": ma.argument_size_in_bytes, "temp": ma.temp_size_in_bytes, "out": ma.output_size_in_bytes,
            "alias": ma.alias_size_in_bytes, "compile_s": time.perf_counter() - t0}


def context_comm_bytes(cfg: ModelConfig, T: int, context: int, tensor: int, rows: int, remat: bool) -> float:
    """Bytes one device sends per optimizer step for context parallelism (sbd_jax/attention/context.py): per layer
    and row, the all-gather of its K/V shard ((N-1)/N of the row's K and V, its KV heads of the tensor axis) in
    the forward pass, again when remat recomputes the layer, and the reduce-scatter of dK/dV in the backward."""
    if context == 1:
        return 0.0
    kv = 2 * T * max(cfg.num_key_value_heads // tensor, 1) * cfg.head_dim * 2  # K and V, bf16
    return (3 if remat else 2) * cfg.num_hidden_layers * rows * kv * (context - 1) / context


def lora_step_memory(cfg: ModelConfig, *, seq_len: int, layout: AdapterLayout, base_dtype: str, devices,
                     rows_per_device: int = 1, grad_accum: int = 1) -> dict:
    """AOT-compile one LoRA step (AdamW on the adapter only, f32 master adapter; the frozen base in `base_dtype`,
    an argument of the step) over `devices` as fsdp and return its memory analysis in bytes."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=len(devices), tensor=1), devices)
    batch = rows_per_device * len(devices) * grad_accum
    tx, schedule = make_optimizer(OptimConfig(), 1000)
    sh = state_shardings(cfg, tx, mesh, layout=layout)
    base_sh = param_shardings(cfg, mesh)
    base = jax.tree.map(lambda s, b: jax.ShapeDtypeStruct(s.shape(cfg), base_dtype, sharding=b), param_specs(cfg),
                        base_sh)
    rows = jax.ShapeDtypeStruct((batch, seq_len), "int32", sharding=batch_shardings(mesh, batch).tokens)
    opts = StepOptions(cfg.mask_token_id, block_align="document", grad_accum=grad_accum)
    step = jit_train_step(make_train_step(cfg, opts, tx, schedule, mesh, layout), mesh, sh, batch, base_sh)
    t0 = time.perf_counter()
    ma = step.lower(abstract_state(cfg, tx, sh, layout), PackedBatch(rows, rows, rows, rows), base).compile() \
        .memory_analysis()
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / len(devices)  # noqa: E731
    return {"args": ma.argument_size_in_bytes, "temp": ma.temp_size_in_bytes, "out": ma.output_size_in_bytes,
            "alias": ma.alias_size_in_bytes, "base": nbytes(base), "adapter": nbytes(abstract_state(cfg, tx, sh, layout)),
            "compile_s": time.perf_counter() - t0}


def plan_lora(argv) -> int:
    ap = argparse.ArgumentParser(description="a LoRA train step's memory plan (plan_memory.py lora)")
    ap.add_argument("--models", default="llama3-8b,qwen3-8b")
    ap.add_argument("--seq-len", default="4096", help="L (the SBD input is 2L tokens per row)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(LORA_TARGETS))
    ap.add_argument("--base-dtype", default="bfloat16", help="dtype the frozen base is held in (lora.base_dtype)")
    ap.add_argument("--devices", type=int, default=1, help="fsdp degree (1: one device)")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--attention", default="pallas", choices=("pallas", "xla"))
    ap.add_argument("--remat", default=ModelSource.__dataclass_fields__["remat"].default)
    args = ap.parse_args(argv)
    layout = AdapterLayout(args.rank, float(args.rank), tuple(args.targets.split(",")))
    print(f"LoRA rank {args.rank} on {args.targets}, base in {args.base_dtype}, f32 adapter + AdamW, bf16 compute, "
          f"attention {args.attention}, 1 row of L per device x {args.grad_accum} microbatch(es); GiB per device")
    print("| model | devices | L | remat | base | adapter + optimizer | temp | args+temp | compile s |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        cfg = dataclasses.replace(SHAPES[name], dtype="bfloat16", param_dtype="float32", attention_impl=args.attention,
                                  remat=args.remat)
        for L in map(int, args.seq_len.split(",")):
            m = lora_step_memory(cfg, seq_len=L, layout=layout, base_dtype=args.base_dtype,
                                 devices=jax.devices()[:args.devices], grad_accum=args.grad_accum)
            print(f"| {name} | {args.devices} | {L} | {cfg.remat} | {m['base'] / GiB:.1f} | {m['adapter'] / GiB:.2f} | "
                  f"{m['temp'] / GiB:.1f} | {(m['args'] + m['temp']) / GiB:.1f} | {m['compile_s']:.0f} |", flush=True)
    return 0


def _abstract_params(cfg: ModelConfig, tensor: int, devices):
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=tensor), devices) if tensor > 1 else None
    shardings = param_shardings(cfg, mesh) if mesh else jax.tree.map(lambda _: None, param_specs(cfg))
    return mesh, jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape(cfg), cfg.param_dtype, sharding=sh),
                              param_specs(cfg), shardings)


def _kv_bytes(cfg: ModelConfig, rows: int, width: int, tensor: int) -> float:
    return 2 * cfg.num_hidden_layers * rows * width * cfg.num_key_value_heads * cfg.head_dim * 2 / tensor


def decode_memory(cfg: ModelConfig, *, batch: int, prompt: int, new: int, mode: str, tensor: int, devices,
                  quantize=None, kv_cache_dtype=None, per_layer: bool = False) -> dict:
    """AOT-compile `generate` (bf16 weights, greedy, block 16; the projections quantized with `quantize`, the cache
    in `kv_cache_dtype`) and return its memory analysis in bytes."""
    mesh, params = _abstract_params(cfg, tensor, devices)
    if quantize is not None:  # (one device: the quantized leaves carry no shardings here)
        params = jax.eval_shape(lambda p: quantize_params(p, cfg, quantize), params)
    if per_layer:  # decode.py's layout (`unstack_layers`): a buffer per layer's weight
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params["layers"])
        params = {**params, "layers": (layer,) * cfg.num_hidden_layers}
    row = lambda dt: jax.ShapeDtypeStruct((batch,), dt)  # noqa: E731
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    spec = DecodeSpec(mode=mode, block_size=16, max_new_tokens=new, kv_cache_dtype=kv_cache_dtype)
    t0 = time.perf_counter()
    compiled = decode_batch.lower(params, jax.ShapeDtypeStruct((batch, prompt), "int32"), row("int32"),
                                  row("float32"), row("float32"), keys, row("int32"), cfg=cfg, spec=spec,
                                  mesh=mesh).compile()
    ma = compiled.memory_analysis()
    cache = _kv_bytes(cfg, batch, prompt + new, tensor) * ((cfg.head_dim + 2) / (2 * cfg.head_dim) if kv_cache_dtype
                                                           else 1.0)  # int8 values + one bf16 scale per head
    return {"args": ma.argument_size_in_bytes, "temp": ma.temp_size_in_bytes, "out": ma.output_size_in_bytes,
            "cache": cache, "compile_s": time.perf_counter() - t0}


def continuous_memory(cfg: ModelConfig, *, slots: int, prompt: int, new: int, mode: str, tensor: int, devices,
                      admit_rows: int = 16) -> dict:
    """AOT-compile the continuous decoder (decode.py's default engine): its decode loop `run_slots` and its largest
    admission `admit_slots` (min(slots, admit_rows) rows, rounded up to a power of two, as the decoder does). A
    program's peak is its arguments + temporaries + the outputs not aliased to a donated argument."""
    mesh, params = _abstract_params(cfg, tensor, devices)
    kw = dict(cfg=cfg, spec=DecodeSpec(mode=mode, block_size=16, max_new_tokens=new), mesh=mesh)
    t0 = time.perf_counter()
    state, rows = continuous.empty_slots.lower(params, slots=slots, width=prompt, **kw).compile().out_info
    R = continuous.admission_rows(min(slots, admit_rows))
    new_rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct((R,) + a.shape[1:], a.dtype), rows)
    peak = {}
    for name, fn, args in (("run", continuous.run_slots, (params, state, rows, jax.ShapeDtypeStruct((), bool))),
                           ("admit", continuous.admit_slots, (params, state, rows, jax.ShapeDtypeStruct((R,), "int32"),
                                                         jax.ShapeDtypeStruct((R, prompt), "int32"), new_rows))):
        ma = fn.lower(*args, **kw).compile().memory_analysis()
        peak[name] = (ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
                      - ma.alias_size_in_bytes)
        peak[name + "_temp"] = ma.temp_size_in_bytes
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / tensor
    return {**peak, "weights": weights, "cache": _kv_bytes(cfg, slots, prompt + new, tensor), "admit_R": R,
            "compile_s": time.perf_counter() - t0}


def _decode_grid(argv, description: str, rows: str, extra=()):
    """Parse the decoding plans' options; yield (args, model name, tensor, attention, cfg, rows, mode)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--models", default="llama3-8b,qwen3-8b")
    ap.add_argument(f"--{rows}", default="16,64")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--modes", default="sbd,ar")
    ap.add_argument("--tensor", default="1,8", help="tensor-parallel degrees (1 = one device, no mesh)")
    ap.add_argument("--attention", default="pallas,xla")
    for flag, kw in extra:
        ap.add_argument(flag, **kw)
    args = ap.parse_args(argv)
    yield args
    for name in args.models.split(","):
        for tensor in map(int, args.tensor.split(",")):
            for attn in args.attention.split(","):
                cfg = dataclasses.replace(SHAPES[name], dtype="bfloat16", param_dtype="bfloat16", attention_impl=attn)
                for n in map(int, getattr(args, rows).split(",")):
                    for mode in args.modes.split(","):
                        yield name, tensor, attn, cfg, n, mode


def plan_decode(argv) -> int:
    grid = _decode_grid(argv, "the decoder's memory plan (bench/plan_memory.py decode)", "batch")
    args = next(grid)
    print(f"prompt {args.prompt}, {args.new} new tokens, bf16 weights and compute, block 16; GiB per device")
    print("| model | tensor | attention | batch | mode | weights | KV cache | temp | args+temp | compile s |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for name, tensor, attn, cfg, batch, mode in grid:
        m = decode_memory(cfg, batch=batch, prompt=args.prompt, new=args.new, mode=mode, tensor=tensor,
                          devices=jax.devices()[:tensor])
        print(f"| {name} | {tensor} | {attn} | {batch} | {mode} | {(m['args']) / GiB:.1f} | {m['cache'] / GiB:.1f} | "
              f"{m['temp'] / GiB:.1f} | {(m['args'] + m['temp']) / GiB:.1f} | {m['compile_s']:.0f} |", flush=True)
    return 0


def plan_continuous(argv) -> int:
    grid = _decode_grid(argv, "the continuous decoder's memory plan (plan_memory.py continuous)", "slots",
                        [("--admit-rows", dict(type=int, default=16, help="ContinuousDecoder's admit_rows"))])
    args = next(grid)
    print(f"continuous decoder: prompt width {args.prompt}, {args.new} new tokens, bf16 weights and compute, block "
          f"16, admissions of up to {args.admit_rows} rows; GiB per device (peak: arguments + temporaries + "
          "outputs not aliased to donated arguments, per program)")
    print("| model | tensor | attention | slots | mode | weights | KV cache | loop temp | loop peak | admit rows | "
          "admit temp | admit peak | compile s |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, tensor, attn, cfg, slots, mode in grid:
        m = continuous_memory(cfg, slots=slots, prompt=args.prompt, new=args.new, mode=mode, tensor=tensor,
                              devices=jax.devices()[:tensor], admit_rows=args.admit_rows)
        print(f"| {name} | {tensor} | {attn} | {slots} | {mode} | {m['weights'] / GiB:.1f} | {m['cache'] / GiB:.1f} | "
              f"{m['run_temp'] / GiB:.1f} | {m['run'] / GiB:.1f} | {m['admit_R']} | {m['admit_temp'] / GiB:.1f} | "
              f"{m['admit'] / GiB:.1f} | {m['compile_s']:.0f} |", flush=True)
    return 0


def plan_quantized(argv) -> int:
    """Quantized decoding on one device: per-device GiB at each batch, and the largest batch one card holds (per-row
    bytes from the two batches compiled, linear in the rows)."""
    ap = argparse.ArgumentParser(description="quantized decoding's memory plan (plan_memory.py quant)")
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--schemes", default="none,int8,int4", help="weight schemes (none: bf16; fp8 holds int8's bytes)")
    ap.add_argument("--kv", default="none,int8", help="KV cache dtypes (none: bf16)")
    ap.add_argument("--cache", default="4096,32768", help="cache slots per row (prompt + new tokens)")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--card-gib", type=float, default=80.0)
    ap.add_argument("--layout", default="per-layer", choices=("per-layer", "stacked"),
                    help="per-layer: decode.py's weights (slow to compile: every layer in the program); stacked: the "
                         "layer scan (same per-row bytes; int4's plan then holds an unpacked copy of the stack)")
    args = ap.parse_args(argv)
    opt = lambda v: None if v == "none" else v  # noqa: E731
    print(f"one device, {args.layout} weights, bf16 compute, SBD block 16, {args.new} new tokens; "
          f"GiB; 'max batch': the largest batch whose weights + temporaries fit {args.card_gib:.0f} GiB (temporaries "
          "include the KV cache)")
    print("| model | weights | KV cache | cache slots | batch | weights GiB | KV cache GiB | temp GiB | total GiB | "
          "max batch on one card |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    batches = [int(b) for b in args.batch.split(",")]
    for name in args.models.split(","):
        cfg = dataclasses.replace(SHAPES[name], dtype="bfloat16", param_dtype="bfloat16", attention_impl="pallas")
        for scheme in args.schemes.split(","):
            for kv in args.kv.split(","):
                for slots in map(int, args.cache.split(",")):
                    got = {b: decode_memory(cfg, batch=b, prompt=slots - args.new, new=args.new, mode="sbd", tensor=1,
                                            devices=jax.devices()[:1], quantize=opt(scheme), kv_cache_dtype=opt(kv),
                                            per_layer=args.layout == "per-layer")
                           for b in batches}
                    jax.clear_caches()  # (the compiled programs: 72 of them exhaust a 24 GiB host)
                    lo, hi = min(batches), max(batches)
                    per_row = (got[hi]["temp"] - got[lo]["temp"]) / max(hi - lo, 1)
                    fixed = got[lo]["args"] + got[lo]["temp"] - lo * per_row
                    most = int((args.card_gib * GiB - fixed) // per_row) if per_row > 0 else 0
                    for b in batches:
                        m = got[b]
                        print(f"| {name} | {scheme if scheme != 'none' else 'bf16'} | {kv if kv != 'none' else 'bf16'}"
                              f" | {slots} | {b} | {m['args'] / GiB:.1f} | {m['cache'] / GiB:.1f} | "
                              f"{m['temp'] / GiB:.1f} | {(m['args'] + m['temp']) / GiB:.1f} | "
                              f"{max(most, 0) if b == hi and hi > lo else ''} |", flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["quant"]:
        return plan_quantized(argv[1:])
    if argv[:1] == ["decode"]:
        return plan_decode(argv[1:])
    if argv[:1] == ["continuous"]:
        return plan_continuous(argv[1:])
    if argv[:1] == ["lora"]:
        return plan_lora(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,qwen3-8b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--seq-len", default="4096,8192", help="L (the SBD input is 2L tokens per row)")
    ap.add_argument("--losses", default="sbd,ntp", help="sbd (dual loss) and/or ntp (the baseline step)")
    ap.add_argument("--fsdp", type=int, default=8)
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--context", type=int, default=1, help="context-parallel degree: each row's 2L tokens split over it")
    ap.add_argument("--rows-per-device", type=int, default=1, help="rows per device in each microbatch")
    ap.add_argument("--grad-accum", type=int, default=1, help="microbatches per step (optim.grad_accum)")
    ap.add_argument("--attention", default="pallas", choices=("pallas", "xla"))
    ap.add_argument("--remat", default=ModelSource.__dataclass_fields__["remat"].default,
                    help="ModelConfig.remat (default: what train.py uses)")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype (master weights stay float32)")
    args = ap.parse_args(argv)
    n = args.fsdp * args.tensor * args.context
    if n > jax.device_count():
        ap.error(f"the mesh needs {n} devices, {jax.device_count()} fake ones exist (set PLAN_DEVICES)")
    mesh_cfg = MeshConfig(data=1, fsdp=args.fsdp, tensor=args.tensor, context=args.context)
    print(f"mesh data=1 fsdp={args.fsdp} context={args.context} tensor={args.tensor}, {args.rows_per_device} row(s) "
          f"per data x fsdp device x {args.grad_accum} microbatch(es), "
          f"attention {args.attention}, compute {args.dtype}, f32 master weights + AdamW; GiB per device; context "
          "comm: the K/V all-gather + dK/dV reduce-scatter bytes per step and device (analytic)")
    print("| model | mesh | L | loss | remat | args | temp | args+temp | out | context comm GiB | compile s |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        cfg = dataclasses.replace(SHAPES[name], dtype=args.dtype, param_dtype="float32", attention_impl=args.attention,
                                  remat=args.remat)
        for L in (int(x) for x in args.seq_len.split(",")):
            for loss in args.losses.split(","):
                m = train_step_memory(cfg, seq_len=L, rows_per_device=args.rows_per_device, mesh_cfg=mesh_cfg,
                                      ntp_only=loss == "ntp", devices=jax.devices()[:n], grad_accum=args.grad_accum)
                comm = context_comm_bytes(cfg, L if loss == "ntp" else 2 * L, args.context, args.tensor,
                                          args.rows_per_device * args.grad_accum, cfg.remat != "none")
                print(f"| {name} | fsdp {args.fsdp} context {args.context} tensor {args.tensor} | {L} | {loss} | "
                      f"{cfg.remat} | {m['args'] / GiB:.1f} | {m['temp'] / GiB:.1f} | {(m['args'] + m['temp']) / GiB:.1f} | "
                      f"{m['out'] / GiB:.1f} | {comm / GiB:.1f} | {m['compile_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
