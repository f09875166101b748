"""--weights auto's choices kept once per machine (auto.Measurement.recall): read back by the next process, measured
again on request, never inside a request's timed span; the note on a method predicted slower than ar or sd; the
lines that say what loading and measuring do."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import engine
import kernels
import methods
import model
from test_engine import requests_of, save
from cpu import auto, store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """The PyTorch reference kernels on one thread, as in test_engine.py."""
    monkeypatch.setattr(kernels, "INTERPRET", False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """A tiny qwen2 model directory with a word tokenizer (w0 ... w95), drafting for itself."""
    c = model.Config(arch="qwen2", vocab_size=96, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, ffn_dim=96,
                     qkv_bias=True, max_seq_len=64)
    m = model.Transformer(c, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return save(m, tmp_path_factory.mktemp("auto") / "qwen2")


def timings(fastest):
    """A Measurement.timed_calls whose format `fastest` runs each matmul ten times faster than the others."""
    def timed_calls(self, shape, fmt, rows):
        return {r: 1e-3 if fmt == fastest else 1e-2 for r in rows}
    return timed_calls


def test_the_choice_is_kept_so_a_second_process_makes_the_same_tokens(path, monkeypatch, capsys):
    """Two engines on the same files ("processes"), the second measuring float32 slow: it reads back the first's
    float32 and decodes the same tokens; remeasure measures again and chooses int8."""
    monkeypatch.setattr(auto.Measurement, "timed_calls", timings("float32"))
    first = engine.Engine(path, path, weights="auto", on_line=engine.say)
    tokens = first.generate("w1 w2 w3", max_new_tokens=8, seed=3).tokens
    kept = first.measurement.path
    err = capsys.readouterr().err
    assert (first.weights, first.draft_weights) == ("float32", "float32")
    assert f"weights auto: measuring the weight formats on this CPU (once; kept in {kept}) ..." in err.splitlines()
    assert os.path.dirname(kept) == os.environ[store.CACHE_ENV] and sorted(os.listdir(os.path.dirname(kept))) == [
        os.path.basename(kept), "weights"]  # written whole, no temporary file left; weight_cache's folder beside it
    monkeypatch.setattr(auto.Measurement, "timed_calls", timings("int8"))
    second = engine.Engine(path, path, weights="auto", on_line=engine.say)
    assert second.generate("w1 w2 w3", max_new_tokens=8, seed=3).tokens == tokens
    assert second.weights == "float32" and second.measurement.path == kept
    err = capsys.readouterr().err
    assert f"weights auto: read back from {kept} (measured once on this machine; --remeasure measures again)" in err
    assert "measuring" not in err
    again = engine.Engine(path, path, weights="auto", remeasure=True, on_line=engine.say).load()
    assert again.weights == "int8" and "(again, as asked; kept in " in capsys.readouterr().err
    assert engine.Engine(path, path, weights="auto").load().weights == "int8"  # what the last measuring kept


def test_the_key_is_the_machine_and_the_files(path, monkeypatch, tmp_path):
    """Another thread count, or a model file changed, is another file of choices; XDG_CACHE_HOME is honoured."""
    monkeypatch.setattr(auto.Measurement, "timed_calls", timings("float32"))
    kept = engine.Engine(path, path, weights="auto", on_line=engine.say).measurement.path
    torch.set_num_threads(2)
    assert engine.Engine(path, path, weights="auto", on_line=engine.say).measurement.path != kept
    torch.set_num_threads(1)
    config = os.path.join(path, "config.json")
    os.utime(config, ns=(0, os.stat(config).st_mtime_ns + 1))
    assert engine.Engine(path, path, weights="auto", on_line=engine.say).measurement.path != kept
    monkeypatch.delenv(store.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert store.cache_folder() == str(tmp_path / "smcsd-mini")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert store.cache_folder() == os.path.join(os.path.expanduser("~"), ".cache", "smcsd-mini")


def test_a_corrupt_or_unwritable_file_is_one_line_and_measured_again(path, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(auto.Measurement, "timed_calls", timings("float32"))
    e = engine.Engine(path, path, weights="auto", on_line=engine.say).load()
    with open(e.measurement.path, "w") as f:
        f.write('{"key": ')  # half a file
    capsys.readouterr()
    again = engine.Engine(path, path, weights="auto", on_line=engine.say).load()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"weights auto: {e.measurement.path} is unreadable (") and \
        lines[0].endswith("; measuring again")
    assert lines[1].startswith("weights auto: measuring") and again.weights == "float32"
    assert json.load(open(e.measurement.path))["choices"]  # replaced, whole
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "file" / "cache"))  # a folder that cannot be made
    assert engine.Engine(path, path, weights="auto", on_line=engine.say).load().weights == "float32"
    assert "weights auto: cannot keep the choices in " in capsys.readouterr().err


@pytest.mark.slow
def test_the_cli_measures_once_then_reads_back(path, tmp_path):
    """engine.py twice with one seed: the first run measures and keeps, the second reads back; the same tokens."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", store.CACHE_ENV)}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    command = [sys.executable, os.path.join(ROOT, "engine.py"), "--target", path, "--draft", path, "--prompt",
               "w1 w2 w3", "--max-new-tokens", "8", "--seed", "3", "--json"]
    first, second = [subprocess.run(command, env=env, capture_output=True, text=True) for _ in range(2)]
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    kept = re.search(r"kept in (\S+)\) \.\.\.", first.stderr).group(1)
    assert kept.startswith(str(tmp_path / "smcsd-mini" / "auto-")) and os.path.exists(kept)
    assert f"read back from {kept}" in second.stderr and "measuring" not in second.stderr
    assert json.loads(first.stdout)["tokens"] == json.loads(second.stdout)["tokens"]
    assert re.search(rf"^loading {re.escape(path)} \([\d.]+ MB\) and the draft {re.escape(path)} \([\d.]+ MB\) \.\.\.$",
                     first.stderr, re.M)


