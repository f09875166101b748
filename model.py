"""A Llama-family decoder (llama, qwen2, mistral) from scratch, its weight loaders (Hugging Face safetensors
directories and GGUF files), its tokenizer, the static prefix/suffix KV cache, tensor-parallel sharding."""
import dataclasses
import datetime
import json
import math
import mmap
import os
import struct
from functools import partial

import torch
import torch.nn.functional as F

import kernels


class LoadError(Exception):
    """A one-line, user-facing problem with a model path; the CLI prints it without a traceback."""

    def __init__(self, message):
        super().__init__(" ".join(str(message).split()))  # one line even when a hostile file's names hold newlines


# ---------------------------------------------------------------- config
@dataclasses.dataclass
class Config:
    arch: str  # "llama" | "qwen2" | "mistral" (Hugging Face model_type)
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...} as in Hugging Face
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_seq_len: int = 4096
    bos_id: int | None = None
    eos_ids: list = dataclasses.field(default_factory=list)
    tp: int = 1  # tensor-parallel ranks: n_heads, n_kv_heads and ffn_dim are one rank's share (shard_config)


ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# Config field -> its name in a config.json
HF_FIELDS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "ffn_dim": "intermediate_size", "max_seq_len": "max_position_embeddings",
             "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta"}
ROPE_KEYS = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def config_from_hf(hf, path, more_eos=()):
    """The Config of a config.json (more_eos: generation_config.json's end ids, which generation also stops at)."""
    if (arch := hf.get("model_type")) not in ARCHS:
        raise LoadError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHS)})")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise LoadError(f"{path}: attention_bias/mlp_bias on {arch} is not supported")
    if arch == "mistral" and hf.get("sliding_window") not in (None, 0):
        raise LoadError(f"{path}: sliding-window attention is not supported")
    if type(hf.get("tie_word_embeddings", False)) is not bool:
        raise LoadError(f"{path}: tie_word_embeddings is {hf['tie_word_embeddings']!r}, expected true or false")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers >= 5 | < 5
    if not isinstance(rope, dict):
        raise LoadError(f"{path}: rope_parameters/rope_scaling is {rope!r}, expected an object")
    rope = dict(rope)
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if (rope_type := rope.get("rope_type", rope.get("type", "default"))) not in ("default", "llama3", "linear"):
        raise LoadError(f"{path}: rope type {rope_type!r} is not supported (default, llama3, linear)")
    sizes = {f: hf.get(key, {"norm_eps": 1e-6, "max_seq_len": 4096}.get(f)) for f, key in HF_FIELDS.items()}
    kv_heads = sizes["n_heads"] if sizes["n_kv_heads"] is None else sizes["n_kv_heads"]
    c = Config(arch=arch, **sizes | {"n_kv_heads": kv_heads, "rope_theta": theta}, qkv_bias=arch == "qwen2",
               rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
               tie_embeddings=hf.get("tie_word_embeddings", False), bos_id=hf.get("bos_token_id"),
               eos_ids=list(dict.fromkeys(token_ids(hf.get("eos_token_id"), path) + list(more_eos))))
    return checked_config(c, HF_FIELDS, path)


def token_ids(eos, where):
    """An eos_token_id field (null, one id or a list of ids) as a list."""
    ids = [] if eos is None else [eos] if type(eos) is int else eos
    if not (isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)):
        raise LoadError(f"{where}: eos_token_id is {eos!r}, expected a token id or a list of them")
    return ids


def checked_config(c, names, where):
    """c with every size a positive integer (head_dim derived if absent) and the heads grouping evenly, else a LoadError
    naming the field as the file spells it: no ZeroDivisionError or negative size from a damaged or hostile file."""
    def positive(x, integer, name):  # else a LoadError; integer false: a positive finite number
        if not (type(x) is int if integer else type(x) in (int, float) and math.isfinite(x)) or x <= 0:
            raise LoadError(f"{where}: {name} is {x!r}, expected a positive {'integer' if integer else 'number'}")

    for f, name in names.items():
        if not (f == "head_dim" and c.head_dim is None):
            positive(getattr(c, f), f not in ("norm_eps", "rope_theta"), name)
    if c.n_heads % c.n_kv_heads:
        raise LoadError(f"{where}: {names['n_heads']} ({c.n_heads}) is not a multiple of {names['n_kv_heads']} "
                        f"({c.n_kv_heads})")
    if c.head_dim is None:
        if c.dim % c.n_heads:
            raise LoadError(f"{where}: {names['dim']} ({c.dim}) is not a multiple of {names['n_heads']} "
                            f"({c.n_heads}) and {names['head_dim']} is not given")
        c.head_dim = c.dim // c.n_heads
    if c.head_dim % 2:
        raise LoadError(f"{where}: {names['head_dim']} is {c.head_dim}; rotary embeddings need an even head size")
    s = c.rope_scaling or {}
    for key in ROPE_KEYS.get(s.get("rope_type"), ()):
        positive(s.get(key), key == "original_max_position_embeddings", f"rope scaling {key}")
    if s and s["factor"] < 1:  # a factor below 1 would speed positions up, which no scaling means
        raise LoadError(f"{where}: rope scaling factor is {s['factor']!r}, expected at least 1")
    if s.get("rope_type") == "llama3" and s["high_freq_factor"] <= s["low_freq_factor"]:  # the ramp divides by it
        raise LoadError(f"{where}: rope scaling high_freq_factor ({s['high_freq_factor']}) must exceed "
                        f"low_freq_factor ({s['low_freq_factor']})")
    for what, i in [("bos", c.bos_id)] * (c.bos_id is not None) + [("eos", i) for i in c.eos_ids]:
        if not (type(i) is int and 0 <= i < c.vocab_size):  # the engine indexes a [vocab] table with them
            raise LoadError(f"{where}: {what} token id {i!r} lies outside the vocabulary of {c.vocab_size}")
    c.rope_theta = float(c.rope_theta)
    return c


# ---------------------------------------------------------------- tensor parallel
# Megatron layout: q/k/v and gate/up split by output rows (heads, FFN columns), o and down by input columns, their
# partial sums all-reduced; the KV cache split by KV head. Embedding and LM head stay whole on every rank: split by
# vocabulary, they cut a rank's weights from 861 to 471 MiB (Qwen2.5-0.5B, bf16, 2 CPU ranks) but not the time of a
# step (gloo-bound: 116-134 vs 125-136 ms) and would need an all-gather and a vocabulary the ranks divide. A draft
# stays whole: K one-row steps a cycle, each would pay two all-reduces a layer to save little reading.

