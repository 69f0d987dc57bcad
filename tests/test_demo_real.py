"""`make demo-real` (demos/real/recipe.py, the draft recipe) end to end at a tiny setting on the CPU, run the way the
GPU campaign runs it (bench/gpu_campaign.sh at CAMPAIGN_SIZE=tiny: the same stages and code paths as on the GPU): a
tiny random GGUF that carries SmolLM2's real tokenizer, split into the three pieces three device calls carry,
joined and checked; the data made beforehand from a dozen real stdlib modules; the base's greedy continuations,
the copy-only adapter (two steps), every decoder on a few held-out functions and HumanEval problems. The numbers
mean nothing, but the lossless rows must equal the base's AR, a rerun reuses every stage or names what changed,
and a damaged or missing piece of the model file is refused by name."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from gguf_fixtures import make_tiny_gguf

from sbd_jax.config import ConfigError, from_dict
from demos.real import corpus, recipe
from demos.real.config import RealDemoConfig
from demos.real.evaluation import decoders
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
    # the stages a GPU session still has to run (the mfu stages ran on an H100 and an H200: BENCHMARKS.md, "The GPU
    # campaign's stages"); END_S: the GPU call's deadline, which a busy CPU running the tiny stages may pass
    proc = campaign(tmp, "prepare", "take1", "info", "decode8b", "take2", "take3", "draft-distill",
                    "draft-train", "draft-eval", GGUF=str(gguf), END_S="3000", CORPUS_ROOT=str(lib),
                    SLOTS="1", WIDE_COST="4", ROUNDS="1",
                    QUANT="int8", KV="int8")  # (decode8b with quantized weights and cache: issue 42's GPU stage)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp, lib, proc.stdout


def test_the_draft_recipe_stages_run(demo):
    """draft-distill / draft-train / draft-eval (the recipe at the campaign's size, here tiny): the base's greedy
    continuations as id records, the adapter trained with its draft metric logged (AR agreement 1: the
    continuations are the base's own), the table with the lossless rows equal to the base's AR and the HumanEval
    problems checked, all packed."""
    tmp, _, stdout = demo
    assert "join: " in stdout and "from 3 pieces" in stdout  # the model file came in three pieces, checked
    d = tmp / "work" / "draft"
    held = [json.loads(ln) for ln in (d / "heldout_distilled.jsonl").read_text().splitlines()]
    assert held and all(r["prompt_ids"] and r["response_ids"] for r in held)
    evals = [json.loads(ln) for ln in (d / "run" / "draft_quality.jsonl").read_text().splitlines()]
    assert evals and all(e["ar_agreement"] == 1.0 for e in evals)
    res = json.loads((d / "eval" / "results.json").read_text())
    cfg = from_dict(RealDemoConfig, res["settings"])
    rows = {r["label"]: r for r in res["rows"]}
    assert list(rows) == [dec.label for dec in decoders(cfg)]
    lossless = [r for label, r in rows.items() if "lossless" in label]
    assert len(lossless) == 2 and all(r["same_as_base_ar"] == 1.0 for r in lossless), list(rows)
    for r in rows.values():
        assert r["n_heldout"] == 2 and r["n_humaneval"] == 2 and 0.0 <= r["humaneval_pass1"] <= 1.0
        assert r["tokens"] > 0 and r["nfe"] > 0 and r["tokens_per_s"] > 0
        assert r["latency_n"] == (1 if r["mode"] == "ar" or r["verify"] else 0), r["label"]
    assert "HumanEval pass@1" in (d / "eval" / "table.md").read_text()
    out = tmp / "out"
    assert (out / "draft.tgz").is_file() and list(out.glob("draft_adapter.tgz.part*"))
    with tarfile.open(out / "logs.tgz") as t:  # what a device call brings back
        assert {"logs/draft_eval.log", "logs/decode8b_s1_int8_kvint8.log"} <= set(t.getnames())


def test_the_other_gpu_stages_run(demo):
    stdout = demo[2]
    out = demo[0] / "out"
    assert "=== info rc=0" in stdout
    assert "=== decode8b_s1_int8_kvint8 rc=0" in stdout
    assert "projections int8, KV cache int8" in (out / "policy8b_s1_int8_kvint8.md").read_text()


def test_rerun_reuses_every_stage_and_refuses_other_data(demo, capsys):
    """Run again, the stages reuse what they made (decoding and training find their work done, the adapter is the
    same); data made with other settings, or damaged since, is refused by name."""
    tmp, lib, _ = demo
    work = tmp / "work"
    adapter = work / "draft" / "run" / "adapter" / "adapter_model.safetensors"
    before = adapter.read_bytes()
    logs = []
    kw = dict(gguf=str(work / "model.gguf"), corpus_root=str(lib), data_dir=str(work / "data"), log=logs.append)
    recipe.run(work, "tiny", ("distill", "train"), **kw)
    out = capsys.readouterr().out
    assert out.count("nothing to do: every prompt is already in the output") == 2 and "already complete at step 2" in out
    assert adapter.read_bytes() == before and any(line.startswith("[data] using") for line in logs)
    with pytest.raises(ConfigError, match="n_heldout"):  # the prepared data was made for the tiny size's 3, not 64
        recipe.run(work, "cpu", ("distill",), **kw)
    saved = work / "data" / "settings.json"  # data cut by an older task format (made before the key existed)
    settings = saved.read_text()
    saved.write_text(json.dumps({k: v for k, v in json.loads(settings).items() if k != "task_format"}))
    try:
        with pytest.raises(ConfigError, match="task_format"):
            recipe.run(work, "tiny", ("distill",), **kw)
    finally:
        saved.write_text(settings)
    held = work / "data" / "heldout.jsonl"  # a data file damaged after the stage (a held-out line lost)
    whole = held.read_bytes()
    held.write_bytes(whole[:whole.rindex(b"\n", 0, len(whole) - 1) + 1])
    try:
        with pytest.raises(ConfigError, match=r"heldout\.jsonl' is not what the data stage wrote"):
            recipe.run(work, "tiny", ("distill",), **kw)
    finally:
        held.write_bytes(whole)


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


def test_config_checks():
    with pytest.raises(ConfigError, match="n_heldout"):
        RealDemoConfig(n_heldout=0)
    with pytest.raises(ConfigError, match="'sometimes'"):
        RealDemoConfig(lossless_policies=("sometimes",))
    with pytest.raises(ConfigError, match="latency_n"):
        RealDemoConfig(latency_n=-1)
    for bad in ((1,), 4):
        with pytest.raises(ConfigError, match="always_blocks"):
            RealDemoConfig(always_blocks=bad)
    rows = decoders(RealDemoConfig(always_blocks=(2, 4)))  # an "always" row per block, the others at the table's
    assert [(d.policy, d.block_size) for d in rows if d.verify] == [("adaptive", None), ("always", 2), ("always", 4)]
    assert "block 2" in rows[2].label and "block 4" in rows[3].label and "block" not in rows[1].label
    with pytest.raises(ConfigError, match="size"):
        recipe.run(Path("/nonexistent"), "huge")
    with pytest.raises(ConfigError, match="unknown stage"):
        recipe.run(Path("/nonexistent"), "tiny", ("fine-tune",))


def test_demo_cli_errors_are_one_line(tmp_path, capsys):
    """The demo's command line: a bad choice is an argparse line, a failing stage an `error:` line, not a
    traceback."""
    from demos.real.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--size", "huge"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--size", "tiny", "--work", str(tmp_path), "--stages", "distill", "--data-dir", str(tmp_path / "none")])
    assert str(e.value.code).startswith("error: ") and "not a finished data stage" in str(e.value.code)
