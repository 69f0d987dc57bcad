"""LoRA fine-tuning (sbd_jax/models/lora.py, training/lora.py) and its PEFT export (sbd_jax/io/peft.py).
Tolerances (float32 logits): the LoRA forward (x @ W + (x @ A) @ B * scale) vs the merged weights' forward
max abs diff <= 1e-5 (only the summation order differs; logits are ~1-5); HF PEFT (torch) on our export vs our
LoRA forward <= 1e-4, the HF parity tests' tolerance. Resume and decoding comparisons are exact."""
import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_hf
from subproc import ROOT, run_on_8_devices
from training_fixtures import CFG, lora_step, np_params, packed_batch, per_step, write_inputs

import sbd_jax
from sbd_jax.config import ConfigError, load_config
from sbd_jax.io.hf import CheckpointError
from sbd_jax.io.peft import apply_adapter, load_adapter, save_adapter
from sbd_jax.models import causal_meta
from sbd_jax.models.fingerprint import base_fingerprint
from sbd_jax.models.lora import LORA_TARGETS, AdapterLayout, attach, init_adapter, merge
from sbd_jax.sharding import MeshConfig, make_mesh, param_shardings
from sbd_jax.training.checkpoint import Checkpointer
from sbd_jax.training.config import TrainConfig
from sbd_jax.training.loop import train
from sbd_jax.training.model_source import add_mask_row
from sbd_jax.training.step import WithBase, create_state

forward = jax.jit(sbd_jax.forward, static_argnums=1)


def _adapter(cfg, layout, base, seed=1, std=0.05):
    """An adapter as after some training: init (A random, B zero) plus noise on every array."""
    ad = init_adapter(cfg, layout, jax.random.key(seed), base)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(ad))))
    return jax.tree.map(lambda a: a + std * jax.random.normal(next(keys), a.shape, a.dtype), ad)


@pytest.mark.parametrize("tied", [False, True])
def test_lora_forward_equals_merged_forward(tied):
    cfg, params = add_mask_row(dataclasses.replace(CFG, tie_word_embeddings=tied, mask_token_id=None),
                               np_params(dataclasses.replace(CFG, tie_word_embeddings=tied)))
    layout = AdapterLayout(4, 8.0, tuple(LORA_TARGETS), mask_row=cfg.mask_token_id)
    adapter = _adapter(cfg, layout, params)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    tokens[:, 5] = cfg.mask_token_id  # the trainable row is read
    meta = causal_meta(jnp.array([24, 17]), 24)
    lora, _ = forward(attach(params, adapter, layout), cfg, tokens, meta)
    merged, _ = forward(merge(params, adapter, layout), cfg, tokens, meta)
    plain, _ = forward(params, cfg, tokens, meta)
    assert np.abs(np.asarray(lora) - np.asarray(merged)).max() <= 1e-5
    assert np.abs(np.asarray(lora) - np.asarray(plain)).max() > 0.1  # the adapter really changes the model
    init = init_adapter(cfg, layout, jax.random.key(0), params)  # B = 0, rows copied: the base's own outputs
    np.testing.assert_allclose(forward(attach(params, init, layout), cfg, tokens, meta)[0], plain, atol=1e-6)


def test_gradients_and_optimizer_state_reach_only_the_adapter():
    """One LoRA step: the state (what is differentiated, updated and has AdamW moments) is the adapter alone; the
    base is an argument the step reads, unchanged and not donated; every adapter array moves, B and the mask
    token's row included."""
    cfg, base = add_mask_row(dataclasses.replace(CFG, mask_token_id=None), np_params(CFG))
    layout = AdapterLayout(4, 8.0, tuple(LORA_TARGETS), mask_row=cfg.mask_token_id)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    tx, sh, step = lora_step(cfg, layout, mesh)
    base = jax.device_put(base, param_shardings(cfg, mesh))
    adapter = init_adapter(cfg, layout, jax.random.key(0), base)
    state = create_state(jax.tree.map(jnp.copy, adapter), tx, jax.random.PRNGKey(0), sh)
    batch = packed_batch()
    new, m = WithBase(step, base)(state, jax.tree.map(jnp.asarray, batch))
    assert jax.tree.structure(new.params) == jax.tree.structure(adapter)
    assert set(new.params) == {"layers", "mask_embed", "mask_head"}
    moments = [x for x in jax.tree.leaves(new.opt_state) if x.ndim > 0]
    n_adapter = sum(x.size for x in jax.tree.leaves(adapter))
    assert sum(x.size for x in moments) == 2 * n_adapter  # AdamW's mu and nu, for the adapter only
    assert n_adapter < 0.25 * sum(x.size for x in jax.tree.leaves(base))
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new.params, adapter)
    assert min(jax.tree.leaves(moved)) > 1e-5, moved  # every adapter array trained (B from 0, both mask entries)
    assert all(not x.is_deleted() for x in jax.tree.leaves(base)) and np.isfinite(float(m["loss"]))
    grads = jax.grad(lambda ad: jnp.sum(forward(attach(base, ad, layout), cfg, batch.tokens,
                                                causal_meta(jnp.full((8,), 24), 24))[0]))(adapter)
    assert jax.tree.structure(grads) == jax.tree.structure(adapter)  # a gradient exists only for the adapter


