"""Triton kernels, each beside the few-line PyTorch reference that documents it: attention over particles, sampling,
resampling, the suffix gather, the int8 / int4 matmuls; and the Backend, what a model and its cycles call: the
references, or the kernels (TritonBackend), chosen once per device. The methods' own rules live in decode.py; the CPU's
own kernels in the CPU wing (cpu/backend.py)."""
import functools
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    jit = triton.jit
except ImportError:  # the references serve everywhere
    triton = None
    tl = SimpleNamespace(constexpr=None)

    def jit(fn):
        return fn


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # triton reads it when a kernel is defined
LOG2E = 1.4426950408889634
MAX_SPLITS = 16  # KV splits of an attention pass at most: enough to fill a GPU


# Triton for CUDA tensors, and for CPU ones if TRITON_INTERPRET=1 was set before import (the tests); else, or without
# triton (no macOS wheels), the reference.
def use_triton(t):
    """The one dispatch rule between a kernel and its reference, by the tensor t its call takes."""
    return triton is not None and (t.is_cuda or INTERPRET)


def make_rng(seed, device):
    """The device-side rng of sampling calls: int64 [R, 2], row r = (seed_r, counter 0), from a seed list or an int.
    Request r owns data rows [r*M, (r+1)*M) of B = R*M. Each drawing call (`sample`, `resample`) keys request r's
    numbers on its own row and the data row's index in the request, then adds 1 to every counter on the device: batching
    never changes a request's draws, a CUDA-graph replay draws fresh noise, the same seed replays the same run. Triton's
    Philox numbers and the references' torch generators agree in distribution, not draw for draw."""
    seeds = [seed] if isinstance(seed, int) else seed
    return torch.tensor([[s, 0] for s in seeds], dtype=torch.int64, device=device)


def _uniforms(rng, M):
    """float32 [R * M, 1] for the references: request r's M rows from a generator keyed on rng[r]; counters + 1."""
    rows = []
    for s, c in rng.tolist():
        g = torch.Generator(rng.device).manual_seed((s * 0x9E3779B97F4A7C15 + c) % 2**64)
        rows.append(torch.rand(M, 1, generator=g, device=rng.device))
    rng[:, 1] += 1
    return torch.cat(rows)


def _temperatures(temperature, device, R=None):
    """Temperature per request, float32 [R]: a tensor as is, a float for all R (R = None: the tensor's length, or 1)."""
    if torch.is_tensor(temperature):
        assert R in (None, len(temperature)), "one temperature per request"
        return temperature.float().contiguous()
    return torch.full((R or 1,), temperature, dtype=torch.float32, device=device)


def _per_row(t, B):
    """Request r's value for each of its rows [r*M, (r+1)*M) of B = R*M: [R] -> [B]. No host sync."""
    assert B % len(t) == 0, "rows are grouped by request: B must be a multiple of R"
    return t.repeat_interleave(B // len(t))


@jit
def _offset(i, stride):
    """i * stride in int64, for every (request, particle, head, layer) offset in the kernels: one layer's suffix cache
    reaches 2**31 elements at long contexts (N=16, 8 KV heads, D=128, S=128k), where int32 products wrap."""
    return tl.cast(i, tl.int64) * stride


# ---------------------------------------------------------------- attention
def prefill_attention(q, k, v, scale):
    """Causal attention over one prompt. q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], by torch's fused attention (4-D,
    KV heads repeated: only such inputs reach its flash / efficient / cuDNN kernels)."""
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    k, v = (x[:, :, None].expand(T, k.shape[1], G, D).reshape(T, Hq, D) for x in (k, v))
    qkv = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, Hq, T, D]
    return F.scaled_dot_product_attention(*qkv, is_causal=True, scale=scale)[0].transpose(0, 1)


def particle_attention_ref(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree=None):
    """Attention for R requests x N particles x T new tokens. q [R, N, T, Hq, D]; prefix_k/v [R, Hkv, P, D] (the prompt,
    shared by all particles); suffix_k/v [R, N, Hkv, S, D] (each particle's generated tokens, the T new ones already at
    suffix_len ..); prefix_len, suffix_len: int32 [R]. -> [R, N, T, Hq, D]. Query t sees prefix keys [0, prefix_len) and
    suffix keys [0, suffix_len + t]; given tree (bool [R, T, T], a draft tree verified in one pass: RACER), the prefix,
    the committed suffix keys [0, suffix_len) and new token j iff tree[r, t, j] (its ancestors and itself), for every
    particle (lower-triangular = causal). The math, not the speed: broadcasts copy the prefix per particle and head."""
    R, N, T, Hq, D = q.shape
    Hkv = prefix_k.shape[1]
    out = torch.empty_like(q)
    for r in range(R):
        P = int(prefix_len[r])
        S = int(suffix_len[r]) + T
        qr = q[r].view(N, T, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)  # [N, Hkv, G, T, D]
        kp, vp = prefix_k[r, :, None, :P], prefix_v[r, :, None, :P]  # [Hkv, 1, P, D]
        ks, vs = suffix_k[r, :, :, None, :S], suffix_v[r, :, :, None, :S]  # [N, Hkv, 1, S, D]
        scores = torch.cat([qr @ kp.transpose(-1, -2), qr @ ks.transpose(-1, -2)], -1).float() * scale
        if tree is None:
            sees = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # [T, T], causal
        else:
            sees = tree[r]  # [T, T]
        hidden = F.pad(~sees, (S - T, 0))  # [T, S]: every new token sees the committed keys
        scores[..., P:].masked_fill_(hidden, float("-inf"))  # [N, Hkv, G, T, P+S]
        p = scores.softmax(-1).to(q.dtype)
        o = p[..., :P] @ vp + p[..., P:] @ vs  # [N, Hkv, G, T, D]
        out[r] = o.permute(0, 3, 1, 2, 4).reshape(N, T, Hq, D)
    return out


