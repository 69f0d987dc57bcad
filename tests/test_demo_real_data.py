"""The real-model demo's data: the stdlib corpus and its split, the function-completion examples, prompt
truncation, cutting completions, the metrics and the HumanEval harness (demos/real/)."""
import ast
import json
import re
import time

import pytest

from demos.real import corpus, metrics, tasks

MODULE = '''"""A fake module."""
import functools


def plain(a, b):
    """Add."""
    c = a + b
    return c


@functools.lru_cache(maxsize=None)
def decorated(
        x,
        y=1):
    """Multi-line signature,
    decorated.

    def not_this(self):
        the docstring shows code
    """

    if x:
        # a comment at the body's level
        return y
# a comment at column 0 inside the body
    return x


class Outer:
    """A class."""

    def method(self):
        """A method."""
        def helper():
            """The helper."""
            first = 1
            return first
        return helper()

    async def amethod(self):
        """Async."""
        await self.other()
        return 2

    def short(self):
        """Too short."""
        return 1

    def nodoc(self):
        x = 1
        return x


try:
    def in_try(p):
        """Inside a try body."""
        q = p * 2
        return q
except ImportError:
    pass


def unstable(s):
    """A string continues at column 0."""
    t = """
x"""
    return s + t


def last(z):
    """No newline at the end of the file."""
    w = z
    return w'''

EXPECTED_QUALNAMES = ["plain", "decorated", "Outer.method", "Outer.method.<locals>.helper", "Outer.amethod",
                      "in_try", "last"]


def _write(root, rel, text, mode="w"):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


@pytest.fixture
def fake_stdlib(tmp_path):
    """A small stdlib-like tree: kept modules, one file for each exclusion rule, two unreadable files."""
    kept = {"mod_a.py": MODULE, "pkg/__init__.py": "X = 1\n", "pkg/sub.py": "def f():\n    return 1\n",
            "encodings/utf_9.py": '"""A hand-written codec."""\n', "unittest/case.py": "Y = 2\n"}
    excluded = {"test/test_x.py": "test suite", "test/support/helper.py": "test suite",
                "pkg/tests/helper.py": "test suite", "idlelib/idle_test/t.py": "test suite",
                "test_foo.py": "test suite", "foo_test.py": "test suite", "site-packages/x.py": "third-party packages",
                "pkg/__pycache__/y.py": "bytecode cache", "pydoc_data/topics.py": "generated data (pydoc_data)",
                "config-3.12-x/python-config.py": "build support", "_sysconfigdata__linux.py": "build support",
                "encodings/cp999.py": "generated data (codec tables)"}
    for rel, text in kept.items():
        _write(tmp_path, rel, text)
    for rel in excluded:
        _write(tmp_path, rel, '""" Python Character Mapping Codec cp999 generated from X with gencodec.py."""\n'
               if rel.startswith("encodings/") else "Z = 3\n")
    _write(tmp_path, "bad_utf8.py", b"S = '\xff'\n")
    _write(tmp_path, "bad_syntax.py", "def (:\n")
    _write(tmp_path, "notes.txt", "not python\n")
    return tmp_path, kept, excluded


@pytest.fixture(scope="module")
def stdlib():
    return corpus.load()


# ---- corpus ----

def test_fake_corpus_keeps_excludes_and_skips_by_rule(fake_stdlib):
    root, kept, excluded = fake_stdlib
    c = corpus.load(root)
    assert sorted(m.path for m in c.modules) == sorted(kept)
    assert {m.path: m.name for m in c.modules}["pkg/__init__.py"] == "pkg"
    assert {m.path: m.name for m in c.modules}["pkg/sub.py"] == "pkg.sub"
    want = {}
    for reason in excluded.values():
        want[reason] = want.get(reason, 0) + 1
    assert c.excluded == want
    assert c.skipped == {"not valid UTF-8": ("bad_utf8.py",), "does not parse": ("bad_syntax.py",)}
    summary = json.loads(json.dumps(c.summary()))
    assert summary["modules"] == len(kept) and summary["train"] + summary["heldout"] == len(kept)
    assert summary["python"] == corpus.python_id() and summary["fingerprint"] == c.fingerprint


