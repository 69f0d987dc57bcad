"""Tests on 8 fake CPU devices. XLA_FLAGS must be set before jax is imported, so such a test runs its
script in a fresh interpreter (`run_on_8_devices`); `train_setup` is what the sharded train-step
scripts share."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_on_8_devices(script: str, *args) -> dict:
    """Run `python -c script ROOT *args` with 8 fake CPU devices, the repository and tests/ on its path
    and the repository as cwd; the script prints "RESULT" + a JSON object, which is returned."""
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p for p in path if p))
    script = "import jax\nassert jax.device_count() == 8, jax.devices()\n" + script
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT), *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def train_setup():
    """A tiny model config, its parameters (float32, numpy), one packed batch of 8 rows of 24 tokens
    (two documents and padding per row) and AdamW (lr 1e-3, no warmup): (cfg, params, batch, tx, sched)."""
    import jax
    import numpy as np

    from sbd_jax.config import ModelConfig
    from sbd_jax.models import param_shapes
    from sbd_jax.training.config import OptimConfig
    from sbd_jax.training.examples import PackedBatch
    from sbd_jax.training.optim import make_optimizer

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, mask_token_id=3)
    rng = np.random.default_rng(0)
    params = jax.tree.map_with_path(
        lambda path, s: (1.0 if path[-1].key.endswith("norm") else 0.0) + rng.normal(0, 0.05, s).astype(np.float32),
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    B, L = 8, 24
    tok = rng.integers(4, 64, (B, L))
    cut = rng.integers(6, L - 6, B)
    ar = np.arange(L)
    seg = np.where(ar < cut[:, None], 1, 2)
    seg[:, -2:] = 0
    pos = np.where(seg == 1, ar, ar - cut[:, None]) * (seg > 0)
    batch = PackedBatch(*(a.astype(np.int32) for a in (tok * (seg > 0), seg, pos, (seg > 0).astype(int))))
    tx, sched = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0, eps=1e-6), 10)
    return cfg, params, batch, tx, sched
