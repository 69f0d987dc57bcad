#!/usr/bin/env python
"""SBD fine-tuning: `python train.py --config configs/tiny_sbd.yaml [key=value ...]`.

Overrides use dotted keys, values parsed as YAML: `steps=200 optim.lr=1e-3 sbd.ntp_only=true
mesh.fsdp=8 data.path=my.jsonl`; `mesh.context=8` splits each row's sequence ([x ; x_hat], 2L tokens) over 8
devices (context parallelism, for long rows). Resumes from <out_dir>/checkpoints when a checkpoint is there.
A run holds <out_dir>/train.lock: a second train.py on the same out_dir is refused, naming the first.
Multi-host (GPU clusters, TPU pods): start the same command on every host; jax.distributed is
initialised from the environment (see README)."""
from __future__ import annotations

import argparse
import os
import signal
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="training YAML (configs/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=100 optim.lr=1e-3")
    ap.add_argument("--prepare", action="store_true",
                    help="only tokenize the data into its store (data.store_dir; training reuses it) and report")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    from sbd_jax.config import ConfigError, load_config
    from sbd_jax.io.hf import CheckpointError
    from sbd_jax.sharding import maybe_initialize_distributed
    from sbd_jax.training.config import TrainConfig
    from sbd_jax.training.loop import train
    from sbd_jax.training.checkpoint import CheckpointSaveError
    from sbd_jax.training.step import NonFiniteStepError

    def on_term(signum, frame):  # a scheduler's SIGTERM: stop like Ctrl-C (in-flight saves complete)
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        if args.prepare:
            from sbd_jax.io.hf import load_hf_config
            from sbd_jax.training.data import build_iterator, format_report
            model = cfg.model.config or load_hf_config(cfg.model.init_from)  # its EOS, as training uses it
            it = build_iterator(cfg.data, cfg.batch_size, eos_id=model.eos_ids[0] if model.eos_ids else None,
                                vocab_size=model.vocab_size, mask_id=None if cfg.sbd.ntp_only else model.mask_token_id)
            print(format_report(it.report))
            return 0
        maybe_initialize_distributed()
        signal.signal(signal.SIGTERM, on_term)
        result = train(cfg)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteStepError, CheckpointSaveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the message short
        print("interrupted: the last complete checkpoint is intact; run the same command to resume",
              file=sys.stderr)
        return 130
    if not result.history:  # nothing left to train: the run was complete
        print(f"done: the run in {result.out_dir} is already complete at step {result.step} (raise steps, with "
              "allow_changes=[steps], to train on)")
        return 0
    last = result.history[-1]
    print(f"done: step {result.step}, loss {last.get('loss', float('nan')):.4f} "
          f"(ntp {last.get('ntp_loss', float('nan')):.4f}, matp {last.get('matp_loss', float('nan')):.4f}); "
          f"checkpoints in {result.out_dir / 'checkpoints'}" + (f"; HF export in {result.hf_dir}" if result.hf_dir else "")
          + (f"; LoRA adapter (PEFT layout) in {result.adapter_dir}" if result.adapter_dir else "")
          + (f"; resumed from step {result.resumed_from}" if result.resumed_from is not None else ""))
    return 0


if __name__ == "__main__":
    code = main()
    if code == 130:  # interrupted: a checkpoint or data thread may still run; leave without the interpreter's
        sys.stdout.flush()  # teardown, which aborts on a running native thread ("terminate called ...")
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
