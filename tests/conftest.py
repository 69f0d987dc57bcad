"""Shared fixtures. The HF reference runs in a separate interpreter (.venv-ref, Python 3.11 + torch CPU +
transformers; see README) because torch's CPU wheel is only available for Python 3.11 here while the
project runs on Python 3.12 / jax 0.11.2. Set SBD_HF_PYTHON to point elsewhere."""
import atexit
import contextlib
import gc
import json
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# tokenized training stores (sbd_jax/training/store.py) and converted GGUF models (sbd_jax/io/gguf.py) of this test
# session, not the user's caches (a warm one would also hide a conversion's cost from the suite's time)
for _var, _prefix in (("SBD_DATA_STORE", "sbd_test_stores_"), ("SBD_MODEL_CACHE", "sbd_test_models_")):
    if _var not in os.environ:
        os.environ[_var] = tempfile.mkdtemp(prefix=_prefix)
        atexit.register(shutil.rmtree, os.environ[_var], ignore_errors=True)
# One on-disk XLA compilation cache per test run, shared by the pytest workers (they inherit the controller's
# environment) and by the scripts the tests start (train.py, decode.py, the 8-device scripts; a script given an
# environment of its own gets subproc.compilation_cache_env()): a program compiled once - in another file, worker
# or process - is loaded, not compiled again. Programs that compile in under 0.3 s (eager ops, small helpers) are
# not written: storing them costs about what compiling them does. No size cap: with one, jax scans the whole
# directory on every write. (Two workers writing the same entry at once at worst make a third compile it again:
# an unreadable entry is a cache miss.) Programs still leave memory when a file ends (_release_compiled_programs).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="sbd_test_xla_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
for _k, _v in {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.3", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}.items():
    os.environ.setdefault(_k, _v)
# The tests' programs are tiny and mostly run once or a few times: compiling them costs more than running them,
# so XLA skips most of its optimizations (jax's own switch; the scripts the tests start inherit it). The files
# whose time goes into running programs (training and evaluating a model) compile them optimized:
# XLA_OPTIMIZED_FILES. Measured one file at a time on this 2-core machine (CPU seconds): test_verify.py +
# test_readme_recipe.py 192 -> 120, test_training_step.py + test_pallas_attention.py 156 -> 111, but
# test_demo.py 105 -> 164 unoptimized.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# test_user_path.py: its tiny model's answers are argmaxes of a model trained in the file; unoptimized programs
# round differently and flipped one ("Hi bye." for "Goodbye."), as a model trained on another CPU would. Inside an
# optimized file, a part that only compiles (a few dozen tokens of decoding) runs `with xla_optimized(False)`.
XLA_OPTIMIZED_FILES = {"test_demo.py", "test_gguf.py", "test_user_path.py", "test_demo_real_eval.py"}


@contextlib.contextmanager
def xla_optimized(on: bool):
    """XLA's optimizations on or off for the programs compiled inside the block (restored after)."""
    import jax
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", not on)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


# The longest files first: `make test` runs files whole on 2 workers (--dist loadfile), so a long file started last
# leaves the other worker idle at the end.
SLOW_FILES = ("test_user_path.py", "test_lora.py", "test_multiprocess.py", "test_verify.py", "test_demo.py",
              "test_pallas_attention.py", "test_pallas_sharded.py", "test_rows_alone.py", "test_gguf.py",
              "test_reliability.py", "test_decoding.py", "test_demo_real.py", "test_training_loop.py",
              "test_context_parallel.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(SLOW_FILES)))  # stable: file order kept


@pytest.fixture(autouse=True, scope="module")
def _xla_optimization(request):
    """XLA's optimizations on for the files of XLA_OPTIMIZED_FILES (and off again after them)."""
    optimized = Path(str(request.fspath)).name in XLA_OPTIMIZED_FILES
    with xla_optimized(True) if optimized else contextlib.nullcontext():
        yield


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each XLA:CPU executable holds ~7 memory mappings of JIT code until it is freed. A test worker that kept
    the programs of every file it ran passed Linux's 65530-mapping limit (vm.max_map_count) and crashed inside
    the compiler, so each file's programs are dropped when it ends."""
    yield
    import jax

    from sbd_jax.decoding import continuous
    continuous.PROGRAMS.clear()
    jax.clear_caches()
    gc.collect()


ROOT = Path(__file__).resolve().parents[1]
HF_REF_SCRIPT = Path(__file__).with_name("hf_ref.py")


def hf_python() -> str:
    py = os.environ.get("SBD_HF_PYTHON", str(ROOT / ".venv-ref" / "bin" / "python"))
    if not Path(py).exists():
        raise RuntimeError(f"HF reference interpreter {py!r} not found: run `make install` (it builds .venv-ref) "
                           "or set SBD_HF_PYTHON")
    return py


class _HFServer:
    """This process's `hf_ref.py serve` (one per test worker, started on first use): torch and transformers are
    imported once per worker instead of once per reference call (2-5 s each). Its stderr goes to an unlinked
    temporary file, read back from where a request began when that request fails. The server exits when its stdin
    closes: at this process's exit (atexit), or when the process dies and the kernel closes the pipe."""

    proc = None
    err_fd = None  # the server's stderr (shared by the servers restarted after it); read with pread, never written
    started_at = 0  # where the running server's stderr begins in it

    @classmethod
    def start(cls):
        if cls.proc is not None:
            if cls.proc.poll() is None:
                return
            cls._forget()
        if cls.err_fd is None:
            cls.err_fd, path = tempfile.mkstemp(prefix="sbd_hf_ref_", suffix=".stderr")
            os.unlink(path)
            atexit.register(cls.stop)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
        env.pop("XLA_FLAGS", None)
        cls.started_at = os.fstat(cls.err_fd).st_size
        cls.proc = subprocess.Popen([hf_python(), str(HF_REF_SCRIPT), "serve"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=cls.err_fd, env=env, text=True, bufsize=1)

    @classmethod
    def _forget(cls, kill=False):
        """Drops the server (killed first if `kill`) and closes this side of its pipes."""
        proc, cls.proc = cls.proc, None
        if kill:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        return proc.returncode

    @classmethod
    def stop(cls):
        if cls.proc is not None:
            try:
                cls.proc.stdin.close()  # the server's loop ends
                cls.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
            cls._forget(kill=cls.proc.poll() is None)

    @classmethod
    def err_tail(cls, start: int) -> str:
        end = os.fstat(cls.err_fd).st_size
        start = max(start, end - 16000)
        return os.pread(cls.err_fd, end - start, start).decode(errors="replace")[-4000:]

    @classmethod
    def call(cls, args) -> None:
        cmd = str(args[0])
        request = json.dumps({"cmd": cmd, "args": [str(a) for a in args[1:]], "cwd": os.getcwd()}) + "\n"
        for attempt in range(2):  # a dead server is started again once
            cls.start()
            start = os.fstat(cls.err_fd).st_size
            try:
                cls.proc.stdin.write(request)
                cls.proc.stdin.flush()
                line = cls.proc.stdout.readline()
            except OSError:  # BrokenPipeError: it died before reading the request
                line = ""
            except BaseException:  # interrupted (Ctrl-C, a test timeout) mid-request: its answer would be read as
                cls._forget(kill=True)  # the next request's, so this server goes
                raise
            if line:
                answer = json.loads(line)
                if not answer["ok"]:
                    raise RuntimeError(f"hf_ref.py {cmd} failed:\n{cls.err_tail(start) or answer['error'][-4000:]}")
                return
            rc = cls._forget()
            died = f"hf_ref.py serve died (exit code {rc}) during `{cmd}`; its stderr:\n{cls.err_tail(cls.started_at)}"
            if attempt:
                raise RuntimeError(f"hf_ref.py {cmd} failed:\n{died[-4000:]}")
            warnings.warn(f"{died[-4000:]}\n(starting it again)", stacklevel=3)


def run_hf(*args) -> None:
    """Runs `hf_ref.py CMD ARGS...` (see its docstring) in this worker's reference server; raises RuntimeError with
    the command's stderr when it fails."""
    _HFServer.call(args)


class HFRef:
    """Thin client of tests/hf_ref.py."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.n = 0
        _HFServer.start()  # the server's start (torch's import) overlaps the test's own work until its first call

    def _p(self, name):
        self.n += 1
        return self.tmp / f"{self.n}_{name}"

    def make(self, arch: str, config: dict, seed=0, std=0.02, dtype="float32", max_shard_size="5GB") -> Path:
        spec = self._p("spec.json")
        spec.write_text(json.dumps(dict(arch=arch, config=config, seed=seed, std=std, dtype=dtype,
                                        max_shard_size=max_shard_size)))
        out = self._p("model")
        run_hf("make", spec, out)
        return out

    def logits(self, model_dir, tokens, lengths=None) -> np.ndarray:
        tp, op = self._p("tokens.npy"), self._p("logits.npy")
        np.save(tp, np.asarray(tokens))
        extra = []
        if lengths is not None:
            lp = self._p("lengths.npy")
            np.save(lp, np.asarray(lengths))
            extra = [lp]
        run_hf("logits", model_dir, tp, op, *extra)
        return np.load(op)

    def generate(self, model_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        pp, op = self._p("prompts.json"), self._p("gen.json")
        pp.write_text(json.dumps([list(map(int, p)) for p in prompts]))
        run_hf("generate", model_dir, pp, max_new, op)
        return json.loads(op.read_text())


@pytest.fixture(params=["triton", "tpu"])
def backend(request) -> str:
    """The Pallas kernel family under test: "triton" (the Triton-style kernels: interpret mode on CPU,
    compiled on a GPU) or "tpu" (the Mosaic-TPU kernels in TPU interpret mode)."""
    return request.param


@pytest.fixture
def hf_ref(tmp_path) -> HFRef:
    return HFRef(tmp_path)


@pytest.fixture(scope="session")
def hf_ref_session(tmp_path_factory) -> HFRef:
    return HFRef(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def params():
    """The random decoding test model of tests/decoding_fixtures.py (one copy per module that asks for it)."""
    from decoding_fixtures import make_params
    return make_params()


@pytest.fixture(scope="module")
def prompts():
    """tests/decoding_fixtures.py's ragged prompt batch (garbage in the padding)."""
    from decoding_fixtures import make_prompts
    return make_prompts()
