"""bench.py's whole path on a tiny random model pair: the tables and the JSON report, with sane fields."""
import json

import pytest

import bench
import kernels
import quality


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """The PyTorch reference kernels, as on CPU (the interpreted Triton ones are far slower)."""
    monkeypatch.setattr(kernels, "INTERPRET", False)


def test_quick_run_on_random_models(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--random", "tiny:tiny", "--prompt-len", "8", "--grid", "2x2,4x4", "--repeats", "2",
                "--threads", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "| prompt | method |" in printed and "| N | K | draft ms |" in printed
    assert report["machine"]["threads"] == 1 and report["date"] and report["copy_bandwidth_gbs"] > 0
    rows = {(r["method"], r["N"], r["K"]): r for r in report["speed"]}
    assert set(rows) == {("ar", 1, 1), ("sd", 1, 4), ("smc", 2, 2), ("smc", 4, 4)}
    assert rows["ar", 1, 1]["speedup"] == 1.0
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and len(r["runs"]) == 2 and r["achieved_gbs"] > 0
        assert r["stats"]["new_tokens"] == 32  # random models have no EOS
    assert 0 <= rows["sd", 1, 4]["accepted_per_cycle"] <= 4
    assert rows["smc", 4, 4]["tokens_per_cycle"] > 4 and 0 < rows["smc", 4, 4]["mean_ess"] <= 4
    for phase in report["phases"]:
        assert min(phase["draft_ms"], phase["verify_ms"]) > 0 and phase["cycle_ms"] >= phase["draft_ms"]
    assert "quality" not in report  # random models have no tokenizer


def test_bytes_per_cycle_counts_each_forward_once():
    e, _, _ = bench.load_engines(bench.parse(["--random", "tiny:tiny", "--device", "cpu"]), bench.torch.device("cpu"))
    ar = bench.bytes_per_cycle(e, "ar", 1, 1, prompt_len=0, new_tokens=0)
    assert ar == e.target.weight_bytes()
    smc = bench.bytes_per_cycle(e, "smc", 4, 3, prompt_len=0, new_tokens=0)
    assert smc == 3 * e.draft.weight_bytes() + ar


@pytest.mark.parametrize("text, complete", [
    ("    return 1\n", False),
    ("    a = 1\n\n    return a\n", False),
    ("    return 1\n\nprint(f(2))", False),  # the top-level line is not finished yet
    ("    return 1\n\nprint(f(2))\n", True),
    ("    return 1\n```\n", True),
])
def test_body_complete(text, complete):
    assert quality.body_complete(text) == complete