CASES = {  # (arch, HF config, the run added a mask token)
    "llama_untied_mask_added": ("llama", dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
                                True),
    "qwen3_tied": ("qwen3", dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
                   False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_the_export_with_the_same_logits(case, hf_ref, tmp_path):
    """Our export in PEFT's layout, loaded by `PeftModel.from_pretrained` onto the base in transformers, gives our
    LoRA forward's logits; our own loader reads it back and its merge gives them too."""
    arch, config, added = CASES[case]
    base_dir = hf_ref.make(arch, config, seed=1, std=0.1)
    cfg0, base = sbd_jax.from_pretrained(base_dir)
    cfg, grown = add_mask_row(cfg0, base) if added else (dataclasses.replace(cfg0, mask_token_id=7), base)
    layout = AdapterLayout(4, 16.0, ("q", "v", "o", "gate", "down") if added else tuple(LORA_TARGETS),
                           mask_row=cfg.mask_token_id if added else None)
    adapter = _adapter(cfg, layout, grown, std=0.1)
    out = save_adapter(tmp_path / "adapter", cfg, layout, adapter, fingerprint=base_fingerprint(base),
                       base_name=str(base_dir))
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 16.0
    assert conf["base_model_name_or_path"] == str(base_dir)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20)).astype(np.int32)
    tokens[:, 3] = cfg.mask_token_id
    ours = np.asarray(forward(attach(grown, adapter, layout), cfg, tokens, causal_meta(jnp.array([20, 20]), 20))[0])
    np.save(tmp_path / "tokens.npy", tokens)
    run_hf("peft", base_dir, out, tmp_path / "tokens.npy", tmp_path / "ref.npy", *([cfg.vocab_size] if added else []))
    ref = np.load(tmp_path / "ref.npy")
    assert ref.shape == ours.shape and np.abs(ours - ref).max() <= 1e-4, np.abs(ours - ref).max()
    loaded = load_adapter(out, cfg0)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), loaded.tensors, adapter)
    cfg2, merged = apply_adapter(cfg0, base, out)
    assert cfg2.vocab_size == cfg.vocab_size and cfg2.mask_token_id == cfg.mask_token_id
    np.testing.assert_allclose(forward(merged, cfg2, tokens, causal_meta(jnp.array([20, 20]), 20))[0], ours, atol=1e-5)


@pytest.mark.parametrize("copy_only", [False, True])
def test_lora_resume_is_exact(tmp_path, copy_only):
    """A LoRA run (mask token added, base held in bf16) stopped and resumed == the same run straight: per-step
    metrics and the final adapter identical. Its checkpoints hold the adapter and the base's fingerprint. Also for
    a copy-only adapter with the draft recipe's options (all-masked blocks, decayed position weights)."""
    cfg_path = write_inputs(tmp_path)
    over = ["lora.rank=4", "lora.base_dtype=bfloat16", "model.config.mask_token_id=null", "model.add_mask_token=true",
            "steps=8", "checkpoint.every=4", "checkpoint.export_hf=false"]
    if copy_only:
        over += ["lora.copy_only=true", "sbd.eta=[1.0, 1.0]", "sbd.position_decay=0.8"]
    straight = train(load_config(TrainConfig, cfg_path, over + [f"out_dir={tmp_path / 'a'}"]))
    cfg = load_config(TrainConfig, cfg_path, over + [f"out_dir={tmp_path / 'b'}"])
    first = train(cfg, stop_after=4)
    second = train(cfg)
    assert second.resumed_from == 4 and second.step == 8 and straight.step_compilations == 1
    assert per_step(first.history + second.history) == per_step(straight.history)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(straight.params), jax.device_get(second.params))
    # the adapter, not the model (a copy-only one has no lm_head row: the mask row is an input only)
    assert set(straight.params) == {"layers", "mask_embed"} | (set() if copy_only else {"mask_head"})
    assert all((h["ntp_loss"] == 0.0) == copy_only for h in straight.history)
    meta = Checkpointer(tmp_path / "b" / "checkpoints").restore_meta(8)
    assert re.fullmatch(r"sha256:[0-9a-f]{16}", meta["base_fingerprint"]), meta
    assert straight.history[-1]["matp_loss"] < straight.history[0]["matp_loss"]