@jit
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, tree_ptr, o_ptr, lse_ptr, qk_scale, sq_r, sq_n, sq_t,
                            sk_r, sk_n, sk_h, sk_s, so_r, so_n, so_t, so_h, N, T, G, Hkv, split0, CAUSAL: tl.constexpr,
                            TREE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                            UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One KV split of a (request, KV head[, particle]) against a block of query rows. Prefix pass (CAUSAL=False): every
    particle x token x head of the KV group, each K/V tile loaded once for all. Suffix pass: one particle's rows, causal
    in the T new tokens, or by the tree (TREE: bytes [R, T, T]). Splits share the live keys, not the capacity: short
    caches spread too. Writes the split's normalised output and log-sum-exp (empty: no loads, lse = -inf, out = 0)."""
    pid = tl.program_id(0)
    h = pid % Hkv
    if CAUSAL:
        n0 = pid // Hkv % N
        r = pid // (Hkv * N)
        rows = T * G
    else:
        n0 = 0
        r = pid // Hkv
        rows = N * T * G
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows ordered (particle, token, head)
    n = n0 + m // (T * G)  # particle
    t = m // G % T  # token
    hq = h * G + m % G  # query head
    d = tl.arange(0, D)
    row_ok = m < rows
    length = tl.load(len_ptr + r)
    if CAUSAL:  # token t sees its own row of the suffix and those before it
        limit = length + t + 1  # [BLOCK_M]
        end = length + T  # their maximum
        if TREE:  # the committed rows here, the new ones by the tree below
            limit = length + 0 * t
    else:
        limit = length + 0 * t
        end = length
    tiles = tl.cdiv(end, BLOCK_N)  # `_split_len`'s rule on the live keys, over the grid's splits
    split = BLOCK_N * tl.maximum(tl.cdiv(tiles, tl.num_programs(2)), tl.cdiv(rows, BLOCK_N))
    lo = tl.program_id(2) * split
    hi = tl.minimum(lo + split, end)
    q_rows = (t * sq_t + hq * D)[:, None] + d[None, :]
    q = tl.load(q_ptr + _offset(r, sq_r) + _offset(n, sq_n)[:, None] + q_rows,  # an empty split loads nothing
                mask=(m < tl.where(lo < hi, rows, 0))[:, None], other=0.0)  # [BLOCK_M, D]
    head = _offset(r, sk_r) + _offset(n0, sk_n) + _offset(h, sk_h)
    if UPCAST:  # the interpreter's half-precision tl.dot is broken
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite, so fully masked rows give 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        kv = j[:, None] * sk_s + d[None, :]  # int32 is enough within one head's keys
        k = tl.load(k_ptr + head + kv, mask=(j < hi)[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptr + head + kv, mask=(j < hi)[:, None], other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        seen = j[None, :] < limit[:, None]
        if TREE:  # key j is new token j - length where in [0, T): seen iff tree[r, t, j - length]
            node = j[None, :] - length
            bit = tl.load(tree_ptr + r * T * T + t[:, None] * T + node, mask=(node >= 0) & (node < T), other=0)
            seen = seen | (bit != 0)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    slot = _offset(r, so_r) + _offset(n, so_n) + t * so_t + hq * so_h + split0 + tl.program_id(2)  # [BLOCK_M]
    tl.store(lse_ptr + slot, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)  # ln; -inf if l_i = 0
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + slot[:, None] * D + d[None, :], out, mask=row_ok[:, None])


def _split_len(capacity, rows, block_n):
    """Keys per split of a full cache: at most MAX_SPLITS splits (to fill the GPU), at least `rows` keys each (the fp32
    partials, rows x D, weigh <= the K/V read). The grid splits capacity by this; the kernel applies it to live keys."""
    tiles = triton.cdiv(max(capacity, 1), block_n)
    return block_n * max(triton.cdiv(tiles, MAX_SPLITS), triton.cdiv(rows, block_n))


def _attention_blocks(rows, D, elem, smem, tree=False):
    """(BLOCK_M, BLOCK_N, num_stages): the largest whose estimated shared memory fits `smem` bytes per program (a Q
    tile, num_stages K and V tiles, an fp32 [BLOCK_M, BLOCK_N] scratch: above what Triton allocates on sm_80 and sm_90)
    among tiles that spill no register there (tests/test_compile.py): float32's ieee dots run on FMA units from
    registers (16 keys, 4096 / D rows); at D >= 128 bf16 takes 32 keys, a tree's masks at most 64 rows."""
    top = min(max(triton.next_power_of_2(rows), 16), 128)
    keys = ((64, 3), (64, 2), (32, 2), (32, 1))
    if elem == 4:
        top = min(top, max(16, 4096 // D))
        keys = ((16, 2), (16, 1))
    elif D >= 128:
        keys = ((32, 3), (32, 2), (32, 1))
        if tree:
            top = min(top, 64)
    for block_m in (m for m in (128, 64, 32, 16) if m <= top):
        for block_n, stages in keys:
            if elem * D * (block_m + 2 * block_n * stages) + 4 * block_m * block_n <= smem:
                return block_m, block_n, stages
    return 16, 16, 1


@functools.cache
def _shared_memory(device):
    """Shared memory one program may use on CUDA device `device` (an index): the opt-in maximum."""
    smem = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return smem or triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def launch_target(t):
    """What a launch on tensor t's device chooses its blocks for: the shared memory one program may use there
    (bytes), or None under the interpreter, which keeps small blocks (it is slow)."""
    return None if INTERPRET else _shared_memory(t.get_device())


def _precision(dtype, smem):
    """tl.dot's input precision: ieee for float32 operands and for the interpreter (its half-precision dot is
    broken), tf32 otherwise (only float32 operands care)."""
    return "ieee" if smem is None or dtype == torch.float32 else "tf32"


def attention_launch(rows, capacity, D, dtype, smem, tree=False):
    """(splits, the kernel's launch options) of an attention pass of `rows` query rows a program over a cache of
    `capacity` keys of head dim D in dtype, for `smem` (`launch_target`), by a tree's masks or not: shapes only, for
    CUDA graphs. A tree's masks take registers: 8 warps from half the tile that other passes take them at."""
    if smem is None:
        block_m = min(max(triton.next_power_of_2(rows), 16), 128)
        block_n = 16
        stages = 1
    else:
        block_m, block_n, stages = _attention_blocks(rows, D, dtype.itemsize, smem, tree)
    splits = triton.cdiv(capacity, _split_len(capacity, rows, block_n))
    wide = block_m * D >= (8192 if tree else 16384)
    return splits, dict(BLOCK_M=block_m, BLOCK_N=block_n, D=D, UPCAST=smem is None, PRECISION=_precision(dtype, smem),
                        num_warps=8 if wide else 4, num_stages=stages)


def _attend_splits(q, k, v, lengths, out, lse, split0, plan, scale, causal, tree=None):
    """One pass (the suffix's if causal, else the prefix's): its splits' partials into out and lse from split0 on."""
    R, N, T, Hq, D = q.shape
    Hkv = k.shape[-3]
    G = Hq // Hkv
    splits, options = plan
    if causal:
        programs = R * Hkv * N
        rows = T * G
        sk_n = k.stride(1)
    else:  # the prefix is shared: every particle reads the same rows
        programs = R * Hkv
        rows = N * T * G
        sk_n = 0
    grid = (programs, triton.cdiv(rows, options["BLOCK_M"]), splits)
    bits = lengths if tree is None else tree.contiguous().view(torch.uint8)  # [R, T, T] bytes; a view, no copy
    _attention_split_kernel[grid](q, k, v, lengths, bits, out, lse, scale * LOG2E, *q.stride()[:3], k.stride(0), sk_n,
                                  *k.stride()[-3:-1], *lse.stride()[:4], N, T, G, Hkv, split0, CAUSAL=causal,
                                  TREE=tree is not None, **options)


def merge_splits_ref(out, lse, dtype):
    """The KV splits' partial outputs out [..., splits, D] (each normalised) merged by their log-sum-exps lse
    [..., splits] -> [..., D] in dtype: each split's part of the mass, 0 if empty; the own token keeps one finite."""
    share = lse.softmax(-1)
    return (share[..., None, :] @ out)[..., 0, :].to(dtype)  # a matmul reads the partials once, makes no temporary


@jit
def _merge_kernel(out_ptr, lse_ptr, merged_ptr, splits, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One query row (request, particle, token, head): its splits' partials weighted by softmax(lse), in float32."""
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + _offset(row, splits) + s, mask=s < splits, other=float("-inf"))
    share = tl.exp(lse - tl.max(lse, 0))
    share = share / tl.sum(share, 0)
    parts = (_offset(row, splits) + s)[:, None] * D + d[None, :]  # [BLOCK_S, D]
    partial = tl.load(out_ptr + parts, mask=(s < splits)[:, None], other=0.0)
    tl.store(merged_ptr + _offset(row, D) + d, tl.sum(share[:, None] * partial, 0))


def merge_splits(out, lse, dtype):
    """`merge_splits_ref`'s contract, out and lse contiguous; one kernel on a GPU."""
    if not use_triton(out):
        return merge_splits_ref(out, lse, dtype)
    splits = lse.shape[-1]
    assert splits <= 2 * MAX_SPLITS and out.is_contiguous() and lse.is_contiguous()
    merged = out.new_empty(out.shape[:-2] + out.shape[-1:], dtype=dtype)
    _merge_kernel[(lse.numel() // splits,)](out, lse, merged, splits, D=out.shape[-1], BLOCK_S=2 * MAX_SPLITS,
                                           num_warps=4)
    return merged


def particle_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree=None):
    """`particle_attention_ref`'s contract. Triton: a prefix and a per-particle suffix pass write a partial softmax per
    KV split, merged by log-sum-exp. The grid depends on shapes only, lengths and tree on device: CUDA-graph safe."""
    if not use_triton(q):
        return particle_attention_ref(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree)
    R, N, T, Hq, D = q.shape
    assert tree is None or (tree.shape == (R, T, T) and tree.dtype == torch.bool)
    assert D == triton.next_power_of_2(D) and q.stride(-2) == D
    assert q.stride(-1) == prefix_k.stride(-1) == suffix_k.stride(-1) == 1
    assert prefix_k.stride() == prefix_v.stride() and suffix_k.stride() == suffix_v.stride()
    G = Hq // prefix_k.shape[1]
    P = prefix_k.shape[2]
    S = suffix_k.shape[3]
    smem = launch_target(q)
    prefix = attention_launch(N * T * G, P, D, q.dtype, smem)
    suffix = attention_launch(T * G, S, D, q.dtype, smem, tree is not None)
    lse = q.new_empty(R, N, T, Hq, prefix[0] + suffix[0], dtype=torch.float32)
    out = q.new_empty(*lse.shape, D, dtype=torch.float32)  # [R, N, T, Hq, splits, D]
    _attend_splits(q, prefix_k, prefix_v, prefix_len, out, lse, 0, prefix, scale, False)
    _attend_splits(q, suffix_k, suffix_v, suffix_len, out, lse, prefix[0], suffix, scale, True, tree)
    return merge_splits(out, lse, q.dtype)


# ---------------------------------------------------------------- sampling
SAMPLE_CHUNK = 256  # vocabulary entries a partial sum covers: the draw finds its chunk, then its token in there


def sample_ref(logits, temperature, rng):
    """`sample`'s contract by inverse CDF: the first token whose running sum of exp(logits / T - max) exceeds a uniform
    times the total. On CPU much cheaper than Gumbel noise per vocabulary entry, which the kernel's one pass needs;
    the running sum in two levels (chunks' sums, then one chunk's entries), as a whole-vocabulary cumsum costs more."""
    B, V = logits.shape
    R = rng.shape[0]
    t = _per_row(_temperatures(temperature, logits.device, R), B)[:, None]  # [B, 1]
    scale = t.where(t > 0, 1.0)
    top = logits.float().amax(-1, keepdim=True) / scale  # [B, 1] the largest tempered logit (dividing keeps order)
    p = (logits.float() / scale).sub_(top).exp_()  # [B, V] unnormalised probabilities, the one tensor of V a row
    C = -(-V // SAMPLE_CHUNK)
    whole = V // SAMPLE_CHUNK * SAMPLE_CHUNK
    sums = p[:, :whole].view(B, -1, SAMPLE_CHUNK).sum(-1)  # [B, V // CHUNK]
    if whole < V:  # a last, shorter chunk
        sums = torch.cat([sums, p[:, whole:].sum(-1, keepdim=True)], 1)
    cdf = sums.cumsum_(-1)  # [B, C] nondecreasing, so chunks of probability 0 are never hit
    total = cdf[:, -1:]
    u = _uniforms(rng, B // R) * total  # greedy rows draw too: alone == batched
    # the last chunk (and in it the last token) of nonzero probability, as u * total may round up past its sums (a row
    # of no probability: NaN, the last token)
    last = torch.searchsorted(cdf, total.contiguous()).clamp(max=C - 1)  # [B, 1]
    c = torch.searchsorted(cdf, u, right=True).minimum(last)  # [B, 1] the chunk of the draw
    before = cdf.gather(1, (c - 1).clamp(min=0)).where(c > 0, 0.0)  # [B, 1] the mass of the chunks before it
    at = c * SAMPLE_CHUNK + torch.arange(SAMPLE_CHUNK, device=logits.device)  # [B, CHUNK] its entries
    inside = p.gather(1, at.clamp(max=V - 1)).where(at < V, 0.0).cumsum_(-1) + before  # [B, CHUNK]
    last_inside = torch.searchsorted(inside, inside[:, -1:].contiguous()).clamp(max=SAMPLE_CHUNK - 1)
    tokens = (c * SAMPLE_CHUNK + torch.searchsorted(inside, u, right=True).minimum(last_inside)).clamp(max=V - 1)
    if bool((t == 0).any()):
        tokens = tokens.where(t > 0, logits.argmax(-1, keepdim=True))  # the first largest logit
    logprobs = (logits.gather(-1, tokens).float() / scale - top - total.log()).where(t > 0, 0.0)
    return tokens[:, 0], logprobs[:, 0]


def token_logprobs_ref(logits, tokens, temperature):
    """log softmax(logits / T)[tokens], float32 [B]. T = 0: 0 for the argmax token, -inf otherwise."""
    t = _per_row(_temperatures(temperature, logits.device), logits.shape[0])[:, None]  # [B, 1]
    x = logits.float() / t.where(t > 0, 1.0)
    picked = x.gather(-1, tokens[:, None])
    greedy = torch.where(picked >= x.amax(-1, keepdim=True), 0.0, float("-inf"))
    return (picked - x.logsumexp(-1, keepdim=True)).where(t > 0, greedy)[:, 0]


@jit
def _vocab_chunk_kernel(logits_ptr, stride_b, V, M, temp_ptr, rng_ptr, max_ptr, sum_ptr, key_ptr, x_ptr, at_ptr,
                        CHUNK: tl.constexpr, SAMPLE: tl.constexpr, NOISE: tl.constexpr, BLOCK_V: tl.constexpr):
    """One vocabulary chunk of row b, streamed once: the max of the tempered logits x and the sum of exp(x - max); with
    SAMPLE its Gumbel-max winner (key, x, index), noise keyed on request b // M's rng unless NOISE is off or T = 0."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    row = logits_ptr + b.to(tl.int64) * stride_b
    r = b // M
    temp = tl.load(temp_ptr + r)
    inv_temp = 1.0 / tl.where(temp > 0, temp, 1.0)
    if NOISE:  # Philox counter (element within the request, call): the request's other rows never enter
        seed = tl.load(rng_ptr + 2 * r)
        stream = (tl.load(rng_ptr + 2 * r + 1) << 32) + (b % M).to(tl.int64) * V
    m = -1e30  # finite, so an all -inf tile adds nothing instead of NaN
    total = 0.0
    best = float("-inf")  # the Gumbel-max winner so far: its key, tempered logit and index
    best_x = 0.0
    best_at = 0
    for v0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, V), BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row + v, mask=v < V, other=float("-inf")).to(tl.float32) * inv_temp  # [BLOCK_V]
        m_new = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        if SAMPLE:
            key = x
            if NOISE:
                key = tl.where(temp > 0, x - tl.log(-tl.log(tl.rand(seed, stream + v))), x)
            at = tl.argmax(key, 0)
            better = tl.max(key, 0) > best  # strict: ties keep the lowest index, like torch.argmax
            best = tl.where(better, tl.max(key, 0), best)
            best_x = tl.where(better, tl.sum(tl.where(v == v0 + at, x, 0.0), 0), best_x)
            best_at = tl.where(better, v0 + at, best_at)
    out = b * tl.num_programs(1) + c
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, total)
    if SAMPLE:
        tl.store(key_ptr + out, best)
        tl.store(x_ptr + out, best_x)
        tl.store(at_ptr + out, best_at.to(tl.int64))


def vocab_launch(V, M, smem):
    """(chunks a row, the kernel's launch options) of `_vocab_chunk_kernel` over rows of V logits, M rows a request, for
    `smem` (`launch_target`). Rows are cut into chunks so one request's M rows spread over ~256 programs (the whole
    GPU); sized by M, not B, so a request's partial sums come out the same to the bit in any batch."""
    block_v = 256 if smem is None else 2048
    tiles = triton.cdiv(V, block_v)
    chunk = block_v * triton.cdiv(tiles, min(tiles, triton.cdiv(256, M)))
    return triton.cdiv(V, chunk), dict(CHUNK=chunk, BLOCK_V=block_v, num_warps=8)


def _vocab_chunks(logits, temperature, rng, noise):
    """Per (row, chunk) partials [B, C] of `_vocab_chunk_kernel`: max, sum and, given rng, key, x, index.
    temperature float32 [R]."""
    B, V = logits.shape
    M = B // len(temperature)
    assert M * len(temperature) == B, "rows are grouped by request: B must be a multiple of R"
    assert M * V < 2**32 and logits.stride(-1) == 1, "Philox element offsets are 32-bit"
    chunks, options = vocab_launch(V, M, launch_target(logits))
    floats = torch.empty(4, B, chunks, dtype=torch.float32, device=logits.device)
    at = torch.empty(floats.shape[1:], dtype=torch.int64, device=logits.device)
    rng_ptr = at if rng is None else rng  # any int64 tensor: read only when sampling
    _vocab_chunk_kernel[floats.shape[1:]](logits, logits.stride(0), V, M, temperature, rng_ptr, *floats, at,
                                          SAMPLE=rng is not None, NOISE=noise, **options)
    return (*floats, at)


def _logprob(picked, chunk_max, chunk_sum, t):
    """log-prob of tempered logit `picked` [B] from the chunks' max and sum(exp(x - max)) [B, C]; t [B]: 0 = greedy."""
    greedy = torch.where(picked >= chunk_max.amax(-1), 0.0, float("-inf"))
    return (picked - (chunk_max + chunk_sum.log()).logsumexp(-1)).where(t > 0, greedy)


def sample(logits, temperature, rng):
    """One token per row of logits [B, V], grouped by request, from softmax(logits / temperature), temperature a float
    or float32 [R] -> tokens int64 [B], log-probs float32 [B] (T = 0: greedy, 0). rng: see `make_rng`. No host sync."""
    if not use_triton(logits):
        return sample_ref(logits, temperature, rng)
    t = _temperatures(temperature, logits.device, rng.shape[0])  # [R]
    noise = torch.is_tensor(temperature) or temperature != 0
    chunk_max, chunk_sum, key, x, at = _vocab_chunks(logits, t, rng, noise)  # [B, C] each
    rng[:, 1].add_(1)
    winner = key.argmax(-1, keepdim=True)  # [B, 1] the chunk holding the row's Gumbel-max
    picked = x.gather(1, winner)[:, 0]
    tokens = at.gather(1, winner)[:, 0]
    return tokens, _logprob(picked, chunk_max, chunk_sum, _per_row(t, len(logits)))


def token_logprobs(logits, tokens, temperature):
    """log softmax(logits [B, V] / temperature)[tokens [B]] -> float32 [B], in one pass over logits. temperature: a
    float, or float32 [R] for R requests of B // R rows each; 0 = greedy: 0 for the argmax token, -inf for others."""
    if not use_triton(logits):
        return token_logprobs_ref(logits, tokens, temperature)
    t = _temperatures(temperature, logits.device)  # [R]
    chunk_max, chunk_sum = _vocab_chunks(logits, t, None, False)[:2]
    rows = _per_row(t, len(logits))  # [B]
    picked = logits.gather(1, tokens[:, None])[:, 0].float() * (1.0 / rows.where(rows > 0, 1.0))  # as the kernel
    return _logprob(picked, chunk_max, chunk_sum, rows)


# ---------------------------------------------------------------- resampling
# An ESS within this relative distance below threshold * N counts as at it: compiled exp and division are approximate
# (k equal weights may give an ESS just under k), while weights this close to equal change nothing worth a resample.
ESS_RTOL = 1e-5


def _ess_limit(threshold, N):
    """The ESS below which a request resamples, one Python float for the kernel and the reference alike."""
    return threshold * N * (1 - ESS_RTOL)


def resample_ref(logw, threshold, rng):
    """`resample`'s contract: systematic resampling of logw [R, N] where ESS < threshold * N * (1 - ESS_RTOL)."""
    R, N = logw.shape
    assert rng.shape == (R, 2), "one (seed, counter) per request"
    i = torch.arange(N, device=logw.device)
    nan = logw.isnan()
    empty = (nan | (logw == float("-inf"))).all(-1, keepdim=True)
    x = logw.masked_fill(nan, float("-inf")).masked_fill(empty, 0.0)
    u = (x - x.amax(-1, keepdim=True)).exp()  # [R, N]; exactly 1 for the largest weights, 0 for -inf
    w = u / u.sum(-1, keepdim=True)
    ess = (u.sum(-1) ** 2 / (u * u).sum(-1)).clamp(1, N)  # [R]; k equal weights give k here, ~k compiled
    resampled = ess < _ess_limit(threshold, N)  # the float32 comparison the kernel makes
    pos = (i + _uniforms(rng, 1)) / N  # [R, N], request r's uniform its own
    last = torch.where(w > 0, i, 0).amax(-1, keepdim=True)  # catches pos beyond a rounded-down total
    hit = (w.cumsum(-1)[:, None, :] > pos[:, :, None]) & (w[:, None, :] > 0)  # [R, slot, particle]
    systematic = torch.where(hit, i, last[:, :, None]).amin(-1)  # sorted; never a zero weight
    offspring = (systematic[:, :, None] == i).sum(1)  # [R, N]
    # each particle with offspring stays its own ancestor, its spare copies fill the childless slots in order
    extra = (offspring - 1).clamp(min=0).cumsum(-1)  # [R, N] spare copies of particles 0..j
    rank = (offspring == 0).cumsum(-1) - 1  # [R, N] slot i is the rank-th childless one
    fill = (extra[:, None, :] <= rank[:, :, None]).sum(-1)  # first j whose spares reach that rank
    ancestors = torch.where(resampled[:, None] & (offspring == 0), fill, i)
    return ancestors, ess, resampled, nan.any(-1) | empty[:, 0]


@jit
def _resample_kernel(logw_ptr, rng_ptr, ancestors_ptr, ess_ptr, resampled_ptr, degenerate_ptr, N, ess_limit,
                     BLOCK: tl.constexpr):
    """One request per program: `resample_ref`, [BLOCK, BLOCK] comparisons standing in for searchsorted, bincount."""
    r = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    valid = i < N
    x = tl.load(logw_ptr + r * N + i, mask=valid, other=float("-inf"))
    nan = x != x
    x = tl.where(nan, float("-inf"), x)
    empty = tl.max(x, 0) == float("-inf")
    x = tl.where(valid, tl.where(empty, 0.0, x), x)  # (int1 scalar & block breaks the interpreter)
    u = tl.exp(x - tl.max(x, 0))  # [BLOCK], 0 beyond N
    total = tl.sum(u, 0)
    w = u / total
    ess = tl.minimum(tl.maximum(total * total / tl.sum(u * u, 0), 1.0), N)
    resampled = ess < ess_limit
    pos = (i + tl.rand(tl.load(rng_ptr + 2 * r), tl.load(rng_ptr + 2 * r + 1) << 32)) / N  # keyed on r's rng only
    last = tl.max(tl.where(w > 0, i, 0), 0)
    hit = (tl.cumsum(w, 0)[None, :] > pos[:, None]) & (w[None, :] > 0)  # [slot, particle]
    systematic = tl.min(tl.where(hit, i[None, :], last), 1)  # [BLOCK]
    offspring = tl.sum(((systematic[:, None] == i[None, :]) & valid[:, None]).to(tl.int32), 0)
    extra = tl.cumsum(tl.maximum(offspring - 1, 0), 0)
    rank = tl.cumsum((offspring == 0).to(tl.int32), 0) - 1
    fill = tl.sum(((extra[None, :] <= rank[:, None]) & valid[None, :]).to(tl.int32), 1)
    ancestors = tl.where(resampled, tl.where(offspring == 0, fill, i), i)
    tl.store(ancestors_ptr + r * N + i, ancestors.to(tl.int64), mask=valid)
    tl.store(ess_ptr + r, ess)
    tl.store(resampled_ptr + r, resampled)
    tl.store(degenerate_ptr + r, empty | (tl.sum(nan.to(tl.int32), 0) > 0))


def resample_launch(N, smem):
    """The launch options of `_resample_kernel` for N particles: one block holds them all (any target)."""
    return dict(BLOCK=max(triton.next_power_of_2(N), 2))


def resample(logw, threshold, rng):
    """Systematic resampling per request by log-weights logw [R, N] float32. Weights: softmax(logw), NaN read as -inf
    (weight 0), an all -inf row as uniform. ESS = clamp(1 / sum(w^2), 1, N). A row resamples iff ESS < threshold * N
    (strict, as in the paper) by over a relative ESS_RTOL, so rounding never decides: threshold 0 never resamples, 1
    unless all weights are equal (which would change nothing). A particle with k >= 1 offspring (floor or ceil of N w)
    keeps its slot, its k-1 spares fill childless ones' (the only slots overwritten); rows not resampled get the
    identity. rng [R, 2]: see `make_rng`; no host sync. The caller resets logw to 0 where resampled.
    -> ancestors int64 [R, N], ess float32 [R], resampled bool [R], degenerate bool [R] (a NaN or all -inf row)."""
    if not use_triton(logw):
        return resample_ref(logw, threshold, rng)
    R, N = logw.shape
    assert rng.shape == (R, 2), "one (seed, counter) per request"
    ancestors = logw.new_empty(R, N, dtype=torch.int64)
    ess = logw.new_empty(R, dtype=torch.float32)
    resampled, degenerate = (logw.new_empty(R, dtype=torch.bool) for _ in range(2))
    _resample_kernel[(R,)](logw.contiguous(), rng, ancestors, ess, resampled, degenerate, N,
                           _ess_limit(threshold, N), **resample_launch(N, launch_target(logw)))  # fp32, as the ref
    rng[:, 1].add_(1)
    return ancestors, ess, resampled, degenerate


# ---------------------------------------------------------------- gather
def _as_6d(cache):
    """A token history [R, N, S] as a cache [1, R, N, 1, S, 1]; a cache [L, R, N, H, S, D] as is."""
    return cache[None, :, :, None, :, None] if cache.dim() == 3 else cache


def gather_suffix_ref(cache, ancestors, length):
    """`gather_suffix`'s contract; the right-hand side is an advanced-indexing copy, so every read sees old values."""
    view = _as_6d(cache)
    N = ancestors.shape[1]
    for r, n in enumerate(length.tolist()):
        moved = (ancestors[r] != torch.arange(N, device=cache.device)).nonzero()[:, 0]
        view[:, r, moved, :, :n] = view[:, r, ancestors[r, moved], :, :n]
    return cache


@jit
def _gather_kernel(cache_ptr, ancestors_ptr, len_ptr, N, R, H, D, st_l, st_r, st_n, st_h, st_s,
                   BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (layer, request, head) per program, all N particles at once; row blocks below the live length go round-robin
    over grid axis 1, so work follows the length, not the capacity, and a request where none moved loads no row. Rows
    are disjoint across programs; in each block loads precede the barrier, stores follow it: reads see old values."""
    pid = tl.program_id(0)
    h = pid % H
    r = pid // H % R
    layer = pid // (H * R)
    p = tl.arange(0, BLOCK_P)  # particle
    d = tl.arange(0, BLOCK_D)
    ancestor = tl.load(ancestors_ptr + _offset(r, N) + p, mask=p < N, other=0)  # [BLOCK_P]
    moved = (p < N) & (ancestor != p)
    end = tl.where(tl.sum(moved.to(tl.int32), 0) > 0, tl.load(len_ptr + r), 0)  # no move: no row to copy
    base = cache_ptr + _offset(layer, st_l) + _offset(r, st_r) + _offset(h, st_h)
    src = base + _offset(ancestor, st_n)[:, None, None]
    dst = base + _offset(p, st_n)[:, None, None]
    for s0 in range(tl.program_id(1) * BLOCK_S, end, tl.num_programs(1) * BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = moved[:, None, None] & (s < end)[None, :, None] & (d < D)[None, None, :]
        rows = s[None, :, None] * st_s + d[None, None, :]  # [1, BLOCK_S, BLOCK_D], int32 within a head
        block = tl.load(src + rows, mask=mask)
        tl.debug_barrier()
        tl.store(dst + rows, block, mask=mask)


def gather_launch(L, R, N, H, S, D, smem):
    """(row blocks a program's grid axis 1 has, the launch options) of `_gather_kernel` over a cache [L, R, N, H, S, D]:
    registers bounded by the block, ~4096 programs to fill a GPU (any target)."""
    block_p = triton.next_power_of_2(N)
    block_d = triton.next_power_of_2(D)
    block_s = max(1, min(triton.next_power_of_2(S), 8192 // (block_p * block_d)))
    blocks = max(1, min(triton.cdiv(S, block_s), triton.cdiv(4096, L * R * H)))
    return blocks, dict(BLOCK_P=block_p, BLOCK_S=block_s, BLOCK_D=block_d)


def gather_suffix(cache, ancestors, length):
    """In place, for cache [L, R, N, H, S, D] (a suffix KV cache, all layers in one launch) or a token history
    [R, N, S]: rows [0, length[r]) of each particle i whose ancestors[r, i] != i become a copy of its ancestor's; no
    other row is touched. Any ancestors are safe. ancestors int64 [R, N], length int32 [R]. Returns cache."""
    if not use_triton(cache):
        return gather_suffix_ref(cache, ancestors, length)
    view = _as_6d(cache)
    L, R, N, H, S, D = view.shape
    assert view.stride(-1) == 1
    blocks, options = gather_launch(L, R, N, H, S, D, launch_target(cache))
    _gather_kernel[(L * R * H, blocks)](view, ancestors.contiguous(), length, N, R, H, D, *view.stride()[:5], **options)
    return cache


def _positions(base, i, shape):
    """Indices along S of a cache of `shape` [L, R, N, H, S, D] for gather and scatter: base[r] + i[r, j]."""
    L, R, N, H, S, D = shape
    return (base.long()[:, None] + i)[None, :, None, None, :, None].expand(L, R, N, H, i.shape[-1], D)


def compact(cache, base, path):
    """Move the suffix K/V of an accepted tree path to consecutive positions: node path[r, d] of the tree written from
    base[r] (int [R]) to base[r] + d; path [R, D]. Parents precede children (path[r, d] >= d): a gather, a scatter."""
    for kv in (cache.suffix_k, cache.suffix_v):  # [L, R, N, H, S, D]
        steps = torch.arange(path.shape[1], device=kv.device)[None]  # [1, D]
        kv.scatter_(4, _positions(base, steps, kv.shape), kv.gather(4, _positions(base, path, kv.shape)))


# ---------------------------------------------------------------- weight-only int8 / int4 matmuls
# Scales in the activations' dtype, as torch's CPU kernels take them, and q rounded from the rounded scales. The
# weight's device picks the kernel: torch's on the CPU (int4 packed its way), else Triton's (int4 by `pack_int4`).
INT4_GROUP = 32  # int4 inputs sharing a scale and zero
QUANT_BLOCK = 2**22  # values quantized at a time: their float32 temporaries stay in a last-level cache


def quantize_int8(w):
    """w [out, in] -> q int8 [out, in], scale [out] in w's dtype, on w's device: symmetric per row, w ~ q * scale."""
    q = torch.empty_like(w, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=w.dtype, device=w.device)
    n = max(1, QUANT_BLOCK // w.shape[1])  # rows at a time
    for i in range(0, len(w), n):
        wf = w[i:i + n].to(torch.float32, copy=True)  # float() would alias a float32 w, and div_ write into it
        scale[i:i + n] = (wf.abs().amax(1) / 127).clamp(min=1e-30)  # clamp: an all-zero row
        q[i:i + n] = wf.div_(scale[i:i + n, None].float()).round_().clamp_(-127, 127)
    return q, scale


def int8_linear_ref(x, q, scale):
    return F.linear(x.float(), q.float() * scale.float()[:, None]).to(x.dtype)


def quantize_int4(w):
    """w [out, in] -> q int32 [out, in] in 0..15, scale_zero [in / 32, out, 2] in w's dtype (the kernels' layout):
    asymmetric per group of 32 inputs, w ~ (q - 8) * scale + zero."""
    q = torch.empty_like(w, dtype=torch.int32)
    scale_zero = torch.empty(w.shape[1] // 32, len(w), 2, dtype=w.dtype, device=w.device)
    n = max(1, QUANT_BLOCK // w.shape[1])  # rows at a time
    for i in range(0, len(w), n):
        wg = w[i:i + n].to(torch.float32, copy=True).unflatten(1, (-1, INT4_GROUP))  # [n, in / 32, 32], written below
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-30).to(w.dtype)  # [n, in / 32]
        zero = (lo + 8 * scale.float()).to(w.dtype)
        scale_zero[:, i:i + n] = torch.stack([scale, zero], -1).transpose(0, 1)
        wg.sub_(zero.float()[..., None]).div_(scale.float()[..., None]).add_(8).round_().clamp_(0, 15)
        q[i:i + n] = wg.flatten(1)
    return q, scale_zero


def int4_linear_ref(x, q, scale_zero):
    scale, zero = scale_zero.float().transpose(0, 1).unbind(-1)  # [out, in / 32] each
    w = (q.unflatten(1, (-1, INT4_GROUP)) - 8) * scale[..., None] + zero[..., None]  # [out, in / 32, 32]
    return F.linear(x.float(), w.flatten(1)).to(x.dtype)


def pack_int4(q):
    """quantize_int4's q int32 [out, in] -> uint8 [out, in / 2] for Triton: byte j = col 2j | (col 2j + 1) << 4."""
    return (q[:, 0::2] | q[:, 1::2] << 4).to(torch.uint8)


@jit
def _int4_weights(q_ptr, s_ptr, n, k0, N, K, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """w[n, k0 : k0 + BLOCK_K].T in float32, [BLOCK_K, BLOCK_N]: one load of the tile's packed bytes [BLOCK_K // 2,
    BLOCK_N] (low nibble the even input, high the odd) and one of its groups' (scale, zero) [BLOCK_K // 32, BLOCK_N, 2],
    broadcast to their bytes. Each byte and scale is read once, in contiguous runs; the nibbles' two tiles interleave
    back in input order in registers, so that one dot takes x as loaded."""
    b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte b packs inputs 2b and 2b + 1
    live = (b < K // 2)[:, None] & (n < N)[None, :]
    byte = tl.load(q_ptr + _offset(n, K // 2)[None, :] + b[:, None], mask=live, other=0)  # [BLOCK_K // 2, BLOCK_N]
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # the tile's groups
    at = (g[:, None] * N + n[None, :]) * 2  # [BLOCK_K // 32, BLOCK_N]: where each (scale, zero) starts
    live = (g < K // 32)[:, None] & (n < N)[None, :]
    pairs = tl.load(s_ptr + at[:, :, None] + tl.arange(0, 2)[None, None, :], mask=live[:, :, None], other=0.0)
    scale, zero = tl.split(pairs.to(tl.float32))  # [BLOCK_K // 32, BLOCK_N] each
    # each group's row for its 16 bytes: [BLOCK_K // 2, BLOCK_N]
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [BLOCK_K // 32, 16, BLOCK_N]), [BLOCK_K // 2, BLOCK_N])
    zero = tl.reshape(tl.broadcast_to(zero[:, None, :], [BLOCK_K // 32, 16, BLOCK_N]), [BLOCK_K // 2, BLOCK_N])
    even = ((byte & 15).to(tl.float32) - 8) * scale + zero  # [BLOCK_K // 2, BLOCK_N]
    odd = ((byte >> 4).to(tl.float32) - 8) * scale + zero
    rows = tl.permute(tl.join(even, odd), 0, 2, 1)  # [BLOCK_K // 2, 2, BLOCK_N]: inputs 2b, 2b + 1 of byte b
    return tl.reshape(rows, [BLOCK_K, BLOCK_N])


@jit
def _quantized_matmul_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K, INT4: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of out = x @ w.T, the weight dequantized a [BLOCK_K, BLOCK_N] tile at a time in
    registers and cast to x's dtype. int4 (nibble - 8) * scale + zero of its group of 32, each packed byte and each
    group's (scale, zero) loaded once a tile (`_int4_weights`), so BLOCK_K a multiple of 64: whole bytes of whole
    groups. int8 q[n, k] as is (exact in any float dtype), its row's scale applied once to the float32 sums."""
    tl.static_assert(not INT4 or BLOCK_K % 64 == 0, "an int4 tile takes whole bytes of whole groups of 32")
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # activation rows
    dot_type = tl.float32 if PRECISION == "ieee" else x_ptr.dtype.element_ty  # ieee: x float32, or the interpreter
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + _offset(m, K)[:, None] + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        if INT4:  # scale_zero [in / 32, out, 2]
            w = _int4_weights(q_ptr, s_ptr, n, k0, N, K, BLOCK_K, BLOCK_N)  # [BLOCK_K, BLOCK_N]
        else:
            live = (k < K)[:, None] & (n < N)[None, :]  # [BLOCK_K, BLOCK_N]
            w = tl.load(q_ptr + _offset(n, K)[None, :] + k[:, None], mask=live, other=0)
        acc += tl.dot(x.to(dot_type), w.to(dot_type), input_precision=PRECISION)
    if not INT4:
        acc *= tl.load(s_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + _offset(m, N)[:, None] + n[None, :], acc, mask=(m < M)[:, None] & (n < N)[None, :])


def quantized_matmul_launch(M, dtype, smem, int4=False):
    """The launch options of `_quantized_matmul_kernel` for M rows of activations in dtype, for `smem`
    (`launch_target`), int4 weights or int8. Tiles by M: decoding's few rows only read the weight (narrow column blocks
    give many programs, long `in` tiles bytes in flight); a prefill's many reuse each weight tile in 128 rows. int4
    tiles span at least 64 inputs, whole bytes of whole groups (the kernel asserts it)."""
    # float32's ieee dots run on FMA units from registers: larger tiles spill, int4's 64 inputs (below) at any M
    if dtype == torch.float32 and (M <= 16 or int4):
        tile = (16, 32, 32, 4, 2)
    elif dtype == torch.float32:
        tile = (32, 64, 16, 4, 2)
    elif M <= 16:  # int4 twice int8's inputs: the same bytes a tile
        tile = (16, 16, 512 if int4 else 256, 4, 4)
    elif M <= 64:
        tile = (min(64, triton.next_power_of_2(M)), 64, 64, 4, 3)
    else:
        tile = (128, 128, 64, 8, 3)
    block_m, block_n, block_k, warps, stages = tile
    if int4:  # whole bytes (two inputs) of whole groups
        block_k = max(block_k, 2 * INT4_GROUP)
    # fewer stages where the estimate (stages x an activation and two weight-sized tiles) passes smem; one always fits
    while smem is not None and stages > 1 and stages * block_k * (block_m + 2 * block_n) * dtype.itemsize > smem:
        stages -= 1
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(dtype, smem), num_warps=warps,
                num_stages=stages)


def quantized_matmul(x, q, scale):
    """x [M, in] @ w.T -> [M, out] in x's dtype, in Triton: q int8 [out, in] with scale [out], or q uint8 [out, in / 2]
    (pack_int4) with scale_zero [in / 32, out, 2]."""
    M, K = x.shape
    N = q.shape[0]
    int4 = q.dtype == torch.uint8
    assert q.shape[1] * (1 + int4) == K and (not int4 or K % INT4_GROUP == 0) and scale.is_contiguous()
    options = quantized_matmul_launch(M, x.dtype, launch_target(x), int4)
    out = x.new_empty(M, N)
    grid = (triton.cdiv(N, options["BLOCK_N"]), triton.cdiv(M, options["BLOCK_M"]))
    _quantized_matmul_kernel[grid](x.contiguous(), q.contiguous(), scale, out, M, N, K, INT4=int4, **options)
    return out


def quantized_linear(x, q, scale):
    """x [..., in] @ w.T for w quantized by quantize_int8 (q int8) or quantize_int4, in the layout of q's device: on the
    CPU torch's, int4 q packed by torch._convert_weight_to_int4pack_for_cpu(q, 1); elsewhere quantized_matmul's; or
    by quantize_fp8 (q float8_e4m3fn), fp8_matmul's anywhere."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # the kernels take 2-D rows in order (torch's int4 one checks)
    if q.dtype == torch.float8_e4m3fn:
        y = fp8_matmul(x2, q, scale)
    elif q.device.type != "cpu":
        y = quantized_matmul(x2, q, scale)
    elif q.dtype == torch.int8:
        y = torch._weight_int8pack_mm(x2, q, scale)
    else:
        y = torch._weight_int4pack_mm_for_cpu(x2, q, INT4_GROUP, scale)
    return y.reshape(*x.shape[:-1], -1)


# ---------------------------------------------------------------- fp8 matmuls
# torch._scaled_mm multiplies two fp8 operands (tensor cores of sm_89 and later; torch's CPU kernel elsewhere): the
# weight is quantized once per output row, the activations per row at each call.
FP8_MAX = 448.0  # the largest float8_e4m3fn


def quantize_fp8(w):
    """w [out, in] -> q float8_e4m3fn [out, in], scale float32 [out]: symmetric per row, w ~ q * scale."""
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    n = max(1, QUANT_BLOCK // w.shape[1])  # rows at a time
    for i in range(0, len(w), n):
        wf = w[i:i + n].to(torch.float32, copy=True)
        scale[i:i + n] = (wf.abs().amax(1) / FP8_MAX).clamp(min=1e-30)  # clamp: an all-zero row
        q[i:i + n] = wf.div_(scale[i:i + n, None])
    return q, scale


def fp8_rows(x):
    """x [M, in] -> (x8 float8_e4m3fn [M, in], its scale float32 [M, 1]): each row on its own scale, x ~ x8 * scale."""
    x_scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-30)  # clamp: an all-zero row
    return (x.float() / x_scale).to(torch.float8_e4m3fn), x_scale


def fp8_linear_ref(x, q, scale):
    """fp8_matmul's arithmetic in float32: x's rows rounded to fp8 (fp8_rows), times the dequantized weight."""
    x8, x_scale = fp8_rows(x)
    return F.linear(x8.float() * x_scale, q.float() * scale[:, None]).to(x.dtype)


def fp8_matmul(x, q, scale):
    """x [M, in] @ (q * scale).T -> [M, out] in x's dtype by one torch._scaled_mm, x's rows cast to fp8 first."""
    x8, x_scale = fp8_rows(x)
    return torch._scaled_mm(x8, q.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype)


# ---------------------------------------------------------------- the layers' glue: a kernel each
# Between a layer's matmuls torch runs a norm as 4 kernels and RoPE as 6 over a few rows; each Triton kernel below
# does one's work in one launch, the reference's arithmetic step for step (float32 inside, rounded where it rounds).
GLUE_BLOCK = 1024  # elements of a row a program handles at a time: one compiled tile for every model width


def rms_norm_ref(x, w, eps):
    """x normalised in float32, then times w in x's dtype, as Hugging Face's Llama computes it."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], w, eps)  # the same, in one operator
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype) * w


def add_rms_norm_ref(x, y, w, eps):
    """(x + y, rms_norm_ref(x + y, w, eps)): a residual add and the norm after it."""
    s = x + y
    return s, rms_norm_ref(s, w, eps)


@jit
def _row_sum(x_row, y_row, i, dim, RESIDUAL: tl.constexpr):
    """x[i] (+ y[i] in float32, rounded to x's dtype as torch's add rounds; the interpreter cannot add bf16)."""
    x = tl.load(x_row + i, mask=i < dim, other=0.0)
    if RESIDUAL:
        y = tl.load(y_row + i, mask=i < dim, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
    return x


@jit
def _rms_norm_kernel(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, stride_x, dim, eps, RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One row: with RESIDUAL x + y (rounded to x's dtype, stored in sum), its mean square in float32 over a first
    pass, then each element normalised, rounded to x's dtype and times w (rms_norm_ref's steps) over a second."""
    row = tl.program_id(0)
    x_row = x_ptr + _offset(row, stride_x)
    own = _offset(row, dim)  # y, sum and out are contiguous
    squares = tl.zeros([BLOCK], tl.float32)
    for i0 in range(0, dim, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        x = _row_sum(x_row, y_ptr + own, i, dim, RESIDUAL)
        if RESIDUAL:
            tl.store(sum_ptr + own + i, x, mask=i < dim)
        squares += x.to(tl.float32) * x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / dim + eps)
    for i0 in range(0, dim, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        x = _row_sum(x_row, y_ptr + own, i, dim, RESIDUAL)  # added again, not read back: another thread stored it
        normed = (x.to(tl.float32) * rstd).to(x.dtype)
        w = tl.load(w_ptr + i, mask=i < dim, other=0.0)
        tl.store(out_ptr + own + i, normed.to(tl.float32) * w.to(tl.float32), mask=i < dim)


def _norm_rows(x, y, w, eps, s):
    """rms_norm of x (+ y, the sum written into s) by the kernel -> the normed rows, shaped as x; y, s None: x alone."""
    x2 = x.reshape(-1, x.shape[-1])  # [rows, dim], a view where the rows are evenly spaced
    assert x2.stride(-1) == 1 and w.is_contiguous()
    out = x.new_empty(x.shape)
    residual = y is not None
    if not residual:  # out stands in for the pointers RESIDUAL = False never reads or writes
        y = out
        s = out
    _rms_norm_kernel[(len(x2),)](x2, y, w, s, out, x2.stride(0), x2.shape[1], eps, RESIDUAL=residual,
                                 BLOCK=GLUE_BLOCK, num_warps=4)
    return out


def rms_norm(x, w, eps):
    """`rms_norm_ref`'s contract, x [..., dim], w [dim]; one kernel on a GPU."""
    if not use_triton(x):
        return rms_norm_ref(x, w, eps)
    return _norm_rows(x, None, w, eps, None)


def add_rms_norm(x, y, w, eps):
    """`add_rms_norm_ref`'s contract, x and y [..., dim]; one kernel on a GPU."""
    if not use_triton(x):
        return add_rms_norm_ref(x, y, w, eps)
    s = x.new_empty(x.shape)
    return s, _norm_rows(x, y.contiguous(), w, eps, s)


def apply_rope(x, cos, sin):
    """x [..., T, H, D]; cos/sin [..., T, 1, D] (model.rope_tables'): x cos + rotate_half(x) sin, in three operators."""
    xf = x.float()
    return torch.addcmul(xf * cos, xf.roll(x.shape[-1] // 2, -1), sin).to(x.dtype)


def rope_ref(y, cos, sin, heads):
    """y [..., heads_all * D] with its first `heads` heads rotated in place by apply_rope; cos/sin [..., 1, D]."""
    y_heads = y.unflatten(-1, (-1, cos.shape[-1]))  # [..., heads_all, D], a view
    y_heads[..., :heads, :] = apply_rope(y_heads[..., :heads, :], cos, sin)
    return y


def qk_norm_rope_ref(y, cos, sin, q_heads, k_heads, qk_norm, eps):
    """rope_ref(y, cos, sin, q_heads + k_heads) after rms_norm_ref over each of y's first q_heads heads (q) with
    qk_norm's first D weights and over each of its next k_heads (k) with the other D (qwen3's q_norm, k_norm)."""
    D = cos.shape[-1]
    y_heads = y.unflatten(-1, (-1, D))  # [..., heads_all, D], a view
    norms = qk_norm.view(2, D)
    y_heads[..., :q_heads, :] = rms_norm_ref(y_heads[..., :q_heads, :], norms[0], eps)
    y_heads[..., q_heads:q_heads + k_heads, :] = rms_norm_ref(y_heads[..., q_heads:q_heads + k_heads, :], norms[1], eps)
    return rope_ref(y, cos, sin, q_heads + k_heads)


@jit
def _head_normed(x, rstd, w_ptrs, live):
    """x times rstd in float32, rounded to x's dtype, times its weights, rounded again: rms_norm_ref's steps."""
    w = tl.load(w_ptrs, mask=live, other=0.0)
    return ((x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)).to(x.dtype)


@jit
def _rope_kernel(y_ptr, cos_ptr, sin_ptr, norm_ptr, stride_y, D, q_heads, eps, NORM: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """One (row, head): x cos + roll(x, D / 2) sin in float32, in place (rope_tables folds rotate_half's sign into
    sin), x's loads before its store. NORM: x normalised first, by norm's first D weights in q's q_heads heads, by its
    next D in k's (qk_norm_rope_ref's)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    head = y_ptr + _offset(row, stride_y) + h * D
    d = tl.arange(0, BLOCK_D)
    live = d < D
    turned = (d + D // 2) % D
    x = tl.load(head + d, mask=live, other=0.0)
    rolled = tl.load(head + turned, mask=live, other=0.0)
    if NORM:
        weights = norm_ptr + tl.where(h < q_heads, 0, D)
        rstd = 1.0 / tl.sqrt(tl.sum(x.to(tl.float32) * x.to(tl.float32), 0) / D + eps)
        x = _head_normed(x, rstd, weights + d, live)
        rolled = _head_normed(rolled, rstd, weights + turned, live)
    cos = tl.load(cos_ptr + _offset(row, D) + d, mask=live, other=0.0)
    sin = tl.load(sin_ptr + _offset(row, D) + d, mask=live, other=0.0)
    tl.store(head + d, x.to(tl.float32) * cos + rolled.to(tl.float32) * sin, mask=live)


def _rope_rows(y, cos, sin, heads, qk_norm, q_heads, eps):
    """The rope kernel over the first `heads` heads of every row of y, in place; qk_norm None: no norm first."""
    D = cos.shape[-1]
    y2 = y.view(-1, y.shape[-1])  # [rows, heads_all * D]: y is the matmul's fresh output
    assert cos.numel() == sin.numel() == len(y2) * D and cos.is_contiguous() and sin.is_contiguous()
    norm = y2 if qk_norm is None else qk_norm  # y2 stands in for the pointer NORM = False never reads
    assert norm.is_contiguous()
    _rope_kernel[(len(y2), heads)](y2, cos, sin, norm, y2.stride(0), D, q_heads, eps, NORM=qk_norm is not None,
                                   BLOCK_D=triton.next_power_of_2(D), num_warps=1)
    return y


def rope(y, cos, sin, heads):
    """`rope_ref`'s contract, cos/sin a row for each row of y; one kernel on a GPU."""
    if not use_triton(y):
        return rope_ref(y, cos, sin, heads)
    return _rope_rows(y, cos, sin, heads, None, 0, 0.0)


def qk_norm_rope(y, cos, sin, q_heads, k_heads, qk_norm, eps):
    """`qk_norm_rope_ref`'s contract, cos/sin a row for each row of y; one kernel on a GPU, as `rope`'s."""
    if not use_triton(y):
        return qk_norm_rope_ref(y, cos, sin, q_heads, k_heads, qk_norm, eps)
    return _rope_rows(y, cos, sin, q_heads + k_heads, qk_norm, q_heads, eps)


def silu_mul_ref(x):
    """silu(gate) x up for x = [gate | up] [..., 2 ffn] (SwiGLU), each rounded to x's dtype as torch's operators do."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


@jit
def _silu_mul_kernel(x_ptr, out_ptr, ffn, BLOCK: tl.constexpr):
    """A block of one row's [gate | up]: silu(gate) in float32 rounded to x's dtype, times up (silu_mul_ref's)."""
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < ffn
    gate = tl.load(x_ptr + _offset(row, 2 * ffn) + i, mask=live, other=0.0)
    up = tl.load(x_ptr + _offset(row, 2 * ffn) + ffn + i, mask=live, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + _offset(row, ffn) + i, act.to(tl.float32) * up.to(tl.float32), mask=live)


def silu_mul(x):
    """`silu_mul_ref`'s contract; one kernel on a GPU."""
    if not use_triton(x):
        return silu_mul_ref(x)
    x2 = x.contiguous().view(-1, x.shape[-1])  # [rows, 2 ffn]
    ffn = x2.shape[1] // 2
    out = x.new_empty(*x.shape[:-1], ffn)
    _silu_mul_kernel[(len(x2), triton.cdiv(ffn, GLUE_BLOCK))](x2, out, ffn, BLOCK=GLUE_BLOCK, num_warps=4)
    return out


# ---------------------------------------------------------------- the backend: what a model and its cycles call
class Backend:
    """The operations a model's forward and a cycle run, each by its PyTorch reference above: what runs where Triton
    does not (`TritonBackend` runs the kernels). The engine picks one per device when it is built (`for_device`) and
    hands it down with the models (Transformer.backend); the CPU wing's (cpu/backend.py) runs its own kernels where it
    has them, behind these same calls."""

    def linear(self, x, w, bias=None):
        """x [..., in] @ w.T + bias [out]; w a plain tensor, or a weight format's module that multiplies itself."""
        if isinstance(w, torch.nn.Module):
            return w.forward(x, bias)  # a module without hooks: its call's machinery is overhead
        return F.linear(x, w, bias)

    def normed_linear(self, x, norm, eps, w, bias=None, rope=None):
        """linear(rms_norm(x, norm, eps), w, bias), the output's first `heads` heads (of cos's width) rotated by rope =
        (cos, sin, heads) as rope_ref rotates them."""
        y = self.linear(self.rms_norm(x, norm, eps), w, bias)
        if rope is None:
            return y
        cos, sin, heads = rope
        return self.rope(y, cos, sin, heads)

    def residual_normed_linear(self, x, y, norm, eps, w):
        """(x + y, linear(rms_norm(x + y, norm, eps), w)): a residual add, the norm after it, the matmul after that."""
        s, h = self.add_rms_norm(x, y, norm, eps)
        return s, self.linear(h, w)

    def gated_linear(self, x, w):
        """linear(silu(gate) x up, w) for x = [gate | up] [..., 2 ffn] (SwiGLU)."""
        return self.linear(self.silu_mul(x), w)

    def fused_layers(self, blocks, x, cache, tree=None):
        """What every layer of a step of x [R, N, T, dim] shares where each runs in one call (`layer`'s fused): None
        here, a layer runs by its block's calls (the CPU wing's compiled layer has one)."""
        return None

    def layer(self, block, i, x, cos, sin, attend, fused=None):
        """Decoder layer i (block, a model.Block) of a step: the block's calls."""
        return block.forward(x, cos, sin, attend, i)

    rms_norm = staticmethod(rms_norm_ref)
    add_rms_norm = staticmethod(add_rms_norm_ref)
    rope = staticmethod(rope_ref)
    qk_norm_rope = staticmethod(qk_norm_rope_ref)
    silu_mul = staticmethod(silu_mul_ref)
    prefill_attention = staticmethod(prefill_attention)
    particle_attention = staticmethod(particle_attention_ref)
    sample = staticmethod(sample_ref)
    token_logprobs = staticmethod(token_logprobs_ref)
    resample = staticmethod(resample_ref)
    gather_suffix = staticmethod(gather_suffix_ref)
    compact = staticmethod(compact)


class TritonBackend(Backend):
    """Backend by the Triton kernels, each of which takes its reference where `use_triton` says its tensors are not
    Triton's (a CPU tensor, unless TRITON_INTERPRET=1 was set before import)."""
    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rope = staticmethod(rope)
    qk_norm_rope = staticmethod(qk_norm_rope)
    silu_mul = staticmethod(silu_mul)
    particle_attention = staticmethod(particle_attention)
    sample = staticmethod(sample)
    token_logprobs = staticmethod(token_logprobs)
    resample = staticmethod(resample)
    gather_suffix = staticmethod(gather_suffix)


def for_device(device):
    """-> the Backend of a device (a torch.device or its name): Triton's kernels where they run (use_triton), else the
    references."""
    if use_triton(torch.empty(0, device=device)):
        return TritonBackend()
    return Backend()
