"""Training side: nothing bad is kept or silently used. A table of cases on a tiny random model:
non-finite steps are never applied or saved (full and LoRA), a damaged latest checkpoint falls back to the
previous one, the mask id may not occur in the data, and train.py's bad inputs are `error:` lines."""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from sbd_jax.config import ConfigError, load_config
from sbd_jax.training.config import TrainConfig
from sbd_jax.training.loop import train
from sbd_jax.training.step import NonFiniteStepError

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<pad>", "<s>", "</s>", "<m>", "<unk>"]
TEXT = ["the quick brown fox jumps over the lazy dog", "a red sun rises over the quiet blue sea",
        "my old cat sleeps on the warm soft mat", "one two three four five six seven eight nine ten"]


def write_inputs(d: Path) -> Path:
    """A word-level tokenizer, a jsonl corpus and a tiny training YAML in `d` -> the YAML's path."""
    words = sorted({w for s in TEXT for w in s.split()})
    tk = HFTokenizer(WordLevel({t: i for i, t in enumerate(SPECIALS + words)}, unk_token="<unk>"))
    tk.pre_tokenizer = WhitespaceSplit()
    tk.add_special_tokens(SPECIALS)
    (d / "tok").mkdir(exist_ok=True)
    tk.save(str(d / "tok" / "tokenizer.json"))
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (d / "train.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in TEXT * 3))
    cfg = {"model": {"config": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                                "mask_token_id": 3, "eos_token_id": 2}},
           "data": {"path": str(d / "train.jsonl"), "tokenizer": str(d / "tok"), "seq_len": 16,
                    "store_dir": str(d / "store")},
           "sbd": {"k_max": 4}, "optim": {"lr": 1e-3, "warmup_steps": 0},
           "checkpoint": {"every": 2, "keep": 3, "export_hf": False, "async_save": False},
           "steps": 4, "batch_size": 2, "log_every": 1, "progress": False, "out_dir": str(d / "run")}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return d / "cfg.yaml"


@pytest.fixture
def inputs(tmp_path) -> Path:
    return write_inputs(tmp_path)


def cfg_of(path: Path, *overrides: str) -> TrainConfig:
    return load_config(TrainConfig, path, list(overrides))


def finite(tree) -> bool:
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(jax.device_get(tree)))


def saved_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


# --- 1. non-finite steps -----------------------------------------------------------------------------------

@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_nonfinite_update_is_not_applied_or_saved_and_resume_works(inputs, lora):
    """lr=1e30 after a good checkpoint at step 2: stops at step 3 naming the update, saves nothing after step 2;
    rerunning with a lower lr (allow_changes=[optim.lr]) resumes from step 2 and finishes finite (and LoRA on this
    random base exports the base beside the adapter)."""
    extra = ["lora.rank=2"] if lora else []
    train(cfg_of(inputs, *extra), stop_after=2)
    run = Path(cfg_of(inputs).out_dir)
    with pytest.raises(NonFiniteStepError, match=r"step 3: the update .* not finite.*step 2 in .*optim\.lr="):
        train(cfg_of(inputs, *extra, "optim.lr=1e30", "allow_changes=[optim.lr]"))
    assert max(saved_steps(run)) == 2
    res = train(cfg_of(inputs, *extra, "allow_changes=[optim.lr]", "checkpoint.export_hf=true"))
    assert res.resumed_from == 2 and res.step == 4 and finite(res.params)
    assert [r["nonfinite"] for r in res.history] == [0, 0]
    if lora:  # a random base (no model.init_from) exists nowhere else: exported beside the adapter, which applies
        from sbd_jax.io.hf import from_pretrained
        from sbd_jax.io.peft import apply_adapter
        assert apply_adapter(*from_pretrained(run / "base"), run / "adapter")[0].mask_token_id == 3


