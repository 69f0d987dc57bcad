"""`make demo-real` end to end at a tiny setting on the CPU, run the way the GPU campaign runs it
(bench/gpu_campaign.sh at CAMPAIGN_SIZE=tiny: the same stages and code paths as on the GPU): a tiny random GGUF that
carries SmolLM2's real tokenizer, split into the three pieces three device calls carry, joined and checked; the data
made beforehand from a dozen real stdlib modules; the SBD and NTP fine-tunes and the SBD LoRA adapter (two steps
each); every decoder on a few held-out functions and HumanEval problems. The numbers mean nothing, but the
lossless rows must equal AR's tokens, a rerun reuses every stage (evaluation by row) or names what changed, and a
damaged or missing piece of the model file is refused by name."""
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from gguf_fixtures import make_tiny_gguf

from sbd_jax.config import ConfigError, from_dict
from demos.real import corpus
from demos.real.config import RealDemoConfig
from demos.real.evaluation import decoders
from demos.real.pipeline import run
from demos.real_model import gguf_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_campaign  # noqa: E402


def _some_stdlib(dest, n_train=8, n_heldout=4):
    """A few real stdlib modules of both sides of the split (the corpus's own rule decides the side)."""
    picked = {"train": [], "heldout": []}
    for mod in corpus.load().modules:
        side = picked[mod.split]
        if len(side) < (n_train if mod.split == "train" else n_heldout) and 2_000 < len(mod.source) < 60_000:
            side.append(mod)
    for mod in picked["train"] + picked["heldout"]:
        (dest / mod.path).parent.mkdir(parents=True, exist_ok=True)
        (dest / mod.path).write_text(mod.source)
    return dest


def campaign(tmp: Path, *stages: str, **env) -> subprocess.CompletedProcess:
    """bench/gpu_campaign.sh STAGES at the tiny size, its work, carry and $OUT directories under `tmp`."""
    env = dict(os.environ, CAMPAIGN_SIZE="tiny", CAMPAIGN_WORK=str(tmp / "work"), CAMPAIGN_CARRY=str(tmp / "carry"),
               OUT=str(tmp / "out"), PY=sys.executable, **env)
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_campaign.sh"), *stages], env=env, capture_output=True,
                          text=True, timeout=900, check=False)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo_real")
    gguf = make_tiny_gguf(tmp / "tiny.gguf", tokenizer_from=gguf_path(), quant="Q8_0")
    lib = _some_stdlib(tmp / "lib")
    # (mfu-profile times the step as the mfu stage does, then profiles it: the one dry run covers both; END_S: the
    # GPU call's deadline, which a busy CPU running the tiny stages may pass)
    proc = campaign(tmp, "prepare", "take1", "info", "mfu-profile", "decode8b", "take2", "take3", "real",
                    "draft-data", "draft-train", "draft-eval", GGUF=str(gguf), END_S="3000",
                    CORPUS_ROOT=str(lib), MFU_CONFIGS="135m-full", MFU_STEPS="2", SLOTS="1", WIDE_COST="4", ROUNDS="1",
                    QUANT="int8", KV="int8")  # (decode8b with quantized weights and cache: issue 42's GPU stage)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp / "work" / "real" / "results.json").read_text())
    cfg = from_dict(RealDemoConfig, res["config"])
    return tmp, cfg, res, proc.stdout


def test_the_draft_recipe_stages_run(demo):
    """draft-data / draft-train / draft-eval (the copy-only recipe at the campaign's size, here tiny): the base's
    greedy continuations as id records, the adapter trained with its draft metric logged (AR agreement 1: the
    continuations are the base's own), the table with the lossless rows equal to the base's AR, all packed."""
    tmp = demo[0]
    d = tmp / "work" / "draft"
    held = [json.loads(ln) for ln in (d / "heldout_distilled.jsonl").read_text().splitlines()]
    assert held and all(r["prompt_ids"] and r["response_ids"] for r in held)
    evals = [json.loads(ln) for ln in (d / "run" / "draft_quality.jsonl").read_text().splitlines()]
    assert evals and all(e["ar_agreement"] == 1.0 for e in evals)
    rows = {r["label"]: r for r in json.loads((d / "eval" / "results.json").read_text())["rows"]}
    lossless = [r for label, r in rows.items() if "lossless" in label]
    assert len(lossless) == 2 and all(r["same_as_base_ar"] == 1.0 for r in lossless), list(rows)
    out = tmp / "out"
    assert (out / "draft.tgz").is_file() and list(out.glob("draft_adapter.tgz.part*"))


