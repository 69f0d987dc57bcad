"""Quantize a model directory once and save it quantized (values + scales, the scheme in config.json), so that
serving loads the small model directly: `decode.py --model OUT_DIR`.

  python -m sbd_jax.io.quantize MODEL_DIR OUT_DIR --quantize fp8 [--calibration text.jsonl] [--windows 16]

With `--calibration` (JSON lines with a "text" or "prompt" field; representative text, not the evaluation set),
int8 / fp8 values are chosen by GPTQ (sbd_jax/models/gptq.py): on SmolLM2-135M fp8 keeps 95% top-1 agreement with
the float model instead of 93% (BENCHMARKS.md, "Quantization"). Without it, round to nearest
(what `decode.py --quantize` does at load). The tokenizer files and generation_config.json are copied along."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from ..config import ConfigError
from ..jsonlines import parse_object
from ..models.gptq import gptq_params
from ..models.quant import Quantization, quantize_params
from .hf import from_pretrained, save_pretrained
from .hf_layout import CheckpointError
from .tokenizer import Tokenizer

TEXT_FIELDS = ("text", "prompt")


def calibration_windows(path, tok: Tokenizer, windows: int, tokens: int) -> np.ndarray:
    """[windows, tokens] ids: the file's texts (one JSON object per line) tokenized, joined and cut into windows;
    an error names the file when it holds too little text."""
    path = Path(path)
    if windows < 1 or tokens < 1:
        raise ConfigError(f"calibration windows and tokens must be >= 1, got {windows} and {tokens}")
    if not path.is_file():
        raise ConfigError(f"calibration file {str(path)!r} does not exist")
    ids: list[int] = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"calibration file {str(path)!r} line {n} is not UTF-8 text (byte {e.start}): "
                                  "JSON lines of text are expected") from None
            if not line.strip():
                continue
            obj = parse_object(line, f"{path}: line {n}", ConfigError)
            text = next((obj[k] for k in TEXT_FIELDS if isinstance(obj.get(k), str)), None)
            if text is None:
                raise ConfigError(f"{path}: line {n}: needs a string field {' or '.join(TEXT_FIELDS)}")
            ids += _first_tokens(tok, text, windows * tokens - len(ids))
            if len(ids) >= windows * tokens:
                return np.asarray(ids[:windows * tokens], np.int32).reshape(windows, tokens)
    raise ConfigError(f"calibration file {str(path)!r} holds {len(ids)} tokens; {windows} windows of {tokens} need "
                      f"{windows * tokens} (pass fewer --windows or --tokens, or more text)")


def _first_tokens(tok: Tokenizer, text: str, need: int, margin: int = 16) -> list[int]:
    """About the first `need` tokens of `text`, tokenizing only a prefix (growing from 8 characters per token needed)
    so that a huge line costs what the windows use: the prefix's last `margin` tokens, which the cut may change,
    are left out."""
    cut = 8 * (need + margin)
    while cut < len(text):
        ids = tok.encode(text[:cut], add_special_tokens=False)
        if len(ids) >= need + margin:
            return ids[:need]
        cut *= 2
    return tok.encode(text, add_special_tokens=False)


def quantize_dir(model_dir, out_dir, quantize: str, *, calibration=None, windows: int = 16, tokens: int = 512) -> Path:
    """MODEL_DIR (full precision) -> OUT_DIR quantized, with its tokenizer and generation files."""
    q = Quantization.of(quantize)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        raise ConfigError(f"output directory {str(out_dir)!r} exists: choose a new one")
    tok = Tokenizer.find(model_dir)
    if calibration is not None and tok is None:
        raise ConfigError(f"{str(model_dir)!r} has no tokenizer.json to read the calibration text with")
    ids = None if calibration is None else calibration_windows(calibration, tok, windows, tokens)
    cfg, params = from_pretrained(model_dir)
    params = quantize_params(params, cfg, q) if ids is None else gptq_params(params, cfg, q, ids)
    # written beside it and renamed when whole: a failed write (a full disk) leaves nothing that blocks a rerun
    part = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    try:
        save_pretrained(cfg, params, part)
        for f in [*(tok.files if tok else ()), model_dir / "generation_config.json"]:
            if Path(f).is_file():
                shutil.copy(f, part / Path(f).name)
        part.rename(out_dir)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sbd_jax.io.quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--quantize", required=True, help="int8, fp8, int4 or int4-g<N>")
    ap.add_argument("--calibration", default=None, help="JSON lines of text: GPTQ (int8, fp8)")
    ap.add_argument("--windows", type=int, default=16, help="calibration windows")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per calibration window")
    args = ap.parse_args(argv)
    try:
        out = quantize_dir(args.model_dir, args.out_dir, args.quantize, calibration=args.calibration,
                           windows=args.windows, tokens=args.tokens)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk: nothing of the output is left
        print(f"error: writing {args.out_dir!r}: {e.strerror or e} (nothing was written there)", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
