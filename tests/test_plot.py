"""plot.py: pictures from a real trace of a tiny random model pair (engine.py --trace) and from bench.py's JSON;
the returned particle's lineage against the tokens the engine returned; bad input is one line."""
import json
import os
import struct
import subprocess
import sys

import pytest

import bench
import kernels
import plot
from test_engine import ROOT, perturbed, run_cli, save, tiny


def png_size(path):
    """(width, height) in pixels, from the PNG header."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def check_png(path):
    width, height = plot.SIZES[os.path.basename(path)]
    assert png_size(path) == (width * plot.DPI, height * plot.DPI)
    assert os.path.getsize(path) > 10_000  # lines, dots and text, not a blank canvas


def run_plot(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny(0, 0.8)
    return save(target, str(root / "target")), save(perturbed(target, 1, 0.3), str(root / "draft"))


def trace(pair, *runs):
    """engine.py --trace PATH for each (PATH, options), all at once -> their JSON results."""
    target, draft = pair
    done = run_cli(*(["--target", target, "--draft", draft, "--trace", str(path), "--prompt", "w1 w2 w3",
                  "--max-new-tokens", "30", "--temperature", "1.0", "--weights", "float32", "--json", *options]
                 for path, options in runs))
    assert all(run.returncode == 0 for run in done), [run.stderr for run in done]
    return [json.loads(run.stdout) for run in done]


@pytest.mark.slow
def test_smc_trace_pictures(pair, tmp_path):
    path = tmp_path / "run.jsonl"
    result, = trace(pair, (path, ["--particles", "4", "--draft-len", "2", "--ess-threshold", "0.9"]))
    start, cycles, end = plot.read_trace(str(path))
    assert end["tokens"] == result["tokens"] and any(c["resampled"] for c in cycles)
    # the lineage picked out in red appended exactly the tokens the engine returned (the first is the prefill's)
    rows = plot.lineage(cycles, end["stats"]["particle"])
    assert len(rows) == len(cycles) and all(0 <= r < 4 for r in rows)
    lineage_tokens = [t for c, r in zip(cycles, rows) for t in c["tokens"][r]]
    assert lineage_tokens[:len(end["tokens"]) - 1] == end["tokens"][1:]
    run = run_plot(str(path), "--out", str(tmp_path / "pictures"))
    assert run.returncode == 0, run.stderr
    for name in ("genealogy.png", "weights.png"):
        check_png(tmp_path / "pictures" / name)


@pytest.mark.slow
def test_sd_trace_draws_acceptance_and_ar_is_refused(pair, tmp_path, capsys):
    trace(pair, (tmp_path / "sd.jsonl", ["--method", "sd", "--draft-len", "3"]),
          (tmp_path / "ar.jsonl", ["--method", "ar"]))
    assert plot.main([str(tmp_path / "sd.jsonl")]) == 0  # default: beside the trace
    check_png(tmp_path / "acceptance.png")
    capsys.readouterr()
    assert plot.main([str(tmp_path / "ar.jsonl")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("plot.py: an ar trace") and err.count("\n") == 1


@pytest.mark.slow
def test_bench_pictures(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)
    report = tmp_path / "bench.json"
    bench.main(["speed", "--quick", "--random", "tiny:tiny", "--prompt-len", "8", "--grid", "2x2,4x2,4x4",
                "--new-tokens", "8", "--threads", "1", "--out", str(report)])
    assert plot.main([str(report), "--out", str(tmp_path / "pictures")]) == 0
    for name in ("roofline.png", "grid.png"):
        check_png(tmp_path / "pictures" / name)


def test_normalised_weights():
    assert plot.normalised([0.0, 0.0]) == [0.5, 0.5]
    assert plot.normalised([0.0, float("-inf")]) == [1.0, 0.0]
    assert plot.normalised([1000.0, 1000.0 + 2 ** 0.5])[1] == pytest.approx(1 / (1 + 2.718281828 ** -(2 ** 0.5)))


def test_shown_escapes_and_cuts():
    assert plot.shown("a\n    b", [1]) == "a\\n b"
    assert plot.shown(None, [5, 6]) == "5 6"
    assert plot.shown("x" * 40, [1], width=10) == "x" * 9 + "…"


@pytest.mark.parametrize("content", [None, "", "hello\n", '{"kind": "start"}\n', '{"speed": []}', "[1, 2]"])
def test_bad_input_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "input.json"
    if content is not None:
        path.write_text(content)
    assert plot.main([str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("plot.py: ") and err.count("\n") == 1 and "Traceback" not in err


def test_import_needs_no_matplotlib_and_errors_need_no_traceback(tmp_path):
    probe = subprocess.Popen([sys.executable, "-c", "import sys, plot; assert 'matplotlib' not in sys.modules"],
                             cwd=ROOT, stderr=subprocess.PIPE, text=True)  # beside the run below
    run = run_plot(str(tmp_path / "missing.jsonl"))
    err = probe.communicate()[1]
    assert probe.returncode == 0, err
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "No such file" in run.stderr


def test_frontier_from_a_quality_run(tmp_path):
    def row(pass_at_1, tokens_per_s, shift=None):
        return {"pass_at_1": pass_at_1, "pass_at_1_stderr": 0.05, "tokens_per_s": tokens_per_s, "problems": 8,
                "samples": 1} | ({} if shift is None else {"logprob_vs_ar": shift, "logprob_vs_ar_stderr": 0.01})
    report = tmp_path / "quality.json"
    report.write_text(json.dumps({"quality": {"ar": row(0.5, 3.0), "smc 3x2": row(0.4, 2.0, -0.1),
                                              "draft alone": row(0.3, 9.0, -0.3)}}))
    assert plot.main([str(report), "--out", str(tmp_path)]) == 0
    check_png(tmp_path / "frontier.png")
    assert not (tmp_path / "roofline.png").exists()