def test_a_diverged_checkpoint_is_not_called_good(inputs):
    """lr=1e15 makes finite but huge weights (checkpoint 3, saved) whose forward pass overflows at step 4. Rerun
    with a lower lr: step 4 (the first after resuming from 3) fails by its loss, so checkpoint 3 is set aside as
    diverged and named; the next rerun resumes from step 2 and finishes finite."""
    every = "checkpoint.every=1"
    train(cfg_of(inputs, every), stop_after=2)
    run = Path(cfg_of(inputs).out_dir)
    with pytest.raises(NonFiniteStepError, match=r"step 4: the loss is not finite.*last good checkpoint, step 3"):
        train(cfg_of(inputs, every, "optim.lr=1e15", "allow_changes=[optim.lr]"))
    with pytest.raises(NonFiniteStepError, match=r"step 4: the loss .* first step after resuming from checkpoint step "
                                                 r"3, .* not good \(moved to .*checkpoints\.diverged/3\).*step 2 in"):
        train(cfg_of(inputs, every, "allow_changes=[optim.lr]"))
    assert saved_steps(run) == [1, 2] and (run / "checkpoints.diverged" / "3").is_dir()
    res = train(cfg_of(inputs, every, "allow_changes=[optim.lr]"))
    assert res.resumed_from == 2 and res.step == 4 and finite(res.params)


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_a_failed_save_is_named_at_once(inputs, monkeypatch, capfd, async_save):
    """The disk fills during the (background or synchronous) save of step 2 (step 1's was written): the run stops
    with one error naming step 2, the cause and step 1; no partial directory is left, no traceback printed."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    from sbd_jax.training.checkpoint import CheckpointSaveError

    saves = []
    write = handler.JsonCheckpointHandler._save_fn

    async def disk_full_after_one(self, x, directory):
        saves.append(1)
        if len(saves) > 1:
            raise OSError(28, "No space left on device")
        return await write(self, x, directory)
    monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", disk_full_after_one)
    cfg = cfg_of(inputs, f"checkpoint.async_save={async_save}", "steps=6")
    with pytest.raises(CheckpointSaveError, match=r"the checkpoint of step 2 could not be written \(OSError: \[Errno "
                                                  r"28\] No space left on device\); its partial files were removed; the "
                                                  r"last complete checkpoint is step 1 in"):
        train(cfg)
    ckpts = Path(cfg.out_dir) / "checkpoints"
    assert [p.name for p in ckpts.iterdir() if not p.name.startswith("_")] == ["1"], list(ckpts.iterdir())
    assert "Traceback" not in capfd.readouterr().err


def test_a_signal_inside_a_synchronous_save_leaves_no_partial_files(inputs, monkeypatch):
    """Ctrl-C (or SIGTERM, which train.py turns into it) while step 2 is being written synchronously: the run stops,
    step 2's partial directory is removed, and the rerun resumes from step 1."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    saves = []
    write = handler.JsonCheckpointHandler._save_fn

    async def interrupted_once(self, x, directory):
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt("signal 15")
        return await write(self, x, directory)
    monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", interrupted_once)
    cfg = cfg_of(inputs, "checkpoint.async_save=false", "steps=4")
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    ckpts = Path(cfg.out_dir) / "checkpoints"
    assert [p.name for p in ckpts.iterdir() if not p.name.startswith("_")] == ["1"], list(ckpts.iterdir())
    assert train(cfg).resumed_from == 1


def test_nan_loss_is_named_and_nothing_is_saved(inputs):
    """NaN weights from the start: the loss of step 1 is named; no checkpoint is written."""
    cfg = cfg_of(inputs)
    mcfg = cfg.model.config
    from sbd_jax.models.params import init_params
    params = jax.tree.map(lambda x: x * np.nan, init_params(mcfg, jax.random.PRNGKey(0)))
    with pytest.raises(NonFiniteStepError, match=r"step 1: the loss is not finite.*starts over"):
        train(cfg, model=(mcfg, params))
    assert saved_steps(Path(cfg.out_dir)) == []


def test_train_py_nonfinite_is_an_error_line(inputs, capsys):
    code, err = train_main("--config", str(inputs), "optim.lr=1e30", capsys=capsys)
    assert code == 1 and "error: step 1: the update (learning rate x AdamW step) is not finite" in err, err


# --- 2. damaged checkpoints ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A complete 4-step run (checkpoints 1, 2, 4) to copy and damage."""
    d = tmp_path_factory.mktemp("trained")
    train(cfg_of(write_inputs(d)))
    return d


def _empty(step_dir: Path) -> str:
    shutil.rmtree(step_dir)
    step_dir.mkdir()
    return f"{step_dir} is empty"


def _truncate(step_dir: Path) -> str:
    big = max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    return "Requested byte range"  # the reader's words for a short file


