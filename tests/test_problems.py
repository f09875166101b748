"""The code-completion set and its scorer: every reference passes, wrong bodies fail, cutting is right."""

import math
import time

import pytest

import quality

PROBLEMS = quality.load_problems()


# ---------------------------------------------------------------------------
# The problem set
# ---------------------------------------------------------------------------

def test_problem_set_is_well_formed():
    assert len(PROBLEMS) >= 36
    assert len({p["id"] for p in PROBLEMS}) == len(PROBLEMS)
    for p in PROBLEMS:
        assert set(p) == {"id", "prompt", "tests", "solution"}, p["id"]
        # The model continues right after the docstring, on a fresh line.
        assert p["prompt"].endswith('"""\n'), p["id"]
        assert 3 <= p["tests"].count("assert") <= 6, p["id"]


def test_every_reference_solution_passes():
    results = quality.score(PROBLEMS, [[p["solution"]] for p in PROBLEMS])
    failing = [p["id"] for p, (ok,) in zip(PROBLEMS, results) if not ok]
    assert failing == []


def test_a_wrong_body_fails_every_problem():
    results = quality.score(PROBLEMS, [["    return None\n"] for _ in PROBLEMS])
    passing = [p["id"] for p, (ok,) in zip(PROBLEMS, results) if ok]
    assert passing == []


def test_trailing_chatter_after_the_function_is_not_run():
    problem = PROBLEMS[0]
    completion = problem["solution"] + "\n\n# Example usage\nassert False, 'model chatter'\n"
    assert quality.passes(problem, completion)


# ---------------------------------------------------------------------------
# Cutting a completion
# ---------------------------------------------------------------------------

BODY = "    total = 0\n    for x in xs:\n        if x > 0:\n\n            total += x\n\n    return total\n"


@pytest.mark.parametrize("tail", [
    "\n\ndef other():\n    pass\n",
    '\nif __name__ == "__main__":\n    print(f([1]))\n',
    "```\n\nThis function sums the positive numbers.\n",
    "    ```\n",
    "print(f([1, -2]))\n",
    "class Helper:\n    pass\n",
])
def test_completion_body_cuts_where_the_function_ends(tail):
    assert quality.completion_body(BODY + tail) == BODY


def test_completion_body_keeps_a_body_that_runs_to_eof_without_newline():
    assert quality.completion_body(BODY.rstrip("\n")) == BODY
    assert quality.completion_body(BODY + "\n\n   \n") == BODY


def test_completion_body_of_nothing_useful_is_empty():
    assert quality.completion_body("def again():\n    pass\n") == "\n"
    assert quality.completion_body("") == "\n"


# ---------------------------------------------------------------------------
# Running the tests
# ---------------------------------------------------------------------------

def test_a_crash_fails():
    assert not quality.passes(PROBLEMS[0], "    raise RuntimeError('boom')\n")
    assert not quality.passes(PROBLEMS[0], "    return (\n")


def test_an_infinite_loop_fails_within_the_timeout():
    start = time.monotonic()
    assert not quality.passes(PROBLEMS[0], "    while True:\n        pass\n", timeout=1.0)
    assert time.monotonic() - start < 1.0 + 3.0


def test_score_keeps_samples_with_their_problems():
    problems = PROBLEMS[:2]
    completions = [[problems[0]["solution"], "    return None\n"], [problems[1]["solution"]]]
    assert quality.score(problems, completions) == [[True, False], [True]]
    with pytest.raises(ValueError):
        quality.score(problems, completions[:1])


# ---------------------------------------------------------------------------
# pass@1
# ---------------------------------------------------------------------------

def test_pass_at_1_on_a_hand_computed_example():
    # Per-problem pass fractions 1, 0.5, 0, 1: mean 0.625; sample variance
    # (0.375^2 + 0.125^2 + 0.625^2 + 0.375^2) / 3 = 0.6875 / 3, standard error sqrt(that / 4).
    results = [[True, True], [True, False], [False, False, False, False], [True]]
    mean, se = quality.pass_at_1(results)
    assert mean == pytest.approx(0.625)
    assert se == pytest.approx(math.sqrt(0.6875 / 3 / 4))


def test_paired_difference_cancels_problem_difficulty():
    # Per-problem differences 0.5, 0.5, 0, 0: mean 0.25, sample variance 1/12, standard error sqrt(1/48).
    method = [[True, True], [True, False], [False, False], [True, True]]
    baseline = [[True, False], [False, False], [False, False], [True, True]]
    mean, se = quality.paired_difference(method, baseline)
    assert mean == pytest.approx(0.25)
    assert se == pytest.approx(math.sqrt(1 / 48))
    with pytest.raises(ValueError, match="3 problems against a baseline of 4"):
        quality.paired_difference(method[:3], baseline)


def test_pass_at_1_of_one_problem_has_no_standard_error():
    mean, se = quality.pass_at_1([[True, False, False, False]])
    assert mean == 0.25
    assert math.isnan(se)