def test_fingerprint_changes_with_content_rule_and_files(fake_stdlib):
    root, _, _ = fake_stdlib
    base = corpus.load(root)
    assert corpus.load(root).fingerprint == base.fingerprint  # deterministic
    _write(root, "test/test_x.py", "CHANGED = 1\n")  # an excluded file does not count
    assert corpus.load(root).fingerprint == base.fingerprint
    assert corpus.load(root, corpus.CorpusOptions(heldout_percent=50)).fingerprint != base.fingerprint
    _write(root, "pkg/sub.py", "def f():\n    return 2\n")
    changed = corpus.load(root)
    assert changed.fingerprint != base.fingerprint
    assert [m.path for m in changed.modules] == [m.path for m in base.modules]
    _write(root, "new_mod.py", "N = 1\n")
    assert corpus.load(root).fingerprint not in (base.fingerprint, changed.fingerprint)


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        corpus.load(tmp_path / "missing")
    _write(tmp_path, "test/test_only.py", "A = 1\n")
    with pytest.raises(ValueError, match="no Python module kept"):
        corpus.load(tmp_path)
    with pytest.raises(ValueError, match="heldout_percent"):
        corpus.CorpusOptions(heldout_percent=0)


def test_stdlib_split_is_deterministic_disjoint_and_large_enough(stdlib):
    paths = [m.path for m in stdlib.modules]
    assert len(paths) > 300 and paths == sorted(set(paths))
    train, held = {m.path for m in stdlib.train}, {m.path for m in stdlib.heldout}
    assert not train & held and train | held == set(paths)
    assert len(held) / len(paths) >= 0.10
    assert all(m.split == corpus.split_of(m.path) for m in stdlib.modules)
    # the rule is pinned: sha256 of the path mod 100 < 12
    assert corpus.split_of("json/decoder.py") == corpus.HELDOUT
    assert corpus.split_of("os.py") == corpus.split_of("ast.py") == corpus.TRAIN
    assert not any(re.search(r"(^|/)(test|tests|idle_test|site-packages)/|(^|/)test_[^/]*$|_test\.py$", p) for p in paths)
    assert "json/decoder.py" in held and "os.py" in train and stdlib.skipped == {}


# ---- examples ----

def _fake_module(text=MODULE, path="mod_a.py"):
    return corpus.Module(path, path[:-3].replace("/", "."), text, "0" * 64, corpus.TRAIN)


def test_examples_are_exact_source_slices():
    sel = tasks.select([_fake_module()])
    assert [e.qualname for e in sel.examples] == EXPECTED_QUALNAMES
    assert sel.counts == {"functions": 10, "kept": 7, "body too short": 1, "no docstring": 1,
                          "body not cut-stable": 1}
    lines = MODULE.split("\n")
    for ex in sel.examples:
        through_end = "\n".join(lines[:_end_line(ex)]) + "\n"
        assert ex.prompt + ex.target == through_end
        assert ex.prompt.endswith('"""') and ex.target.startswith("\n") and ex.target.endswith("\n")
        assert lines[ex.lineno - 1].lstrip().startswith(("def ", "async def "))
        assert ex.indent == len(lines[ex.lineno - 1]) - len(lines[ex.lineno - 1].lstrip())
        assert tasks.def_indent(ex.prompt) == ex.indent
        assert metrics.parses(ex.parse_head, ex.target, ex.parse_tail)
    dec = sel.examples[1]
    assert dec.prompt.endswith('        the docstring shows code\n    """')
    assert dec.target.startswith("\n\n    if x:\n") and dec.target.endswith("    return x\n")
    assert dec.parse_head.startswith("@functools.lru_cache")
    in_try = sel.examples[5]
    assert not metrics.parses(in_try.prompt, in_try.target)  # the module prefix alone lacks the `except`
    assert in_try.parse_head.startswith("try:\n") and in_try.parse_tail.startswith("except ImportError:")


def _end_line(ex):
    tree = ast.parse(ex.module.source)
    fn = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
              and n.lineno == ex.lineno)
    return fn.end_lineno


def test_example_selection_is_deterministic_and_capped():
    many = "".join(f'def f{i}(x):\n    """Doc {i}."""\n    y = x + {i}\n    return y\n\n\n' for i in range(40))
    mod = _fake_module(many, "many.py")
    a = tasks.examples([mod], per_module_cap=10, seed=0)
    assert [e.id for e in a] == [e.id for e in tasks.examples([mod], per_module_cap=10, seed=0)]
    assert len(a) == 10 and [e.lineno for e in a] == sorted(e.lineno for e in a)
    assert [e.id for e in tasks.examples([mod], per_module_cap=10, seed=1)] != [e.id for e in a]
    assert tasks.select([mod], per_module_cap=10).counts["over per-module cap"] == 30
    assert len(tasks.examples([mod], max_body_lines=1, min_body_lines=1)) == 0
    with pytest.raises(ValueError, match="min_body_lines"):
        tasks.TaskOptions(min_body_lines=3, max_body_lines=2)


