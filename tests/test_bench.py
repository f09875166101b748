"""bench.py's subcommands on a tiny random model pair: the tables and the JSON report, with sane fields."""
import json
import os
import subprocess
import sys

import pytest
import torch

import bench
import benches.formats
import benches.quality
import engine
import formats
import kernels
import loading
import model
import peers
import platforms
import quality
import request
from benches import common, lengths, parts, profile, racer, scoring, speed
from cpu import auto, native
from weights import fetch


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """The PyTorch reference kernels, as on CPU (the interpreted Triton ones are far slower)."""
    monkeypatch.setattr(kernels, "INTERPRET", False)


@pytest.mark.slow
def test_quick_run_on_random_models(tmp_path, capsys):
    out = tmp_path / "bench.json"
    common = ["--quick", "--random", "tiny:tiny", "--threads", "1"]
    bench.main(["speed", *common, "--repeats", "2", "--prompt-len", "8", "--grid", "2x2,4x4", "--out", str(out)])
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
        assert 0 <= r["streamed"] <= 1 and r["first_token_s"] > 0
    assert rows["ar", 1, 1]["first_token_s"] < rows["ar", 1, 1]["stats"]["seconds"]  # ar streams every token
    assert 0 <= rows["sd", 1, 4]["accepted_per_cycle"] <= 4
    assert rows["smc", 4, 4]["tokens_per_cycle"] > 4 and 0 < rows["smc", 4, 4]["mean_ess"] <= 4
    for phase in report["phases"]:
        assert min(phase["draft_ms"], phase["verify_ms"]) > 0 and phase["cycle_ms"] >= phase["draft_ms"]
    assert "lengths" not in report and "short_requests" not in report and "batch" not in report
    lengths_out = tmp_path / "lengths.json"
    report = bench.main(["lengths", *common, "--repeats", "2", "--prompt-lengths", "8,40", "--smc-cells", "4x4",
                         "--out", str(lengths_out)])
    requests = bench.main(["requests", *common, "--smc-cells", "4x4", "--out", str(tmp_path / "requests.json")])
    printed = capsys.readouterr().out
    assert "| prompt tokens | method |" in printed and "| method | N | K | requests |" in printed
    assert "speed" not in report and "short_requests" not in report and "lengths" not in requests
    lengths = {(r["prompt_tokens"], r["method"], r["N"], r["K"]): r for r in report["lengths"]}
    assert set(lengths) == {(n, *cell) for n in (8, 40) for cell in (("ar", 1, 1), ("sd", 1, 4), ("smc", 4, 4))}
    for (n, method, _, _), r in lengths.items():
        assert r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0 and r["first_token_s"] > 0 and len(r["runs"]) == 2
        assert r["decode_tokens_per_s_vs_ar"] == pytest.approx(r["decode_tokens_per_s"] /
                                                               lengths[n, "ar", 1, 1]["decode_tokens_per_s"])
    short = {r["method"]: r for r in requests["short_requests"]}
    assert set(short) == {"ar", "sd", "smc"} and short["ar"]["tokens_per_s_vs_ar"] == 1.0
    for r in short.values():  # --quick: 2 problems, 32 new tokens each
        assert r["requests"] == 2 and r["new_tokens"] == 64 and r["tokens_per_s"] > 0 and r["prefill_s"] > 0


def test_random_models_in_a_weight_format(tmp_path):
    """--weights with --random: the random pair's matmuls in that format (what make gpu-check's int4 rows read),
    the report's bytes a forward its; auto, which measures files, is refused in one line."""
    out = tmp_path / "bench.json"
    report = bench.main(["speed", "--quick", "--random", "tiny:tiny", "--weights", "int4", "--methods", "ar,smc",
                         "--prompt-len", "8", "--grid", "2x2", "--threads", "1", "--out", str(out)])
    m = common.random_model("tiny", torch.device("cpu"), torch.float32, 1, weights="int4")
    assert isinstance(m.layers[0].w2, formats.Quantized) and m.embed.dtype == torch.bfloat16
    bf16 = common.random_model("tiny", torch.device("cpu"), torch.bfloat16, 1)
    assert report["models"]["target"]["weight_bytes_read_per_forward"] == m.weight_bytes() < bf16.weight_bytes()
    assert {r["method"] for r in report["speed"]} == {"ar", "smc"} and report["settings"]["weights"] == "int4"
    with pytest.raises(SystemExit):
        bench.parse(["speed", "--random", "tiny:tiny", "--weights", "auto"])


