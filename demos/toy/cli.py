"""The command line shared by the demos: `[--quick] [--out DIR] [key=value ...]` -> a validated config -> run."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from sbd_jax.config import ConfigError, apply_overrides, from_dict
from sbd_jax.decoding.spec import DecodeError
from sbd_jax.io.hf_layout import CheckpointError
from sbd_jax.training.step import NonFiniteStepError


def main(argv, *, prog: str, doc: str, config_cls, run, quick_help: str, default_out: str) -> None:
    """Parse argv, build `config_cls` (its `quick()` with --quick) with the key=value overrides, and `run` it."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", default=None, help=f"output directory (default {default_out})")
    ap.add_argument("overrides", nargs="*", help=f"{config_cls.__name__} fields as key=value")
    args = ap.parse_args(argv)
    base = config_cls.quick() if args.quick else config_cls()
    data = apply_overrides(dataclasses.asdict(base), args.overrides)
    if args.out:
        data["out_dir"] = args.out
    try:
        run(from_dict(config_cls, data))
    except (ConfigError, CheckpointError, DecodeError, NonFiniteStepError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)  # the problem, named (file, key, value), without a traceback
        raise SystemExit(1 if isinstance(e, NonFiniteStepError) else 2) from None
    except KeyboardInterrupt:
        print("interrupted: finished stages are kept; run the same command to resume", file=sys.stderr)
        raise SystemExit(130) from None