def sleeping_costs(seconds):
    """A Measurement.cycle_costs that takes `seconds` and prices every format and cell alike."""
    def cycle_costs(cells, fmts, drafts):
        time.sleep(seconds)
        return {"bf16": {c: 50 for c in cells}}, {"bf16": {c: 5 * c[1] for c in cells}}
    return cycle_costs


@pytest.mark.slow
def test_no_measuring_inside_a_requests_timed_span(path, monkeypatch):
    """Request.start is set when a slot admits it, after load() and choose() have measured: the stats' seconds and
    tok/s leave the measuring out."""
    e = engine.Engine(path, path, weights="auto", on_line=engine.say)
    monkeypatch.setattr(e.measurement, "cycle_costs", sleeping_costs(0.5))
    began = time.perf_counter()
    stats = e.generate("w1 w2", max_new_tokens=4, seed=1).stats
    assert time.perf_counter() - began > 1.0  # measured: the shape, the note and the formats
    assert stats["seconds"] < 0.5 and stats["prefill_seconds"] < 0.5


def linear(base, per_row, step):
    """A Measurement.cycle_costs: a target forward of R rows costs base + per_row x R ms, a draft step `step`."""
    def cycle_costs(cells, fmts, drafts):
        return ({"bf16": {(n, k): base + per_row * n * (k + 1) for n, k in cells}},
                {"bf16": {(n, k): k * step for n, k in cells}})
    return cycle_costs


def test_a_method_predicted_slower_than_ar_or_sd_says_so(path, monkeypatch, capsys):
    """smc 3x2's 9 verify rows on a CPU whose matmuls cost by the row: one note line, with the faster option;
    none where its rows come almost free."""
    e = engine.Engine(path, path, weights="auto", on_line=engine.say)
    monkeypatch.setattr(e.measurement, "cycle_costs", linear(10, 10, 2))  # ar 20 ms a token, smc 3x2 (100 + 4) / 3
    requests_of(e, ["w1"], max_new_tokens=4)  # auto's shape chosen: engine.choose_shapes
    assert capsys.readouterr().err.splitlines()[-1] == ("note: smc 3x2 is predicted to run at 0.58x ar here (measured "
                                                        "matmul costs); --method ar is faster on this machine")
    fast = engine.Engine(path, path, weights="auto", remeasure=True, on_line=engine.say)
    monkeypatch.setattr(fast.measurement, "cycle_costs", linear(50, 1, 5))  # ar 51, smc (59 + 10) / 3, sd K=4 27
    requests_of(fast, ["w1"], max_new_tokens=4)
    assert "note:" not in capsys.readouterr().err
    assert fast.measurement.speed_note(methods.SMC, (3, 2))[0] == pytest.approx(2.22, abs=0.01)
    monkeypatch.setattr(fast.measurement, "cycle_costs", linear(50, 5, 2))  # ar 55, smc 99 / 3, sd K=4 83 / 2.77
    assert fast.measurement.speed_note(methods.SMC, (3, 2), "bf16", "bf16")[1] == (
        "note: smc 3x2 is predicted to run at 1.67x ar here (measured matmul costs); --method sd (1.84x) is faster on "
        "this machine")
    again = engine.Engine(path, path, weights="auto", on_line=engine.say)  # kept: read back, not measured
    monkeypatch.setattr(again.measurement, "cycle_costs", None)
    assert again.measurement.speed_note(methods.SMC, (3, 2))[1] == ""