def _model_dir(path, seed, hidden=64):
    cfg = sbd_jax.ModelConfig(vocab_size=64, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, bos_token_id=1)
    sbd_jax.save_pretrained(cfg, jax.tree.map(np.asarray, sbd_jax.init_params(cfg, jax.random.key(seed))), path)
    return path


def _train_py(argv) -> int:
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """train.py with LoRA on a saved base (mask token id 3), adapter + merged export."""
    d = tmp_path_factory.mktemp("lora_run")
    cfg_path = write_inputs(d)
    base = _model_dir(d / "base", 0)
    over = ["model.config=null", f"model.init_from={base}", "model.mask_token_id=3", "lora.rank=4", "lora.alpha=8",
            "lora.export_merged=true", "steps=6", "checkpoint.every=3", f"out_dir={d / 'run'}"]
    assert _train_py(["--config", str(cfg_path), *over]) == 0
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in
                               enumerate(["the quick brown fox", "one two three", "my old cat"])))
    return d, cfg_path, base, over, prompts


def _decode(d, prompts, name, *extra) -> list[dict]:
    import decode
    out = d / f"{name}.jsonl"
    rc = decode.main(["--input", str(prompts), "--output", str(out), "--max-new-tokens", "8", "--block-size", "4",
                      "--no-progress", "--overwrite", *extra])
    return rc, [json.loads(ln) for ln in out.read_text().splitlines()] if rc == 0 else []


def test_train_py_lora_export_and_decode_end_to_end(lora_run):
    """train.py lora.* -> <out>/adapter (PEFT layout, tokenizer, stop ids) + <out>/hf (merged); decode.py --model
    BASE --adapter <out>/adapter decodes exactly what decode.py --model <out>/hf does, in SBD mode (the adapter
    carries the mask token id the base's config.json lacks)."""
    d, _, base, _, prompts = lora_run
    adapter = d / "run" / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "sbd_adapter.json", "tokenizer.json",
            "generation_config.json"} <= {f.name for f in adapter.iterdir()}
    assert json.loads((adapter / "sbd_adapter.json").read_text())["mask_token_id"] == 3
    rc, rows = _decode(d, prompts, "adapter", "--model", str(base), "--adapter", str(adapter))
    rc2, merged = _decode(d, prompts, "merged", "--model", str(d / "run" / "hf"))
    assert rc == rc2 == 0 and len(rows) == 3
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in merged]
    sampler = sbd_jax.decoding.sampler.Sampler.load(base, adapter=adapter)
    texts = [json.loads(ln)["prompt"] for ln in prompts.read_text().splitlines()]  # all three: decode.py's programs
    assert sampler.cfg.mask_token_id == 3 and [r.tokens for r in sampler(texts, max_new_tokens=8, block_size=4)] \
        == [r["tokens"] for r in rows]


def test_adapter_on_another_base_is_refused(lora_run, tmp_path, capsys):
    """decode.py --adapter onto a base of other weights (fingerprint) or other shapes: exit 2, naming what differs."""
    d, _, _, _, prompts = lora_run
    adapter = d / "run" / "adapter"
    made = json.loads((adapter / "sbd_adapter.json").read_text())["base_fingerprint"]
    rc, _ = _decode(tmp_path, prompts, "x", "--model", str(_model_dir(tmp_path / "other", 1)), "--adapter", str(adapter))
    err = capsys.readouterr().err
    assert rc == 2 and made in err and "was trained on base weights" in err, err
    with pytest.raises(CheckpointError, match=r"lora_A\.weight' has shape \[4, 64\], this model .* needs \[4, 32\]"):
        cfg, params = sbd_jax.from_pretrained(_model_dir(tmp_path / "narrow", 0, hidden=32))
        apply_adapter(cfg, params, adapter)


