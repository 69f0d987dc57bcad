"""Verify mode's call costs timed on this device: what the cost model (sbd_jax/decoding/modes/verify/costs.py)
estimates, measured. It compiles and runs programs, so it is a measurement the caller keeps and states as
`DecodeSpec(wide_cost=...)` (one cost per draft width); the library reads what is stated and never times anything.

    python bench/calibrate.py --model MODEL_DIR --batch 1 --block-size 16 --cache-len 512
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sbd_jax.decoding.modes import ar  # noqa: E402
from sbd_jax.decoding.modes.verify.step import admit, as_ar, from_ar, wide_step  # noqa: E402
from sbd_jax.decoding.modes.verify.state import DraftMemory, VerifyState  # noqa: E402
from sbd_jax.decoding.spec import DecodeError, DecodeSpec  # noqa: E402
from sbd_jax.decoding.state import make_env, new_state, prompt_seq  # noqa: E402
from sbd_jax.models.config import ModelConfig  # noqa: E402

ROUNDS, CALLS = 5, 32


def calibrate(params, cfg: ModelConfig, spec: DecodeSpec, batch: int, cache_len: int) -> tuple[float, ...]:
    """Each draft width's loop-step time over the AR step's on this device, fastest of ROUNDS (`loop_seconds`;
    greedy, every row mid-way through a cache of `cache_len` slots, `batch` rows): state the result as the spec's
    `wide_cost`. A width's step is verify mode's wide call (its check and drafting; the policy's choice and the
    switch between call kinds are paid once per run of same-width calls, `wide_run`, not per call). Compiles and
    runs programs: not inside a trace."""
    seconds = step_seconds(params, cfg, spec, batch, cache_len)
    return tuple(round(t / seconds[0], 3) for t in seconds[1:])


def step_seconds(params, cfg: ModelConfig, spec: DecodeSpec, batch: int, cache_len: int) -> list[float]:
    """Seconds of the AR loop step, then of verify's loop step at each draft width (`calibrate`'s timings)."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
        raise DecodeError("calibrate times programs on the device: call it outside jax.jit and state its result "
                          "as DecodeSpec(wide_cost=...)")
    spec = dataclasses.replace(spec, wide_cost=None)
    P = max(cache_len - spec.max_new_tokens, 1)
    lengths = jnp.full((batch,), max(P // 2, 1), jnp.int32)
    env = make_env(params, cfg, spec, lengths, jnp.full((batch,), 1 << 30, jnp.int32),
                   jnp.zeros((batch,)), jnp.zeros((batch,)), jax.random.split(jax.random.key(0), batch), None)
    env = dataclasses.replace(env, eos=jnp.full((1,), -1, jnp.int32))  # no stop id; a row that reaches the cap
    # keeps the call's shapes (finished rows are padding in the same program)
    state = admit(new_state(env, prompt_seq(jnp.zeros((batch, P), jnp.int32), lengths, spec, env), P,
                            VerifyState.new(batch, DraftMemory.empty(spec.block_size - 1))), env)

    def step_ar(s, w):  # AR mode's step on the same rows, as verify's runs of AR calls take it
        return from_ar(ar.step(as_ar(s), dataclasses.replace(env, params=w)), s.mode_state)

    def wide(width):  # verify's call at this draft width
        return lambda s, w: wide_step(s, dataclasses.replace(env, params=w), width)

    return loop_seconds([step_ar] + [wide(width) for width in spec.draft_widths], state, params)


def loop_seconds(runs, state, weights) -> list[float]:
    """Seconds per step of `runs[i](state, weights)` run CALLS times in one compiled loop: the fastest of ROUNDS
    rounds, the runs interleaved (a busy spell of a shared machine then hits them alike)."""
    progs = [jax.jit(lambda s, w, r=r: jax.lax.fori_loop(0, CALLS, lambda _, x: r(x, w), s)).lower(state, weights)
             .compile() for r in runs]
    for prog in progs:
        jax.block_until_ready(prog(state, weights))
    best = [float("inf")] * len(progs)
    for _ in range(ROUNDS):
        for n, prog in enumerate(progs):
            t = time.perf_counter()
            jax.block_until_ready(prog(state, weights))
            best[n] = min(best[n], (time.perf_counter() - t) / CALLS)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF-layout model directory with the mask token")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache-len", type=int, default=512, help="cache slots per row (prompt + new tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    from sbd_jax.io.hf import from_pretrained
    cfg, params = from_pretrained(args.model)
    spec = DecodeSpec(mode="sbd", verify=True, block_size=args.block_size, max_new_tokens=args.max_new_tokens)
    costs = calibrate(params, cfg, spec, args.batch, args.cache_len)
    print(json.dumps({"backend": jax.default_backend(), "batch": args.batch, "cache_len": args.cache_len,
                      "draft_widths": list(spec.draft_widths), "wide_cost": list(costs)}))


if __name__ == "__main__":
    main()
