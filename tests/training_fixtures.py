"""What the training test modules share: the tiny train-step model, its parameters and packed batch
(tests/test_training_step.py, the sharded step scripts, tests/test_lora.py) and the inputs of the tiny training
run (a word-level tokenizer, a corpus and a train.py config: tests/test_training_loop.py and the recipes)."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing

from sbd_jax.models.config import ModelConfig
from sbd_jax.models import param_shapes
from sbd_jax.sharding import param_shardings
from sbd_jax.training.config import OptimConfig
from sbd_jax.training.examples import PackedBatch
from sbd_jax.training.optim import make_optimizer
from sbd_jax.training.step import StepOptions, jit_train_step, make_train_step, state_shardings

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=10000.0, mask_token_id=3)


def np_params(cfg, seed=0, std=0.05):
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        base = 1.0 if path[-1].key.endswith("norm") else 0.0
        return jnp.asarray(base + rng.normal(0, std, shape), jnp.float32)
    return jax.tree.map_with_path(leaf, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def packed_batch(B=8, L=24, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(4, 64, (B, L))
    cut = rng.integers(6, L - 6, B)
    ar = np.arange(L)
    seg = np.where(ar < cut[:, None], 1, 2)
    seg[:, -2:] = 0
    pos = np.where(seg == 1, ar, ar - cut[:, None]) * (seg > 0)
    return PackedBatch(*(a.astype(np.int32) for a in (tok * (seg > 0), seg, pos, (seg > 0).astype(int))))


def lora_step(cfg, layout, mesh, accum=1):
    """A jitted LoRA train step (AdamW lr 1e-3, no warmup) on `mesh`: (tx, state shardings, step)."""
    tx, sched = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0, eps=1e-6), 10)
    sh = state_shardings(cfg, tx, mesh, layout=layout)
    step = jit_train_step(make_train_step(cfg, StepOptions(cfg.mask_token_id, grad_accum=accum), tx, sched, mesh,
                                          layout), mesh, sh, 8, param_shardings(cfg, mesh))
    return tx, sh, step


SPECIALS = ["<pad>", "<s>", "</s>", "<m>", "<unk>"]
CORPUS = ["the quick brown fox jumps over the lazy dog",
          "a red sun rises over the quiet blue sea",
          "my old cat sleeps on the warm soft mat",
          "one two three four five six seven eight nine ten",
          "green trees grow tall near the cold river bank",
          "she reads a long book by the bright window"]
STEPS = 40  # the training run's length (write_inputs' config)


def write_inputs(d: Path) -> Path:
    words = sorted({w for s in CORPUS for w in s.split()})
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    tk = HFTokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = WhitespaceSplit()
    tk.add_special_tokens(SPECIALS)
    tk.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    (d / "tok").mkdir()
    tk.save(str(d / "tok" / "tokenizer.json"))
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (d / "train.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in CORPUS * 4))
    cfg = {
        "model": {"config": {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
                             "mask_token_id": 3, "eos_token_id": 2, "bos_token_id": 1}},
        "data": {"path": str(d / "train.jsonl"), "tokenizer": str(d / "tok"), "seq_len": 32, "seed": 0},
        "sbd": {"k_max": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 5, "weight_decay": 0.0},
        "checkpoint": {"every": 10, "keep": 2},
        "steps": STEPS, "batch_size": 8, "seed": 0, "log_every": 1, "progress": False,
    }
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return d / "cfg.yaml"


def per_step(history, keys=("ntp_tokens", "matp_tokens", "k", "tokens", "loss")):
    return [tuple(h[k] for k in keys) for h in history]
