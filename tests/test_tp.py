"""Tensor parallelism (model.py, loading.py): 2 gloo ranks on this CPU, float32, against one process: tiny random
models' and the real Qwen2.5-0.5B's logits, an engine's tokens, each rank reading only its chunks (safetensors, GGUF),
the one-line error when the ranks do not divide the KV heads; and the tree plumbing of Transformer.step."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

import engine
import errors
import kernels
import loading
import model
import platforms
from test_engine import save
from test_model import fetch_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = os.path.join(ROOT, "weights", "qwen2.5-coder-0.5b-instruct")
SMOLLM = os.path.join(ROOT, "weights", "smollm2-135m-instruct.gguf")
SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the rest is whole


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)  # the CPU kernels, as model runs them here


# ---------------------------------------------------------------- two ranks


def rank_main(rank, port, out, scenario, args):
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
    torch.set_num_threads(1)  # two ranks on two cores
    kernels.INTERPRET = False
    assert model.init_distributed("cpu") == (rank, 2)
    try:
        torch.save(scenario(rank, *args), os.path.join(out, f"{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def on_two_ranks(tmp_path, scenario, *args, timeout=60):
    """scenario(rank, *args) on 2 gloo ranks, forked from this process (its imports done: spawned ranks spent ~3 s
    importing torch and these modules again; they use no CUDA) -> [its result on rank 0, on rank 1]. A rank that
    raises fails the test at once (its traceback in the message; the other rank is ended), one that hangs after
    `timeout` s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(rank_main, args=(port, str(tmp_path), scenario, args), nprocs=2, join=False,
                             start_method="fork")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=0.5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{scenario.__name__} still running after {timeout} s")
    return [torch.load(tmp_path / f"{r}.pt") for r in range(2)]


# ---------------------------------------------------------------- tiny random models as Hugging Face directories


def tiny_config(arch="qwen2", **changes):
    return model.Config(**{"arch": arch, "vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2,
                           "head_dim": 16, "ffn_dim": 96, "qkv_bias": arch == "qwen2", "qk_norm": arch == "qwen3",
                           "max_seq_len": 64, "tie_embeddings": arch != "qwen2", **changes})