def init_distributed(device):
    """-> (rank, world). Under torchrun (WORLD_SIZE > 1) joins the default process group, once: gloo for a CPU
    device, nccl for CUDA (None: CUDA when there is one). The timeout ends the other ranks when one dies."""
    if (world := int(os.environ.get("WORLD_SIZE", 1))) == 1:
        return 0, 1
    if not torch.distributed.is_initialized():
        if (cuda := torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    return torch.distributed.get_rank(), world


def shard_config(c, world):
    """The Config of one of `world` tensor-parallel ranks: its share of the heads, KV heads and FFN columns."""
    for n, what in ((c.n_kv_heads, "KV heads"), (c.n_heads, "attention heads"), (c.ffn_dim, "FFN columns")):
        if n % world:
            fits = [d for d in range(1, c.n_kv_heads + 1) if c.n_kv_heads % d == c.n_heads % d == c.ffn_dim % d == 0]
            raise LoadError(f"--nproc-per-node {world} does not divide the target's {n} {what}; use "
                            f"{' or '.join(map(str, fits))}")
    return dataclasses.replace(c, tp=world, **{f: getattr(c, f) // world for f in ("n_heads", "n_kv_heads", "ffn_dim")})


# ---------------------------------------------------------------- rotary embeddings
def rope_tables(c, device):
    """cos, sin [max_seq_len, head_dim] in float32, half-split (Hugging Face) layout."""
    inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
    s = c.rope_scaling or {}
    if s.get("rope_type") == "linear":
        inv = inv / s["factor"]
    elif s.get("rope_type") == "llama3":  # long wavelengths slowed by `factor`, short kept, a smooth ramp between
        old_ctx, lo, hi = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
        ramp = ((old_ctx / (2 * math.pi / inv) - lo) / (hi - lo)).clamp(0, 1)  # 2 pi / inv: the wavelength
        inv = (1 - ramp) * inv / s["factor"] + ramp * inv
    angles = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float64), inv).repeat(1, 2)  # [T, D]: both halves
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x, cos, sin):
    """x [..., T, H, D]; cos/sin [..., T, 1, D]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, -1)
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


# ---------------------------------------------------------------- KV cache
class KVCache:
    """Static cache for R requests x N particles, a request's particles at one position: prefix_k/v [L, R, Hkv, P, D]
    hold each prompt once, suffix_k/v [L, R, N, Hkv, S, D] each particle's generated tokens. prefix_len/suffix_len [R]
    live on the device (decoding needs no host sync); the model writes new K/V at suffix_len, the caller advances it."""

    def __init__(self, c, particles, prefix_cap, suffix_cap, device, dtype, requests=1):
        shape_p = (c.n_layers, requests, c.n_kv_heads, prefix_cap, c.head_dim)
        shape_s = (c.n_layers, requests, particles, c.n_kv_heads, suffix_cap, c.head_dim)
        self.prefix_k, self.prefix_v = (torch.zeros(shape_p, device=device, dtype=dtype) for _ in range(2))
        self.suffix_k, self.suffix_v = (torch.zeros(shape_s, device=device, dtype=dtype) for _ in range(2))
        self.prefix_len, self.suffix_len = (torch.zeros(requests, dtype=torch.int32, device=device) for _ in range(2))

    @staticmethod
    def nbytes(c, particles, prefix_cap, suffix_cap, dtype, requests=1):
        per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * torch.empty((), dtype=dtype).element_size()
        return requests * per_token * (prefix_cap + particles * suffix_cap)

    def attend_prefill(self, layer, q, k, v, scale, r):
        """q [T, Hq, D], k/v [T, Hkv, D] at positions 0..T-1 of request r's prompt."""
        self.prefix_k[layer, r, :, :len(q)], self.prefix_v[layer, r, :, :len(q)] = k.transpose(0, 1), v.transpose(0, 1)
        return kernels.prefill_attention(q, k, v, scale)

    def attend_step(self, layer, q, k, v, scale, tree=None):
        """q [R, N, T, Hq, D], k/v [R, N, T, Hkv, D] at suffix positions suffix_len .. suffix_len+T-1; tree bool
        [R, T, T] (None: causal): new token t sees new token j iff tree[r, t, j]."""
        R, N, T, H, D = k.shape
        idx = (self.suffix_len.long()[:, None] + torch.arange(T, device=k.device))[:, None, None, :, None]
        self.suffix_k[layer].scatter_(3, idx.expand(R, N, H, T, D), k.transpose(2, 3))
        self.suffix_v[layer].scatter_(3, idx.expand(R, N, H, T, D), v.transpose(2, 3))
        return kernels.particle_attention(q, self.prefix_k[layer], self.prefix_v[layer], self.suffix_k[layer],
                                          self.suffix_v[layer], self.prefix_len, self.suffix_len, scale, tree)


# ---------------------------------------------------------------- weight formats
# One format holds every matmul weight (each block's wqkv, wo, w13, w2 and the head); activations, embeddings and norms
# are in the dtype its kernels are fast with. None is fastest everywhere (on AVX2 without native bf16, oneDNN cannot
# pack bf16, whose F.linear cost grows with rows; torch's int8 and int4 kernels want bf16 activations, 5-20x slower with
# float32; w8a8's int8 products need float32 ones, calibrated): decode.measure_formats times them on the machine.
FORMATS = {"bf16": torch.bfloat16, "float32": torch.float32, "int8": torch.bfloat16, "int4": torch.bfloat16,
           "w8a8": torch.float32}


def weight_format(fmt, device="cpu"):
    """-> weight format fmt's activations dtype on device, or a one-line LoadError, before any weight is read."""
    if fmt not in FORMATS:
        raise LoadError(f"weights {fmt!r} is not a weight format; use one of {', '.join(FORMATS)}")
    if fmt[:3] == "int" and not ((kind := torch.device(device).type) == "cpu" or kind == "cuda" and kernels.triton):
        raise LoadError(f"{fmt} weights run on the CPU and on CUDA with Triton; use bf16 on {kind}")
    if fmt == "w8a8" and torch.device(device).type != "cpu":
        raise LoadError(f"w8a8 weights run on the CPU only (FBGEMM's int8 products); use int8 on {device}")
    return FORMATS[fmt]


