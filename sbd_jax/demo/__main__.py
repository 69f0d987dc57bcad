"""`python -m sbd_jax.demo`: tiny end-to-end run of the foundation (until the full demo lands):
random tiny Llama -> save in HF layout -> reload -> forward with the SBD mask over [x ; x_hat]."""
import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import sbd_jax
from sbd_jax.attention import block_starts, clean_meta, concat_meta, copy_meta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="where to write the HF-layout model (default: a temp dir)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    cfg = sbd_jax.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, mask_token_id=255)
    t0 = time.time()
    params = sbd_jax.init_params(cfg, jax.random.key(0))
    out = args.out or tempfile.mkdtemp(prefix="sbd_jax_demo_")
    sbd_jax.save_pretrained(cfg, params, out)
    cfg2, params2 = sbd_jax.from_pretrained(out)
    L, k = 12, 4
    x = np.random.default_rng(0).integers(0, 255, (1, L)).astype(np.int32)
    x_hat = np.where(np.arange(L) % 3 == 0, cfg.mask_token_id, x)
    pos = np.arange(L)[None]
    seg = np.ones((1, L), np.int32)
    meta = concat_meta(clean_meta(seg, pos), copy_meta(seg, pos, block_starts(pos, k)))
    logits, _ = sbd_jax.forward(params2, cfg2, jnp.concatenate([x, x_hat], 1), meta)
    same = bool(jnp.all(logits == sbd_jax.forward(params, cfg, jnp.concatenate([x, x_hat], 1), meta)[0]))
    print(f"saved + reloaded a random {cfg.model_type} in HF layout at {out}")
    print(f"forward over [x ; x_hat] (2L={2 * L}, k={k}): logits {tuple(logits.shape)}, "
          f"identical after reload: {same}, {time.time() - t0:.1f}s")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
