"""The training loop end to end on CPU (tiny Llama, tiny local corpus + tokenizer.json):
overfitting (both losses fall), 2N straight steps == N steps, stop, resume N steps (params and data
order identical), a SIGKILLed train.py leaves a complete checkpoint and resumes to the same result,
the HF export loads in `transformers`, and train.py's errors."""
import importlib.util
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

import sbd_jax
from sbd_jax.config import ConfigError, load_config
from sbd_jax.models import causal_meta
from sbd_jax.training.checkpoint import Checkpointer
from sbd_jax.training.config import TrainConfig
from sbd_jax.training.data import build_iterator
from sbd_jax.io.tokenizer import Tokenizer
from sbd_jax.training.loop import train
from training_fixtures import CORPUS, STEPS
from training_fixtures import per_step as _per_step
from training_fixtures import write_inputs as _write_inputs

ROOT = Path(__file__).resolve().parents[1]
HALF = STEPS // 2


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop")
    cfg_path = _write_inputs(d)
    cfg = load_config(TrainConfig, cfg_path, [f"out_dir={d / 'straight'}"])
    res = train(cfg)
    return d, cfg_path, res


def _leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(params))]


def test_tiny_model_overfits_both_losses(straight):
    _, _, res = straight
    h = res.history
    assert [r["step"] for r in h] == list(range(1, STEPS + 1))
    for key in ("ntp_loss", "matp_loss"):
        start = np.mean([r[key] for r in h[:3]])
        end = np.mean([r[key] for r in h[-5:]])
        assert end < 0.5 * start, (key, start, end)
    assert all(2 <= r["k"] <= 8 for r in h) and len({r["k"] for r in h}) > 3
    assert res.step_compilations == 1  # every k ran the same compiled step
    lines = (res.out_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS and {"loss", "ntp_loss", "matp_loss", "tokens_per_s", "lr"} <= set(json.loads(lines[0]))


def test_stop_and_resume_is_identical(straight):
    d, cfg_path, res = straight
    cfg = load_config(TrainConfig, cfg_path, [f"out_dir={d / 'resumed'}"])
    first = train(cfg, stop_after=HALF)
    assert first.step == HALF and first.hf_dir is None
    ck = Checkpointer(d / "resumed" / "checkpoints")
    assert list(ck.manager.all_steps()) == [10, 20]  # every 10 steps, keep 2
    second = train(cfg)
    assert second.resumed_from == HALF and second.step == STEPS
    assert _per_step(first.history + second.history) == _per_step(res.history)  # same data order and masks
    for a, b in zip(_leaves(res.params), _leaves(second.params)):
        np.testing.assert_array_equal(a, b)
    # the final data position and optimizer state were restored and advanced identically
    a, b = (Checkpointer(d / name / "checkpoints") for name in ("straight", "resumed"))
    assert a.manager.latest_step() == b.manager.latest_step() == STEPS
    assert a.restore_data() == b.restore_data() and a.restore_data()["rows"] == STEPS * 8


def test_loop_runs_ahead_of_the_host(straight):
    """Nothing waits on the host per step: the next batches are packed and placed while a step runs (the
    iterator is ahead of every logged step), a step's metrics are read once the next step is dispatched, and
    a checkpoint saves the data position of the batches its steps used, not of those prefetched."""
    d, cfg_path, _ = straight
    cfg = load_config(TrainConfig, cfg_path, [f"out_dir={d / 'ahead'}", "steps=12", "checkpoint.every=6"])
    inner = build_iterator(cfg.data, cfg.batch_size, eos_id=2)

    class Counting:
        calls = 0

        def next_batch(self):
            Counting.calls += 1
            return inner.next_batch()

        def state(self):
            return inner.state()

        def restore(self, state):
            inner.restore(state)

    seen = []
    train(cfg, data=Counting(), on_log=lambda rec: seen.append((rec["step"], Counting.calls)))
    assert [s for s, _ in seen] == list(range(1, 13))
    assert all(calls > step for step, calls in seen[:-1]), seen
    ck = Checkpointer(d / "ahead" / "checkpoints")
    assert list(ck.manager.all_steps()) == [6, 12] and ck.restore_data()["rows"] == 12 * 8


def test_interrupt_waits_for_saves_and_resumes(straight):
    """Ctrl-C (KeyboardInterrupt) mid-run: in-flight async saves complete, the run resumes from the last
    one to the same result, and metrics.jsonl keeps one record per step."""
    d, cfg_path, res = straight
    cfg = load_config(TrainConfig, cfg_path, [f"out_dir={d / 'interrupted'}", "checkpoint.every=5"])

    def interrupt(rec):
        if rec["step"] == 13:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg, on_log=interrupt)
    assert list(Checkpointer(d / "interrupted" / "checkpoints").manager.all_steps()) == [5, 10]
    resumed = train(cfg)
    assert resumed.resumed_from == 10
    for a, b in zip(_leaves(res.params), _leaves(resumed.params)):
        np.testing.assert_array_equal(a, b)
    steps = [json.loads(ln)["step"] for ln in (d / "interrupted" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))