def test_stdlib_heldout_examples_parse(stdlib):
    held = tasks.examples(stdlib.heldout)
    assert len(held) >= 200 and len({e.id for e in held}) == len(held)
    assert all(e.module.split == corpus.HELDOUT for e in held)
    assert all(metrics.parses(e.parse_head, e.target, e.parse_tail) for e in held)
    naive = sum(metrics.parses(e.prompt, e.target) for e in held[:60])  # module prefix + body: nearly always
    assert naive >= 59
    assert all(tasks.def_indent(e.prompt) == e.indent and e.cut(e.target) == e.target for e in held)


# ---- truncation ----

def _word_encode(calls):
    def encode(text):
        calls.append(len(text))
        return [hash(t) % 1000 for t in re.findall(r"\s+|\w+|[^\w\s]", text)]
    return encode


def test_truncate_prompt_keeps_the_end_within_budget():
    prompt = "".join(f"line_{i} = {i} + value\n" for i in range(5000)) + "def f(x):\n    \"\"\"Doc.\"\"\"\n"
    calls = []
    encode = _word_encode(calls)
    for budget in (12, 50, 333, 2000):  # the last line is 10 words
        calls.clear()
        text = tasks.truncate_prompt_text(prompt, encode, budget)
        ids = tasks.truncate_prompt(prompt, encode, budget)
        assert len(ids) <= budget and ids == encode(text) and prompt.endswith(text)
        start = len(prompt) - len(text)
        assert start == 0 or prompt[start - 1] == "\n"  # at a line start
        previous = prompt.rfind("\n", 0, start - 1) + 1
        assert len(encode(prompt[previous:])) > budget  # one more line would not fit
        assert len(calls) < 60  # not one encode per line
    assert tasks.truncate_prompt_text(prompt, encode, 10**6) == prompt
    long_last = "a = 1\n" + "x " * 100 + "\n"
    text = tasks.truncate_prompt_text(long_last, encode, 11)  # the last line alone is over the budget
    assert long_last.endswith(text) and len(encode(text)) == 11
    with pytest.raises(ValueError, match="budget"):
        tasks.truncate_prompt("x\n", encode, 0)


def test_records_and_jsonl(tmp_path):
    mod = _fake_module()
    exs = tasks.examples([mod])
    encode = _word_encode([])
    assert tasks.write_jsonl(tmp_path / "train.jsonl", tasks.training_records([mod], None, encode, 40)) == len(exs)
    assert tasks.write_jsonl(tmp_path / "held.jsonl", tasks.heldout_records([mod], None, encode, 40)) == len(exs)
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "held.jsonl").read_text().splitlines()]
    for ex, t, h in zip(exs, train, held):
        assert set(t) == {"prompt", "response"} and t["response"] == ex.target and len(encode(t["prompt"])) <= 40
        assert h["id"] == ex.id and h["qualname"] == ex.qualname and h["module"] == "mod_a.py"
        assert h["target"] == ex.target and h["prompt"] == t["prompt"] and h["prompt_ids"] == encode(h["prompt"])
        assert ex.module.source[:h["prompt_start"]] + h["prompt"] == ex.prompt
        assert metrics.score(h, ex.target + "x = 1\n") == metrics.score(ex, ex.target)  # records score like examples
    limited = tasks.heldout_records([mod], tasks.TaskOptions(), encode, 40, limit=3)
    assert [r["qualname"] for r in limited] == [EXPECTED_QUALNAMES[i] for i in (0, 2, 4)]  # evenly spread
    he = tasks.humaneval_records(encode, 64, limit=2)
    assert [r["id"] for r in he] == ["HumanEval/0", "HumanEval/1"] and he[0]["prompt"].startswith("from typing")
    model_prompt = he[0]["prompt"].removesuffix("\n")  # the model's prompt stops where held-out prompts do
    assert len(he[0]["prompt_ids"]) <= 64 and he[0]["prompt_ids"] == encode(tasks.truncate_prompt_text(model_prompt,
                                                                                                       encode, 64))


# ---- cutting ----