@pytest.mark.parametrize("key, value", [("lora_alpha", 16.0), ("r", 8), ("target_modules", ["q_proj"])])
def test_an_edited_adapter_config_is_refused(lora_run, tmp_path, key, value):
    """adapter_config.json's math (rank, alpha, targets) must be what the adapter was trained with: an edited
    lora_alpha would rescale every update without a word."""
    adapter = shutil.copytree(lora_run[0] / "run" / "adapter", tmp_path / "adapter")
    conf = json.loads((adapter / "adapter_config.json").read_text())
    trained = conf[key]
    (adapter / "adapter_config.json").write_text(json.dumps({**conf, key: value}))
    with pytest.raises(CheckpointError, match=rf"{key} is {re.escape(repr(value))}, but the adapter was trained "
                                              rf"with {re.escape(repr(trained))}"):
        load_adapter(adapter, sbd_jax.from_pretrained(lora_run[2])[0])


def test_lora_rank_above_the_weights_is_refused():
    with pytest.raises(ConfigError, match=r"LoRA rank 17 is above what k \(32 in, 16 out\) can use: at most 16"):
        init_adapter(CFG, AdapterLayout(17, 8.0), jax.random.key(0), np_params(CFG))


def test_resume_refuses_another_base(lora_run, tmp_path):
    """The base moved (a path change allowed on purpose) but its weights are not the ones the checkpoints' adapter
    was trained on: refused, naming both fingerprints."""
    d, cfg_path, _, over, _ = lora_run
    run = tmp_path / "run"
    shutil.copytree(d / "run", run)
    other = _model_dir(tmp_path / "other", 1)
    cfg = load_config(TrainConfig, cfg_path, over + [f"out_dir={run}", f"model.init_from={other}", "steps=8",
                                                     "allow_changes=[model.init_from,steps]"])
    with pytest.raises(ConfigError, match=r"was trained on base weights sha256:\w+ \(.*base\); this run's base "
                                          rf"\({re.escape(str(other))}\) is sha256:\w+"):
        train(cfg)


@pytest.mark.parametrize("override, message", [
    ("lora.rank=0", "lora.rank must be >= 1, got 0"),
    ("lora.targets=[q,attn]", "lora.targets must be distinct names among"),
    ("lora.base_dtype=int8", "lora.base_dtype must be float32, bfloat16 or float16"),
    ("lora.ranks=4", "unknown config key(s) ['ranks'] in TrainConfig.lora"),
])
def test_lora_config_errors_name_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, write_inputs(tmp_path), [override])
    assert message in str(e.value)


@pytest.mark.parametrize("change, message", [
    ({"peft_type": "IA3"}, "peft_type is 'IA3', only 'LORA'"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"target_modules": "all-linear"}, "target_modules 'all-linear' must be a list of"),
    ({"target_modules": ["q_proj", "qkv_proj"]}, "must be a list of"),
    ({"trainable_token_indices": {"embed_tokens": [1, 2]}}, "only one trainable token"),
    ({"r": "two"}, "r is 'two'; the LoRA rank must be an integer >= 1"),
    ({"r": None}, "r is None; the LoRA rank must be an integer >= 1"),
    ({"r": 2.5}, "r is 2.5; the LoRA rank"),
    ({"lora_alpha": "8"}, "lora_alpha is '8'; it must be a finite number > 0"),
    ({"lora_alpha": None}, "lora_alpha is None; it must be"),
])
def test_adapter_options_not_implemented_are_refused(tmp_path, change, message):
    conf = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none", **change}
    (tmp_path / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_adapter(tmp_path, CFG)


SHARDED = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from subproc import train_setup
    from training_fixtures import lora_step
    from sbd_jax.models.lora import LORA_TARGETS, AdapterLayout, init_adapter
    from sbd_jax.sharding import MeshConfig, make_mesh, param_shardings
    from sbd_jax.training.step import WithBase, create_state, put_batch

    cfg, params, batch, _, _ = train_setup()
    layout = AdapterLayout(4, 8.0, tuple(LORA_TARGETS))
    adapter = jax.tree.map(np.asarray, init_adapter(cfg, layout, jax.random.key(0), params))

    def run(mesh, accum):
        tx, sh, step = lora_step(cfg, layout, mesh, accum)
        base = jax.device_put(params, param_shardings(cfg, mesh))
        state = create_state(jax.device_put(adapter, sh.params), tx, jax.random.PRNGKey(0), sh)
        new, m = WithBase(step, base)(state, put_batch(batch, mesh, 8))
        ab = new.params["layers"]
        info = {k: str(ab[w][p].sharding.spec) for k, (w, p) in
                {"wq_a": ("wq", "a"), "wq_b": ("wq", "b"), "down_a": ("w_down", "a"), "down_b": ("w_down", "b")}.items()}
        info["mu_wq_b"] = str(new.opt_state[1][0].mu["layers"]["wq"]["b"].sharding.spec)
        return jax.device_get(new.params), {k: float(v) for k, v in jax.device_get(m).items()}, info

    p1, m1, _ = run(make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), 1)
    out = {"one": m1}
    for accum in (1, 2):
        p8, m8, info = run(make_mesh(MeshConfig(2, 2, 2)), accum)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)))
        out[f"accum{accum}"] = dict(metrics=m8, max_param_diff=diff, **info)
    print("RESULT " + json.dumps(out))