def test_sigkill_leaves_complete_checkpoint_and_resume_matches(straight):
    d, cfg_path, res = straight
    out = d / "killed"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", str(cfg_path), f"out_dir={out}",
                             "checkpoint.every=1", "checkpoint.keep=3", "progress=true"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ckdir = out / "checkpoints"
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            steps = [int(p.name) for p in ckdir.glob("*") if p.name.isdigit()] if ckdir.exists() else []
            if steps and max(steps) >= 6:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "train.py ended before it could be killed:\n" + proc.stderr.read().decode()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    killed_at = Checkpointer(ckdir).manager.latest_step()
    assert killed_at is not None and 6 <= killed_at < STEPS
    # what a kill in the middle of a save leaves behind: orbax's temporary directory, never a `<step>`
    partial = ckdir / f"{killed_at + 1}.orbax-checkpoint-tmp-1700000000000000"
    (partial / "state").mkdir(parents=True, exist_ok=True)
    (partial / "state" / "half_written").write_bytes(b"\0" * 100)
    assert Checkpointer(ckdir).manager.latest_step() == killed_at and not partial.exists()  # removed at start
    cfg = load_config(TrainConfig, cfg_path, [f"out_dir={out}", "checkpoint.every=1", "checkpoint.keep=3"])
    resumed = train(cfg)  # restores the latest *complete* checkpoint (a half-written one is ignored)
    assert resumed.resumed_from == killed_at and resumed.step == STEPS
    assert _per_step(resumed.history) == _per_step(res.history[killed_at:])
    for a, b in zip(_leaves(res.params), _leaves(resumed.params)):
        np.testing.assert_array_equal(a, b)


def test_hf_export_loads_in_transformers(straight, hf_ref):
    _, _, res = straight
    assert res.hf_dir is not None and (res.hf_dir / "config.json").is_file()
    cfg, params = sbd_jax.from_pretrained(res.hf_dir)
    assert cfg.mask_token_id == 3 and cfg.vocab_size == 64
    for a, b in zip(_leaves(res.params), _leaves(params)):
        np.testing.assert_array_equal(a, b)
    tokens = np.array([[1, 10, 20, 30, 5, 6, 7, 8]], np.int32)
    ours, _ = jax.jit(sbd_jax.forward, static_argnums=1)(params, cfg, tokens, causal_meta(np.array([8]), 8))
    ref = hf_ref.logits(res.hf_dir, tokens)
    assert np.abs(np.asarray(ours) - ref).max() <= 1e-4


CHAT = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def test_export_is_a_complete_model_directory(straight, tmp_path):
    """SFT on a chat template whose turns end with <|end|> (not the EOS): the export carries the tokenizer
    files and generation_config.json whose stop ids add <|end|>; decode.py reads both from the directory (a
    `messages` prompt is rendered by the exported template; its stop ids are EOS and <|end|>); the files get the
    umask's permissions."""
    d, cfg_path, res = straight
    assert {"tokenizer.json", "tokenizer_config.json"} <= {f.name for f in res.hf_dir.iterdir()}
    assert json.loads((res.hf_dir / "generation_config.json").read_text())["eos_token_id"] == [2]
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tk = HFTokenizer.from_file(str(d / "tok" / "tokenizer.json"))
    tk.add_special_tokens(["<|user|>", "<|assistant|>", "<|end|>"])
    tk.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "chat_template": CHAT}))
    end = tk.token_to_id("<|end|>")
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"prompt": a, "response": b}) + "\n"
                                                for a, b in zip(CORPUS, CORPUS[1:])))
    cfg = load_config(TrainConfig, cfg_path, [f"out_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'sft.jsonl'}",
                                              f"data.tokenizer={tok_dir}", "steps=3", "data.mode=sft"])
    out = train(cfg)
    gen = json.loads((out.hf_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, end] and (out.hf_dir / "tokenizer.json").read_bytes() == \
        (tok_dir / "tokenizer.json").read_bytes()
    umask = os.umask(0)
    os.umask(umask)
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in out.hf_dir.iterdir())
    import decode
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "c", "messages": [{"role": "user", "content": "the quick brown fox"}]}) + "\n")
    rc = decode.main(["--model", str(out.hf_dir), "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                      "--max-new-tokens", "8", "--block-size", "4", "--no-progress", "--summary",
                      str(tmp_path / "s.json")])
    assert rc == 0
    row = json.loads((tmp_path / "o.jsonl").read_text())
    assert row["prompt_tokens"] == len(Tokenizer.load(tok_dir).apply_chat_template(
        [{"role": "user", "content": "the quick brown fox"}])) and isinstance(row["text"], str)
    from sbd_jax.decoding.sampler import generation_eos
    assert generation_eos(sbd_jax.io.load_hf_config(out.hf_dir), out.hf_dir) == (2, end)


