"""Backend choice, tile sizes and the lowerings' rules for the SBD Pallas kernels.

Backends (`PallasOptions.backend`; None follows `force_backend`, else `jax.default_backend()`):
"interpret" (CPU) runs the Triton-style kernels (`flash_train`, `decode`) in interpret mode;
"triton" (GPU) the same kernels through the Triton lowering (chosen by passing its CompilerParams);
"tpu" the Mosaic-TPU kernels (`tpu_train`, `tpu_decode`), with `interpret=True` on the host.
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
# the side of the score tile each tile field sits on in the TPU kernels
TPU_LANE_FIELDS = ("block_q", "block_k", "block_q_dkv", "decode_block_k")
TPU_SUBLANE_FIELDS = ("block_k_dkv", "decode_block_rows")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two): block_q x block_k for the training forward and dq kernels,
    block_q_dkv x block_k_dkv for dk/dv; decode_block_k (keys) x decode_block_rows (rows of (window
    token, query head of the KV head): one K/V read per row tile) for decode. num_splits: decode
    programs per (row, KV head) along the cache (None: from batch, heads and device).
    num_warps / num_stages: Triton only."""

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


DEFAULT_BLOCKS = {
    "interpret": BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32,
                            decode_block_k=32, decode_block_rows=64, num_splits=2),
    # decode tiles from bench/tune_decode.py (BENCHMARKS.md "Decode tile sweep"); training tiles untuned
    "triton": BlockSizes(decode_block_rows=64),  # the other fields: the class defaults
    # untuned, in the range of jax's splash attention defaults; lane-side tiles are multiples of
    # 128, sublane-side ones of 16; 2 splits give both TensorCores of a megacore chip work at batch 1
    "tpu": BlockSizes(block_q=256, block_k=512, block_q_dkv=512, block_k_dkv=256,
                      decode_block_k=512, decode_block_rows=256, num_splits=2),
}


@dataclasses.dataclass(frozen=True)
class PallasOptions:
    """Everything static about one kernel call (hashable: used as a custom_vjp static argument).

    kernel:  "auto" picks "decode" when there are more keys than queries (a KV cache) and at
             most `decode_max_q` queries, else "train" (only speed differs; one backward pass).
    backend: None (see the module docstring) or one of BACKENDS; blocks: None -> DEFAULT_BLOCKS.
    scale:   softmax scale; None -> head_dim ** -0.5 (as the reference).
    interpret: with backend "tpu", run its kernels in interpret mode on the host (None -> False,
             or what `force_backend` set).
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

    def resolved(self, head_dim: int | None = None) -> PallasOptions:
        """Backend, interpret and blocks filled in (and the scale, given `head_dim`), checked
        against the backend's rules."""
        backend, interpret = self.backend, self.interpret
        if backend is None:
            backend, forced_interpret = _forced[-1] if _forced else (default_backend(), False)
            interpret = forced_interpret if interpret is None else interpret
        interpret = bool(interpret) or backend == "interpret"
        if interpret and backend == "triton":
            backend = "interpret"  # the Triton kernels' interpret mode
        scale = self.scale if self.scale is not None or head_dim is None else float(head_dim) ** -0.5
        opts = dataclasses.replace(self, backend=backend, blocks=self.blocks or DEFAULT_BLOCKS[backend],
                                   interpret=interpret, scale=scale)
        opts._check(head_dim)
        return opts

    def _check(self, head_dim):
        if self.backend == "triton" and head_dim is not None and not _is_pow2(head_dim):
            raise PallasOptionsError(
                f"the Triton lowering needs a power-of-two head_dim, got {head_dim} (use impl='xla')")
        for backend, compiled_only, fields, bad, msg in _TILE_RULES:
            if backend != self.backend or (compiled_only and self.interpret):
                continue
            for f in fields:
                if bad(getattr(self.blocks, f)):
                    raise PallasOptionsError(msg.format(f=f, v=getattr(self.blocks, f)))


# The lowerings' tile rules: (backend, compiled only, fields, is_bad(tile), message). Mosaic's rules
# are for tiles that do not cover a whole axis (one that does is the full array dim, always legal).
# TPU interpret mode accepts any tile >= 8, so that CPU tests cross many tiles on short sequences.
_TILE_RULES = (
    ("triton", False, TILE_FIELDS, lambda v: v < 16, "Triton dots need tiles >= 16, got {f}={v}"),
    ("tpu", False, TPU_LANE_FIELDS + TPU_SUBLANE_FIELDS, lambda v: v < 8,
     "TPU kernels need tiles >= 8, got {f}={v}"),
    ("tpu", True, TPU_LANE_FIELDS, lambda v: v % 128,
     "Mosaic TPU: {f} sits on the lane axis and must be a multiple of 128, got {v} "
     "(any tile >= 8 is accepted in interpret mode only)"),
    ("tpu", True, TPU_SUBLANE_FIELDS, lambda v: v < 16,
     "Mosaic TPU: {f} sits on the sublane axis and must be >= 16 (bf16 packs 16 rows per tile), got {v}"),
)


_forced: list[tuple[str, bool]] = []


@contextlib.contextmanager
def force_backend(backend: str, *, interpret: bool = False):
    """Within the block, options with backend=None (e.g. the model's attention_impl="pallas")
    resolve to `backend` (and `interpret`), e.g. `force_backend("tpu", interpret=True)` runs the
    Mosaic-TPU kernels on CPU. Read when a call is TRACED: trace jitted functions inside the block."""
    if backend not in BACKENDS:
        raise PallasOptionsError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _forced.append((backend, bool(interpret)))
    try:
        yield
    finally:
        _forced.pop()


_PLATFORM_BACKENDS = {"cpu": "interpret", "gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "tpu"}


def default_backend() -> str:
    plat = jax.default_backend()
    if plat not in _PLATFORM_BACKENDS:
        raise PallasOptionsError(f"no Pallas backend for platform {plat!r}; pass backend='interpret'")
    return _PLATFORM_BACKENDS[plat]


def call_kwargs(opts: PallasOptions, semantics: tuple[str, ...] = ()) -> dict:
    """`interpret=` / `compiler_params=` arguments of pl.pallas_call for `opts.backend`
    (`semantics`: the Mosaic dimension semantics of a TPU kernel's grid). TPU interpret mode,
    `pltpu.InterpretParams()`, simulates VMEM/SMEM, DMAs and the scalar prefetch on the host and
    reads uninitialised buffers as NaN, which the tests rely on."""
    if opts.backend == "interpret":
        return {"interpret": True}
    if opts.backend == "triton":
        from jax.experimental.pallas import triton as plgpu
        return {"compiler_params": plgpu.CompilerParams(num_warps=opts.blocks.num_warps,
                                                        num_stages=opts.blocks.num_stages)}
    from jax.experimental.pallas import tpu as pltpu
    kw = {"compiler_params": pltpu.CompilerParams(dimension_semantics=semantics)}
    if opts.interpret:
        kw["interpret"] = pltpu.InterpretParams()
    return kw
