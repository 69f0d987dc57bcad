"""The demo's stages before evaluation: data (task suite + tokenizer), then training runs (pretrain, the two
fine-tunes). Each leaves its result in the output directory with the settings that made it; a rerun reuses a
finished stage, resumes an interrupted one, and refuses one made with other settings."""
from __future__ import annotations

import json
import time
from pathlib import Path

from sbd_jax.config import ConfigError, changed_settings, to_dict
from sbd_jax.models.config import ModelConfig
from sbd_jax.sharding import MeshConfig
from sbd_jax.training.config import CheckpointConfig, DataConfig, ModelSource, OptimConfig, SBDConfig, TrainConfig
from . import tasks
from . import tokenizer as demo_tok
from .config import DemoConfig


def stage_data(cfg: DemoConfig, log=print) -> dict:
    root = Path(cfg.out_dir) / "data"
    files = {n: root / f"{n}.jsonl" for n in ("pretrain", "finetune", "test")}
    tok_dir = root / "tokenizer"
    spec = {k: getattr(cfg, k) for k in ("seed", "n_pretrain", "n_finetune", "n_test", "vocab_size")}
    if (root / "settings.json").exists():
        check_stage_settings(root, json.loads((root / "settings.json").read_text()), spec)
    if all(f.exists() for f in files.values()) and (tok_dir / "tokenizer.json").exists():
        log(f"[data] reusing {root}")
        return {**files, "tokenizer": tok_dir}
    root.mkdir(parents=True, exist_ok=True)
    (root / "settings.json").write_text(json.dumps(spec))
    sets = {"pretrain": tasks.generate(cfg.n_pretrain, "train", cfg.seed),
            "finetune": tasks.generate(cfg.n_finetune, "train", cfg.seed + 1),
            "test": tasks.generate(cfg.n_test, "test", cfg.seed)}
    tok = demo_tok.build_tokenizer((p.text for p in sets["pretrain"]), cfg.vocab_size)  # training text only
    demo_tok.save(tok, tok_dir)
    for name, probs in sets.items():
        tmp = files[name].with_suffix(".tmp")
        with tmp.open("w") as f:
            for i, p in enumerate(probs):
                rec = ({"text": p.text} if name == "pretrain" else
                       {"id": f"{name}-{i}", "family": p.family, "prompt": p.prompt, "response": p.solution,
                        "answer": p.answer})
                f.write(json.dumps(rec) + "\n")
        tmp.rename(files[name])
    log(f"[data] {len(sets['pretrain'])} pretrain / {len(sets['finetune'])} fine-tune / {len(sets['test'])} "
        f"held-out problems ({', '.join(tasks.FAMILIES)}), tokenizer with {tok.get_vocab_size()} ids -> {root}")
    return {**files, "tokenizer": tok_dir}


def model_config(cfg: DemoConfig, tok_dir: Path) -> ModelConfig:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = demo_tok.special_ids(tok)
    vocab = -(-tok.get_vocab_size() // 8) * 8  # pad the table to a multiple of 8; unused rows are free ids
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                       rope_theta=10000.0, max_position_embeddings=512, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, mask_token_id=ids["m"], bos_token_id=ids["bos"],
                       eos_token_id=ids["eos"], pad_token_id=ids["pad"])


def train_config(cfg: DemoConfig, data_file: Path, tok_dir: Path, *, mode: str, steps: int, lr: float,
                  ntp_only: bool, init_from: str | None, model: ModelConfig | None, out: Path) -> TrainConfig:
    return TrainConfig(
        # the layer loop unrolled (ModelConfig.scan_unroll): faster SBD steps, NTP steps unchanged (BENCHMARKS.md);
        # no remat: this model's activations are small, recomputing them would only cost time
        model=ModelSource(init_from=init_from, config=model, scan_unroll=cfg.num_layers, remat="none"),
        data=DataConfig(path=str(data_file), mode=mode, tokenizer=str(tok_dir), seq_len=cfg.seq_len,
                        seed=cfg.seed, chat_template=False, copy_len=cfg.copy_len if mode == "sft" else None),
        sbd=SBDConfig(k_max=cfg.k_max, block_size=cfg.train_block_size, ntp_only=ntp_only,
                      block_align=cfg.block_align if mode == "sft" else "document"),
        optim=OptimConfig(lr=lr, warmup_steps=max(1, steps // 20), schedule="cosine", weight_decay=0.01),
        checkpoint=CheckpointConfig(every=max(1, steps // 4), keep=2, async_save=False),
        mesh=MeshConfig(data=1), out_dir=str(out), steps=steps, batch_size=cfg.batch_size, seed=cfg.seed,
        log_every=10)


# where a stage's saved settings may differ from this run's without making its result stale (paths, and the
# layer loop's unrolling and remat, which change speed and memory only)
_NEUTRAL_KEYS = {"out_dir", "model.init_from", "data.path", "data.tokenizer", "model.scan_unroll", "model.remat"}


def check_stage_settings(stage_dir: Path, saved: dict, wanted: dict) -> None:
    """Refuse to reuse or resume a stage whose saved settings differ from this run's (a rerun with
    `finetune_steps=4000` must not silently reuse a 2000-step model): ConfigError naming every difference."""
    diff = changed_settings(saved, wanted, _NEUTRAL_KEYS)
    if diff:
        raise ConfigError(f"{stage_dir} was made with other settings ({', '.join(diff)}); pass a new --out "
                          f"directory or delete {stage_dir} to redo that stage")


def stage_train(name: str, tcfg: TrainConfig, log=print) -> Path:
    """Run (or resume, or skip) one training stage; returns its HF export directory (a LoRA run's: its adapter's)."""
    from sbd_jax.training import train
    out = Path(tcfg.out_dir)
    hf = out / ("adapter" if tcfg.lora else "hf")
    saved = out / "train_config.json"
    if saved.exists():
        check_stage_settings(out, json.loads(saved.read_text())["train"], to_dict(tcfg))
    if (out / "DONE").exists() and (hf / ("adapter_config.json" if tcfg.lora else "config.json")).exists():
        log(f"[{name}] reusing {hf}")
        return hf
    log(f"[{name}] {'NTP only' if tcfg.sbd.ntp_only else 'SBD dual loss'}{f', LoRA rank {tcfg.lora.rank}' if tcfg.lora else ''}, "
        f"{tcfg.steps} steps -> {out}")
    t0 = time.time()
    result = train(tcfg)
    done = result.adapter_dir if tcfg.lora else result.hf_dir
    if done is None:
        raise RuntimeError(f"[{name}] training ended without an export")
    last = result.history[-1] if result.history else {}
    (out / "DONE").write_text(json.dumps({"seconds": time.time() - t0, "last": last}, default=float))
    log(f"[{name}] done in {time.time() - t0:.0f}s: " +
        ", ".join(f"{k}={last[k]:.3f}" for k in ("loss", "ntp_loss", "matp_loss") if k in last and last[k] is not None))
    return done
