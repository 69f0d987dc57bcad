"""Multi-process for real: train.py and decode.py started as 2 processes of one jax.distributed job (localhost
coordinator, gloo CPU collectives, 4 fake CPU devices each, one mesh over all 8) against the same commands as
1 process with 8 fake devices. Training is SIGKILLed mid-run in both processes, resumed, and exported."""
import json
import signal
import time

import jax
import numpy as np
import pytest

import sbd_jax
from subproc import finish, free_port, start_processes
from training_fixtures import write_inputs

STEPS = 6  # checkpoints at 2, 4 and 6: the two-process run is killed after one and resumed
TRAIN = ["train.py", "--config", None, f"steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=2", "log_every=1",
         "mesh.data=2", "mesh.fsdp=4", "progress=false"]


def _train(cfg_path, out, processes, *, kill_after=None, mesh=()):
    argv = [str(cfg_path) if a is None else a for a in TRAIN] + [*mesh, f"out_dir={out}"]
    procs = start_processes(argv, processes=processes, devices_each=8 // processes, port=free_port())
    if kill_after is None:
        return finish(procs)
    ckdir, deadline = out / "checkpoints", time.time() + 300
    try:
        while time.time() < deadline and all(p.poll() is None for p in procs):
            if any(p.name.isdigit() and int(p.name) >= kill_after for p in ckdir.glob("*")):
                break
            time.sleep(0.02)
        assert all(p.poll() is None for p in procs), "train.py ended before it could be killed:\n" + \
            "\n".join(p.communicate()[1].decode()[-3000:] for p in procs)
        for p in procs:
            p.send_signal(signal.SIGKILL)
    finally:
        for p in procs:
            p.wait(30)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp")
    cfg_path = write_inputs(d)
    _train(cfg_path, d / "one", 1)
    _train(cfg_path, d / "two", 2, kill_after=2)
    assert not (d / "two" / "hf").exists()
    out = _train(cfg_path, d / "two", 2)  # resumes from the last complete checkpoint
    resumed = int(out[0].split("resumed from step ")[1].split()[0])
    assert 2 <= resumed < STEPS and list((d / "two" / "checkpoints" / str(STEPS) / "state").glob("ocdbt.process_1"))
    return d


def test_two_processes_train_resume_and_export_like_one(runs):
    one, two = _metrics(runs / "one"), _metrics(runs / "two")
    assert [m["step"] for m in one] == [m["step"] for m in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):  # same batches, masks and k; sums reduced in another order across processes
        assert (a["k"], a["ntp_tokens"], a["matp_tokens"]) == (b["k"], b["ntp_tokens"], b["matp_tokens"])
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    _, p1 = sbd_jax.from_pretrained(runs / "one" / "hf")
    _, p2 = sbd_jax.from_pretrained(runs / "two" / "hf")
    # Adam's normalised update turns reduction-order rounding of a near-zero gradient into ~lr-sized noise on a
    # few elements (seen: 1.8e-6 on weights of ~0.05 after 12 steps on an AMD EPYC runner); 1e-5 is still far
    # below one step's update
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


def test_context_axis_spanning_both_processes_trains_like_one(runs):
    """mesh context 4 x tensor 2 over 2 processes of 4 devices (axes in the order data, fsdp, context, tensor):
    each row's sequence is split over devices of both processes, and every process reads the whole batch (the
    rows its devices hold). Killed after a checkpoint and resumed, its losses equal the one-process data 2 x fsdp 4
    run's, step for step."""
    out, mesh = runs / "context", ("mesh.data=1", "mesh.fsdp=1", "mesh.context=4", "mesh.tensor=2")
    _train(runs / "cfg.yaml", out, 2, kill_after=2, mesh=mesh)
    assert "resumed from step" in _train(runs / "cfg.yaml", out, 2, mesh=mesh)[0]
    one, ctx = _metrics(runs / "one"), _metrics(out)
    assert [m["step"] for m in ctx] == list(range(1, STEPS + 1))
    assert json.loads((out / "train_config.json").read_text())["train"]["mesh"]["context"] == 4
    for a, b in zip(one, ctx):
        assert (a["k"], a["ntp_tokens"], a["matp_tokens"]) == (b["k"], b["ntp_tokens"], b["matp_tokens"])
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)


