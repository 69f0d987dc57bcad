"""A built-in reasoning task suite in the spirit of the paper's math and code benchmarks, generated
deterministically from a seed, with worked solutions and exact-match answers.

Families (each problem is `prompt` -> `solution` whose final `=` answer is checked exactly):
  arith  multi-step arithmetic word problem, solved left to right with a chain of partial results
         "Q:Ann has 7, gets 5, loses 3, gets 9. How many?"  -> "7+5=12;12-3=9;9+9=18;=18"
  trace  program tracing, the value of the last statement (as a REPL prints it):
         "Q:run a=3;b=a+2;a=b*2"                             -> "b=a+2=3+2=5;a=b*2=5*2=10;=10"
  rev    list reversal:   "Q:rev 4 1 7 2"                  -> "2 7 1 4;=2 7 1 4"
  sort   list sorting:    "Q:sort 4 1 7 2"                 -> "1 2 4 7;=1 2 4 7"
  sum    running sum:     "Q:sum 4 1 7"                    -> "4+1=5;5+7=12;=12"

Train and test problems are drawn from disjoint problem identities: a problem's canonical prompt string is
hashed and its split decided by the hash, so a held-out problem never appears in training, whatever the seeds.
"""
from __future__ import annotations

import dataclasses
import hashlib
import random

FAMILIES = ("arith", "trace", "rev", "sort", "sum")
NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal")


@dataclasses.dataclass(frozen=True)
class Problem:
    family: str
    prompt: str    # what the model is given (ends right before the solution)
    solution: str  # worked solution, ends with "=<answer>"
    answer: str

    @property
    def text(self) -> str:
        return self.prompt + self.solution


def _arith(r: random.Random) -> tuple[str, str, str]:
    name = r.choice(NAMES)
    v = r.randint(2, 9)
    parts, steps = [f"{name} has {v}"], []
    for _ in range(r.randint(2, 4)):
        if v > 3 and r.random() < 0.4:
            d = r.randint(1, min(9, v - 1))
            parts.append(f"loses {d}")
            steps.append(f"{v}-{d}={v - d}")
            v -= d
        else:
            d = r.randint(1, 9)
            parts.append(f"gets {d}")
            steps.append(f"{v}+{d}={v + d}")
            v += d
    return f"Q:{', '.join(parts)}. How many?\nA:", ";".join(steps) + f";={v}", str(v)


def _trace(r: random.Random) -> tuple[str, str, str]:
    env = {"a": r.randint(1, 9)}
    prog, steps = [f"a={env['a']}"], []
    for _ in range(r.randint(2, 3)):
        dst = r.choice("abc")
        src = r.choice(sorted(env))
        op = r.choice("+*") if env[src] < 10 else "+"
        c = r.randint(2, 3) if op == "*" else r.randint(1, 9)
        val = env[src] + c if op == "+" else env[src] * c
        prog.append(f"{dst}={src}{op}{c}")
        steps.append(f"{dst}={src}{op}{c}={env[src]}{op}{c}={val}")
        env[dst] = val
    # the answer is the last statement's value (a query for any variable was learned erratically by the
    # small model: docs/demo_experiments.md)
    return f"Q:run {';'.join(prog)}\nA:", ";".join(steps) + f";={val}", str(val)


def _lists(r: random.Random, family: str) -> tuple[str, str, str]:
    xs = [r.randint(0, 9) for _ in range(r.randint(3, 6))]
    if family == "rev":
        out = xs[::-1]
    elif family == "sort":
        out = sorted(xs)
    else:  # running sum
        xs = xs[:4]
        steps, s = [], xs[0]
        for x in xs[1:]:
            steps.append(f"{s}+{x}={s + x}")
            s += x
        return f"Q:sum {' '.join(map(str, xs))}\nA:", ";".join(steps) + f";={s}", str(s)
    ans = " ".join(map(str, out))
    return f"Q:{family} {' '.join(map(str, xs))}\nA:", f"{ans};={ans}", ans


def make_problem(r: random.Random, family: str) -> Problem:
    if family == "arith":
        p, s, a = _arith(r)
    elif family == "trace":
        p, s, a = _trace(r)
    else:
        p, s, a = _lists(r, family)
    return Problem(family, p, s, a)


def is_test_problem(prompt: str, test_fraction: float = 0.2) -> bool:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return (h % 10_000) < test_fraction * 10_000


def generate(n: int, split: str, seed: int, families=FAMILIES) -> list[Problem]:
    """`n` distinct problems of `split` ("train" | "test"), families interleaved, deterministic in `seed`."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    r = random.Random(f"{split}-{seed}")
    out, seen = [], set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            raise RuntimeError(f"could not draw {n} distinct {split} problems")
        fam = families[len(out) % len(families)]
        p = make_problem(r, fam)
        if p.prompt in seen or is_test_problem(p.prompt) != (split == "test"):
            continue
        seen.add(p.prompt)
        out.append(p)
    return out


def extract_answer(generated: str) -> str | None:
    """The exact-match answer: text after the last '=' of the first line-free solution, up to EOS."""
    line = generated.split("\n", 1)[0]
    if ";=" not in line:
        return None
    return line.rsplit(";=", 1)[1].strip()