def test_every_stage_runs_and_lossless_rows_equal_ar(demo):
    tmp, cfg, res, stdout = demo
    out, rows = Path(cfg.out_dir), res["rows"]
    for f in ("table.md", "results.json", "quality_vs_speedup.png", "ft_ntp/hf/config.json", "ft_sbd/hf/config.json",
              "ft_sbd_lora/adapter/adapter_model.safetensors"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    assert "join: " in stdout and "from 3 pieces" in stdout  # the model file came in three pieces, checked
    assert cfg.data_dir == str(tmp / "work" / "data") and res["complete"]
    assert res["corpus"]["fingerprint"] == corpus.load(cfg.corpus_root).fingerprint  # made by `prepare`
    assert res["corpus"]["examples"]["heldout"] == cfg.n_heldout and res["corpus"]["examples"]["humaneval"] == 2
    assert [r["label"] for r in rows] == [d.label for d in decoders(cfg)]
    done = res["training"]
    assert set(done) == {"ft_ntp", "ft_sbd", "ft_sbd_lora"}
    assert not done["ft_ntp"]["last"].get("matp_loss") and done["ft_sbd"]["last"]["matp_loss"] > 0
    assert done["ft_sbd_lora"]["last"]["matp_loss"] > 0
    for r in rows:
        assert r["n_heldout"] == cfg.n_heldout and r["n_humaneval"] == 2
        for key in ("first_line_exact", "similarity", "parses", "humaneval_pass1"):
            assert 0.0 <= r[key] <= 1.0, (r["label"], key)
        assert r["tokens"] > 0 and r["nfe"] > 0 and r["tokens_per_s"] > 0
        # batch-1 timing for AR and lossless rows only (latency_lossy=False)
        assert r["latency_n"] == (1 if r["mode"] == "ar" or r["verify"] else 0), r["label"]
        if r["mode"] == "ar":
            assert r["tokens_per_forward"] == 1.0 and r["same_as_ar"] == 1.0
        if r["verify"]:  # lossless: the same model's own AR tokens, whatever its drafts
            assert r["same_as_ar"] == 1.0 and r["drafts"] >= r["drafts_agreed"] >= 0, r["label"]
    assert {r["model"] for r in rows if r["verify"]} == {"sbd", "lora"}
    table = (out / "table.md").read_text()
    assert all(r["label"] in table for r in rows) and "tokens decoded per row" in table
    with tarfile.open(tmp / "out" / "logs.tgz") as t:  # what a device call brings back
        names = t.getnames()
    assert {"real/table.md", "real/results.json", "logs/real.log", "logs/mfu_profile.log",
            "real/ft_sbd/metrics.jsonl"} <= set(names)
    pieces = sorted((tmp / "out").glob("adapter.tgz.part*"))  # each under what a device call returns
    assert pieces and all(p.stat().st_size <= 15 * 2**20 for p in pieces)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in pieces))) as t:
        assert "adapter/adapter_model.safetensors" in t.getnames()
    assert "=== info rc=0" in stdout and "smollm2-135m (tiny)" in (tmp / "out" / "mfu_profile.md").read_text()
    assert "=== mfu_profile rc=0" in stdout and (tmp / "out" / "mfu_profile_profile.md").is_file()
    assert "=== decode8b_s1_int8_kvint8 rc=0" in stdout
    assert "projections int8, KV cache int8" in (tmp / "out" / "policy8b_s1_int8_kvint8.md").read_text()


