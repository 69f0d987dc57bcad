"""Benchmark: the whole training loop (`sbd_jax.training.loop.train`: data packing, batch placement, the step,
metrics, checkpoints) at the demo's model shape, as wall-clock per step after compilation. The step alone is
bench_train.py; the difference is what the loop around it costs.

    .venv/bin/python bench/bench_loop.py                 # demo shape, 300 steps, a checkpoint every 50
    .venv/bin/python bench/bench_loop.py --log-every 10
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from sbd_jax.models.config import ModelConfig  # noqa: E402
from sbd_jax.sharding import MeshConfig  # noqa: E402
from sbd_jax.training.config import CheckpointConfig, DataConfig, ModelSource, OptimConfig, TrainConfig  # noqa: E402
from sbd_jax.training.data import Documents, PackedIterator  # noqa: E402
from sbd_jax.training.loop import train  # noqa: E402
from sbd_jax.training.spec import SBDConfig  # noqa: E402

# the demo's model (sbd_jax/demo: DemoConfig, stages.model_config) and rows
MODEL = ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                    mask_token_id=3, eos_token_id=2)


def run(args, ntp_only: bool) -> dict:
    rng = np.random.default_rng(0)
    lens = rng.integers(16, 64, 4000)
    docs = Documents.from_lists([list(rng.integers(8, MODEL.vocab_size, n)) for n in lens],
                                n_prompt=[max(1, n * 44 // 100) for n in lens])
    data = PackedIterator(docs, args.seq_len, args.batch, seed=0, copy_len=None if ntp_only else args.copy_len)
    stamps = []
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(
            model=ModelSource(config=MODEL, scan_unroll=MODEL.num_hidden_layers, remat="none"),
            data=DataConfig(seq_len=args.seq_len, copy_len=None if ntp_only else args.copy_len),
            sbd=SBDConfig(k_max=16, ntp_only=ntp_only, block_align="response"),
            optim=OptimConfig(lr=2e-3, warmup_steps=10),
            checkpoint=CheckpointConfig(every=args.checkpoint_every, keep=2, export_hf=False),
            mesh=MeshConfig(data=1), steps=args.steps, batch_size=args.batch, log_every=args.log_every,
            progress=False, out_dir=out)
        train(cfg, data=data, on_log=lambda rec: stamps.append((rec["step"], time.perf_counter())))
    (s0, t0), (s1, t1) = next(x for x in stamps if x[0] >= args.skip), stamps[-1]
    return {"step_ms": 1e3 * (t1 - t0) / (s1 - s0), "steps": s1 - s0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip", type=int, default=20, help="steps left out of the timing (compilation, warm-up)")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--copy-len", type=int, default=80)
    args = ap.parse_args(argv)
    print(f"demo-shaped model, batch {args.batch} x L {args.seq_len}, log every {args.log_every}, checkpoint every "
          f"{args.checkpoint_every}, steps {args.skip}..{args.steps} timed")
    for name, ntp in (("NTP", True), ("SBD copy_len", False)):
        r = run(args, ntp)
        print(f"{name}: {r['step_ms']:.1f} ms per step over {r['steps']} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