def _garbage(step_dir: Path) -> str:
    (step_dir / "state" / "_METADATA").write_bytes(b"\x00garbage{")
    return f"file {step_dir / 'state' / '_METADATA'} is not valid JSON"


@pytest.mark.parametrize("damage", [_empty, _truncate, _garbage], ids=["emptied", "truncated", "garbage"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous(trained, tmp_path, capsys, damage):
    d = tmp_path / "copy"
    shutil.copytree(trained / "run", d / "run")
    expect = damage(d / "run" / "checkpoints" / "4")
    res = train(cfg_of(trained / "cfg.yaml", f"out_dir={d / 'run'}"))
    out = capsys.readouterr().out
    assert "warning: checkpoint step 4 cannot be restored" in out and expect in out, out
    assert "resuming from the previous good one, step 2" in out
    assert res.resumed_from == 2 and res.step == 4 and finite(res.params)
    assert (d / "run" / "checkpoints.damaged" / "4").is_dir() and max(saved_steps(d / "run")) == 4


def test_only_checkpoint_damaged_is_named(trained, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(trained / "run", d / "run")
    for s in saved_steps(d / "run")[:-1]:
        shutil.rmtree(d / "run" / "checkpoints" / str(s))
    _empty(d / "run" / "checkpoints" / "4")
    with pytest.raises(ConfigError, match=r"checkpoint step 4 .* is empty"):
        train(cfg_of(trained / "cfg.yaml", f"out_dir={d / 'run'}"))


# --- 3. the mask id must not be data ---------------------------------------------------------------------------

def _chat_inputs(d: Path) -> Path:
    """Prompt/response data (sft.jsonl) and a chat template that writes <s> and </s> around each message."""
    cfg_path = write_inputs(d)
    conf = {"eos_token": "</s>", "bos_token": "<s>",
            "chat_template": "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}"}
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps(conf))
    (d / "sft.jsonl").write_text("".join(json.dumps({"prompt": s[:9], "response": s}) + "\n" for s in TEXT))
    return cfg_path


@pytest.mark.parametrize("case", ["in_text", "template_special"])
def test_mask_id_in_the_data_is_refused(tmp_path, case):
    from sbd_jax.training.data import DataError
    if case == "in_text":  # " fox" (id 17 in the word list) is the mask: 3 occurrences, first on line 1
        fox = (SPECIALS + sorted({w for s in TEXT for w in s.split()})).index("fox")
        cfg = cfg_of(write_inputs(tmp_path), f"model.config.mask_token_id={fox}")
        match = rf"mask_token_id {fox} occurs 3 time\(s\) .*first: .*train\.jsonl line 1\)"
    else:  # <s> (id 1): a special token the chat template writes
        cfg = cfg_of(_chat_inputs(tmp_path), f"data.path={tmp_path / 'sft.jsonl'}", "data.chat_template=true",
                     "model.config.mask_token_id=1", "model.config.bos_token_id=1")
        match = r"mask_token_id 1 is '<s>', the tokenizer's bos_token that the chat template"
    with pytest.raises(DataError, match=match):
        train(cfg)


# --- 4. train.py: bad inputs are `error:` lines (exit 2), Ctrl-C exits 130 -----------------------------------

def train_main(*argv: str, capsys) -> tuple[int, str]:
    """train.py's main() in this process -> (exit code, stderr)."""
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    capsys.readouterr()
    code = mod.main(list(argv))
    return code, capsys.readouterr().err


def _bad_utf8(d: Path, cfg: Path) -> tuple[list, str]:
    (d / "bad.jsonl").write_bytes(b'{"text": "the fox"}\n{"text": "a \xff dog"}\n')
    return [cfg, f"data.path={d / 'bad.jsonl'}"], r"bad\.jsonl' line 2 column 13 is not UTF-8 text \(byte 0xff\)"


def _bad_json_line(d: Path, cfg: Path) -> tuple[list, str]:
    lines = [json.dumps({"text": "the fox"})] * 6 + ["", "", "{bad json"]  # row 6, line 9
    (d / "bj.jsonl").write_text("\n".join(lines) + "\n")
    return [cfg, f"data.path={d / 'bj.jsonl'}"], r"bj\.jsonl' line 9: not valid JSON"


def _out_dir_under_file(d: Path, cfg: Path) -> tuple[list, str]:
    (d / "afile").write_text("x")
    return [cfg, f"out_dir={d / 'afile' / 'run'}"], r"out_dir '.*afile/run' cannot be created: Not a directory"


def _bad_yaml(d: Path, cfg: Path) -> tuple[list, str]:
    (d / "bad.yaml").write_text("model: {config: [\n  x: 1\n")
    return [d / "bad.yaml"], r"config file '.*bad\.yaml' line 3 column 1 is not valid YAML"


def _key_twice(d: Path, cfg: Path) -> tuple[list, str]:
    (d / "twice.yaml").write_text(cfg.read_text() + "steps: 5\nsteps: 7\n")
    return [d / "twice.yaml"], r"config file '.*twice\.yaml' line \d+ column 1 is not valid YAML: key 'steps' is " \
        r"given twice \(first at line \d+\)"


def _infinite_lr(d: Path, cfg: Path) -> tuple[list, str]:
    return [cfg, "optim.lr=.inf"], r"optim\.lr must be a finite number > 0, got inf"


def _string_hidden_size(d: Path, cfg: Path) -> tuple[list, str]:
    (d / "model").mkdir()
    conf = {"model_type": "llama", "vocab_size": 64, "hidden_size": "64", "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    (d / "model" / "config.json").write_text(json.dumps(conf))
    return [cfg, "model.config=null", f"model.init_from={d / 'model'}"], \
        r"model/config\.json': hidden_size is '64' \(str\), expected an integer"


@pytest.mark.parametrize("case", [_bad_utf8, _bad_json_line, _out_dir_under_file, _bad_yaml, _key_twice, _infinite_lr,
                                  _string_hidden_size],
                         ids=lambda f: f.__name__.strip("_"))
def test_train_py_bad_input_is_an_error_line(inputs, capsys, case):
    argv, match = case(inputs.parent, inputs)
    code, err = train_main("--config", str(argv[0]), *argv[1:], capsys=capsys)
    assert code == 2 and re.search(r"^error: .*" + match, err, re.M), err
    assert "Traceback" not in err


def test_missing_train_config_json_is_refused(trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    (run / "train_config.json").unlink()
    cfg = str(trained / "cfg.yaml")
    code, err = train_main("--config", cfg, f"out_dir={run}", capsys=capsys)
    assert code == 2 and "holds checkpoints (up to step 4) but no train_config.json" in err, err
    assert "allow_changes=[train_config.json]" in err
    code, err = train_main("--config", cfg, f"out_dir={run}", "allow_changes=[train_config.json]", capsys=capsys)
    assert code == 0, err


def interrupt_when(argv: list[str], ready, timeout: float = 120) -> tuple[int, str]:
    """Run `python ARGV` (the repository as cwd), send it SIGINT once `ready()` holds -> (exit code, stderr). The
    child starts with SIGINT handled, as at a terminal (a test runner started in the background ignores SIGINT, and
    a Python started with it ignored never raises KeyboardInterrupt): a handler set here is reset to the default
    in the child, an ignored signal stays ignored. Killed if the test fails first."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, cwd=ROOT)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        deadline = time.time() + timeout
        while not ready():
            if p.poll() is not None or time.time() > deadline:  # ended early, or never ready: killed first, so
                p.kill()                                         # reading its stderr cannot wait on a live child
                raise AssertionError(f"not ready (exit {p.wait()}): {p.communicate()[1][-2000:]}")
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=timeout)
        return p.returncode, err
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_ctrl_c_exits_130_without_abort(inputs):
    """SIGINT mid-run (checkpoint saves in flight): the message, exit 130, no native abort."""
    out = inputs.parent / "run"
    code, err = interrupt_when(
        ["train.py", "--config", str(inputs), "steps=100000", "checkpoint.every=1", "checkpoint.async_save=true"],
        lambda: (out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2)
    assert code == 130, err[-3000:]
    assert "interrupted: the last complete checkpoint is intact" in err and "terminate called" not in err


# --- 5. decoding: the resume record, non-finite weights, bad input as error lines (decode.py) ------------------

def decode_cli():
    """decode.py as a module (its main() runs in this process)."""
    spec = importlib.util.spec_from_file_location("decode_cli", ROOT / "decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DECODE_FLAGS = ["--block-size", "4", "--max-new-tokens", "6", "--batch-size", "2", "--pad-multiple", "8",
                "--no-progress"]
PROMPTS = ["the quick brown fox", "a red sun", "my old cat sleeps"]  # no ids: keyed by line number


def save_model(d: Path, scale: float = 1.0) -> Path:
    """A tiny random SBD model (tests/decoding_fixtures.py's CFG) with the word-level tokenizer of write_inputs, in `d`."""
    import sbd_jax
    from decoding_fixtures import CFG, make_params
    sbd_jax.save_pretrained(CFG, jax.tree.map(lambda x: x * scale, make_params()), d)
    tok = write_inputs(d.parent) and d.parent / "tok"
    for f in tok.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def decode_model(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("decode") / "m")


def decode_run(model: Path, d: Path, *extra: str, prompts=PROMPTS, capsys=None) -> tuple[int, str]:
    """decode.py on `prompts` (text lines) into d/out.jsonl -> (exit code, stderr)."""
    inp = d / "in.jsonl"
    if not inp.exists():
        inp.write_text("".join(json.dumps(p if isinstance(p, dict) else {"prompt": p}) + "\n" for p in prompts))
    argv = ["--model", str(model), "--input", str(inp), "--output", str(d / "out.jsonl"), *DECODE_FLAGS, *extra]
    if capsys is not None:
        capsys.readouterr()
    code = decode_cli().main(argv)
    return code, capsys.readouterr().err if capsys is not None else ""


def _weights_rewritten(d: Path, model: Path) -> tuple[list, str]:
    save_model(model, scale=0.5)  # same shapes, same config: only the weight file's size/mtime tell
    match = r"was written by another model: its files changed \(model_files\.model\.safetensors: '\d+ bytes, " \
            r"modified \d+' there, .*--allow-change model_files"
    return ["--allow-change", "model_files"], match


def _prompt_inserted(d: Path, model: Path) -> tuple[list, str]:
    lines = (d / "in.jsonl").read_text().splitlines(keepends=True)
    (d / "in.jsonl").write_text(json.dumps({"prompt": "one two three"}) + "\n" + "".join(lines))
    match = r"1 written row\(s\) have an id that now names other prompt content: 1 \(input line 1\).*--allow-change prompts"
    return ["--allow-change", "prompts"], match


def _record_deleted(d: Path, model: Path) -> tuple[list, str]:
    (d / "out.jsonl.settings.json").unlink()
    return ["--allow-change", "settings"], r"holds 1 row\(s\) but its settings record '.*out\.jsonl\.settings\.json' " \
                                           r"is missing.*--allow-change settings"


@pytest.mark.parametrize("change", [_weights_rewritten, _prompt_inserted, _record_deleted],
                         ids=lambda f: f.__name__.strip("_"))
def test_decode_resume_refuses_a_changed_model_prompt_or_missing_record(decode_model, tmp_path, capsys, change):
    """A first run leaves one row; after the change `--resume` is an error naming it (nothing appended); the
    `--allow-change` it names resumes."""
    model = tmp_path / "m"
    shutil.copytree(decode_model, model)
    assert decode_run(model, tmp_path, capsys=capsys)[0] == 0
    out = tmp_path / "out.jsonl"
    out.write_text(out.read_text().splitlines(keepends=True)[0])
    allow, match = change(tmp_path, model)
    code, err = decode_run(model, tmp_path, "--resume", capsys=capsys)
    assert code == 2 and re.search(r"^error: .*" + match, err, re.M), err
    assert len(out.read_text().splitlines()) == 1
    assert decode_run(model, tmp_path, "--resume", *allow, capsys=capsys)[0] == 0
    assert len(out.read_text().splitlines()) == len(json.loads((tmp_path / "out.jsonl.settings.json").read_text())
                                                     ["prompt_hashes"])


def _nan_weights(d: Path, model: Path) -> tuple[list, str]:
    save_model(model, scale=float("nan"))
    return [], r"model '.*m': the weights are not finite \(NaN or inf\) in \d+ of \d+ tensors, first \["


def _eos_beyond_vocab(d: Path, model: Path) -> tuple[list, str]:
    return ["--eos-id", "64"], r"eos id\(s\) \[64\] \(eos_ids, decode\.py --eos-id\) are outside the vocabulary " \
                               r"\[0, 64\)"


def _numeric_content(d: Path, model: Path) -> tuple[list, str]:
    (d / "in.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    return [], r"in\.jsonl: line 1: message 0 'content' must be a string, got int 5"


def _summary_dir_missing(d: Path, model: Path) -> tuple[list, str]:
    return ["--summary", str(d / "nodir" / "s.json")], r"--summary '.*nodir/s\.json': its directory .* does not exist"


def _output_under_file(d: Path, model: Path) -> tuple[list, str]:
    (d / "afile").write_text("x")
    return ["--output", str(d / "afile" / "out.jsonl")], r"output '.*afile/out\.jsonl' cannot be written: '.*afile' " \
                                                          r"is a regular file"


def _output_is_dir(d: Path, model: Path) -> tuple[list, str]:
    (d / "odir").mkdir()
    return ["--output", str(d / "odir")], r"output '.*odir' is a directory"


def _template_loops(d: Path, model: Path) -> tuple[list, str]:
    loop = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": loop}))
    return ["--chat"], r"in\.jsonl: line 1: the tokenizer's chat template did not finish rendering within 0\.5 s"


def _template_grows(d: Path, model: Path) -> tuple[list, str]:
    grow = "{% for a in range(100000) %}{% for b in range(100000) %}{{ messages }}{% endfor %}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": grow}))
    return ["--chat"], r"line 1: the tokenizer's chat template rendered more than 4000000 characters"


def _surrogate_prompt(d: Path, model: Path) -> tuple[list, str]:
    (d / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "a \\ud800 b"}]}\n')
    return [], r"in\.jsonl: line 1: 'content' holds a lone surrogate '\\ud800' \(not text\)"


def _surrogate_id(d: Path, model: Path) -> tuple[list, str]:
    (d / "in.jsonl").write_text('{"id": "x\\udfff", "prompt": "the fox"}\n')
    return [], r"in\.jsonl: line 1: 'id' holds a lone surrogate '\\udfff'"


def _context_axis(d: Path, model: Path) -> tuple[list, str]:
    return ["mesh.context=2"], r"mesh\.context=2: context parallelism is for training"


@pytest.mark.parametrize("case", [_nan_weights, _eos_beyond_vocab, _numeric_content, _summary_dir_missing,
                                  _output_under_file, _output_is_dir, _template_loops, _template_grows, _context_axis,
                                  _surrogate_prompt, _surrogate_id],
                         ids=lambda f: f.__name__.strip("_"))
def test_decode_py_bad_input_is_an_error_line(decode_model, tmp_path, capsys, monkeypatch, case):
    """Each an `error:` line naming the value, exit 2, before anything is decoded or written."""
    from sbd_jax.io import tokenizer
    monkeypatch.setattr(tokenizer, "CHAT_RENDER_SECONDS", 0.5)
    model = tmp_path / "m"
    shutil.copytree(decode_model, model)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "the quick fox"}) + "\n")
    extra, match = case(tmp_path, model)
    code, err = decode_run(model, tmp_path, *extra, capsys=capsys)
    assert code == 2 and re.search(r"^error: .*" + match, err, re.M), err
    assert "Traceback" not in err and not (tmp_path / "out.jsonl").exists()


def test_a_full_output_disk_is_named():
    """A write the disk refuses (/dev/full: always ENOSPC) is an error naming the output, not an OSError."""
    from sbd_jax.decoding.prompts import PromptFileError, write_row
    f = open("/dev/full", "w")  # noqa: SIM115
    with pytest.raises(PromptFileError, match=r"cannot write to the output '/dev/full': No space left on device"):
        write_row(f, {"id": 0, "tokens": [1, 2]})
    with pytest.raises(OSError):  # the refused bytes are still buffered (decode.py closes it quietly)
        f.close()


def test_decode_py_ctrl_c_exits_130_without_abort(decode_model, tmp_path):
    """SIGINT mid-decode: the message, exit 130, no native abort; every written row is complete."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": [5 + i % 30, 7]}) + "\n" for i in range(20000)))
    out = tmp_path / "out.jsonl"
    code, err = interrupt_when(["decode.py", "--model", str(decode_model), "--input", str(inp), "--output", str(out),
                                *DECODE_FLAGS], lambda: out.is_file() and out.stat().st_size > 0)
    assert code == 130, err[-3000:]
    assert "interrupted: every row in" in err and "terminate called" not in err
    assert all(json.loads(line)["tokens"] is not None for line in out.read_text().splitlines())