def test_rerun_reuses_every_stage_and_refuses_other_settings(demo):
    _, cfg, res, _ = demo
    logs = []
    rows = run(cfg, log=logs.append)
    assert json.dumps(rows) == json.dumps(res["rows"])  # (NaN columns: compared as JSON)
    for stage in ("[data] using", "[ft_ntp] reusing", "[ft_sbd] reusing", "[ft_sbd_lora] reusing", "[eval] reusing"):
        assert any(line.startswith(stage) for line in logs), stage
    with pytest.raises(ConfigError, match="steps"):
        run(RealDemoConfig(**{**cfg.__dict__, "steps": 3}), log=lambda *_: None)
    with pytest.raises(ConfigError, match="n_heldout"):  # the prepared data was made for 3
        run(RealDemoConfig(**{**cfg.__dict__, "n_heldout": 2}), log=lambda *_: None)
    held = Path(cfg.data_dir) / "heldout.jsonl"  # a data file damaged after the stage (a held-out line lost)
    whole = held.read_bytes()
    held.write_bytes(whole[:whole.rindex(b"\n", 0, len(whole) - 1) + 1])
    try:
        with pytest.raises(ConfigError, match=r"heldout\.jsonl' is not what the data stage wrote"):
            run(cfg, log=lambda *_: None)
    finally:
        held.write_bytes(whole)


def test_a_stopped_evaluation_resumes_by_row(demo):
    """A run stopped during evaluation (a device call's time limit) keeps its finished rows: the rerun decodes only
    the others and ends with the same table."""
    _, cfg, res, _ = demo
    out = Path(cfg.out_dir)
    store = (out / "eval_rows.jsonl").read_text().splitlines()
    kept = len(store) - 2  # the settings line and all finished rows but the last one
    (out / "eval_rows.jsonl").write_text("\n".join(store[:kept]) + "\n")
    partial = {**res, "complete": False}
    (out / "results.json").write_text(json.dumps(partial))
    logs = []
    rows = run(cfg, log=logs.append)
    assert any(line.startswith(f"[eval] reusing {kept - 1} finished rows") for line in logs)
    assert sum(line.startswith("[eval] ") and "first-line EM" in line for line in logs) == len(rows) - (kept - 1)
    keys = ("label", "tokens", "nfe", "first_line_exact", "same_as_ar", "accepted_per_forward")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in res["rows"]]


def test_the_model_file_travels_in_checked_pieces(tmp_path):
    src = tmp_path / "file.bin"
    src.write_bytes(os.urandom(100_001))
    dirs = gpu_campaign.split(src, tmp_path / "carry")
    assert [d.name for d in dirs] == ["p1", "p2", "p3"]
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    for i, d in enumerate(dirs, 1):
        (pieces / f"model.gguf.part{i}").write_bytes((d / f"model.gguf.part{i}").read_bytes())
        (pieces / f"manifest{i}.json").write_text((d / "manifest.json").read_text())
    assert gpu_campaign.join(pieces, tmp_path / "joined").read_bytes() == src.read_bytes()
    part2 = pieces / "model.gguf.part2"
    data = part2.read_bytes()
    part2.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped (a fixed byte would be a no-op 1 in 256)
    with pytest.raises(SystemExit, match="piece 2 .* damaged"):
        gpu_campaign.join(pieces, tmp_path / "joined2")
    part2.unlink()
    with pytest.raises(SystemExit, match="piece 2 of 3 is missing"):
        gpu_campaign.join(pieces, tmp_path / "joined2")
    assert not (tmp_path / "joined2").exists()
    proc = campaign(tmp_path / "elsewhere", "take2")  # a call that did not carry its piece says so and stops
    assert proc.returncode != 0 and "was not carried by this call" in proc.stdout


def test_quick_config_checks():
    with pytest.raises(ConfigError, match="prompt_tokens"):
        RealDemoConfig(prompt_tokens=700, seq_len=640)
    with pytest.raises(ConfigError, match="remat"):
        RealDemoConfig(remat="some")
    with pytest.raises(ConfigError, match="'sometimes'"):
        RealDemoConfig.quick(lossless_policies=("sometimes",))
    with pytest.raises(ConfigError, match="dtype"):
        RealDemoConfig(dtype="float8")
    with pytest.raises(ConfigError, match="lora_rank"):
        RealDemoConfig(lora_rank=-1)
    with pytest.raises(ConfigError, match="checkpoints"):
        RealDemoConfig(checkpoints=0)


@pytest.mark.parametrize("argv, match", [(["lora_rank=-1"], "lora_rank"), (["--out", "/dev/null/x"], "Not a directory")],
                         ids=["bad_value", "bad_out"])
def test_demo_cli_errors_are_one_line(argv, match, capsys):
    """The demos' command line: a bad value or output is an `error:` line and exit 2, not a traceback."""
    from demos.real.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--quick", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and match in err and "Traceback" not in err, err
