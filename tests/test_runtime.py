"""The XLA flags decode.py and the benchmarks run with (`sbd_jax.runtime`)."""
import os
import subprocess
import sys
from pathlib import Path

from sbd_jax.runtime import GPU_DECODE_FLAGS, use_decode_xla_flags

ROOT = Path(__file__).resolve().parents[1]


def test_decode_flags_are_added_and_the_users_win():
    env = {}
    assert use_decode_xla_flags(env) == list(GPU_DECODE_FLAGS) and env["XLA_FLAGS"] == " ".join(GPU_DECODE_FLAGS)
    assert use_decode_xla_flags(env) == []  # idempotent
    mine = "--xla_force_host_platform_device_count=2 --xla_gpu_enable_command_buffer=FUSION"
    env = {"XLA_FLAGS": mine}
    assert use_decode_xla_flags(env) == [] and env["XLA_FLAGS"] == mine
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    use_decode_xla_flags(env)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", *GPU_DECODE_FLAGS]


def test_this_xla_accepts_the_decode_flags():
    """XLA aborts on a flag it does not know: a jax upgrade that drops one must fail here, not in decode.py."""
    code = ("from sbd_jax.runtime import use_decode_xla_flags; use_decode_xla_flags(); import jax, jax.numpy as jnp; "
            "print(int(jax.jit(lambda x: jax.lax.while_loop(lambda c: c < 5, lambda c: c + 1, x))(jnp.int32(0))))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "5", proc.stderr[-2000:]
