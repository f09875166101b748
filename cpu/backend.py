"""The CPU's Backend: kernels.Backend's calls, each by what runs fastest on a CPU. The compiled kernels of native.py
(w4a8's matmuls, fused with the norm, RoPE or SwiGLU around them; a step's attention; a decoder layer's step in one
call; sampling), torch's oneDNN and fused CPU attention elsewhere, and kernels.py's references where the compiled
code cannot be built here. Each is held to its reference by the tests."""
import functools
import logging
import weakref

import torch
import torch.nn.functional as F

import kernels
from cpu import native

log = logging.getLogger("smcsd")
_cpu_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (out, log-sum-exp)
WIDE_ROWS = 64  # rows from which a bf16 matmul that oneDNN cannot pack runs in float32 (no bf16 arithmetic here)


def prefill_attention(q, k, v, scale):
    """kernels.prefill_attention's contract on a CPU: in blocks of query tokens, a KV group's rows of a block one
    matrix against the keys up to the block's end (torch's fused CPU attention is slower there). Scores in float32
    (bf16 scores widen the logits' KL divergence), probabilities in q's dtype."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    block = max(1, min(128, 2**23 // (Hq * T)))  # query tokens: more spill the float32 scores out of cache
    qg = q.view(T, Hkv, G, D).transpose(0, 1)  # [Hkv, T, G, D]
    kf = k.transpose(0, 1).float()  # [Hkv, T, D]
    vt = v.transpose(0, 1)  # [Hkv, T, D]
    out = torch.empty_like(q)
    for s in range(0, T, block):
        e = min(s + block, T)
        rows = qg[:, s:e].reshape(Hkv, (e - s) * G, D).float()  # ordered (token, head)
        scores = (rows @ kf[:, :e].mT).mul_(scale)  # [Hkv, (e - s) * G, e]
        token = torch.arange(e - s, device=q.device).repeat_interleave(G)  # the block's own keys: the only ones masked
        scores[..., s:].masked_fill_(torch.arange(e - s, device=q.device) > token[:, None], float("-inf"))
        o = scores.softmax(-1).to(q.dtype) @ vt[:, :e]  # [Hkv, (e - s) * G, D]
        out[s:e] = o.view(Hkv, e - s, G, D).transpose(0, 1).reshape(e - s, Hq, D)
    return out


@functools.lru_cache(maxsize=64)
def causal_mask(T, G, S, dtype, device):
    """The suffix pass's additive mask [T * G, S], rows ordered (token, head): new token t sees the keys up to its
    own, S - T + t. Made once for every layer and step of a shape (read only)."""
    token = torch.arange(T * G, device=device) // G
    future = torch.arange(S, device=device) > S - T + token[:, None]
    return torch.zeros(future.shape, dtype=dtype, device=device).masked_fill_(future, float("-inf"))


def particle_attention_cpu(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree=None):
    """`kernels.particle_attention_ref`'s contract, fast on CPU: two calls of torch's fused CPU attention (each row's
    log-sum-exp too). Prefix pass: a KV group's rows of all particles as one matrix, the prompt read once. Suffix
    pass: each particle against its own suffix, causal or by the tree. Prefix mass share: sigmoid(lse_prefix -
    lse_suffix)."""
    R, N, T, Hq, D = q.shape
    Hkv = prefix_k.shape[1]
    G = Hq // Hkv
    out = torch.empty_like(q)
    for r, (P, S) in enumerate(zip(prefix_len.tolist(), suffix_len.tolist())):
        S += T
        qr = q[r].view(N, T, Hkv, G, D)
        mask = None  # one new token a particle (a step) sees every key
        if tree is not None:  # the committed keys seen by all, the new ones where the tree says
            future = F.pad(~tree[r, torch.arange(T * G, device=q.device) // G], (S - T, 0))
            mask = torch.zeros(future.shape, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf"))
        elif T > 1:
            mask = causal_mask(T, G, S, q.dtype, q.device)
        o, lse = _cpu_attention(qr.transpose(1, 2).reshape(N, Hkv, T * G, D), suffix_k[r, :, :, :S],
                                suffix_v[r, :, :, :S], attn_mask=mask, scale=scale)  # [N, Hkv, T * G, D], [.., T * G]
        if P:  # the fused op crashes on no keys: a one-token prompt leaves the draft's prefix empty
            rows = qr.permute(2, 0, 1, 3, 4).reshape(1, Hkv, N * T * G, D)  # every particle's, per KV group
            op, lp = _cpu_attention(rows, prefix_k[r:r + 1, :, :P], prefix_v[r:r + 1, :, :P], scale=scale)
            op, lp = op.view(Hkv, N, T * G, D).transpose(0, 1), lp.view(Hkv, N, T * G, 1).transpose(0, 1)
            o = torch.lerp(o.float(), op.float(), torch.sigmoid(lp - lse[..., None]))
        out[r] = o.view(N, Hkv, T, G, D).transpose(1, 2).reshape(N, T, Hq, D)
    return out


@functools.cache
def say_once(line):
    """line on the "smcsd" log, the first time it is said only."""
    log.info(line)


def w4a8(w):
    """Whether matmul weight w is w4a8's, which the compiled kernel multiplies (with the norm or gate around it)."""
    return getattr(w, "fmt", None) == "w4a8"