def test_resume_refuses_changed_settings(straight, tmp_path):
    """A run directory resumes only under the settings it was made with: each changed key is named; a change
    allowed on purpose (allow_changes) and settings that cannot change the result (logging, the mesh) pass."""
    _, cfg_path, _ = straight
    base = [f"out_dir={tmp_path / 'r'}", "checkpoint.every=2"]
    train(load_config(TrainConfig, cfg_path, base + ["steps=4"]))
    for change, key in (("sbd.ntp_only=true", "sbd.ntp_only"), ("optim.lr=0.5", "optim.lr"),
                        ("model.config.rope_theta=500.0", "model.config.rope_theta"), ("steps=6", "steps")):
        with pytest.raises(ConfigError, match=rf"other settings \({re.escape(key)}: .* there, .* now\)"):
            train(load_config(TrainConfig, cfg_path, base + ["steps=4", change] if key != "steps" else base + [change]))
    more = train(load_config(TrainConfig, cfg_path, base + ["steps=6", "allow_changes=[steps]", "log_every=2"]))
    assert more.resumed_from == 4 and more.step == 6


def test_init_from_hf_dir_continues_from_the_weights(straight):
    d, cfg_path, res = straight
    cfg = load_config(TrainConfig, cfg_path, [f"out_dir={d / 'finetune'}", "model.config=null",
                                       f"model.init_from={res.hf_dir}"])
    ft = train(cfg, stop_after=2)
    assert ft.model_cfg.mask_token_id == 3
    first = ft.history[0]
    start = res.history[0]
    assert first["ntp_loss"] < 0.5 * start["ntp_loss"]  # starts from the trained weights, not a random init


# ---------------------------------------------------------------------------------------------- CLI errors


def _main():
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.mark.parametrize("overrides, message", [
    (["optim.learning_rate=1"], "unknown config key(s) ['learning_rate'] in TrainConfig.optim"),
    (["data.seq_len=6"], "data.seq_len (6) is shorter than sbd.k_max (8)"),
    (["mesh.fsdp=2"], "does not divide the 1 devices"),
    (["data.text_field=body", "data.mode=text"], "data.text_field 'body' is not a column"),
    (["data.min_doc_tokens=100"], "has no usable rows"),
    (["model.config.mask_token_id=null"], "the model has no mask token id"),
])
def test_train_py_clear_errors(straight, tmp_path, capsys, overrides, message):
    _, cfg_path, _ = straight
    rc = _main()(["--config", str(cfg_path), f"out_dir={tmp_path / 'x'}", *overrides])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_train_py_on_a_finished_run_says_so(straight, capsys):
    """Rerunning the command of a finished run trains nothing and says the run is complete (no "loss nan")."""
    d, cfg_path, _ = straight
    assert _main()(["--config", str(cfg_path), f"out_dir={d / 'straight'}"]) == 0
    out = capsys.readouterr().out
    assert f"already complete at step {STEPS}" in out and "nan" not in out


def test_prepare_builds_the_store_training_reuses(tmp_path, capsys):
    """`train.py --prepare` tokenizes into the store that training then opens without a tokenizer call, also when
    the tokenizer names no EOS (the model's EOS is appended in both)."""
    cfg_path = _write_inputs(tmp_path)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))  # no eos_token
    store = tmp_path / "store"
    over = [f"data.store_dir={store}", f"out_dir={tmp_path / 'run'}"]
    assert _main()(["--config", str(cfg_path), "--prepare", *over]) == 0
    assert f"data: {4 * len(CORPUS)} of {4 * len(CORPUS)} records used" in capsys.readouterr().out
    made = sorted(store.iterdir())
    tk = Tokenizer.load(tmp_path / "tok")
    calls, encode = [0], tk._encode
    tk._encode = lambda *a: (calls.__setitem__(0, calls[0] + 1), encode(*a))[1]
    cfg = load_config(TrainConfig, cfg_path, over)
    it = build_iterator(cfg.data, cfg.batch_size, tokenizer=tk, eos_id=2)  # what train() passes: the model's EOS
    assert calls[0] == 0 and sorted(store.iterdir()) == made and it.report["store"] == str(made[0])
    b = it.next_batch()
    assert 2 in b.tokens[0]  # documents end with the model's EOS