def test_two_processes_decode_like_one(runs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_ids": ids}) + "\n" for i, ids in
                               enumerate([[1, 30, 25, 9], [1, 5, 27], [1, 22, 33, 40, 12, 7], [1, 18]])))
    outs = {}
    runs_ = (("two", 2, []), ("continuous", 1, []), ("one_verify", 1, ["--static", "--verify"]),
             ("two_verify", 2, ["--verify"]))
    for name, n, flags in runs_:
        outs[name] = tmp_path / f"{name}.jsonl"
        finish(start_processes(["decode.py", "--model", str(runs / "one" / "hf"), "--input", str(prompts),
                                "--output", str(outs[name]), "--max-new-tokens", "8", "--block-size", "4",
                                "--batch-size", "8", "--no-progress", "mesh.data=8", *flags],
                               processes=n, devices_each=8 // n, port=free_port()))
    # several processes decode static batches (continuous batching is single-process): the rows one process writes
    rows = lambda p: sorted(p.read_text().splitlines())  # noqa: E731 - each writes in its own finishing order
    assert rows(outs["continuous"]) == rows(outs["two"]) and len(rows(outs["two"])) == 4
    # verify mode over two processes (its policy's counts replicated, its rows gathered): the same file as one
    assert outs["one_verify"].read_text() == outs["two_verify"].read_text()


PACK = """
import json, sys
import numpy as np
from sbd_jax.sharding import MeshConfig, make_mesh, maybe_initialize_distributed
maybe_initialize_distributed()
import jax
from sbd_jax.training.data import Documents, PackedIterator, gather_state
from sbd_jax.training.step import local_rows

rng = np.random.default_rng(0)
docs = Documents.from_lists([list(rng.integers(5, 90, rng.integers(2, 20))) for _ in range(300)])
rows = local_rows(make_mesh(MeshConfig(data=4, fsdp=2)), 16)
it = PackedIterator(docs, 24, 16, seed=3, rows=rows)
before = [it.next_batch().tokens for _ in range(5)]  # ~160 of 300 documents: mid-epoch
state = gather_state(it.state())  # a collective, as at a checkpoint
after = [it.next_batch().tokens for _ in range(3)]
resumed = PackedIterator(docs, 24, 16, seed=3, rows=rows)
resumed.restore(json.loads(json.dumps(state)))
json.dump({"rows": rows, "tokens": np.stack(before + after).tolist(), "state": state,
           "processes": jax.process_count(),
           "resumed_exact": all(np.array_equal(a, resumed.next_batch().tokens) for a in after)},
          open(sys.argv[1] + f".{jax.process_index()}", "w"))
"""


def test_two_processes_pack_disjoint_rows_whose_union_is_one_process(tmp_path):
    """Each process packs only its devices' rows; over 2 processes the rows are disjoint and together exactly the
    rows one process packs; the state gathered at a "checkpoint" is the same as one process's, and each process
    resumes its own rows exactly from it."""
    out = {}
    for n in (1, 2):
        finish(start_processes(["-c", PACK, str(tmp_path / f"p{n}")], processes=n, devices_each=8 // n,
                               port=free_port()))
        out[n] = [json.loads((tmp_path / f"p{n}.{i}").read_text()) for i in range(n)]
    one, (a, b) = out[1][0], out[2]
    assert one["rows"] == list(range(16)) and len(a["rows"]) == len(b["rows"]) == 8 and a["processes"] == 2
    assert not set(a["rows"]) & set(b["rows"]) and sorted(a["rows"] + b["rows"]) == one["rows"]
    full = np.asarray(one["tokens"])
    for p in (a, b):
        np.testing.assert_array_equal(np.asarray(p["tokens"]), full[:, p["rows"]])
        assert p["resumed_exact"] and p["state"] == one["state"]
    assert one["resumed_exact"] and one["state"]["rows"] == 5 * 16