def test_report_prints_the_tables_of_a_report_again(tmp_path, capsys):
    """`report` reads any bench.py JSON and prints its tables as the subcommand printed them."""
    out = tmp_path / "bench.json"
    report = bench.main(["speed", "--quick", "--random", "tiny:tiny", "--methods", "ar", "--prompt-len", "8",
                         "--threads", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "lengths" not in report and "short_requests" not in report and report["speed"]
    assert report["command"] == "speed" and report["settings"]["out"] == str(out)
    bench.main(["report", str(out)])
    again = capsys.readouterr().out
    assert speed.speed_table(report["speed"], report["copy_bandwidth_gbs"]) in printed
    assert speed.speed_table(report["speed"], report["copy_bandwidth_gbs"]) in again
    assert again.startswith(common.machine_line(report["machine"]))
    assert bench.parse(["speed"]).out == "bench-speed.json"


def test_batches_at_each_concurrency(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench.main(["batch", "--random", "tiny:tiny", "--prompt-len", "8", "--methods", "ar,sd,smc",
                         "--concurrency", "1,2,3", "--new-tokens", "8", "--repeats", "2", "--threads", "1", "--out",
                         str(out)])
    assert "| R | method | N | K | total tok/s |" in capsys.readouterr().out
    assert "speed" not in report and "phases" not in report and "overlap_phases" not in report
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


def test_overlap_rows_beside_the_plain_ones_and_the_phase_split(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench.main(["batch", "--random", "tiny:tiny", "--prompt-len", "8", "--methods",
                         "ar,sd,smc,sd+overlap,smc+overlap", "--concurrency", "1,2", "--new-tokens", "8", "--repeats",
                         "1", "--threads", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| x plain | tok/s per request |" in printed and "| run | slots per phase | threads per phase |" in printed
    saved = json.loads(out.read_text())
    rows = {(r["R"], r["method"]): r for r in saved["batch"]}
    assert set(rows) == {(1, m) for m in ("ar", "sd", "smc")} | {(2, m) for m in ("ar", "sd", "smc", "sd+overlap",
                                                                                 "smc+overlap")}
    for method in ("sd", "smc"):
        plain = rows[2, method]
        overlap = rows[2, method + "+overlap"]
        assert (overlap["N"], overlap["K"], overlap["new_tokens"]) == (plain["N"], plain["K"], 16)
        assert overlap["tokens_per_s_vs_plain"] == pytest.approx(overlap["tokens_per_s"] / plain["tokens_per_s"])
        assert overlap["mean_latency_s_vs_plain"] == pytest.approx(overlap["mean_latency_s"] / plain["mean_latency_s"])
        assert "tokens_per_s_vs_plain" not in plain and overlap["tokens_per_s_vs_ar"] > 0
    phases = {(r["method"], r["run"]): r for r in saved["overlap_phases"]}
    runs = ("plain", "half alone", "overlap bound", "overlapped")
    assert list(phases) == [(m, run) for m in ("sd", "smc") for run in runs] and report["overlap_phases"]
    for m in ("sd", "smc"):
        plain, half, bound, both = (phases[m, run] for run in runs)
        assert [r["slots"] for r in (plain, half, bound, both)] == [2, 1, 1, 1] and both["threads"] == 1
        for r in (plain, half, both):
            assert min(r["draft_ms"], r["verify_ms"]) > 0
        assert plain["cycle_ms"] == pytest.approx(plain["draft_ms"] + plain["verify_ms"])
        assert plain["speed_vs_plain"] == 1
        assert half["cycle_ms"] == pytest.approx(2 * (half["draft_ms"] + half["verify_ms"]))
        assert bound["cycle_ms"] == pytest.approx(2 * max(half["draft_ms"], half["verify_ms"]))
        assert both["speed_vs_plain"] == pytest.approx(plain["cycle_ms"] / both["cycle_ms"])
    args = bench.parse(["batch", "--methods", "ar,sd+overlap,smc+overlap"])
    assert common.configs(args, [(2, 2)]) == [("ar", 1, 1)]  # the other sections leave overlap out
    assert common.configs(args, [(2, 2)], overlap=True) == [("ar", 1, 1), ("sd+overlap", 1, 4), ("smc+overlap", 2, 2)]
    with pytest.raises(SystemExit):
        bench.parse(["batch", "--methods", "ar+overlap"])
    with pytest.raises(SystemExit):
        bench.parse(["speed", "--methods", "smc+overlap"])  # one request at a time: no halves


class Chars:
    """A tokenizer of one token per character (its code point mod 64, the tiny vocabulary): real text on tiny
    random models."""
    chat_template = None

    @staticmethod
    def encode(text):
        return [ord(c) % 64 for c in text]

    @staticmethod
    def decode(ids):
        return "".join(chr(32 + i) for i in ids)


def test_racer_rows_on_a_refactor_request_and_fresh_code(tmp_path, capsys, monkeypatch):
    load = common.load_pair

    def with_tokenizer(args, device, world=1):
        e, _ = load(args, device, world)
        e.tokenizer = Chars()
        return e, None
    monkeypatch.setattr(common, "load_pair", with_tokenizer)
    out = tmp_path / "bench.json"
    bench.main(["racer", "--random", "tiny:tiny", "--trees", "0,4", "--sd-draft-len", "3", "--new-tokens", "12",
                "--repeats", "2", "--threads", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| prompt | method | draft | tree nodes | K | tok/s | x ar | x sd | accepted/cycle |" in printed
    rows = {(r["prompt"], r["draft"], r["tree"]): r for r in json.loads(out.read_text())["racer"]}
    configs = [("", 0), ("draft model", 0), ("racer", 0), ("racer", 4)]
    assert list(rows) == [(p, *c) for p in ("refactor", "fresh") for c in configs]
    for (prompt, draft, tree), r in rows.items():
        assert r["method"] == ("ar" if draft == "" else "sd") and r["K"] == 3 and len(r["runs"]) == 2
        assert r["tokens_per_s"] == pytest.approx(sum(r["runs"]) / 2) and r["new_tokens"] == 12  # no EOS
        assert r["tokens_per_s_vs_ar"] == pytest.approx(r["tokens_per_s"] / rows[prompt, "", 0]["tokens_per_s"])
        assert r["tokens_per_s_vs_sd"] == pytest.approx(r["tokens_per_s"] /
                                                        rows[prompt, "draft model", 0]["tokens_per_s"])
        if draft:
            assert 0 <= r["accepted_per_cycle"] <= 3 and r["tokens_per_cycle"] >= 1
        else:
            assert r["accepted_per_cycle"] is None and r["tokens_per_s_vs_ar"] == 1
    assert rows["refactor", "", 0]["prompt_tokens"] > rows["fresh", "", 0]["prompt_tokens"]


def test_racer_shares_the_loaded_target_and_its_tokenizer():
    e, _ = common.load_pair(bench.parse(["racer", "--random", "tiny:tiny"]), torch.device("cpu"))
    e.tokenizer = Chars()
    r = racer.racer_engine(e)
    assert r.racer and r.target is e.target and r.draft is None and r.tokenizer is e.tokenizer
    assert r.generate(r.encode("def f(x):"), method="sd", draft_len=2, tree=3, max_new_tokens=6).text
    class Texts:  # encode as the identity: the prompts' text
        encode = staticmethod(lambda text: text)
    prompts = racer.racer_prompts(Texts)
    problems = quality.load_problems()
    assert prompts["fresh"] == problems[3]["prompt"] and prompts["refactor"].startswith(problems[5]["prompt"])
    assert "docstring kept word for word" in prompts["refactor"]
    assert bench.parse(["racer"]).trees == [0, 8, 16] and bench.parse(["racer", "--quick"]).trees == [0]
    with pytest.raises(SystemExit, match="racer drafts from text"):
        bench.main(["racer", "--random", "tiny:tiny", "--out", os.devnull])


@pytest.mark.slow
def test_batch_peer_pads_on_the_left_and_counts_tokens_before_eos():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(config).eval()
    rows = peers.hf_batch_rows(target, [[5, 6, 7], [8, 9]], 0, [0], common.TEMPERATURE, [1, 2], 6, 1)
    assert [(r["R"], r["method"]) for r in rows] == [(1, peers.HF_GENERATE), (2, peers.HF_GENERATE)]
    for r in rows:  # token 0 is both the pad and the EOS: a row counts only its tokens before it
        assert 0 < r["new_tokens"] <= 6 * r["R"] and r["tokens_per_s"] > 0
        assert r["mean_latency_s"] == r["max_latency_s"] == r["seconds"]


def test_llama_cpp_rows_run_each_models_gguf_file(tmp_path):
    """The llama.cpp peer runs a model's GGUF file: the path itself, or the file a weights/ directory came from,
    beside it; a model without one has no row. Its runs need llama-cpp-python or llama-cpp-cffi, not test
    requirements."""
    (tmp_path / "converted").mkdir()
    (tmp_path / "converted.gguf").write_bytes(b"")
    (tmp_path / "alone").mkdir()
    assert peers.gguf_of(str(tmp_path / "converted") + "/") == str(tmp_path / "converted.gguf")
    assert peers.gguf_of(str(tmp_path / "alone")) is None and peers.gguf_of(str(tmp_path / "x.gguf")) is None
    if peers.llama_cpp_bindings() is None:
        pytest.skip("no llama.cpp bindings installed")
    gguf = fetch.fetch_gguf("smollm2-135m-instruct")
    rows = peers.llama_cpp_rows((str(tmp_path / "alone"), gguf), {"code": [1, 2, 3], "prose": [4]},
                                common.TEMPERATURE, 5, 2)
    assert [(r["prompt"], r["method"]) for r in rows] == \
        [(p, "llama.cpp ar, the target (smollm2-135m-instruct.gguf)") for p in ("code", "prose")]
    assert all(len(r["runs"]) == 2 and r["tokens_per_s"] > 0 for r in rows)
    peer = peers.LlamaCpp.load(gguf)
    stats = peer.run([1, 2, 3], common.TEMPERATURE, 5, 0)
    peer.close()
    assert 0 < stats["prefill_seconds"] == stats["first_token_s"] < stats["seconds"] and stats["new_tokens"] == 5
    assert stats["tokens_per_s"] == pytest.approx(5 / stats["seconds"])


class Peer:
    """A llama.cpp stand-in: each run's prefill a millisecond a prompt token, then 3 s."""

    def __init__(self):
        self.calls = []

    def run(self, ids, temperature, new_tokens, seed):
        self.calls.append((len(ids), new_tokens, seed))
        prefill = len(ids) / 1000
        return {"new_tokens": new_tokens, "tokens_per_s": new_tokens / (prefill + 3.0), "prefill_seconds": prefill,
                "first_token_s": prefill, "seconds": prefill + 3.0}


def test_lengths_runs_llama_cpp_beside_the_engine_at_each_length():
    """bench.py lengths' peer: run at each length in the engine's loop, its prefill and decode rate beside ar's."""
    args = bench.parse(["lengths", "--random", "tiny:tiny", "--threads", "1", "--methods", "ar", "--repeats", "2",
                        "--prompt-lengths", "8,16", "--new-tokens", "4"])
    e, _ = common.load_pair(args, torch.device("cpu"))
    peer = Peer()
    rows = lengths.length_axis(e, args, peer)
    assert peer.calls == [(8, 4, 0), (8, 4, 0), (16, 4, 0), (8, 4, 1), (16, 4, 1)]  # a warm-up first
    llama = {r["prompt_tokens"]: r for r in rows if r["method"] == common.LLAMA_CPP_AR}
    ar = {r["prompt_tokens"]: r for r in rows if r["method"] == "ar"}
    assert set(llama) == set(ar) == {8, 16}
    for n, r in llama.items():
        assert r["prefill_s"] == r["first_token_s"] == pytest.approx(n / 1000)
        assert r["decode_tokens_per_s"] == pytest.approx(1.0)
        assert r["prefill_s_vs_ar"] == pytest.approx(r["prefill_s"] / ar[n]["prefill_s"])
    assert "| llama.cpp ar |  |  | 1.00 |" in lengths.length_table(rows)


def test_the_weight_cost_table_reads_the_same_from_a_report():
    """formats' table of ps a weight by rows, as printed and as `report` prints it again from the JSON."""
    costs = {"int4": {1: 30.0, 9: 150.0, 16: 210.0}, "w4a8": {1: 25.0, 9: 30.0, 16: 50.0}}
    table = benches.formats.weight_cost_table(costs)
    assert "| w4a8 | 25.0 | 30.0 | 50.0 | 1.20x | 2.00x |" in table
    assert benches.formats.weight_cost_table(json.loads(json.dumps(costs))) == table


def test_a_llama_cpp_library_that_does_not_load_is_left_out_in_one_line(tmp_path, monkeypatch, capsys):
    """An installed binding whose library cannot load (a C++ runtime older than its build's) is no peer: one line
    says so, and the benchmark goes on without it."""
    (tmp_path / "llama_cpp.py").write_text("raise ImportError('undefined symbol: __cxa_call_terminate')\n")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "__init__.py").write_text("")
    (tmp_path / "llama" / "llama_cpp.py").write_text("raise OSError('libstdc++.so.6: version not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("llama_cpp", "llama", "llama.llama_cpp"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert peers.llama_cpp_bindings() is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "__cxa_call_terminate" in lines[0] and "left out" in lines[1]


@pytest.mark.slow
def test_transformers_peers_read_a_gguf_pair_through_its_converted_directory(tmp_path):
    """transformers cannot read the engine's default pair (GGUF files): the peers convert a file once, beside it."""
    pytest.importorskip("transformers")
    os.symlink(fetch.fetch_gguf("smollm2-135m-instruct"), gguf := str(tmp_path / "small.gguf"))
    target, draft = peers.hf_models((gguf, gguf), torch.bfloat16)
    made = os.path.getmtime(tmp_path / "small" / "model.safetensors")
    assert target.config.vocab_size == draft.config.vocab_size == loading.open_weights(gguf)[0].vocab_size
    peers.hf_models((gguf, str(tmp_path / "small")), torch.bfloat16)
    assert os.path.getmtime(tmp_path / "small" / "model.safetensors") == made  # converted once


@pytest.mark.slow
def test_under_weights_auto_ar_runs_in_the_format_auto_picks_for_ar(tmp_path, monkeypatch):
    """--weights auto: ar runs on the target in auto's choice for one row, which may not be the verify's, so that
    its speed-ups are against the engine's best ar, as `engine.py --method ar` runs it; the table names each row's
    weights then. With a format given, ar shares the pair's engine."""
    from test_model import save_tiny
    save_tiny("qwen2", path := str(tmp_path))
    pair = engine.Engine(path, path, "cpu", "auto").load()
    other = "float32" if pair.weights != "float32" else "bf16"
    monkeypatch.setattr(auto.Measurement, "choose_weights",
                        lambda self, shape: ((other, other), "weights: " + other))
    args = bench.parse(["speed", "--weights", "auto", "--methods", "ar,sd", "--new-tokens", "4", "--repeats", "1"])
    ar = speed.ar_engine(pair, (path, path), args)
    assert ar.weights == other and ar.draft is None and ar.target.embed.dtype == formats.FORMATS[other]
    rows = speed.speed_rows(pair, {"code": [5, 6, 7]}, args, ar)
    speed.annotate(pair, rows, {"code": [5, 6, 7]}, args, 10.0, ar)
    assert {r["method"]: r["weights"] for r in rows} == {"ar": other, "sd": common.weights_of(pair)}
    assert rows[0]["gb_per_cycle"] == pytest.approx(ar.target.weight_bytes() / 1e9, rel=0.2)  # ar's own bytes
    assert f"| code | ar ({other}) |" in speed.speed_table(rows, 1.0)
    given = engine.Engine(path, path, "cpu", "bf16").load()
    assert speed.ar_engine(given, (path, path), bench.parse(["speed", "--weights", "bf16"])) is given


def test_long_prompts_are_real_code_cut_to_length():
    class Engine:  # a character-level tokenizer
        tokenizer = True
        encode = staticmethod(lambda text: [ord(c) for c in text])
    prompts = lengths.long_prompts(Engine, [10, 100_000])
    text = "".join(map(chr, prompts[100_000]))
    assert len(prompts[10]) == 10 and prompts[10] == prompts[100_000][:10]
    assert text.startswith(quality.load_problems()[0]["prompt"]) and "    return" in text


def test_bytes_per_cycle_counts_each_forward_once():
    e, _ = common.load_pair(bench.parse(["speed", "--random", "tiny:tiny", "--device", "cpu"]),
                           torch.device("cpu"))
    ar = speed.bytes_per_cycle(e, "ar", 1, 1, prompt_len=0, new_tokens=0)
    assert ar == e.target.weight_bytes()
    smc = speed.bytes_per_cycle(e, "smc", 4, 3, prompt_len=0, new_tokens=0)
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
    printed = " ".join(capsys.readouterr().out.split())
    assert "as markdown" in printed and all(name in printed for name in [*bench.COMMANDS, "report"])
    with pytest.raises(SystemExit):
        bench.parse(["quality", "--help"])
    assert "pass@1 and the target's log-probability" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_under_torchrun_rank_zero_reports(tmp_path):
    """Two tensor-parallel ranks (gloo) of a random target: one table and one JSON, from rank 0; the random
    draft is whole on each rank."""
    out = tmp_path / "tp.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench.py"),
                          "speed", "--quick", "--random", "tiny:tiny2", "--prompt-len", "8", "--grid", "2x2",
                          "--threads", "1", "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tensor_parallel"] == 2 and {r["method"] for r in report["speed"]} == {"ar", "sd", "smc"}
    assert run.stdout.count("| prompt | method |") == 1 and run.stdout.count("wrote ") == 1


def test_target_logprobs_score_each_continuation_as_one_forward_would():
    m = common.random_model("tiny", torch.device("cpu"), torch.float32, seed=3)
    prompt = [1, 2, 3]
    continuations = [[4, 5, 6], [7], []]
    got = scoring.target_logprobs(m, prompt, continuations, temperature=0.7)
    for tokens, mean in zip(continuations[:2], got):
        ids = torch.tensor(prompt + tokens)
        cache = model.KVCache(m.config, 1, len(ids), 1, "cpu", torch.float32)
        logits = m.prefill(ids, cache, logits="all")[len(prompt) - 1:-1] / 0.7  # [T, V]
        want = logits.log_softmax(-1).gather(1, ids[len(prompt):, None]).mean().item()
        assert mean == pytest.approx(want, abs=1e-5)
    assert got[2] is None


def stub_completions(problems):
    """completions() for pass_rates: ar writes the reference solutions, the draft alone fails every problem, smc
    passes every other one; each completion's one token (1, 2, 3) is minus its log-probability (stub_logprobs)."""
    fail = "    return None\n"
    plan = {"ar": (lambda i: problems[i]["solution"], 1), "smc": (lambda i: problems[i]["solution"] if i % 2
                                                                 else fail, 2), "draft": (lambda i: fail, 3)}

    def completions(runner, group, seeds, method, N, K, max_new_tokens, options):
        text, code = plan["draft" if runner == "draft" else method]
        return [request.Result(text(problems.index(p)), [code], {"new_tokens": 2, "cycles": 1, "streamed": 1})
                for p in group]
    return completions


def stub_logprobs(m, prompt, continuations):
    return [-t[0] for t in continuations]


class StubPair:
    target = None
    encode = staticmethod(lambda text: [0])


def test_quality_pairs_every_method_with_ar_and_the_draft_alone(monkeypatch):
    """pass@1 and the target's log-probability, paired per problem, from stub completions."""
    monkeypatch.setattr(scoring, "completions", stub_completions(quality.load_problems()[:4]))
    monkeypatch.setattr(scoring, "target_logprobs", stub_logprobs)
    args = bench.parse(["quality", "--problem-set", "ours", "--problems", "4", "--samples", "2", "--methods",
                        "ar,smc,draft", "--smc-cells", "3x2", "--lag", "0"])
    *_, out = benches.quality.pass_rates(StubPair(), "draft", args)
    assert list(out) == ["ar", "smc 3x2", "draft alone"] and out["ar"]["problems"] == 4
    assert out["ar"]["pass_at_1"] == 1.0 and out["draft alone"]["pass_at_1"] == 0.0
    assert out["smc 3x2"]["pass_at_1"] == 0.5 and out["smc 3x2"]["vs_ar"] == -0.5
    assert out["smc 3x2"]["logprob_vs_ar"] == pytest.approx(-1.0) and out["smc 3x2"]["logprob_vs_ar_stderr"] == 0
    assert out["smc 3x2"]["shift_of_draft"] == pytest.approx(0.5) and out["smc 3x2"]["tokens_per_cycle"] == 2
    assert "| smc 3x2 | 0.500 ± 0.289 | -0.500 ± 0.289 | -2.000 ± 0.000 | -1.000 ± 0.000 | 0.50 ± 0.00 |" in \
        benches.quality.quality_table(out)
    lag_args = bench.parse(["quality", "--methods", "smc", "--smc-cells", "3x2,4x4", "--lag", "4,0,32"])
    lags = benches.quality.quality_runners(StubPair(), "draft", lag_args)
    assert {k: v[-1] for k, v in lags.items()} == {"smc 3x2": {"lag": 0}, "smc 4x4": {"lag": 0},  # not the default 16
                                                   "smc 3x2 lag 4": {"lag": 4}, "smc 3x2 lag 32": {"lag": 32}}


def test_resume_goes_on_where_the_run_stopped(monkeypatch, tmp_path, capsys):
    """--resume continues the report in --out from its last problem, to the figures of one whole run; a report of
    other settings is refused in one line, before any weight is read."""
    monkeypatch.setattr(scoring, "completions", stub_completions(quality.load_problems()[:4]))
    monkeypatch.setattr(scoring, "target_logprobs", stub_logprobs)
    out = tmp_path / "q.json"
    flags = ["quality", "--problem-set", "ours", "--samples", "1", "--methods", "ar,smc,draft", "--smc-cells", "3x2",
             "--lag", "0", "--out", str(out)]
    *_, whole = benches.quality.pass_rates(StubPair(), "draft", bench.parse(flags + ["--problems", "4"]))
    whole = json.loads(json.dumps(whole))
    first = bench.parse(flags + ["--problems", "1"])
    first_run = list(benches.quality.pass_rates(StubPair(), "draft", first))[-1]
    common.write({"settings": dict(vars(first)), "quality": first_run}, out)
    again = bench.parse(flags + ["--problems", "4", "--resume"])
    *_, resumed = benches.quality.pass_rates(StubPair(), "draft", again, benches.quality.resumed(again))
    for label, q in whole.items():
        for key in ("problems", "results", "logprobs", "texts", "pass_at_1", "logprob_vs_ar", "new_tokens"):
            assert resumed[label].get(key) == q.get(key), (label, key)
    assert whole["smc 3x2"]["logprob_vs_ar"] == pytest.approx(-1.0)
    old = json.loads(out.read_text())  # reports from before --lag took a list hold one int
    old["settings"]["lag"] = 0
    out.write_text(json.dumps(old))
    assert benches.quality.resumed(again)["ar"]["problems"] == 1
    with pytest.raises(SystemExit, match="--resume: lag differ from the run in"):
        benches.quality.resumed(bench.parse(flags[:-2] + ["--lag", "16", "--out", str(out), "--resume"]))
    with pytest.raises(SystemExit, match="--resume: samples differ from the run in"):
        benches.quality.resumed(bench.parse(flags[:3] + ["--samples", "2"] + flags[5:] + ["--resume"]))
    with pytest.raises(SystemExit, match="--resume needs a quality run's report in --out"):
        benches.quality.resumed(bench.parse(["quality", "--out", str(tmp_path / "missing.json"), "--resume"]))


@pytest.mark.slow
def test_each_format_against_bf16_and_the_unquantized_target(tmp_path):
    """Greedy texts against bf16's, and samples scored by the float32 target and by their own format: float32 is
    the unquantized target itself (no divergence), and bf16's greedy text is its own reference."""
    from test_model import save_tiny
    save_tiny("qwen2", str(tmp_path))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    tokens = 6
    out = benches.formats.format_report(str(tmp_path), prompts, ["float32", "int8", "int4"], tokens, "cpu")
    assert list(out) == ["bf16", "float32", "int8", "int4"]
    assert out["bf16"]["first_difference"] == [len(t) for t in out["bf16"]["greedy"]] and out["bf16"]["identical"] == 3
    assert out["float32"]["kl"] == pytest.approx(0, abs=1e-5) and out["float32"]["prompt_kl_mean"] < 1e-6
    assert all(f["prompt_kl_mean"] > 1e-6 and len(f["prompt_kl"]) == 3 for fmt, f in out.items() if fmt != "float32")
    unquantized = platforms.load(str(tmp_path), weights="float32")[0]
    for fmt, f in out.items():
        assert all(len(t) == tokens for t in f["samples"]) and f["tokens_per_s"] > 0
        want = [scoring.target_logprobs(unquantized, p, [t])[0] for p, t in zip(prompts, f["samples"])]
        assert f["logprobs"] == pytest.approx(want, abs=1e-5)
        assert f["kl"] == pytest.approx(sum(s - r for s, r in zip(f["self_logprobs"], want)) / 3, abs=1e-5)
        assert all(0 <= d <= tokens for d in f["first_difference"])
    assert "| int4 |" in benches.formats.format_table(out)
    with pytest.raises(SystemExit):
        bench.parse(["formats", "--formats", "int9"])
    with pytest.raises(SystemExit):
        bench.parse(["formats", "--formats", "int8", "--random", "tiny:tiny"])


@pytest.mark.slow
def test_parts_split_each_cycle_by_part(tmp_path, capsys):
    """bench.py parts: every method's cycle split into the named parts, which add up to the profiled cycle, the
    matmuls, the attention and the sampling among them, smc's rule too; the models as they were after."""
    out = tmp_path / "parts.json"
    report = bench.main(["parts", "--quick", "--random", "tiny:tiny", "--threads", "1", "--prompt-len", "8",
                         "--methods", "ar,smc", "--grid", "2x2", "--out", str(out)])
    assert "| method | N | K | tokens/cycle | cycle ms | profiled ms | matmuls |" in capsys.readouterr().out
    rows = {(r["method"], r["N"], r["K"]): r for r in json.loads(out.read_text())["parts"]}
    assert set(rows) == {("ar", 1, 1), ("smc", 2, 2)} and report["parts"]
    for r in rows.values():
        assert set(r["parts_ms"]) == set(parts.PART_NAMES) and r["cycle_ms"] > 0
        assert sum(r["parts_ms"].values()) == pytest.approx(r["profiled_ms"])
        assert r["parts_ms"]["matmuls"] > 0 and r["parts_ms"]["attention"] > 0 and r["parts_ms"]["sampling"] > 0
        assert min(r["parts_ms"].values()) >= 0
    assert rows["smc", 2, 2]["parts_ms"]["the rule"] > 0 and 1 <= rows["ar", 1, 1]["tokens_per_cycle"] < 1.1
    if native.library()[0] is not None:  # w4a8's layers a call each: split by the parts its C code times
        bench.main(["parts", "--quick", "--random", "tiny:tiny", "--threads", "1", "--prompt-len", "8", "--methods",
                    "ar", "--weights", "w4a8", "--out", str(out)])
        (one_call,) = json.loads(out.read_text())["parts"]
        assert one_call["weights"].startswith("w4a8")
        assert one_call["parts_ms"]["matmuls"] > 0 and one_call["parts_ms"]["attention"] > 0
        assert sum(one_call["parts_ms"].values()) == pytest.approx(one_call["profiled_ms"])


def test_parts_time_every_call_of_the_backend_by_name_and_a_missing_one_fails():
    """PARTS names every call of kernels.Backend (a call added to the seam needs its part); wrapping a name the
    backend lacks fails at once, not as a part that reads 0; the timers come off again."""
    calls = {name for name in dir(kernels.Backend) if not name.startswith("_")}
    assert set(parts.PARTS) == calls and set(parts.PARTS.values()) <= set(parts.PART_NAMES)
    backend = kernels.Backend()
    seam = parts.Seam()
    with pytest.raises(AttributeError, match="no layer_norm"):
        seam.wrap(backend, {"layer_norm": "matmuls"})
    seam.wrap(backend, {"linear": "matmuls"})
    assert backend.linear(torch.ones(1, 2), torch.ones(3, 2)).tolist() == [[2.0, 2.0, 2.0]]
    [call] = seam.calls
    assert call.spent["matmuls"] > 0 and call.end > 0
    seam.unwrap()
    assert "linear" not in vars(backend)


@pytest.mark.slow
def test_profile_takes_a_cycle_apart(tmp_path, capsys):
    """bench.py profile on a CPU, CUDA's code paths run eagerly (no graphs, the host clock for timer): every config's
    phases timed, its traced kernel classes within the traced wall time, GEMM among them, the host gap beside the
    replays; a sweep row for every (model, matrix, rows); both copy bandwidths; `report` prints the tables again."""
    out = tmp_path / "p.json"
    report = bench.main(["profile", "--quick", "--random", "tiny:tiny", "--threads", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| method | N | K | suffix tokens |" in printed and "| method | N | K | wall ms | GEMM |" in printed
    section = json.loads(out.read_text())["profile"]
    assert section["replays"] == 2 and section["device"] == "cpu" and report["profile"]
    configs = {(r["method"], r["N"], r["K"]): r for r in section["configs"]}
    assert set(configs) == {("ar", 1, 1), ("smc", 2, 2), ("smc", 2, 1)}
    assert set(configs["ar", 1, 1]["phases_ms"]) == {"verify_cycle"}
    assert set(configs["smc", 2, 2]["phases_ms"]) == {"draft_block", "verify_cycle"}
    for r in configs.values():
        assert min(min(p.values()) for p in r["phases_ms"].values()) > 0 and r["suffix_tokens"] > 0
        assert r["cycle_ms"] == pytest.approx(sum(p["mean_ms"] for p in r["phases_ms"].values()))
        assert set(r["ideal_ms"]) == set(r["phases_ms"]) | {"cycle"} and r["ideal_ms"]["cycle"] > 0
        classes = r["profile"]["classes_ms"]
        assert set(classes) == set(profile.CLASS_NAMES) and classes["GEMM"] > 0 and min(classes.values()) >= 0
        assert sum(classes.values()) <= 1.05 * r["profile"]["wall_ms"]
        gap = r["host_gap"]
        assert gap["loop_ms"] > 0 and gap["replay_ms"] > 0
        assert gap["gap_ms"] == pytest.approx(gap["loop_ms"] - gap["replay_ms"])
    matrices = ("wqkv", "wo", "w13", "w2", "lm_head")
    cells = [(r["model"], r["matrix"], r["rows"]) for r in section["sweep"]]
    assert sorted(cells) == sorted((m, x, n) for m in ("draft", "target") for x in matrices for n in (1, 8))
    assert all(r["gbs"] > 0 and r["ms"] > 0 and r["library"] == "default" for r in section["sweep"])
    assert min(section["copy"]["engine_gbs"], section["copy"]["buffer_gbs"]) > 0
    bench.main(["report", str(out)])
    assert profile.tables(section) in capsys.readouterr().out


@pytest.mark.skipif(native.library()[0] is None, reason="no C compiler here: the C kernel's calls cannot be traced")
def test_profile_counts_the_c_kernels_calls(tmp_path):
    """In w4a8 the matmuls and the sampler are the C kernel's calls, which the profiler sees only as records the
    kernel makes while a trace runs, its fused layers split by their own clock: GEMM and sampling above 0."""
    out = tmp_path / "p.json"
    bench.main(["profile", "--quick", "--random", "tiny:tiny", "--threads", "1", "--weights", "w4a8", "--out",
                str(out)])
    for r in json.loads(out.read_text())["profile"]["configs"]:
        classes = r["profile"]["classes_ms"]
        assert classes["GEMM"] > 0 and classes["sampling"] > 0 and classes["attention"] > 0
        assert sum(classes.values()) <= 1.05 * r["profile"]["wall_ms"]
