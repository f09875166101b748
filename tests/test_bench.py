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
                "--threads", "1", "--prompt-lengths", "8,40", "--smc-cells", "4x4", "--out", str(out)])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "| prompt | method |" in printed and "| N | K | draft ms |" in printed
    assert "| prompt tokens | method |" in printed and "| method | N | K | requests |" in printed
    assert report["machine"]["threads"] == 1 and report["date"] and report["copy_bandwidth_gbs"] > 0
    rows = {(r["method"], r["N"], r["K"]): r for r in report["speed"]}
    assert set(rows) == {("ar", 1, 1), ("sd", 1, 4), ("smc", 2, 2), ("smc", 4, 4)}
    assert rows["ar", 1, 1]["speedup"] == 1.0
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and len(r["runs"]) == 2 and r["achieved_gbs"] > 0
        assert r["stats"]["new_tokens"] == 32  # random models have no EOS
        assert 0 <= r["streamed"] <= 1
    assert 0 <= rows["sd", 1, 4]["accepted_per_cycle"] <= 4
    assert rows["smc", 4, 4]["tokens_per_cycle"] > 4 and 0 < rows["smc", 4, 4]["mean_ess"] <= 4
    for phase in report["phases"]:
        assert min(phase["draft_ms"], phase["verify_ms"]) > 0 and phase["cycle_ms"] >= phase["draft_ms"]
    assert "quality" not in report  # random models have no tokenizer
    lengths = {(r["prompt_tokens"], r["method"], r["N"], r["K"]): r for r in report["lengths"]}
    assert set(lengths) == {(n, *cell) for n in (8, 40) for cell in (("ar", 1, 1), ("sd", 1, 4), ("smc", 4, 4))}
    for (n, method, _, _), r in lengths.items():
        assert r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0 and len(r["runs"]) == 2
        assert r["decode_tokens_per_s_vs_ar"] == pytest.approx(r["decode_tokens_per_s"] /
                                                               lengths[n, "ar", 1, 1]["decode_tokens_per_s"])
    short = {r["method"]: r for r in report["short_requests"]}
    assert set(short) == {"ar", "sd", "smc"} and short["ar"]["tokens_per_s_vs_ar"] == 1.0
    for r in short.values():  # --quick: 2 problems, 32 new tokens each
        assert r["requests"] == 2 and r["new_tokens"] == 64 and r["tokens_per_s"] > 0 and r["prefill_s"] > 0


def test_lengths_and_short_requests_are_skippable(tmp_path):
    out = tmp_path / "bench.json"
    report = bench.main(["--quick", "--random", "tiny:tiny", "--methods", "ar", "--prompt-len", "8", "--threads", "1",
                         "--prompt-lengths", "", "--short-requests", "0", "--out", str(out)])
    assert "lengths" not in report and "short_requests" not in report and report["speed"]


def test_batches_at_each_concurrency(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench.main(["--random", "tiny:tiny", "--prompt-len", "8", "--methods", "ar,sd,smc", "--grid", "",
                         "--prompt-lengths", "", "--short-requests", "0", "--concurrency", "1,2,3",
                         "--new-tokens", "8", "--repeats", "2", "--threads", "1", "--out", str(out)])
    assert "| R | method | N | K | total tok/s |" in capsys.readouterr().out
    assert "speed" not in report and "phases" not in report  # --grid "": no speed table
    rows = {(r["R"], r["method"]): r for r in json.loads(out.read_text())["batch"]}
    assert set(rows) == {(R, method) for R in (1, 2, 3) for method in ("ar", "sd", "smc")}
    assert (rows[1, "smc"]["N"], rows[1, "smc"]["K"]) == (3, 2)  # the engine's default cell on a CPU
    for (R, method), r in rows.items():
        assert r["new_tokens"] == 8 * R and r["eos_stops"] == 0  # random models have no EOS
        assert r["tokens_per_s"] > 0 and len(r["runs"]) == 2 and r["capture_s"] == 0
        assert 0 < r["prefill_share"] < 1 and 0 < r["mean_latency_s"] <= r["max_latency_s"] <= r["seconds"]
        assert r["request_tokens_per_s"] > 0
        assert r["tokens_per_s_vs_ar"] == pytest.approx(r["tokens_per_s"] / rows[R, "ar"]["tokens_per_s"])
        assert r["tokens_per_s_vs_r1"] == pytest.approx(r["tokens_per_s"] / rows[1, method]["tokens_per_s"])


def test_batch_peer_pads_on_the_left_and_counts_tokens_before_eos():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)
    bench.torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(config).eval()
    args = bench.parse(["--concurrency", "1,2", "--new-tokens", "6", "--repeats", "1"])
    rows = bench.batch_peer(target, [[5, 6, 7], [8, 9]], 0, [0], args)
    assert [(r["R"], r["method"]) for r in rows] == [(1, bench.HF_GENERATE), (2, bench.HF_GENERATE)]
    for r in rows:  # token 0 is both the pad and the EOS: a row counts only its tokens before it
        assert 0 < r["new_tokens"] <= 6 * r["R"] and r["tokens_per_s"] > 0
        assert r["mean_latency_s"] == r["max_latency_s"] == r["seconds"]


def test_long_prompts_are_real_code_cut_to_length():
    class Engine:  # a character-level tokenizer
        tokenizer = True
        encode = staticmethod(lambda text: [ord(c) for c in text])
    prompts = bench.long_prompts(Engine, [10, 100_000])
    text = "".join(map(chr, prompts[100_000]))
    assert len(prompts[10]) == 10 and prompts[10] == prompts[100_000][:10]
    assert text.startswith(quality.load_problems()[0]["prompt"]) and "    return" in text


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


def test_help_describes_the_benchmark_in_full(capsys):
    with pytest.raises(SystemExit):
        bench.parse(["--help"])
    assert "and pass@1 on the code-completion set." in " ".join(capsys.readouterr().out.split())