class Quantized(torch.nn.Module):
    """A matmul weight [out, in] in int8 or int4 for kernels.quantized_linear; parameters, so weight_bytes counts it.
    blocks: int4's (q, scale_zero) as read from a file (then w gives only the shape, device and dtype). w8a8: FBGEMM's
    packed int8 (`packed_bytes` of it) and float32 outlier columns (kernels.w8a8_linear), amax [in] calibration's."""

    def __init__(self, fmt, w, blocks=None, amax=None):
        super().__init__()
        self.fmt, self.packed_bytes = fmt, 0
        if fmt == "w8a8":
            self.packed, self.outliers, w_outliers = kernels.quantize_w8a8(w, w.new_ones(w.shape[1]) if amax is None
                                                                           else amax)
            self.w_outliers = torch.nn.Parameter(w_outliers, requires_grad=False)
            self.packed_bytes = w.numel() + 4 * len(w)  # int8 values, a float32 scale a row
            return
        if fmt == "int4" and (w.shape[0] % 16 or w.shape[1] % kernels.INT4_GROUP):  # the CPU kernel's tiles
            raise LoadError(f"int4 needs matmul weights of 16k x 32k, not {tuple(w.shape)}; use int8")
        q, scale = blocks or (kernels.quantize_int8(w) if fmt == "int8" else kernels.quantize_int4(w))
        q, scale = q.to(w.device), scale.to(w.device, w.dtype)
        if fmt == "int4":  # uint8 [out, in / 2], packed for the device's kernel
            q = torch._convert_weight_to_int4pack_for_cpu(q, 1) if w.is_cpu else kernels.pack_int4(q)
        self.q, self.scale = (torch.nn.Parameter(t, requires_grad=False) for t in (q, scale))


def converted(w, fmt, amax=None):
    """w [out, in] (plain, activations' dtype) in weight format fmt for `linear`: int8, int4, w8a8 quantized (amax:
    w8a8's calibration; None: no outliers known, as for timing); on the CPU, bf16 and float32 in oneDNN's blocked layout
    if it packs the dtype (bf16: AVX-512, AVX-NE-CONVERT), 1.4-2x F.linear's speed at decoding's few rows (AVX-512)."""
    if fmt in ("int8", "int4", "w8a8"):
        return Quantized(fmt, w, amax=amax)
    packs = w.dtype == torch.float32 or w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if w.device.type == "cpu" and torch.backends.mkldnn.is_available() and packs:
        return torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1), requires_grad=False)
    return w


def linear(x, w, bias=None):
    """x [..., in] @ w.T + bias [out]; w plain, oneDNN-packed or Quantized (`converted`). bf16 that oneDNN cannot pack
    costs F.linear as much a row at any row count (no bf16 arithmetic): at 64 rows or more, float32 is faster."""
    if isinstance(w, Probe):
        w.amax = torch.maximum(w.amax, x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float())
        w = w.w
    if isinstance(w, Quantized):
        y = kernels.w8a8_linear(x, w.packed, w.outliers, w.w_outliers) if w.fmt == "w8a8" else \
            kernels.quantized_linear(x, w.q, w.scale)
        return y if bias is None else y + bias
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if w.is_cpu and w.dtype == torch.bfloat16 and x.numel() >= 64 * x.shape[-1]:
        return F.linear(x.float(), w.float(), bias if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, w, bias)


MATMULS = ("wqkv", "wo", "w13", "w2", "lm_head")


def replace(m, name, w):
    delattr(m, name)  # a module's parameter cannot be replaced by a module by assignment
    setattr(m, name, w)


def matmuls(model):
    """-> [(name, module, attribute)] of every matmul weight: ('layers.3.w2', model.layers[3], 'w2'), ..."""
    return [(f"layers.{i}.{n}", b, n) for i, b in enumerate(model.layers) for n in MATMULS[:4]] + \
        [("lm_head", model, "lm_head")]


class Probe:
    """A matmul weight w in calibration: `linear` keeps amax [in], the largest |input| per channel it has seen."""

    def __init__(self, w):
        self.w, self.amax = w, torch.zeros(w.shape[1], device=w.device)


