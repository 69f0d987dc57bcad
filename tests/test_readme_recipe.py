"""The README's fine-tuning commands (the recipe and the long-context one) run as typed, with only the model, the
data, the sizes and the mesh swapped for tiny ones (every other flag kept), on 8 fake CPU devices: each flag exists
and works together with the others."""
import json
import re
import shlex
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import sbd_jax
from subproc import ROOT, compilation_cache_env
from training_fixtures import write_inputs

SWAPPED = {"model.init_from", "model.mask_token_id", "data.path", "data.tokenizer", "data.seq_len", "steps",
           "out_dir"}


def readme_recipe(heading: str = "## Fine-tuning a real checkpoint") -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    command = " ".join(ln.rstrip("\\").strip() for ln in block.splitlines() if not ln.lstrip().startswith("#"))
    return shlex.split(command)


# heading -> the swapped sizes and mesh (8 devices), and what the run's train_config.json must keep
RECIPES = {"## Fine-tuning a real checkpoint": ({}, {"remat": "full", "grad_accum": 8}),
           "**Long context.**": ({"mesh.fsdp": "2", "mesh.context": "4"}, {"context": 4, "fsdp": 2})}


@pytest.mark.parametrize("heading", RECIPES, ids=["recipe", "long_context"])
def test_readme_fine_tune_command_runs_on_a_tiny_model(heading, tmp_path):
    mesh, kept = RECIPES[heading]
    argv = readme_recipe(heading)
    assert argv[:4] == [".venv/bin/python", "train.py", "--config", "configs/tiny_sbd.yaml"], argv
    overrides = dict(a.split("=", 1) for a in argv[4:])
    assert SWAPPED | set(mesh) <= set(overrides), sorted(SWAPPED | set(mesh) - set(overrides))
    write_inputs(tmp_path)
    model = tmp_path / "model"
    cfg = sbd_jax.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, bos_token_id=1)
    sbd_jax.save_pretrained(cfg, jax.tree.map(np.asarray, sbd_jax.init_params(cfg, jax.random.key(0))), model)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / f, model / f)
    overrides.update({"model.init_from": str(model), "model.mask_token_id": "3", "data.path":
                      str(tmp_path / "train.jsonl"), "data.tokenizer": str(model), "data.seq_len": "32", "steps": "2",
                      "out_dir": str(tmp_path / "run"), **mesh})
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "", **compilation_cache_env()}
    proc = subprocess.run([sys.executable, *argv[1:4], *(f"{k}={v}" for k, v in overrides.items())], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "done: step 2" in proc.stdout
    cfg2, _ = sbd_jax.from_pretrained(tmp_path / "run" / "hf")
    assert cfg2.mask_token_id == 3 and cfg2.vocab_size == 64
    train_cfg = (tmp_path / "run" / "train_config.json").read_text()
    for key, value in kept.items():
        assert f"\"{key}\": {json.dumps(value)}" in train_cfg, (key, train_cfg)
