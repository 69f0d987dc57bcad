"""Backend choice and block sizes for the SBD Pallas kernels.

The backend is chosen from `jax.default_backend()` unless given explicitly (or forced with
`force_backend`):
  "cpu" -> "interpret": the Triton-style kernels (`flash_train`, `decode`) in Pallas interpret
           mode (the only mode Pallas supports on CPU);
  "gpu" -> "triton": the same kernels compiled with the *Triton* lowering, selected explicitly by
           passing `jax.experimental.pallas.triton.CompilerParams` (in jax 0.11.x a GPU
           pallas_call without compiler params is also lowered through Triton; Mosaic GPU needs
           its own kernel style);
  "tpu" -> "tpu": the Mosaic-TPU kernels (`tpu_train`, `tpu_decode`: [.., T, D] tiles with
           (8, 128)-legal blocks, scalar-prefetched tile lists, VMEM scratch accumulators).
           `interpret=True` runs them in TPU interpret mode (`pltpu.InterpretParams()`) on CPU.

STATUS:
  * interpret mode: both kernel families run and are tested against the reference attention
    (tests/test_pallas_attention.py, tests/test_pallas_model.py: Triton-style;
    tests/test_pallas_tpu.py: TPU kernels in TPU interpret mode, outputs, gradients, GQA/MQA,
    ragged caches, bf16, and the whole model);
  * Triton: the kernels are written to the Triton lowering's rules (power-of-two tensor shapes,
    2-D dots without batch dims, dynamic `pl.ds` slices of refs, scalar loads of tile tables),
    and tests/test_pallas_lowering.py lowers them (Pallas -> Triton IR) for an abstract H100 on
    CPU; on an H100 they compiled, pass test_pallas_attention.py / test_pallas_model.py and were
    timed (BENCHMARKS.md; decode tiles tuned there, training tiles not). jax 0.11.2 marks the
    Pallas Triton backend deprecated in favour of Mosaic GPU;
  * TPU: tests/test_pallas_lowering.py cross-lowers the TPU kernels on CPU
    (`lower(lowering_platforms=("tpu",))`: Pallas' Mosaic lowering, its block-shape rules, SMEM
    scalar prefetch, dimension semantics; the serialised kernels are decoded and checked).
    Mosaic's layout passes and compilation (they run in libtpu, on a TPU host), VMEM limits,
    runtime on a TPU and speed are NOT verified. DEFAULT_BLOCKS["tpu"] is untuned.
"""
from __future__ import annotations

import contextlib
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


# Per-backend defaults. The TPU values are starting points, NOT tuned (no TPU was available).
DEFAULT_BLOCKS = {
    "interpret": BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32,
                            decode_block_k=32, decode_block_rows=64, num_splits=2),
    # triton decode tiles from bench/tune_decode.py on an H100 (bench/results/gpu_h100/tune_decode.log):
    # 64-row query tiles with 4 warps were fastest at batch 8 (0.35 ms vs 0.52 ms with 128 rows)
    # and within 8% of the best at batch 1. The training tiles are untuned.
    "triton": BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_k_dkv=64,
                         decode_block_k=64, decode_block_rows=64, num_splits=None,
                         num_warps=4, num_stages=2),
    # Mosaic TPU: lane-facing tiles (block_q, block_k, block_q_dkv, decode_block_k) are
    # multiples of 128, sublane-facing ones (block_k_dkv, decode_block_rows) multiples of 16.
    # UNTUNED starting points (no TPU was available), in the range of jax's splash attention
    # defaults; num_splits = 2 gives both TensorCores of a megacore chip work at batch 1.
    "tpu": BlockSizes(block_q=256, block_k=512, block_q_dkv=512, block_k_dkv=256,
                      decode_block_k=512, decode_block_rows=256, num_splits=2),
}

