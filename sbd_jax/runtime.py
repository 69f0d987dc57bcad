"""XLA settings the decoders are measured with (BENCHMARKS.md, "8B decoding on an H100"). XLA reads XLA_FLAGS
once, when jax first creates a backend: call these before the first computation."""
from __future__ import annotations

import os

# The whole decode loop (its `lax.while_loop` and the `lax.cond`s inside) captured as CUDA graphs: without it,
# the host launches each of the ~900 kernels of an 8B step and the GPU idles ~30% of the time between them.
# The first five kinds are XLA's default; CONDITIONAL and WHILE are what the loop needs.
GPU_DECODE_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",)


def use_decode_xla_flags(environ=os.environ) -> list[str]:
    """Add `GPU_DECODE_FLAGS` to XLA_FLAGS, each unless XLA_FLAGS already sets that flag (the user's value
    wins). Harmless on CPU and TPU (GPU flags; XLA accepts them everywhere). Returns the flags added."""
    current = environ.get("XLA_FLAGS", "")
    set_already = {f.split("=")[0].lstrip("-") for f in current.split()}
    added = [f for f in GPU_DECODE_FLAGS if f.split("=")[0].lstrip("-") not in set_already]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
