"""A Llama-family decoder (llama, qwen2, qwen3, mistral) from scratch: its Config and the checks of one, tensor-parallel
sharding, rotary embeddings, the static prefix/suffix KV cache, the Transformer, and its tensors by their Hugging
Face names. Reading weights is loading.py's; holding them in a weight format formats.py's; running its operations
the Backend's it is built with (kernels.py's, or the CPU wing's)."""
import dataclasses
import datetime
import math
import os
from functools import partial

import torch

import kernels
from errors import LoadError


# ---------------------------------------------------------------- config
@dataclasses.dataclass
class Config:
    arch: str  # "llama" | "qwen2" | "qwen3" | "mistral" (Hugging Face model_type)
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...} as in Hugging Face, or "factors"
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # qwen3: an RMSNorm over each head of q and of k, after the projection, before RoPE
    max_seq_len: int = 4096
    bos_id: int | None = None
    eos_ids: list = dataclasses.field(default_factory=list)
    tp: int = 1  # tensor-parallel ranks: n_heads, n_kv_heads and ffn_dim are one rank's share (shard_config)


# "factors": a GGUF's rope_freqs (llama.cpp's form of llama3's), each of the head_dim / 2 frequencies divided by one
ROPE_KEYS = {"linear": ("factor",), "factors": (),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
REAL_FIELDS = ("norm_eps", "rope_theta")  # the sizes that need not be integers


def check_positive(x, integer, name, where):
    """A LoadError unless x is a positive integer (integer false: a positive finite number)."""
    if integer:
        valid = type(x) is int
    else:
        valid = type(x) in (int, float) and math.isfinite(x)
    if not valid or x <= 0:
        kind = "integer" if integer else "number"
        raise LoadError(f"{where}: {name} is {x!r}, expected a positive {kind}")


def checked_config(c, names, where):
    """c with every size a positive integer (head_dim derived if absent) and the heads grouping evenly, else a LoadError
    naming the field as the file spells it (names: Config field -> that name): no ZeroDivisionError or negative size
    from a damaged or hostile file."""
    for f, name in names.items():
        if not (f == "head_dim" and c.head_dim is None):
            check_positive(getattr(c, f), f not in REAL_FIELDS, name, where)
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
    scaling = c.rope_scaling or {}
    for key in ROPE_KEYS.get(scaling.get("rope_type"), ()):
        check_positive(scaling.get(key), key == "original_max_position_embeddings", f"rope scaling {key}", where)
    if scaling.get("factor", 1) < 1:  # a factor below 1 would speed positions up, which no scaling means
        raise LoadError(f"{where}: rope scaling factor is {scaling['factor']!r}, expected at least 1")
    factors = scaling.get("factors")
    if factors is not None and len(factors) != c.head_dim // 2:
        raise LoadError(f"{where}: rope_freqs holds {len(factors)} factors, expected head_dim / 2 = {c.head_dim // 2}")
    for factor in factors or ():
        check_positive(factor, False, "a rope_freqs factor", where)
    if scaling.get("rope_type") == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise LoadError(f"{where}: rope scaling high_freq_factor ({scaling['high_freq_factor']}) must exceed "
                        f"low_freq_factor ({scaling['low_freq_factor']})")  # the llama3 ramp divides by their gap
    special = [("eos", i) for i in c.eos_ids]
    if c.bos_id is not None:
        special.insert(0, ("bos", c.bos_id))
    for what, i in special:
        if not (type(i) is int and 0 <= i < c.vocab_size):  # the engine indexes a [vocab] table with them
            raise LoadError(f"{where}: {what} token id {i!r} lies outside the vocabulary of {c.vocab_size}")
    c.rope_theta = float(c.rope_theta)
    return c


# ---------------------------------------------------------------- tensor parallel
# Megatron layout: q/k/v and gate/up split by output rows (heads, FFN columns), o and down by input columns, their
# partial sums all-reduced; the KV cache split by KV head. Embedding and LM head stay whole on every rank: split by
# vocabulary, they would halve a rank's weights but not the time of a step (the all-reduces bound it) and would need
# an all-gather and a vocabulary the ranks divide. A draft stays whole: K one-row steps a cycle, each would pay two
# all-reduces a layer to save little reading.

def init_distributed(device):
    """-> (rank, world). Under torchrun (WORLD_SIZE > 1) joins the default process group, once: gloo for a CPU
    device, nccl for CUDA (None: CUDA when there is one). The timeout ends the other ranks when one dies."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1
    if not torch.distributed.is_initialized():
        cuda = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if cuda else "gloo"
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    return torch.distributed.get_rank(), world


SHARDED = ("n_heads", "n_kv_heads", "ffn_dim")  # the Config fields a tensor-parallel rank holds a share of


def shard_config(c, world):
    """The Config of one of `world` tensor-parallel ranks: its share of the heads, KV heads and FFN columns."""
    for n, what in ((c.n_kv_heads, "KV heads"), (c.n_heads, "attention heads"), (c.ffn_dim, "FFN columns")):
        if n % world:
            fits = [d for d in range(1, c.n_kv_heads + 1) if c.n_kv_heads % d == c.n_heads % d == c.ffn_dim % d == 0]
            raise LoadError(f"--nproc-per-node {world} does not divide the target's {n} {what}; use "
                            f"{' or '.join(map(str, fits))}")
    shares = {f: getattr(c, f) // world for f in SHARDED}
    return dataclasses.replace(c, tp=world, **shares)


# ---------------------------------------------------------------- rotary embeddings
def rope_tables(c, device):
    """cos, sin [max_seq_len, head_dim] in float32, half-split (Hugging Face) layout, sin's first half negated: the
    sign of rotate_half(x) = cat(-x2, x1) folded in, so that kernels.apply_rope rotates with a roll."""
    inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
    scaling = c.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        inv = inv / scaling["factor"]
    elif scaling.get("rope_type") == "factors":
        inv = inv / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif scaling.get("rope_type") == "llama3":  # long wavelengths slowed by `factor`, short kept, a smooth ramp between
        old_context = scaling["original_max_position_embeddings"]
        low = scaling["low_freq_factor"]
        high = scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv
        ramp = ((old_context / wavelength - low) / (high - low)).clamp(0, 1)
        inv = (1 - ramp) * inv / scaling["factor"] + ramp * inv
    angles = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float64), inv)  # [T, D / 2]
    sin = torch.cat([-angles.sin(), angles.sin()], -1)  # [T, D]
    return angles.repeat(1, 2).cos().float().to(device), sin.float().to(device)


# ---------------------------------------------------------------- KV cache
class KVCache:
    """Static cache for R requests x N particles, a request's particles at one position: prefix_k/v [L, R, Hkv, P, D]
    hold each prompt once, suffix_k/v [L, R, N, Hkv, S, D] each particle's generated tokens. prefix_len/suffix_len [R]
    live on the device (decoding needs no host sync); the model writes new K/V at suffix_len, the caller advances it."""

    def __init__(self, c, particles, prefix_cap, suffix_cap, device, dtype, requests=1):
        shape_p = (c.n_layers, requests, c.n_kv_heads, prefix_cap, c.head_dim)
        shape_s = (c.n_layers, requests, particles, c.n_kv_heads, suffix_cap, c.head_dim)
        self.prefix_k = torch.zeros(shape_p, device=device, dtype=dtype)
        self.prefix_v = torch.zeros(shape_p, device=device, dtype=dtype)
        self.suffix_k = torch.zeros(shape_s, device=device, dtype=dtype)
        self.suffix_v = torch.zeros(shape_s, device=device, dtype=dtype)
        self.prefix_len = torch.zeros(requests, dtype=torch.int32, device=device)
        self.suffix_len = torch.zeros(requests, dtype=torch.int32, device=device)

    @staticmethod
    def nbytes(c, particles, prefix_cap, suffix_cap, dtype, requests=1):
        per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * torch.empty((), dtype=dtype).element_size()
        return requests * per_token * (prefix_cap + particles * suffix_cap)

    def attend_prefill(self, layer, q, k, v, scale, r, attention):
        """q [T, Hq, D], k/v [T, Hkv, D] at positions 0..T-1 of request r's prompt; attention: the backend's."""
        self.prefix_k[layer, r, :, :len(q)] = k.transpose(0, 1)
        self.prefix_v[layer, r, :, :len(q)] = v.transpose(0, 1)
        return attention(q, k, v, scale)

    def attend_step(self, layer, q, k, v, scale, at, tree, attention):
        """q [R, N, T, Hq, D], k/v [R, N, T, Hkv, D] at suffix positions suffix_len .. suffix_len+T-1 (at: those
        positions, int64 [R, N, Hkv, T, D]); tree bool [R, T, T] (None: causal): new token t sees new token j iff
        tree[r, t, j]; attention: the backend's particle attention."""
        self.suffix_k[layer].scatter_(3, at, k.transpose(2, 3))
        self.suffix_v[layer].scatter_(3, at, v.transpose(2, 3))
        return attention(q, self.prefix_k[layer], self.prefix_v[layer], self.suffix_k[layer], self.suffix_v[layer],
                         self.prefix_len, self.suffix_len, scale, tree)


# ---------------------------------------------------------------- transformer
class Block(torch.nn.Module):
    """A decoder layer: attention and the SwiGLU FFN, each after its RMSNorm, each added to the residual stream."""

    def __init__(self, c, empty, backend):  # empty(*shape): an uninitialised parameter
        super().__init__()
        qkv_rows = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim  # wqkv: q, k and v fused, one matmul reads them all
        self.attn_norm = empty(c.dim)
        self.ffn_norm = empty(c.dim)
        self.wqkv = empty(qkv_rows, c.dim)
        self.bqkv = empty(qkv_rows) if c.qkv_bias else None
        self.qk_norm = empty(2 * c.head_dim) if c.qk_norm else None  # q's head norm, then k's: fused as wqkv is
        self.wo = empty(c.dim, c.n_heads * c.head_dim)
        self.w13 = empty(2 * c.ffn_dim, c.dim)  # gate and up projections fused
        self.w2 = empty(c.dim, c.ffn_dim)
        self.c = c
        self.backend = backend

    def forward(self, x, cos, sin, attend, layer):
        """x [..., T, dim] -> the layer's output; attend(layer, q, k, v, scale) is the cache's. Under tensor
        parallelism wo and w2 give this rank's heads' and columns' partial sums, all-reduced into the whole."""
        c = self.c
        rope = (cos, sin, c.n_heads + c.n_kv_heads)  # q and k rotated, v as it is
        if self.qk_norm is None:
            qkv = self.backend.normed_linear(x, self.attn_norm, c.norm_eps, self.wqkv, self.bqkv, rope)
        else:  # each head of q and of k normalised between the projection and RoPE
            qkv = self.backend.normed_linear(x, self.attn_norm, c.norm_eps, self.wqkv, self.bqkv)
            qkv = self.backend.qk_norm_rope(qkv, cos, sin, c.n_heads, c.n_kv_heads, self.qk_norm, c.norm_eps)
        q, k, v = qkv.unflatten(-1, (-1, c.head_dim)).split([c.n_heads, c.n_kv_heads, c.n_kv_heads], -2)
        attended = self.backend.linear(attend(layer, q, k, v, c.head_dim ** -0.5).flatten(-2), self.wo)
        if c.tp > 1:
            torch.distributed.all_reduce(attended)
        x, up = self.backend.residual_normed_linear(x, attended, self.ffn_norm, c.norm_eps, self.w13)
        out = self.backend.gated_linear(up, self.w2)  # up [..., 2 ffn]: gate | up
        if c.tp > 1:
            torch.distributed.all_reduce(out)
        return out.add_(x)  # into the FFN's new rows: no new tensor of the stream's size


class Transformer(torch.nn.Module):
    """backend: what runs its operations (kernels.Backend, or the CPU wing's), chosen once by whoever builds it."""

    def __init__(self, c, device="cpu", dtype=torch.bfloat16, backend=None):
        super().__init__()
        self.config = c
        self.backend = backend or kernels.for_device(device)

        def empty(*shape):
            return torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)
        self.embed = empty(c.vocab_size, c.dim)
        self.layers = torch.nn.ModuleList(Block(c, empty, self.backend) for _ in range(c.n_layers))
        self.norm = empty(c.dim)
        self.lm_head = self.embed if c.tie_embeddings else empty(c.vocab_size, c.dim)
        cos, sin = rope_tables(c, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def device(self):
        return self.embed.device

    def num_params(self):  # of this rank's shard under tensor parallelism, as weight_bytes; in any format
        return sum(math.prod(shape) for shape in expected_shapes(self.config).values())

    def weight_bytes(self):
        """Bytes one full forward reads from weights (a tensor-parallel rank's: its shard's), all but the embedding
        table's (a few rows read) unless that is also the head: the memory-bandwidth roofline's numerator."""
        read = [p for name, p in self.named_parameters() if name.partition(".")[0] != "embed" or p is self.lm_head]
        return sum(p.numel() * p.element_size() for p in read)

    def _logits(self, h):
        """h [..., dim], the last layer's output -> float32 logits [..., V], after the final norm."""
        return self.backend.normed_linear(h, self.norm, self.config.norm_eps, self.lm_head).float()

    @torch.inference_mode()
    def prefill(self, tokens, cache, r=0, logits="last", on_layer=None):
        """tokens [T] -> logits [V] of the last position, [T, V] of all (logits="all") or None (logits=None: the LM head
        is skipped, as a draft's prefill needs) for request r's prompt. Sets prefix_len[r] = T and suffix_len[r] = 0.
        on_layer(done, layers): called before the first layer (done 0) and after each, a long prompt's progress."""
        cos = self.cos[:len(tokens), None]  # [T, 1, D]
        sin = self.sin[:len(tokens), None]
        attend = partial(cache.attend_prefill, r=r, attention=self.backend.prefill_attention)
        h = self.embed[tokens]  # [T, dim]
        if on_layer:
            on_layer(0, len(self.layers))
        for i, block in enumerate(self.layers):
            h = block.forward(h, cos, sin, attend, i)
            if on_layer:
                on_layer(i + 1, len(self.layers))
        cache.prefix_len[r] = len(tokens)
        cache.suffix_len[r] = 0
        if logits is None:
            return None
        return self._logits(h if logits == "all" else h[-1])

    @torch.inference_mode()
    def step(self, tokens, cache, last_only=False, depth=None, tree=None):
        """tokens [R, N, T] continue every particle at suffix_len -> logits [R, N, T, V] (float32), or only the
        last position's [R, N, V]. Writes their K/V at suffix_len .. suffix_len+T-1; advancing suffix_len is
        the caller's choice. A token tree (None: a chain): depth int64 [R, T] puts new token t at position
        prefix_len + suffix_len + depth[r, t], not + t; tree bool [R, T, T]: it sees new token j iff tree[r, t, j]."""
        T = tokens.shape[-1]
        offset = torch.arange(T, device=tokens.device) if depth is None else depth  # [T] | [R, T]
        pos = (cache.prefix_len + cache.suffix_len).long()[:, None] + offset  # [R, T]
        per_particle = (-1, tokens.shape[1], -1, -1, -1)  # a row of them for each row of x, as w4a8's call reads them
        cos = self.cos[pos][:, None, :, None].expand(per_particle).contiguous()  # [R, N, T, 1, D]
        sin = self.sin[pos][:, None, :, None].expand(per_particle).contiguous()
        _, R, N, H, _, D = cache.suffix_k.shape
        at = cache.suffix_len.long()[:, None] + torch.arange(T, device=tokens.device)  # [R, T]
        at = at[:, None, None, :, None].expand(R, N, H, T, D)  # where the new K/V go in every layer's suffix
        attend = partial(cache.attend_step, at=at, tree=tree, attention=self.backend.particle_attention)
        h = self.embed[tokens]  # [R, N, T, dim]
        fused = self.backend.fused_layers(self.layers, h, cache, tree)  # None: each layer by its block's calls
        for i, block in enumerate(self.layers):
            h = self.backend.layer(block, i, h, cos, sin, attend, fused)
        return self._logits(h[:, :, -1] if last_only else h)


# ---------------------------------------------------------------- its tensors by Hugging Face name
def layout(c):
    """[(a model parameter's name, its Hugging Face tensors [(name, shape)] one after another along its rows, the
    dim along which a tensor-parallel rank takes its chunk of each: None for all of it)] for every tensor c needs."""
    q = c.n_heads * c.head_dim
    kv = c.n_kv_heads * c.head_dim
    out = [("embed", [("model.embed_tokens.weight", (c.vocab_size, c.dim))], None),
           ("norm", [("model.norm.weight", (c.dim,))], None)]
    if not c.tie_embeddings:
        out.append(("lm_head", [("lm_head.weight", (c.vocab_size, c.dim))], None))
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        qkv = list(zip("qkv", (q, kv, kv)))
        out.append((f"layers.{i}.wqkv", [(p + f"self_attn.{x}_proj.weight", (n, c.dim)) for x, n in qkv], 0))
        if c.qkv_bias:
            out.append((f"layers.{i}.bqkv", [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in qkv], 0))
        if c.qk_norm:  # per head: every tensor-parallel rank holds them whole
            out.append((f"layers.{i}.qk_norm", [(p + f"self_attn.{x}_norm.weight", (c.head_dim,)) for x in "qk"], None))
        out += [(f"layers.{i}.wo", [(p + "self_attn.o_proj.weight", (c.dim, q))], 1),
                (f"layers.{i}.w13", [(p + f"mlp.{x}_proj.weight", (c.ffn_dim, c.dim)) for x in ("gate", "up")], 0),
                (f"layers.{i}.w2", [(p + "mlp.down_proj.weight", (c.dim, c.ffn_dim))], 1),
                (f"layers.{i}.attn_norm", [(p + "input_layernorm.weight", (c.dim,))], None),
                (f"layers.{i}.ffn_norm", [(p + "post_attention_layernorm.weight", (c.dim,))], None)]
    return out


def expected_shapes(c):
    """Every tensor the model needs, by its Hugging Face name."""
    return {name: shape for _, tensors, _ in layout(c) for name, shape in tensors}
