"""Backend choice and block sizes for the SBD Pallas kernels.

The backend is chosen from `jax.default_backend()` unless given explicitly:
  "cpu" -> Pallas interpret mode (the only mode Pallas supports on CPU; this is what the tests run);
  "gpu" -> compiled with the *Triton* lowering, selected explicitly by passing
           `jax.experimental.pallas.triton.CompilerParams` (in jax 0.11.x a GPU pallas_call without
           compiler params is also lowered through Triton; Mosaic GPU needs its own kernel style);
  "tpu" -> not supported yet (clear error; see below).

HONEST STATUS (no GPU or TPU was available to the session that wrote this):
  * interpret mode: run and tested against the reference attention (tests/test_pallas_*.py);
  * Triton: the kernels are written to the Triton lowering's rules (power-of-two tensor shapes,
    2-D dots without batch dims, dynamic `pl.ds` slices of refs, scalar loads of tile tables),
    and tests/test_pallas_lowering.py lowers them (Pallas -> Triton IR) for an abstract H100 on
    CPU. PTX compilation, runtime and speed are NOT verified;
  * TPU: NOT supported yet. Cross-lowering for TPU shows these kernels' layouts break Mosaic's
    block rules (last two block dims must be (8k, 128m) or full; scalar tables belong in SMEM),
    so backend "tpu" raises a clear error instead of failing deep inside the lowering. A TPU
    version needs a [B, H, T, D] layout and scalar-prefetched tile lists (splash-attention style).
"""
from __future__ import annotations

import dataclasses

import jax


class PallasOptionsError(ValueError):
    """Bad kernel options (block sizes, backend, kernel name)."""


BACKENDS = ("interpret", "triton", "tpu")
KERNELS = ("auto", "train", "decode")


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


TILE_FIELDS = ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "decode_block_k",
               "decode_block_rows")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (all powers of two).

    block_q / block_k:           training forward and dq kernels (query tile x key tile)
    block_q_dkv / block_k_dkv:   dk/dv kernel
    decode_block_k:              decode kernel key tile
    decode_block_rows:           decode kernel query tile, in rows of (window token, query head
                                 of the KV head); the window's Tq * G rows are split into tiles
                                 of this size (one K/V read per tile: keep Tq * G <= this when
                                 registers allow, e.g. 2k = 32 tokens x G = 4 heads = 128)
    num_splits:                  decode: programs per (row, KV head) along the cache
                                 (flash-decoding); None = chosen from batch, heads and device
    num_warps / num_stages:      Triton only
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    decode_block_k: int = 64
    decode_block_rows: int = 128
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for f in TILE_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, int) or not _is_pow2(v):
                raise PallasOptionsError(f"{f} must be a power of two, got {v!r}")
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise PallasOptionsError(f"num_splits must be None or an int >= 1, got {self.num_splits!r}")


# Per-backend defaults. GPU/TPU values are starting points, NOT tuned (no device was available).
DEFAULT_BLOCKS = {
    "interpret": BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32,
                            decode_block_k=32, decode_block_rows=64, num_splits=2),
    "triton": BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_k_dkv=64,
                         decode_block_k=64, decode_block_rows=128, num_splits=None,
                         num_warps=4, num_stages=2),
}


@dataclasses.dataclass(frozen=True)
class PallasOptions:
    """Everything static about one kernel call (hashable: used as a custom_vjp static argument).

    kernel:  "auto" picks "decode" when there are more keys than queries (a KV cache) and at
             most `decode_max_q` queries, else "train". Both kernels accept any metadata, so the
             choice only affects speed; both share the same backward pass.
    backend: None -> from jax.default_backend() ("cpu" -> "interpret", "gpu" -> "triton",
             "tpu" -> "tpu"); or one of "interpret", "triton", "tpu".
    blocks:  None -> DEFAULT_BLOCKS[backend].
    scale:   softmax scale; None -> head_dim ** -0.5 (as the reference).
    """

    kernel: str = "auto"
    backend: str | None = None
    blocks: BlockSizes | None = None
    scale: float | None = None
    decode_max_q: int = 128

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise PallasOptionsError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise PallasOptionsError(f"backend must be None or one of {BACKENDS}, got {self.backend!r}")
        if self.blocks is not None and not isinstance(self.blocks, BlockSizes):
            raise PallasOptionsError(f"blocks must be a BlockSizes, got {type(self.blocks).__name__}")

    def resolved(self) -> PallasOptions:
        backend = self.backend or default_backend()
        if backend == "tpu":
            raise PallasOptionsError(
                "the SBD Pallas kernels have no TPU (Mosaic) version yet: their layouts break "
                "Mosaic's block-shape rules; use attention_impl='xla' on TPU")
        blocks = self.blocks or DEFAULT_BLOCKS[backend]
        return dataclasses.replace(self, backend=backend, blocks=blocks)


def default_backend() -> str:
    plat = jax.default_backend()
    if plat == "cpu":
        return "interpret"
    if plat in ("gpu", "cuda", "rocm"):
        return "triton"
    if plat == "tpu":
        return "tpu"
    raise PallasOptionsError(f"no Pallas backend for platform {plat!r}; pass backend='interpret'")


def call_kwargs(backend: str, blocks: BlockSizes) -> dict:
    """`interpret=` / `compiler_params=` arguments of pl.pallas_call for `backend`. Passing the
    Triton CompilerParams selects the Triton lowering explicitly (not Mosaic GPU)."""
    if backend == "interpret":
        return {"interpret": True}
    if backend == "triton":
        from jax.experimental.pallas import triton as plgpu
        return {"compiler_params": plgpu.CompilerParams(num_warps=blocks.num_warps,
                                                        num_stages=blocks.num_stages)}
    raise PallasOptionsError(f"no Pallas kernels for backend {backend!r}")


def check_head_dim(backend: str, head_dim: int) -> None:
    if backend == "triton" and not _is_pow2(head_dim):
        raise PallasOptionsError(
            f"the Triton lowering needs a power-of-two head_dim, got {head_dim} (use impl='xla')")


def check_triton_blocks(backend: str, blocks: BlockSizes) -> None:
    if backend != "triton":
        return
    for f in TILE_FIELDS:
        if getattr(blocks, f) < 16:
            raise PallasOptionsError(f"Triton dots need tiles >= 16, got {f}={getattr(blocks, f)}")