""")


def test_sharded_lora_step_matches_single_device():
    """A LoRA step on a 2x2x2 (data, fsdp, tensor) mesh of 8 fake CPU devices == on one device (tolerances of
    tests/test_training_sharded.py); A is sharded like its weight's input axes, B like its output axes."""
    out = run_on_8_devices(SHARDED)
    for key in ("accum1", "accum2"):
        r = out[key]
        for name in ("loss", "ntp_loss", "matp_loss", "grad_norm"):
            np.testing.assert_allclose(r["metrics"][name], out["one"][name], rtol=1e-5, err_msg=f"{key} {name}")
        assert r["max_param_diff"] <= 1e-5, r
        # wq [L, D, H, Dh]: A [L, D, r] by D (fsdp), B [L, r, H, Dh] by H (tensor); w_down [L, F, D]: A by F, B by D
        assert (r["wq_a"], r["wq_b"], r["down_a"], r["down_b"]) == (
            "P(None, 'fsdp', None)", "P(None, None, 'tensor', None)", "P(None, 'tensor', None)",
            "P(None, None, 'fsdp')"), r
        assert r["mu_wq_b"] == r["wq_b"]


# ------------------------------------------------------------------------------------------ the README recipe

LORA_SWAPPED = {"model.init_from", "model.mask_token_id", "data.path", "data.tokenizer", "data.seq_len", "steps",
                "out_dir"}


def readme_lora_commands() -> list[list[str]]:
    """The commands (argv lists) of the README's LoRA recipe: the ```bash block of the fine-tuning section that sets
    lora.rank (a command runs on until a line without a trailing backslash)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text[text.index("## Fine-tuning a real checkpoint"):], re.S)
    block = next((b for b in blocks if "lora.rank=" in b), None)
    assert block is not None, "README.md's fine-tuning section has no LoRA recipe (a ```bash block with lora.rank=)"
    commands, current = [], []
    for ln in (ln.strip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")):
        current.append(ln.rstrip("\\").strip())
        if not ln.endswith("\\"):
            commands, current = commands + [shlex.split(" ".join(current))], []
    return commands


def test_readme_lora_command_runs_on_a_tiny_model(tmp_path):
    """The README's 8B LoRA commands as typed (one device), only the model, data, sizes and paths swapped for tiny
    ones: train.py with lora.*, then decode.py --adapter on its export."""
    train_argv, decode_argv = readme_lora_commands()
    assert train_argv[:4] == [".venv/bin/python", "train.py", "--config", "configs/tiny_sbd.yaml"], train_argv
    assert decode_argv[:2] == [".venv/bin/python", "decode.py"] and "--adapter" in decode_argv, decode_argv
    overrides = dict(a.split("=", 1) for a in train_argv[4:])
    assert LORA_SWAPPED <= set(overrides), sorted(LORA_SWAPPED - set(overrides))
    write_inputs(tmp_path)
    model = _model_dir(tmp_path / "model", 0)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / f, model / f)
    overrides.update({"model.init_from": str(model), "data.path": str(tmp_path / "train.jsonl"),
                      "model.mask_token_id": "3", "data.tokenizer": str(model), "data.seq_len": "32", "steps": "2",
                      "out_dir": str(tmp_path / "r")})
    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PATH": ""}
    proc = subprocess.run([sys.executable, *train_argv[1:4], *(f"{k}={v}" for k, v in overrides.items())], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "done: step 2" in proc.stdout and "adapter" in proc.stdout
    saved = json.loads((tmp_path / "r" / "train_config.json").read_text())["train"]
    assert saved["lora"]["rank"] == 16 and saved["lora"]["base_dtype"] == "bfloat16"
    assert saved["model"]["remat"] == "full"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": 0, "prompt": "the quick brown fox"}) + "\n")
    swap = {"--model": str(model), "--adapter": str(tmp_path / "r" / "adapter"), "--input": str(prompts),
            "--output": str(tmp_path / "o.jsonl")}
    args = [swap.get(prev, a) for prev, a in zip([None] + decode_argv[2:], decode_argv[2:])]
    import decode
    assert decode.main(args + ["--max-new-tokens", "8", "--block-size", "4", "--no-progress"]) == 0
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 1