class Backend(kernels.Backend):
    """kernels.Backend for a CPU: its references replaced where native.py or torch's CPU kernels run faster, with the
    same results (float32 sums in another order)."""

    def __init__(self):
        self.lib = native.library()[0]  # None: no compiler here, the references serve
        self.layers = weakref.WeakKeyDictionary()  # model.Block -> (its weights, native.Layer of them)

    def linear(self, x, w, bias=None):
        """A plain, oneDNN-packed (formats.packed) or module weight; bf16 that oneDNN cannot pack costs F.linear as
        much a row at any row count, so many rows run in float32."""
        if isinstance(w, torch.nn.Module):
            return w.forward(x, bias)
        if w.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        if w.dtype == torch.bfloat16 and x.numel() >= WIDE_ROWS * x.shape[-1]:
            wide_bias = None if bias is None else bias.float()
            return F.linear(x.float(), w.float(), wide_bias).to(x.dtype)
        return F.linear(x, w, bias)

    def normed_linear(self, x, norm, eps, w, bias=None, rope=None):
        """w4a8 normalises and rotates in its kernel's call."""
        if w4a8(w):
            return w.normed(x, norm, eps, bias, rope)
        return super().normed_linear(x, norm, eps, w, bias, rope)

    def residual_normed_linear(self, x, y, norm, eps, w):
        """w4a8 normalises in its kernel's call."""
        if w4a8(w):
            s = y.add_(x)  # y, the caller's new matmul rows, takes the sum: a long prompt's rows allocated once fewer
            return s, w.normed(s, norm, eps)
        return super().residual_normed_linear(x, y, norm, eps, w)

    def gated_linear(self, x, w):
        """w4a8 gates the rows in its kernel's pass over them."""
        if w4a8(w):
            return w.gated(x)
        return super().gated_linear(x, w)

    prefill_attention = staticmethod(prefill_attention)

    def particle_attention(self, q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree=None):
        """A float32 request's few rows by the compiled kernel, the rest by torch's fused attention."""
        args = (q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree)
        if self.lib is None or q.dtype != torch.float32:
            return particle_attention_cpu(*args)
        return native.particle_attention(*args, large=particle_attention_cpu)

    def sample(self, logits, temperature, rng):
        """kernels.sample_ref's draw (the same uniforms) by the compiled code, without its [B, V] temporaries."""
        if self.lib is None or logits.dtype != torch.float32:
            return kernels.sample_ref(logits, temperature, rng)
        B = logits.shape[0]
        R = rng.shape[0]
        t = kernels._per_row(kernels._temperatures(temperature, logits.device, R), B)  # [B]
        u = kernels._uniforms(rng, B // R)[:, 0]  # [B]
        return native.sample(logits.contiguous(), t.contiguous(), u)

    def token_logprobs(self, logits, tokens, temperature):
        """kernels.token_logprobs_ref by the compiled code, in one pass over each row and no temporaries."""
        if self.lib is None or logits.dtype != torch.float32:
            return kernels.token_logprobs_ref(logits, tokens, temperature)
        t = kernels._per_row(kernels._temperatures(temperature, logits.device), logits.shape[0])  # [B]
        return native.token_logprobs(logits.contiguous(), tokens.long().contiguous(), t.contiguous())

    def fused_layers(self, blocks, x, cache, tree=None):
        """-> native.fused_step's (what each layer's call shares) where every layer of a step of x [R, N, T, dim] runs
        in one call of the compiled code: its four matmuls w4a8, one rank holds them, no q/k head norms, and every
        request's attention the compiled kernel's (native.small, up to FUSED_ATTENTION); else None: each layer by its
        block's calls."""
        _, N, T, _ = x.shape
        c = blocks[0].c
        if c.qk_norm and w4a8(blocks[0].wqkv):
            say_once(f"{c.arch}'s q and k head norms are not in the compiled decoder layer: its calls run one by one")
        if self.lib is None or c.tp > 1 or c.qk_norm or cache.prefix_k.dtype != torch.float32:
            return None
        layers = []
        for block in blocks:
            layer = self.layer_of(block)
            if layer is None:
                return None
            layers.append(layer)
        keys = int((cache.prefix_len + cache.suffix_len).max()) + T  # CPU memory: reading it waits for nothing
        if not native.small(N * T * c.n_heads // c.n_kv_heads, keys, native.FUSED_ATTENTION):
            return None
        caches = (cache.prefix_k, cache.prefix_v, cache.suffix_k, cache.suffix_v, cache.prefix_len, cache.suffix_len)
        return native.fused_step(x, layers, *caches, tree)

    def layer(self, block, i, x, cos, sin, attend, fused=None):
        """Layer i in one call of the compiled code where the step's layers run so (fused): the same arithmetic as
        the block's calls."""
        if fused is None:
            return block.forward(x, cos, sin, attend, i)
        return native.decoder_layer(fused, i, x, cos, sin)

    def layer_of(self, block):
        """-> native.Layer of block's w4a8 weights, norms, bias and shapes (by address), made once for these weights;
        None where a matmul is not w4a8."""
        weights = (block.wqkv, block.wo, block.w13, block.w2)
        if not all(w4a8(w) for w in weights):
            return None
        tensors = (block.attn_norm, block.ffn_norm, block.bqkv)
        key = (*weights, *(None if t is None else t.data_ptr() for t in tensors))
        kept = self.layers.get(block)
        if kept is None or kept[0] != key:
            kept = (key, layer_struct(block))
            self.layers[block] = kept
        return kept[1]


def layer_struct(block):
    """-> native.Layer: a block's w4a8 weights, norms, bias and shapes, by address."""
    c = block.c
    return native.Layer(qkv=block.wqkv.matmul(c.dim, block.bqkv), wo=block.wo.matmul(c.n_heads * c.head_dim),
                        w13=block.w13.matmul(c.dim), w2=block.w2.matmul(c.ffn_dim),
                        attn_norm=block.attn_norm.data_ptr(), ffn_norm=block.ffn_norm.data_ptr(), eps=c.norm_eps,
                        scale=c.head_dim ** -0.5, Hq=c.n_heads, Hkv=c.n_kv_heads, D=c.head_dim)