# tile fields by the side of the score tile they sit on in the TPU kernels
TPU_LANE_FIELDS = ("block_q", "block_k", "block_q_dkv", "decode_block_k")
TPU_SUBLANE_FIELDS = ("block_k_dkv", "decode_block_rows")


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
    interpret: run the chosen backend's kernels in Pallas interpret mode on the host. Only
             meaningful with backend "tpu" (the TPU kernels under `pltpu.InterpretParams()`, how
             they are tested on CPU); backend "interpret" always interprets. None -> False, or
             what `force_backend` set.
    """

    kernel: str = "auto"
    backend: str | None = None
    blocks: BlockSizes | None = None
    scale: float | None = None
    decode_max_q: int = 128
    interpret: bool | None = None

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise PallasOptionsError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise PallasOptionsError(f"backend must be None or one of {BACKENDS}, got {self.backend!r}")
        if self.blocks is not None and not isinstance(self.blocks, BlockSizes):
            raise PallasOptionsError(f"blocks must be a BlockSizes, got {type(self.blocks).__name__}")
        if self.interpret not in (None, True, False):
            raise PallasOptionsError(f"interpret must be None or a bool, got {self.interpret!r}")

    def resolved(self) -> PallasOptions:
        backend, interpret = self.backend, self.interpret
        if backend is None:
            backend, forced_interpret = _forced[-1] if _forced else (default_backend(), False)
            interpret = forced_interpret if interpret is None else interpret
        interpret = bool(interpret) or backend == "interpret"
        if interpret and backend == "triton":
            backend = "interpret"  # the Triton kernels' interpret mode
        blocks = self.blocks or DEFAULT_BLOCKS[backend]
        return dataclasses.replace(self, backend=backend, blocks=blocks, interpret=interpret)


_forced: list[tuple[str, bool]] = []


@contextlib.contextmanager
def force_backend(backend: str, *, interpret: bool = False):
    """Within the block, options with backend=None (e.g. the model's attention_impl="pallas")
    resolve to `backend` (and `interpret`) instead of following jax.default_backend(). Read when
    a call is TRACED: trace (first-call) jitted functions inside the block. E.g.
    `with force_backend("tpu", interpret=True):` runs the Mosaic-TPU kernels on CPU."""
    if backend not in BACKENDS:
        raise PallasOptionsError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _forced.append((backend, bool(interpret)))
    try:
        yield
    finally:
        _forced.pop()


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


def tpu_call_kwargs(opts: PallasOptions, semantics: tuple[str, ...]) -> dict:
    """`compiler_params=` (Mosaic dimension semantics) and, in interpret mode,
    `interpret=pltpu.InterpretParams()` (TPU interpret mode: simulates VMEM/SMEM, DMAs and the
    scalar prefetch on the host; uninitialised buffers read as NaN, which the tests rely on)."""
    from jax.experimental.pallas import tpu as pltpu
    kw = {"compiler_params": pltpu.CompilerParams(dimension_semantics=semantics)}
    if opts.interpret:
        kw["interpret"] = pltpu.InterpretParams()
    return kw


def check_tpu_blocks(opts: PallasOptions) -> None:
    """Mosaic's block rules for the tiles that do not cover a whole axis (a tile that covers its
    axis is the full array dim, always legal). Interpret mode accepts any tile >= 8 so CPU tests
    can cross many tiles on short sequences."""
    if opts.backend != "tpu":
        return
    b = opts.blocks
    for f in TPU_LANE_FIELDS + TPU_SUBLANE_FIELDS:
        if getattr(b, f) < 8:
            raise PallasOptionsError(f"TPU kernels need tiles >= 8, got {f}={getattr(b, f)}")
    if opts.interpret:
        return
    for f in TPU_LANE_FIELDS:
        if getattr(b, f) % 128:
            raise PallasOptionsError(
                f"Mosaic TPU: {f} sits on the lane axis and must be a multiple of 128, got "
                f"{getattr(b, f)} (any tile >= 8 is accepted in interpret mode only)")
    for f in TPU_SUBLANE_FIELDS:
        if getattr(b, f) < 16:
            raise PallasOptionsError(
                f"Mosaic TPU: {f} sits on the sublane axis and must be >= 16 (bf16 packs 16 "
                f"rows per tile), got {getattr(b, f)}")


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
