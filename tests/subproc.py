"""Tests on 8 fake CPU devices. XLA_FLAGS must be set before jax is imported, so such a test runs its
script in a fresh interpreter (`run_on_8_devices`); `train_setup` is what the sharded train-step
scripts share."""
import json
import os
import socket
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


def compilation_cache_env() -> dict:
    """The test run's XLA compilation cache settings (tests/conftest.py), for a script started with an
    environment of its own: it loads the programs the run compiled before and leaves its own for the rest."""
    return {k: v for k, v in os.environ.items() if k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_processes(argv: list[str], *, processes: int, devices_each: int, port: int) -> list[subprocess.Popen]:
    """Start `python *argv` as `processes` processes of one jax.distributed job (localhost coordinator at
    `port`, `devices_each` fake CPU devices each), the repository as cwd; stdout/stderr piped."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT), JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(processes))
    if processes == 1:
        env.pop("JAX_COORDINATOR_ADDRESS"), env.pop("JAX_NUM_PROCESSES")
    return [subprocess.Popen([sys.executable, *argv], env=dict(env, JAX_PROCESS_ID=str(i)), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(processes)]


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """Wait for every process; assert each exited 0; -> their stdouts."""
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, e) in zip(procs, outs):
        assert p.returncode == 0, f"process exited {p.returncode}:\n{e.decode()[-4000:]}"
    return [o.decode() for o, _ in outs]


def train_setup():
    """The tiny model, parameters (numpy) and packed batch of tests/training_fixtures.py (8 rows of 24
    tokens: two documents and padding per row) and AdamW (lr 1e-3, no warmup): (cfg, params, batch,
    tx, sched)."""
    import jax
    import numpy as np
    from training_fixtures import CFG, np_params, packed_batch

    from sbd_jax.training.config import OptimConfig
    from sbd_jax.training.optim import make_optimizer

    tx, sched = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0, eps=1e-6), 10)
    return CFG, jax.tree.map(np.asarray, np_params(CFG)), packed_batch(), tx, sched
