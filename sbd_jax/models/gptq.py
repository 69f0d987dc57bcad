"""GPTQ (Frantar et al. 2022, arXiv 2210.17323) for the int8 / fp8 projections: a weight's values are chosen input
column by input column so that its output on calibration activations moves least; each column's rounding error is
folded into the columns not yet quantized through the inverse Hessian of the layer's inputs (H = sum of X^T X). The
scale per output channel stays round-to-nearest's (qwix's absmax), so the result is an ordinary qwix QArray: saved,
loaded and multiplied like any other quantized weight (sbd_jax/models/quant.py).

  calibration_hessians(params, cfg, ids)      -> {(layer, name): H}, from a forward of the float model
  gptq_weight(w, name, H, q)                  -> the QArray of one projection's weight
  gptq_params(params, cfg, q, ids)            -> every projection quantized so (quant.quantize_params' twin)

The column loop is numpy float64 here: qwix.contrib.gptq_core unrolls it into one XLA program, whose compilation
did not finish on CPU for a 1536-column weight (XLA's simplifier looped), and eagerly took over 10 minutes for
SmolLM2-135M; this takes ~30 s. GPTQ needs the float model and calibration text at hand, so it runs once, before
`save_pretrained` writes the quantized model that serving then loads."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from qwix import QArray

from ..config import ConfigError
from .config import ModelConfig
from .layers import project
from .quant import QUANTIZED, Quantization, quantize_weight, weight_axes
from .transformer import forward
from .params import Weight, unstack_layers

BLOCK = 128  # columns updated together (the paper's lazy batch)
DAMP = 0.01  # of the mean diagonal, added to H's diagonal (the paper's dampening)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("w",), meta_fields=("on_input",))
@dataclasses.dataclass(frozen=True)
class Observed(Weight):
    """A weight whose input activations are handed to `on_input` (on the host, `jax.debug.callback`) whenever it is
    multiplied: how `calibration_hessians` sees a layer's inputs, in a jitted forward."""

    w: Any
    on_input: Any

    def astype(self, dtype) -> Observed:
        return dataclasses.replace(self, w=self.w.astype(dtype))

    def product(self, spec: str, x):
        jax.debug.callback(self.on_input, x)
        return project(spec, x, self.w)


def calibration_hessians(params: dict, cfg: ModelConfig, ids, *, batch: int = 4) -> dict:
    """H = X^T X (float64, [inputs, inputs]) of every projection's input activations X, over the token windows
    `ids` [N, T] run through the float model (params in `unstack_layers`' per-layer layout; one compiled forward,
    each projection's inputs handed to the host)."""
    from ..attention import clean_meta
    ids = np.asarray(ids, np.int32)
    if ids.ndim != 2 or ids.size == 0:
        raise ConfigError(f"calibration ids must be [windows, tokens], got shape {ids.shape}")
    hessians: dict = {}

    def record(key):
        def on_input(x):
            X = np.asarray(x, np.float64).reshape(-1, int(np.prod(x.shape[2:])))
            hessians[key] = hessians.get(key, 0.0) + X.T @ X
        return on_input
    layers = tuple({**lp, **{n: Observed(lp[n], record((li, n))) for n in QUANTIZED}}
                   for li, lp in enumerate(params["layers"]))
    observed = {**params, "layers": layers}

    @jax.jit
    def run(observed, x):
        B, T = x.shape
        meta = clean_meta(jnp.ones((B, T), jnp.int32), jnp.broadcast_to(jnp.arange(T), (B, T)))
        return forward(observed, cfg, x, meta)[0].sum()
    for i in range(0, len(ids), batch):
        jax.block_until_ready(run(observed, jnp.asarray(ids[i:i + batch])))
    jax.effects_barrier()  # every callback has run
    return hessians


def gptq_weight(w, name: str, H: np.ndarray, q: Quantization) -> QArray:
    """Projection `name`'s weight (one layer) as round-to-nearest's QArray (`quantize_weight`: int8 / fp8, a scale
    per output channel) with its values chosen by GPTQ against the input Hessian `H`."""
    rnd = quantize_weight(w, name, q)
    ins, outs = weight_axes(name, w.ndim)
    perm = outs + ins
    W = np.transpose(np.asarray(w, np.float64), perm)
    shape = W.shape
    scale = np.transpose(np.asarray(rnd.scale, np.float64), perm).reshape(-1)
    G = _gptq(W.reshape(scale.size, -1), np.asarray(H, np.float64), scale, q.qtype)
    qvalue = np.transpose(G.reshape(shape), np.argsort(perm)).astype(rnd.qvalue.dtype)
    return dataclasses.replace(rnd, qvalue=jnp.asarray(qvalue))


def _grid(x: np.ndarray, qtype) -> np.ndarray:
    """`x` (already divided by its scale) on the qtype's grid, as qwix's convert_to puts it."""
    if jnp.dtype(qtype) == jnp.int8:
        return np.clip(np.round(x), -128, 127)
    big = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    return np.clip(x, -big, big).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _gptq(W: np.ndarray, H: np.ndarray, scale: np.ndarray, qtype) -> np.ndarray:
    """The grid values (W ~ values * scale per row) of W [out, in] against H [in, in]: the paper's algorithm with
    lazy batches of BLOCK columns and the upper Cholesky factor of H^-1."""
    W, H = W.copy(), H.copy()
    cols = W.shape[1]
    dead = np.diag(H) == 0  # an input never seen: its column carries nothing
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H[np.diag_indices(cols)] += DAMP * np.mean(np.diag(H))
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T
    G = np.zeros_like(W)
    for a in range(0, cols, BLOCK):
        b = min(a + BLOCK, cols)
        W1, Err, Hi = W[:, a:b].copy(), np.zeros((W.shape[0], b - a)), Hinv[a:b, a:b]
        for i in range(b - a):
            w = W1[:, i]
            G[:, a + i] = _grid(w / scale, qtype)
            Err[:, i] = (w - G[:, a + i] * scale) / Hi[i, i]
            W1[:, i:] -= np.outer(Err[:, i], Hi[i, i:])
        W[:, b:] -= Err @ Hinv[a:b, b:]
    return G


def gptq_params(params: dict, cfg: ModelConfig, q: Quantization | str, ids) -> dict:
    """Every projection of `params` quantized by GPTQ on calibration windows `ids` [N, T], in the layout given
    (stacked or `unstack_layers`' per-layer): `quantize_params`' result with GPTQ's values."""
    q = Quantization.of(q)
    if q.scheme == "int4":
        raise ConfigError("GPTQ calibration is for int8 and fp8 (int4 groups are rounded to nearest)")
    stacked = not isinstance(params["layers"], (tuple, list))
    per = unstack_layers(params) if stacked else params
    H = calibration_hessians(per, cfg, ids)
    layers = tuple({**lp, **{n: gptq_weight(lp[n], n, H[(li, n)], q) for n in QUANTIZED}}
                   for li, lp in enumerate(per["layers"]))
    return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers) if stacked else layers}