def random_model(c, seed):
    m = model.Transformer(c, "cpu", torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """qwen2 (q/k/v biases, own head), llama (tied embeddings) and qwen3 (q/k head norms, which every rank holds
    whole; heads of 16 though 64 / 8 = 8) targets, and a smaller llama draft."""
    root = tmp_path_factory.mktemp("tp")
    return {"qwen2": save(random_model(tiny_config(), 0), root / "qwen2"),
            "llama": save(random_model(tiny_config("llama"), 1), root / "llama"),
            "qwen3": save(random_model(tiny_config("qwen3"), 3), root / "qwen3"),
            "draft": save(random_model(tiny_config("llama", n_heads=2, n_kv_heads=1, n_layers=1), 2), root / "d")}


def logits_of(m, prompt, particles):
    """Prefill logits of every prompt position, then two particle steps of 3 and 2 tokens (the second after the
    first is kept) -> [prefill [P, V], step [1, N, 3, V], step [1, N, 2, V]]."""
    cache = model.KVCache(m.config, particles.shape[1], len(prompt), particles.shape[2], "cpu", torch.float32)
    out = [m.prefill(prompt, cache, logits="all"), m.step(particles[..., :3], cache)]
    cache.suffix_len += 3
    return out + [m.step(particles[..., 3:], cache)]


def tiny_logits(rank, dirs):
    g = torch.Generator().manual_seed(3)
    prompt, particles = torch.randint(0, 96, (9,), generator=g), torch.randint(0, 96, (1, 4, 5), generator=g)
    out = {}
    for arch in ("qwen2", "llama", "qwen3"):
        shard = platforms.load(dirs[arch], dtype=torch.float32, tp=(rank, 2))[0]
        whole = platforms.load(dirs[arch], dtype=torch.float32)[0]
        out[arch] = logits_of(shard, prompt, particles), logits_of(whole, prompt, particles)
        out[arch + " shard"] = [shard.config.n_heads, shard.config.n_kv_heads, shard.config.ffn_dim]
    return out


def test_tiny_logits_match_one_process(tmp_path, tiny_dirs):
    ranks = on_two_ranks(tmp_path, tiny_logits, tiny_dirs)
    for arch in ("qwen2", "llama", "qwen3"):
        assert ranks[0][arch + " shard"] == [4, 1, 48]  # each rank's share of heads, KV heads, FFN columns
        (shard0, whole), (shard1, _) = ranks[0][arch], ranks[1][arch]
        for a, b, ref in zip(shard0, shard1, whole):
            assert torch.equal(a, b)  # every rank ends with the same logits
            assert (a - ref).abs().max() < 1e-5 * ref.abs().max(), arch


def real_prefill(rank, path, text):
    m, tok = platforms.load(path, dtype=torch.float32, tp=(rank, 2))
    ids = tok.encode(text)
    cache = model.KVCache(m.config, 1, len(ids), 1, "cpu", torch.float32)
    return m.prefill(torch.tensor(ids), cache, logits="all"), model.KVCache.nbytes(m.config, 1, 100, 0, torch.float32)


@pytest.mark.slow
def test_qwen_logits_match_one_process(tmp_path):
    """The real 0.5B (14 heads, 2 KV heads) split in two, in float32."""
    text = "import numpy as np\n\ndef softmax(x):"
    fetch_module().fetch("qwen2.5-coder-0.5b-instruct")  # once; later runs reuse it
    ranks = on_two_ranks(tmp_path, real_prefill, QWEN, text)
    m, tok = platforms.load(QWEN, dtype=torch.float32)
    ids = torch.tensor(tok.encode(text))
    ref = m.prefill(ids, model.KVCache(m.config, 1, len(ids), 1, "cpu", torch.float32), logits="all")
    assert torch.equal(ranks[0][0], ranks[1][0])
    assert (ranks[0][0] - ref).abs().max() < 1e-5 * ref.abs().max()  # measured: 1.2e-6
    assert 2 * ranks[0][1] == model.KVCache.nbytes(m.config, 1, 100, 0, torch.float32)  # a rank caches 1 KV head


# ---------------------------------------------------------------- an engine over a sharded target


def engine_tokens(rank, dirs, prompt):
    draft = platforms.load(dirs["draft"], dtype=torch.float32)[0]  # whole on every rank: see model.py
    out = []
    for tp in ((rank, 2), (0, 1)):
        e = engine.Engine.of_models(platforms.load(dirs["qwen2"], dtype=torch.float32, tp=tp)[0], draft)
        out.append([e.generate(prompt, method=m, max_new_tokens=12, temperature=t, seed=5, **more).tokens
                    for m, t, more in (("ar", 0, {}), ("sd", 0, {"draft_len": 3}),
                                       ("smc", 0.7, {"particles": 3, "draft_len": 2}))])
    return out


def test_engine_tokens_match_one_process(tmp_path, tiny_dirs):
    ranks = on_two_ranks(tmp_path, engine_tokens, tiny_dirs, [5, 17, 42, 8])
    (tp0, one), (tp1, _) = ranks
    assert tp0 == tp1 == one
    assert all(len(tokens) == 12 for tokens in one)


# ---------------------------------------------------------------- the loader reads only a rank's chunks


def test_safetensors_reads_only_the_ranks_chunks(tiny_dirs, monkeypatch):
    import safetensors
    opened, read = safetensors.safe_open, {}

    class Counted:  # a safe_open handle (keys, get_slice) counting the bytes each tensor's slices give
        def __init__(self, *args):
            self.f = opened(*args)
            self.keys = self.f.keys

        def get_slice(self, name):
            self.name, self.slice = name, self.f.get_slice(name)
            return self

        def get_shape(self):
            return self.slice.get_shape()

        def __getitem__(self, index):
            t = self.slice[index]
            read[self.name] = read.get(self.name, 0) + t.numel() * t.element_size()
            return t
    monkeypatch.setattr(safetensors, "safe_open", Counted)
    c = loading.open_weights(tiny_dirs["qwen2"])[0]
    full = {name: 4 * torch.Size(shape).numel() for name, shape in model.expected_shapes(c).items()}
    for rank in range(2):
        read.clear()
        platforms.load(tiny_dirs["qwen2"], dtype=torch.float32, tp=(rank, 2))
        assert read == {name: n // 2 if name.split(".")[-2] in SHARDED else n for name, n in full.items()}


def test_gguf_chunks_and_rows_read(monkeypatch):
    """SmolLM2 (llama: Q/K rows un-permuted; 9 heads, 3 KV heads) in 3 chunks: row chunks dequantize only their
    rows, column chunks every row; each chunk equals the whole tensor's."""
    dequantized, rows = loading.dequantized, []
    monkeypatch.setattr(loading, "dequantized", lambda data, kind: rows.append(len(data)) or dequantized(data, kind))
    fetch_module().fetch("smollm2-135m-instruct")
    c, get, _ = loading.open_weights(SMOLLM)
    for name, dim in (("self_attn.q_proj.weight", 0), ("self_attn.k_proj.weight", 0), ("mlp.up_proj.weight", 0),
                      ("self_attn.o_proj.weight", 1), ("mlp.down_proj.weight", 1)):
        whole = get("model.layers.1." + name)
        rows.clear()
        chunks = [get("model.layers.1." + name, (dim, k, 3)) for k in range(3)]
        assert torch.equal(torch.cat(chunks, dim), whole), name
        assert rows == [len(whole) // 3 if dim == 0 else len(whole)] * 3, name


# ---------------------------------------------------------------- errors and the single-process default


def test_ranks_not_dividing_the_kv_heads_is_one_line(tiny_dirs):
    with pytest.raises(errors.LoadError) as e:
        platforms.load(tiny_dirs["qwen2"], tp=(0, 3))
    assert str(e.value) == "--nproc-per-node 3 does not divide the target's 2 KV heads; use 1 or 2"
    with pytest.raises(errors.LoadError, match="^--nproc-per-node 4 does not divide the target's 6 FFN columns; "
                                              "use 1 or 2$"):
        model.shard_config(tiny_config(n_kv_heads=4, ffn_dim=6), 4)
    shard = model.shard_config(tiny_config(), 2)
    assert model.KVCache.nbytes(shard, 3, 10, 7, torch.float32) * 2 == model.KVCache.nbytes(
        tiny_config(), 3, 10, 7, torch.float32)


def test_one_process_initialises_nothing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert model.init_distributed("cpu") == (0, 1) and not torch.distributed.is_initialized()


# ---------------------------------------------------------------- tree plumbing of Transformer.step


def test_step_depth_and_tree(monkeypatch):
    """depth = arange(T) is the chain step; other depths move the rotary positions; a tree reaches the
    attention kernel (the model's backend's), and a chain passes None."""
    m = random_model(tiny_config(), 4)
    g = torch.Generator().manual_seed(6)
    prompt, new = torch.randint(0, 96, (5,), generator=g), torch.randint(0, 96, (1, 2, 3), generator=g)

    def step(**kw):
        cache = model.KVCache(m.config, 2, 8, 4, "cpu", torch.float32)
        m.prefill(prompt, cache)
        return m.step(new, cache, **kw)
    chain = step()
    assert torch.equal(step(depth=torch.arange(3)[None]), chain)
    assert not torch.allclose(step(depth=torch.tensor([[0, 1, 1]]))[..., 2, :], chain[..., 2, :])
    seen = []
    attention = m.backend.particle_attention

    def spy(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree=None):
        seen.append(tree)
        return attention(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale)
    monkeypatch.setattr(m.backend, "particle_attention", spy)
    tree = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    assert torch.equal(step(tree=tree), chain)  # the kernel stand-in ignores it: this checks the plumbing
    assert all(t is tree for t in seen) and len(seen) == 2
    seen.clear()
    step()
    assert seen == [None, None]


# ---------------------------------------------------------------- torchrun engine.py


ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}  # CPU kernels


def torchrun(world, *args):
    """engine.py on `world` ranks (one thread each) under torchrun; world 1: plain python."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)] if world > 1 else []
    command = [sys.executable, *launch, os.path.join(ROOT, "engine.py"), "--device", "cpu", "--weights", "float32",
               *args]
    return subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_torchrun_engine_speaks_once_and_decodes_as_one_process(tiny_dirs, tmp_path):
    """An sd and an smc prompt of one .jsonl file on 1, 2 and 3 ranks (the three launched at once): two ranks
    print one line per prompt (rank 0 alone speaks) with the tokens of one process; three do not divide the KV
    heads: one error line."""
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": "w5 w17 w42", "method": m}) + "\n"
                                              for m in ("sd", "smc")))
    args = ["--target", tiny_dirs["qwen2"], "--draft", tiny_dirs["draft"], "--prompt-file", str(tmp_path / "p.jsonl"),
            "--max-new-tokens", "12", "--seed", "3"]
    one, two, three = [run.communicate(timeout=120) for run in [torchrun(world, *args) for world in (1, 2, 3)]]
    lines = [json.loads(line) for line in two[0].splitlines()]
    assert [r["stats"]["method"] for r in lines] == ["sd", "smc"], two  # rank 0 alone prints
    assert [r["tokens"] for r in lines] == [json.loads(line)["tokens"] for line in one[0].splitlines()]
    assert all(len(r["tokens"]) == 12 for r in lines)
    out, err = three
    assert out == "" and [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: --nproc-per-node 3 does not divide the target's 2 KV heads; use 1 or 2"]


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_others():
    """SIGKILL one of two ranks while they decode the real 0.5B: torchrun ends the other, no hang."""
    path = fetch_module().fetch("qwen2.5-coder-0.5b-instruct")
    run = torchrun(2, "--target", path, "--method", "ar", "--max-new-tokens", "400", "--weights", "bf16",
                   "--prompt", "def quicksort(xs):")
    assert run.stdout.read(len("def quicksort")) == "def quicksort"  # rank 0 echoed: the ranks are loading
    assert len(run.stdout.read(len("(xs):") + 1)) == 6  # and its first new text: the ranks decode
    ranks = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and parent(int(pid)) == run.pid]
    assert len(ranks) == 2
    os.kill(max(ranks), 9)
    start = time.monotonic()
    run.communicate(timeout=60)
    assert run.returncode != 0 and time.monotonic() - start < 30


def parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