def test_cut_completion_cuts_at_the_dedent_and_keeps_the_body():
    prompt = "class A:\n    def f(self):\n        \"\"\"Doc.\n\n        def g():\n        \"\"\"\n"
    body = ("        for i in range(3):\n"
            "            if i:\n"
            "\n"
            "                continue\n"
            "# a column-0 comment does not end the body\n"
            "        return i\n")
    after = "\n    def g(self):\n        pass\n\nprint(1)\n"
    assert tasks.def_indent(prompt) == 4  # the `def g():` inside the docstring is skipped
    assert tasks.cut_completion(prompt, body + after) == body
    assert tasks.cut_completion(prompt, body + "\n\n   # trailing comment\n\n") == body
    assert tasks.cut_completion(prompt, body + "class B:\n") == body
    assert tasks.cut_completion(prompt, "        return 1") == "        return 1\n"  # a newline is added
    assert tasks.cut_completion(prompt, "    x = 1\n        y = 2\n") == ""
    assert tasks.cut_completion(None, "  a\nb\n", indent=0) == "  a\n"
    assert tasks.cut_completion("async def h():\n  '''d'''\n", "  await x\nasync def k(): pass\n") == "  await x\n"
    assert tasks.cut_completion(prompt, tasks.cut_completion(prompt, body + after)) == body  # idempotent
    with pytest.raises(ValueError, match="def"):
        tasks.cut_completion("x = 1\n", "y\n")


# ---- metrics ----

def test_metrics_on_hand_made_cases():
    assert metrics.first_line("\n  \n    return x  \n    y\n") == "    return x"
    assert metrics.first_line_exact("\n    return x   \n", "    return x\n    z\n")
    assert not metrics.first_line_exact("  return x\n", "    return x\n")  # indentation counts
    assert not metrics.first_line_exact("", "")
    assert metrics.similarity("abcd", "abce") == 0.75
    assert metrics.similarity("abc", "abc") == 1.0 and metrics.similarity("", "xyz") == 0.0
    # one inserted line in a 520-character body: all of the target matches (difflib's autojunk would give 0.50)
    line = "    value = compute(a, b)\n"
    long_target, inserted = line * 20, line * 10 + "    other = 0\n" + line * 10
    assert metrics.similarity(inserted, long_target) == pytest.approx(2 * 520 / (534 + 520))
    assert metrics.parses("def f():\n", "    return 1\n", "x = 2\n")
    assert not metrics.parses("def f():\n", "    return (1\n", "x = 2\n")
    assert metrics.identical_share(["a", "b", "c", "d"], ["a", "x", "c", "y"]) == 0.5
    with pytest.raises(ValueError):
        metrics.identical_share(["a"], ["a", "b"])

    ex = tasks.examples([_fake_module()])[0]  # plain: "\n    c = a + b\n    return c\n"
    exact = metrics.score(ex, ex.target + "\n\ndef next_function():\n    pass\n")
    assert exact == metrics.CompletionScore(ex.target, True, 1.0, True)
    wrong = metrics.score(ex, "\n    c = a - b\n    return (c\n")
    assert (wrong.first_line_exact, wrong.parses) == (False, False)
    # matched: "\\n    c = a " (11) + " b\\n    return " (14) + "c\\n" (2) of 29 + 28 characters
    assert wrong.similarity == pytest.approx(2 * 27 / (29 + 28))
    assert metrics.aggregate([exact, wrong]) == {"n": 2, "first_line_exact": 0.5,
                                                 "similarity": (1 + wrong.similarity) / 2, "parses": 0.5}


def test_humaneval_harness_passes_canonical_and_fails_wrong():
    problems = tasks.humaneval_problems()
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    assert all(tasks.def_indent(p.prompt) == 0 for p in problems)
    # the first three, and three whose tests call the prompt's own helpers (poly, encode_cyclic, encode_shift): the
    # judge runs the prompt beside the tests
    picked = [*problems[:3], *(problems[i] for i in (32, 38, 50))]
    # the model keeps generating past the function: cutting leaves the canonical body
    good = [p.cut(p.canonical_solution + "\n\ndef check(candidate):\n    assert False\n") for p in picked]
    assert good == [p.canonical_solution.rstrip("\n") + "\n" for p in picked]
    wrong = ["    return None\n", "    return []\n", "    while True:\n        pass\n"]
    start = time.time()
    records = tasks.humaneval_records(lambda text: list(text.encode()), 4096, limit=3)  # records work as problems
    results = metrics.humaneval_check([*picked, *records], good + wrong, timeout=2.0)
    assert time.time() - start < 25
    assert [r.passed for r in results] == [True] * 6 + [False] * 3, results
    assert [r.task_id for r in results] == [p.task_id for p in picked] + [p.task_id for p in picked[:3]]
    assert results[6].result.startswith("failed") and results[8].result == "timed out"
    assert metrics.pass_at_1(results) == 6 / 9