@torch.no_grad()
def calibrated(model, length=64):
    """-> {matmul name: amax [in]} over a prefill of `length` seeded random tokens: the model alone decides where w8a8
    keeps floats (its large channels are much the same for any text: README, Model formats)."""
    probes = {name: (m, attr, Probe(getattr(m, attr))) for name, m, attr in matmuls(model)}
    for m, attr, p in probes.values():
        replace(m, attr, p)
    tokens = torch.randint(model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    model.prefill(tokens.to(model.device), KVCache(model.config, 1, length, 1, model.device, model.embed.dtype),
                  logits="all")
    for m, attr, p in probes.values():
        replace(m, attr, p.w)
    return {name: p.amax for name, (_, _, p) in probes.items()}


@torch.no_grad()
def convert_weights(model, fmt=None, held=None):
    """Every matmul weight not yet Quantized into format fmt (None: its dtype's) or held's for it, in place (held:
    fill_weights' {'layers.3.w2': 'int8'}); w8a8 calibrated first, a tied head copied (lookups need plain rows)."""
    fmt = fmt or ("float32" if model.embed.dtype == torch.float32 else "bf16")
    amax = calibrated(model) if fmt == "w8a8" else {}
    for name, m, attr in matmuls(model):
        if not isinstance(w := getattr(m, attr), Quantized):
            replace(m, attr, converted(w, (held or {}).get(name, fmt), amax.get(name)))


# ---------------------------------------------------------------- transformer
def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Block(torch.nn.Module):
    def __init__(self, c, empty):  # empty(*shape): an uninitialised parameter
        super().__init__()
        qkv_rows = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim  # wqkv: q, k and v fused, one matmul reads them all
        self.attn_norm, self.ffn_norm = empty(c.dim), empty(c.dim)
        self.wqkv, self.bqkv = empty(qkv_rows, c.dim), empty(qkv_rows) if c.qkv_bias else None
        self.wo = empty(c.dim, c.n_heads * c.head_dim)
        self.w13, self.w2 = empty(2 * c.ffn_dim, c.dim), empty(c.dim, c.ffn_dim)  # w13: gate and up projections fused
        self.c = c

    def attention(self, x, cos, sin, attend, layer):
        """x [..., T, dim] -> [..., T, dim], this rank's heads' share; attend(layer, q, k, v, scale) is the cache's."""
        c = self.c
        qkv = linear(rms_norm(x, self.attn_norm, c.norm_eps), self.wqkv, self.bqkv).unflatten(-1, (-1, c.head_dim))
        qk, v = apply_rope(qkv[..., :-c.n_kv_heads, :], cos, sin), qkv[..., -c.n_kv_heads:, :]  # q and k rotated at once
        q, k = qk.split([c.n_heads, c.n_kv_heads], -2)  # [..., T, Hq, D], [..., T, Hkv, D]
        return linear(attend(layer, q, k, v, c.head_dim ** -0.5).flatten(-2), self.wo)

    def ffn(self, x):
        """x [..., dim] -> [..., dim], this rank's FFN columns' share."""
        gate, up = linear(rms_norm(x, self.ffn_norm, self.c.norm_eps), self.w13).chunk(2, -1)
        return linear(F.silu(gate) * up, self.w2)


class Transformer(torch.nn.Module):
    def __init__(self, c, device="cpu", dtype=torch.bfloat16):
        super().__init__()
        self.config = c
        empty = lambda *s: torch.nn.Parameter(torch.empty(s, device=device, dtype=dtype), requires_grad=False)
        self.embed = empty(c.vocab_size, c.dim)
        self.layers = torch.nn.ModuleList(Block(c, empty) for _ in range(c.n_layers))
        self.norm, self.lm_head = empty(c.dim), self.embed if c.tie_embeddings else empty(c.vocab_size, c.dim)
        for name, table in zip(("cos", "sin"), rope_tables(c, device)):
            self.register_buffer(name, table, persistent=False)

    @property
    def device(self):
        return self.embed.device

    def num_params(self):  # of this rank's shard under tensor parallelism, as weight_bytes; in any format
        return sum(math.prod(shape) for shape in expected_shapes(self.config).values())

    def weight_bytes(self):
        """Bytes one full forward reads from weights (a tensor-parallel rank's: its shard's), all but the embedding
        table's (a few rows read) unless that is also the head: the memory-bandwidth roofline's numerator."""
        return sum(m.packed_bytes for m in self.modules() if isinstance(m, Quantized)) + sum(
            p.numel() * p.element_size() for p in self.parameters() if p is not self.embed or p is self.lm_head)

    def _hidden(self, x, cos, sin, attend):
        for i, b in enumerate(self.layers):
            x = x + self._all_reduce(b.attention(x, cos, sin, attend, i))
            x = x + self._all_reduce(b.ffn(x))
        return rms_norm(x, self.norm, self.config.norm_eps)

    def _all_reduce(self, x):
        """The sum of every rank's partial output of a row-parallel matmul (wo, w2), the same on every rank."""
        if self.config.tp > 1:
            torch.distributed.all_reduce(x)
        return x

    def _logits(self, h):
        return linear(h, self.lm_head).float()

    @torch.inference_mode()
    def prefill(self, tokens, cache, r=0, logits="last"):
        """tokens [T] -> logits [V] of the last position, [T, V] of all (logits="all") or None (logits=None: the LM head
        is skipped, as a draft's prefill needs) for request r's prompt. Sets prefix_len[r] = T and suffix_len[r] = 0."""
        cos, sin = self.cos[:len(tokens), None], self.sin[:len(tokens), None]  # [T, 1, D]
        h = self._hidden(self.embed[tokens], cos, sin, partial(cache.attend_prefill, r=r))  # [T, dim]
        cache.prefix_len[r], cache.suffix_len[r] = len(tokens), 0
        return None if logits is None else self._logits(h if logits == "all" else h[-1])

    @torch.inference_mode()
    def step(self, tokens, cache, last_only=False, depth=None, tree=None):
        """tokens [R, N, T] continue every particle at suffix_len -> logits [R, N, T, V] (float32), or only the
        last position's [R, N, V]. Writes their K/V at suffix_len .. suffix_len+T-1; advancing suffix_len is
        the caller's choice. A token tree (None: a chain): depth int64 [R, T] puts new token t at position
        prefix_len + suffix_len + depth[r, t], not + t; tree bool [R, T, T]: it sees new token j iff tree[r, t, j]."""
        offset = torch.arange(tokens.shape[-1], device=tokens.device) if depth is None else depth  # [T] | [R, T]
        pos = (cache.prefix_len + cache.suffix_len).long()[:, None] + offset  # [R, T]
        cos, sin = self.cos[pos][:, None, :, None], self.sin[pos][:, None, :, None]  # [R, 1, T, 1, D]
        h = self._hidden(self.embed[tokens], cos, sin, partial(cache.attend_step, tree=tree))  # [R, N, T, dim]
        return self._logits(h[:, :, -1] if last_only else h)


# ---------------------------------------------------------------- weights: Hugging Face names
def layout(c):
    """[(a model parameter's name, its Hugging Face tensors [(name, shape)] one after another along its rows, the
    dim along which a tensor-parallel rank takes its chunk of each: None for all of it)] for every tensor c needs."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out = [("embed", [("model.embed_tokens.weight", (c.vocab_size, c.dim))], None),
           ("norm", [("model.norm.weight", (c.dim,))], None)]
    out += [] if c.tie_embeddings else [("lm_head", [("lm_head.weight", (c.vocab_size, c.dim))], None)]
    for i in range(c.n_layers):
        p, qkv = f"model.layers.{i}.", list(zip("qkv", (q, kv, kv)))
        out += [(f"layers.{i}.wqkv", [(p + f"self_attn.{x}_proj.weight", (n, c.dim)) for x, n in qkv], 0)]
        out += [(f"layers.{i}.bqkv", [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in qkv], 0)] * c.qkv_bias
        out += [(f"layers.{i}.wo", [(p + "self_attn.o_proj.weight", (c.dim, q))], 1),
                (f"layers.{i}.w13", [(p + f"mlp.{x}_proj.weight", (c.ffn_dim, c.dim)) for x in ("gate", "up")], 0),
                (f"layers.{i}.w2", [(p + "mlp.down_proj.weight", (c.dim, c.ffn_dim))], 1),
                (f"layers.{i}.attn_norm", [(p + "input_layernorm.weight", (c.dim,))], None),
                (f"layers.{i}.ffn_norm", [(p + "post_attention_layernorm.weight", (c.dim,))], None)]
    return out


def expected_shapes(c):
    """Every tensor the model needs, by its Hugging Face name."""
    return {name: shape for _, tensors, _ in layout(c) for name, shape in tensors}


def checked_getter(c, tensors, where):
    """Wrap tensors {name: (shape, fetch(index, dtype) -> tensor)} as get(name, part=(dim, k, n), dtype=None) -> the
    k-th of n equal chunks along dim of the tensor (default: all) in dtype (None: the file's), fetching only that chunk
    (a tuple of slices). dtype "format": the weight format holding the chunk as the file quantized it (int4 for 4-bit
    blocks, int8 for more bits, None for floats); "int4": those 4-bit blocks as int4's (q, scale_zero). Each tensor's
    presence and shape is checked first, from the headers, else a one-line LoadError before any weight is read."""
    shapes = expected_shapes(c)
    for name, shape in shapes.items():
        if name not in tensors:
            raise LoadError(f"{where}: missing tensor {name}")
        if tuple(tensors[name][0]) != shape:
            raise LoadError(f"{where}: tensor {name} has shape {tuple(tensors[name][0])}, expected {shape}")

    def get(name, part=(0, 0, 1), dtype=None):
        dim, k, n = part
        size = shapes[name][dim] // n
        return tensors[name][1]((slice(None),) * dim + (slice(k * size, (k + 1) * size),), dtype)
    return get


def held_in_int8(c, get):
    """The matmul weights ('layers.3.w2', 'lm_head') int4 holds in int8: a file's wider blocks (get's "format")."""
    return {"lm_head" if p == "embed" else p for p, tensors, _ in layout(c)
            if (p.endswith(MATMULS) or p == "embed" and c.tie_embeddings)
            and "int8" in {get(name, (0, 0, 1), "format") for name, _ in tensors}}


@torch.no_grad()
def fill_weights(model, get, rank=0, fmt=None):
    """Copy every tensor into the model, in RAM (never left memory-mapped) and its dtype, straight into its rows of the
    fused q/k/v and gate/up weights: no tensor is held twice in full (Qwen2.5-1.5B's GGUF embedding alone is 0.9 GB
    dequantized to float32). A tensor-parallel rank reads only its chunks (layout's); a terminal shows a progress bar (a
    big model takes a minute). With fmt int4, a matmul weight in 4-bit blocks in the file (get's "format") becomes int4
    as it is, one in more bits int8 (held_in_int8), not cut to 4: the returned {name: format}, for convert_weights."""
    from tqdm import tqdm
    total = sum(p.numel() for p in model.parameters())  # a tied head is the embedding: counted once
    held = dict.fromkeys(held_in_int8(model.config, get), "int8") if fmt == "int4" else {}
    with tqdm(total=total, desc="loading weights", unit="", unit_scale=True, leave=False, disable=None) as bar:
        for param, tensors, dim in layout(model.config):
            dst, at, part = model.get_parameter(param), 0, (0, 0, 1) if dim is None else (dim, rank, model.config.tp)
            kept = {get(name, part, "format") for name, _ in tensors} if fmt == "int4" else set()
            if param.endswith(MATMULS) and kept == {"int4"}:
                q, scale_zero = zip(*(get(name, part, "int4") for name, _ in tensors))
                owner, _, name = param.rpartition(".")
                replace(model.get_submodule(owner), name, Quantized(fmt, dst, (torch.cat(q), torch.cat(scale_zero, 1))))
                bar.update(dst.numel())
                continue
            for name, _ in tensors:
                t = get(name, part, dst.dtype)
                dst[at:at + len(t)] = t
                at += len(t)
                bar.update(t.numel())
    return held


# ---------------------------------------------------------------- weights: Hugging Face directories
def read_json(path):
    """The JSON object in path (each JSON file of a model directory holds one)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise LoadError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise LoadError(f"{path}: not a JSON object")
    return data


def shard_files(path):
    """A model directory's *.safetensors files, by its index if any: only relative paths inside it (no hostile absolute
    path or '..' opens files elsewhere); symlinks in it are followed (Hugging Face's cache links snapshots to blobs)."""
    if not os.path.isfile(index := os.path.join(path, "model.safetensors.index.json")):
        return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise LoadError(f"{index}: no weight_map of tensor names to file names")
    for f in set(weight_map.values()):
        if os.path.isabs(norm := os.path.normpath(f)) or norm.split(os.sep)[0] == "..":
            raise LoadError(f"{index}: shard {f!r} lies outside the model directory; refusing to open it")
    return sorted(set(weight_map.values()))


def open_hf_dir(path):
    """-> (Config, get(name, part, dtype) -> tensor, Tokenizer) for a directory with config.json, *.safetensors
    (single or sharded with model.safetensors.index.json) and tokenizer.json."""
    from safetensors import safe_open
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise LoadError(f"{path}: no config.json (expected a Hugging Face model directory or a .gguf file)")
    gen = os.path.join(path, "generation_config.json")
    more_eos = token_ids(read_json(gen).get("eos_token_id"), gen) if os.path.isfile(gen) else []
    c = config_from_hf(read_json(os.path.join(path, "config.json")), path, more_eos)
    if not (files := shard_files(path)):
        raise LoadError(f"{path}: no *.safetensors weights (pickled .bin/.pt checkpoints are not loaded)")

    def fetch(file, name, index, dtype=None):
        # A handle per read, dropped at once: one kept open keeps each page read resident beside the model's copy (twice
        # the weights' memory). get_slice reads only the chunk, a view of the mapping alive as long as the tensor.
        return None if dtype == "format" else safe_open(file, "pt").get_slice(name)[index].to(dtype)
    tensors = {}
    for file in (os.path.join(path, f) for f in files):
        try:
            f = safe_open(file, "pt")
        except Exception as e:
            raise LoadError(f"{file}: cannot read safetensors ({e})") from None
        tensors |= {name: (f.get_slice(name).get_shape(), partial(fetch, file, name)) for name in f.keys()}
    return c, checked_getter(c, tensors, path), Tokenizer.from_hf_dir(path)


# ---------------------------------------------------------------- weights: GGUF files
GGUF_NAMES = {"blk": "model.layers", "token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
              "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm"}
# GGUF value type -> its struct format, but for the two others: strings and arrays
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGUF_STRING, GGUF_ARRAY = 8, 9
GGUF_BLOCK = 2**22  # values dequantized at a time (16 MB of float32): the temporaries of a big tensor stay small
GGUF_INT4 = ("Q4_0", "Q4_1", "Q4_K")  # each group of 32 values a 4-bit code times a scale plus a low value: int4's
GGUF_FLOATS = ("F32", "F16", "BF16", "F64")
# Config field -> its GGUF metadata key, "{}" the architecture
GGUF_KEYS = {"dim": "{}.embedding_length", "n_layers": "{}.block_count", "n_heads": "{}.attention.head_count",
             "n_kv_heads": "{}.attention.head_count_kv", "head_dim": "{}.attention.key_length",
             "ffn_dim": "{}.feed_forward_length", "max_seq_len": "{}.context_length",
             "norm_eps": "{}.attention.layer_norm_rms_epsilon", "rope_theta": "{}.rope.freq_base"}


def hf_name(gguf_name):
    """'blk.3.attn_q.bias' -> 'model.layers.3.self_attn.q_proj.bias': each part as GGUF_NAMES renames it."""
    return ".".join(GGUF_NAMES.get(part, part) for part in gguf_name.split("."))


def unpermute_rope(w, heads):
    """llama.cpp interleaves the two rotary halves of each llama-arch Q/K head; undo it so one
    half-split RoPE serves every format. w [heads * D, ...]."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def q4_groups(raw, kind):
    """Rows of Q4_0, Q4_1 or Q4_K blocks, uint8 [n, bytes a row] -> (codes [n, columns] in 0..15, scale and low
    [n, columns / 32]): each group of 32 values is code x scale + low. As ggml lays them out: a block's codes are
    its last values / 2 bytes, runs of 16 (Q4_K: 32) low nibbles, then their high nibbles; before them its f16 d
    (the scale; Q4_K: d x each group's 6-bit sc), then Q4_1's f16 low m, Q4_K's dmin (low: -dmin x its 6-bit m)."""
    import gguf
    values, size = gguf.GGML_QUANT_SIZES[kind]
    b = torch.from_numpy(raw).view(len(raw), -1, size)  # [n, blocks, bytes a block]
    qs = b[..., size - values // 2:].unflatten(-1, (-1, 16 if values == 32 else 32))  # [n, blocks, runs, 16 | 32]
    codes = torch.stack([qs & 15, qs >> 4], -2).flatten(1)
    d, d2 = (b[..., i:i + 2].contiguous().view(torch.float16).float() for i in (0, 2))  # [n, blocks, 1] each
    if kind.name == "Q4_K":
        sc, m = (torch.from_numpy(x).view(len(b), -1, 8).float()
                 for x in gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12).numpy()))
        return codes, (d * sc).flatten(1), (-d2 * m).flatten(1)
    return codes, d.flatten(1), (-8 * d if kind.name == "Q4_0" else d2).flatten(1)


def dequantized(raw, kind):
    """Rows of GGUF blocks, uint8 [n, bytes a row] -> float32 [n, columns]. The types of Q4_K_M and Q5_0 files (Q4_*,
    Q5_0, Q6_K, Q8_0) in torch, 2-4x the gguf package's numpy, which does the others. Q5_0: 32 values of 4 low bits
    (qs) and a high bit (qh), minus 16, times d; Q6_K: 256 of 4 (ql) and 2 (qh), minus 32, times d x each 16's sc."""
    import gguf
    if kind.name not in GGUF_INT4 + ("Q5_0", "Q6_K", "Q8_0"):
        return torch.from_numpy(gguf.quants.dequantize(raw, kind))
    if kind.name in GGUF_INT4:
        codes, scale, low = q4_groups(raw, kind)
        return codes.unflatten(1, (-1, 32)).float().mul_(scale[..., None]).add_(low[..., None]).flatten(1)
    size = gguf.GGML_QUANT_SIZES[kind][1]
    b = torch.from_numpy(raw).view(len(raw), -1, size)  # [n, blocks, bytes a block]
    d = b[..., size - 2 if kind.name == "Q6_K" else 0:][..., :2].contiguous().view(torch.float16).float()
    if kind.name == "Q8_0":
        return b[..., 2:].view(torch.int8).float().mul_(d).flatten(1)
    if kind.name == "Q5_0":
        high = (b[..., 2:6, None] >> torch.arange(8, dtype=torch.uint8) & 1).flatten(-2)  # [n, blocks, 32] (bits)
        return (torch.cat([b[..., 6:] & 15, b[..., 6:] >> 4], -1) | high << 4).float().sub_(16).mul_(d).flatten(1)
    # Q6_K: in each half of 128, quarter j's low bits are ql[(j % 2) x 32 + l]'s nibble j // 2, its high qh >> 2j
    ql, qh = b[..., :128].unflatten(-1, (2, 2, 32)), b[..., 128:192].unflatten(-1, (2, 1, 32))
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    q = torch.stack([ql & 15, ql >> 4], -3).flatten(-3, -2) | (qh >> shifts & 3) << 4  # [n, blocks, half, j, l]
    scale = b[..., 192:208].view(torch.int8).unflatten(-1, (2, 4, 2, 1)) * d[..., None, None, None]  # per 16 values
    return q.unflatten(-1, (2, 16)).float().sub_(32).mul_(scale).flatten(1)


def read_gguf_header(path):
    """-> (metadata {key: value}, tensors {GGUF name: (shape, GGML type, file offset, bytes a row)}) from the header
    alone. Parsed here, not by gguf.GGUFReader: that builds a numpy view of every vocabulary string (13 s for Qwen2.5's
    150k tokens and merges: 18 s to open a draft and a target) and trusts every count, failing on a damaged one with
    'index 0 is out of bounds'. ValueError names the first count, length or offset the file's size makes impossible."""
    import gguf
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        pos = 0

        def unpack(fmt, field):
            nonlocal pos
            n = struct.calcsize("<" + fmt)
            if pos + n > size:
                raise ValueError(f"the file ends inside {field}")
            pos += n
            return struct.unpack_from("<" + fmt, data, pos - n)

        def count(field, item_bytes):  # of items of at least item_bytes each
            n = unpack("Q", field)[0]
            if n * item_bytes > size - pos:
                raise ValueError(f"{field} is {n}, more than the rest of the file holds")
            return n

        def value(vtype, field):
            nonlocal pos
            if vtype == GGUF_STRING:  # a vocabulary's tokens and merges are 300k of them: no more work than this
                n = count(field + " length", 1)
                pos += n
                return data[pos - n:pos].decode()
            if vtype == GGUF_ARRAY:
                itype = unpack("I", f"{field} element type")[0]
                n = count(f"{field} array length", struct.calcsize("<" + GGUF_SCALARS.get(itype, "Q")))
                if itype in GGUF_SCALARS:
                    return list(unpack(f"{n}{GGUF_SCALARS[itype]}", field))
                element = f"{field} element"
                return [value(itype, element) for _ in range(n)]
            if vtype in GGUF_SCALARS:
                return unpack(GGUF_SCALARS[vtype], field)[0]
            raise ValueError(f"{field} has unknown value type {vtype}")

        if unpack("4s", "the magic number")[0] != b"GGUF":
            raise ValueError("no GGUF magic number")
        version = unpack("I", "the version")[0]
        if version & 0xFFFF == 0:  # as gguf.GGUFReader decides; its tensors' blocks would need byte-swapping too
            raise LoadError(f"{path}: a big-endian GGUF file; convert it to a little-endian one")
        if version not in (2, 3):
            raise LoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = count("the tensor count", 24), count("the key-value count", 13)  # smallest entries
        meta, infos = {}, {}
        for i in range(n_kv):
            key = value(GGUF_STRING, f"metadata key {i}")
            meta[key] = value(unpack("I", f"the type of metadata {key!r}")[0], f"metadata {key!r}")
        for i in range(n_tensors):
            name = value(GGUF_STRING, f"tensor name {i}")
            if (n_dims := unpack("I", f"tensor {name!r} n_dims")[0]) > 4:
                raise ValueError(f"tensor {name!r} n_dims is {n_dims}, more than GGUF's 4")
            *dims, kind, offset = unpack(f"{n_dims}QIQ", f"tensor {name!r} dimensions, type and offset")
            if name in infos:
                raise ValueError(f"tensor {name!r} appears twice")
            infos[name] = dims, kind, offset
    align = meta.get("general.alignment", 32)
    if not (type(align) is int and align > 0 and align & (align - 1) == 0):
        raise ValueError(f"general.alignment is {align!r}, not a power of two")
    start, tensors = -(-pos // align) * align, {}
    for name, (dims, kind, offset) in infos.items():
        if kind not in gguf.GGML_QUANT_SIZES:
            raise ValueError(f"tensor {name!r} has unknown GGML type {kind}")
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        if not dims or 0 in dims or dims[0] % block:
            raise ValueError(f"tensor {name!r} has dimensions {dims}: rows must be whole blocks of {block}")
        row_bytes = dims[0] // block * block_bytes
        if start + offset + row_bytes * math.prod(dims[1:]) > size:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        tensors[name] = tuple(reversed(dims)), gguf.GGMLQuantizationType(kind), start + offset, row_bytes
    return meta, tensors


def open_gguf(path):
    """-> (Config, get(name, part, dtype) -> tensor by Hugging Face name (float32 unless dtype says otherwise),
    Tokenizer), reading the header only: tensors are read and dequantized when got."""
    import gguf
    import numpy as np

    class Metadata(dict):  # a missing required key is a one-line LoadError naming the file
        def __missing__(self, key):
            raise LoadError(f"{path}: GGUF metadata has no {key}")
    try:
        values, infos = read_gguf_header(path)
    except ValueError as e:
        raise LoadError(f"{path}: not a readable GGUF file, truncated or corrupt? ({e})") from None
    meta, found = Metadata(values), {hf_name(n): t for n, t in infos.items()}
    if (arch := meta.get("general.architecture")) not in ("llama", "qwen2"):
        raise LoadError(f"{path}: unsupported GGUF architecture {arch!r} (supported: llama, qwen2)")
    if "rope_freqs.weight" in found:
        raise LoadError(f"{path}: GGUF rope_freqs (llama3 rope scaling) is not supported; load the "
                        "Hugging Face directory instead")
    if (scaling := meta.get(f"{arch}.rope.scaling.type", "none")) not in ("none", "linear"):
        raise LoadError(f"{path}: GGUF rope scaling {scaling!r} is not supported (none, linear)")
    keys = {f: key.format(arch) for f, key in GGUF_KEYS.items()}
    defaults = {"n_kv_heads": meta[keys["n_heads"]], "head_dim": None, "rope_theta": 10000.0}
    sizes = {f: meta.get(key, defaults[f]) if f in defaults else meta[key] for f, key in keys.items()}
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    if "<|endoftext|>" in meta["tokenizer.ggml.tokens"]:  # instruct models still end plain completions with it
        eos.append(meta["tokenizer.ggml.tokens"].index("<|endoftext|>"))
    if "model.embed_tokens.weight" not in found:
        raise LoadError(f"{path}: missing tensor token_embd.weight")
    embed = found["model.embed_tokens.weight"][0]
    c = Config(arch=arch, vocab_size=embed[0] if len(embed) == 2 else None, **sizes,
               rope_scaling={"rope_type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
               if scaling == "linear" else None, tie_embeddings="lm_head.weight" not in found,
               qkv_bias=arch == "qwen2", bos_id=meta.get("tokenizer.ggml.bos_token_id"),
               eos_ids=list(dict.fromkeys(token_ids(eos, path))))
    c = checked_config(c, {"vocab_size": "token_embd.weight's row count", **keys}, path)
    if (rotary := meta.get(f"{arch}.rope.dimension_count", c.head_dim)) != c.head_dim:
        raise LoadError(f"{path}: {arch}.rope.dimension_count is {rotary!r}, not the head size {c.head_dim}: "
                        "partial rotary embeddings are not supported")
    for kind in {t[1] for t in found.values()}:  # one zero block of each type, so that none fails mid-load
        try:
            gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
        except NotImplementedError:
            raise LoadError(f"{path}: the gguf package cannot dequantize {kind.name} tensors; upgrade it") from None

    def read(name, first, n):  # the blocks of rows first .. first + n - 1: uint8 [n, bytes a row]
        _, kind, offset, row_bytes = found[name]
        return np.fromfile(path, np.uint8, n * row_bytes, offset=offset + first * row_bytes).reshape(n, row_bytes)

    def fetch(name, index, dtype=None):
        """Quantized blocks run along rows: a chunk of rows (q/k/v, gate/up of a tensor-parallel rank) dequantizes
        only those rows, a chunk of columns (o, down) every row, then keeps its columns. GGUF_BLOCK values at a
        time go into the result, so a big tensor is never held whole in float32, or twice. dtype "int4" (Q4 blocks
        only): (q [rows, columns], scale_zero [columns / 32, rows, 2]) as kernels.quantize_int4 gives them."""
        from tqdm import tqdm
        shape, kind = found[name][:2]
        if dtype == "format":
            return None if kind.name in GGUF_FLOATS else "int4" if kind.name in GGUF_INT4 else "int8"
        if len(shape) == 1:  # a norm or a bias: one short row
            return dequantized(read(name, 0, 1), kind)[0][index].to(dtype)
        four, rows, g = dtype == "int4", range(shape[0])[index[0]], kernels.INT4_GROUP
        out = torch.empty(torch.empty(shape, device="meta")[index].shape,
                          dtype=torch.int32 if four else dtype or torch.float32)
        groups = torch.empty(len(out), out.shape[1] // g, 2) if four else None  # [rows, columns / 32, (scale, zero)]
        step = c.head_dim * max(1, GGUF_BLOCK // (c.head_dim * shape[1]))  # whole heads: each block un-permutes alone
        permuted = arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))
        at_groups = (slice(None), *(slice(i.start // g, i.stop // g) for i in index[1:]))
        blocks = range(rows.start, rows.stop, step)
        for s in tqdm(blocks, desc=name, leave=False, disable=True if len(blocks) < 8 else None):
            raw, at = read(name, s, n := min(step, rows.stop - s)), slice(s - rows.start, s - rows.start + n)
            if four:  # the kernels' int4 value is (code - 8) x scale + zero
                w, scale, low = q4_groups(raw, kind)
                sz = torch.stack([scale, low + 8 * scale], -1)  # [n, columns / 32, 2]
                groups[at] = (unpermute_rope(sz, n // c.head_dim) if permuted else sz)[at_groups]
            else:
                w = dequantized(raw, kind)
            out[at] = (unpermute_rope(w, n // c.head_dim) if permuted else w)[(slice(None), *index[1:])]
        return (out, groups.transpose(0, 1)) if four else out
    tok = Tokenizer.from_gguf(meta, path)
    return c, checked_getter(c, {name: (t[0], partial(fetch, name)) for name, t in found.items()}, path), tok


# ---------------------------------------------------------------- tokenizer
# Pre-tokenizer regexes by llama.cpp's `tokenizer.ggml.pre` name, as in each model's own tokenizer.json.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def gguf_pre_tokenizer(name, where):
    from tokenizers import Regex, normalizers, pre_tokenizers as pre
    if name == "qwen2":
        return normalizers.NFC(), pre.Sequence([pre.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    if name == "smollm":
        return None, pre.Sequence([pre.Digits(individual_digits=True),
                                   pre.ByteLevel(add_prefix_space=False, use_regex=True)])
    raise LoadError(f"{where}: GGUF pre-tokenizer {name!r} is not supported (supported: qwen2, smollm)")


class Tokenizer:
    """A `tokenizers` BPE tokenizer plus what generation needs from around it: the chat template."""

    def __init__(self, tok, chat_template=None):
        self.tok, self.chat_template = tok, chat_template

    @classmethod
    def from_hf_dir(cls, path):
        from tokenizers import Tokenizer as HFTokenizer
        if not os.path.isfile(file := os.path.join(path, "tokenizer.json")):
            raise LoadError(f"{path}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(file)
        except Exception as e:
            raise LoadError(f"{file}: cannot read tokenizer ({e})") from None
        if os.path.isfile(template := os.path.join(path, "chat_template.jinja")):
            with open(template) as f:
                return cls(tok, f.read())
        config = os.path.join(path, "tokenizer_config.json")
        return cls(tok, read_json(config).get("chat_template") if os.path.isfile(config) else None)

    @classmethod
    def from_gguf(cls, meta, where):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, processors
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise LoadError(f"{where}: GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} is not "
                            "supported (byte-level BPE, 'gpt2', only)")
        normalizer, pre = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"), where)
        tokens, types, merges = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "merges"))
        try:  # a damaged vocabulary fails in `tokenizers` (a merge of unknown tokens) or here (a bos id past the end)
            merges = [tuple(m.split(" ", 1)) for m in merges]
            tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
            tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre, decoders.ByteLevel()
            # llama.cpp token types: 3 = control (special), 4 = user-defined (added, matched verbatim)
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty == 3])
            tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
            bos = meta.get("tokenizer.ggml.bos_token_id")
            if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
                tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                                   special_tokens=[(tokens[bos], bos)])
        except Exception as e:
            raise LoadError(f"{where}: damaged GGUF tokenizer ({e})") from None
        return cls(tok, meta.get("tokenizer.chat_template"))

    def encode(self, text):
        return self.tok.encode(text).ids

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)


# ---------------------------------------------------------------- loading
def open_weights(path):
    """-> (Config, get (checked_getter's), Tokenizer) for a Hugging Face directory or a .gguf file."""
    if not os.path.exists(path := os.fspath(path)):
        raise LoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return open_hf_dir(path)
    if path.endswith(".gguf"):
        return open_gguf(path)
    raise LoadError(f"{path}: not a model directory or a .gguf file")


def build(c, get, device="cpu", dtype=None, tp=(0, 1), weights=None, wider=True):
    """-> Transformer with every weight from get(name) in memory on `device`, its matmul weights in format `weights`
    (FORMATS; None: dtype's, bf16 unless dtype is torch.float32) and its activations in that format's dtype; with
    tp = (rank, world), the rank's tensor-parallel shard of it (shard_config), reading only the rank's chunks.
    wider=False: int4 even where a GGUF file has more bits (a draft's: its format changes only the proposals)."""
    weights = weights or ("float32" if dtype == torch.float32 else "bf16")
    model = Transformer(shard_config(c, tp[1]), device, weight_format(weights, device))
    held = fill_weights(model, get, tp[0], weights)
    convert_weights(model, weights, held if wider else None)
    return model


def load(path, device="cpu", dtype=None, tp=(0, 1), weights=None):
    """-> (Transformer, Tokenizer) with every weight (of rank tp[0] of tp[1]) in memory on `device` (build's)."""
    weight_format(weights or "bf16", device)
    c, get, tok = open_weights(path)
    return build(c, get, device, dtype, tp, weights), tok
