"""The CPU kernels torch lacks: w4a8, a matmul of 4-bit (or 6- or 8-bit) weight codes times activations quantized to
int8 per row and superblock of 256 inputs, summed in int32 (vpdpbusd), beside the few-line PyTorch reference that
defines it; and particle attention for a step's few rows, whose reference is kernels.particle_attention_ref; and the
two with a layer's residual adds as one call a decoder layer (decoder_layer), whose reference is model.Block's
calls. Their C source, native.c, is compiled for this CPU on first use into the user's cache folder (installing
compiles nothing); where no compiler works, `library()` says why and the engine falls back to int4 and torch's
attention."""
import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import types

import torch

from cpu import store

GROUP = 32  # inputs sharing a weight scale and low
PANEL = 16  # output columns the kernel computes side by side (one 512-bit register of int32 sums)
SUPER = 8  # groups whose scales share one float a column, and an activation step: a superblock of 256 inputs
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


# ---------------------------------------------------------------- the reference
def quantize_rows_ref(x):
    """x [..., in] float32 -> (xq int8 [..., in], dx [..., in / 32], xs [..., in / 32]): each superblock of 256 inputs
    of a row (8 groups of 32, as the weights' scales share an f16; the last maybe fewer) in steps of its largest |x|
    / 127, rounded half to even; dx its step for each of its groups, xs = dx x the sum of a group's codes. No row
    depends on another."""
    xg = x.float().unflatten(-1, (-1, GROUP))  # [..., in / 32, 32]
    groups = xg.shape[-2]
    amax = xg.abs().amax(-1)  # [..., in / 32]
    blocks = torch.nn.functional.pad(amax, (0, -groups % SUPER)).unflatten(-1, (-1, SUPER)).amax(-1)  # [..., sb]
    dx = blocks.repeat_interleave(SUPER, -1)[..., :groups] / 127  # [..., in / 32]
    q = torch.where(dx[..., None] > 0, xg / dx[..., None], torch.zeros_like(xg)).round()
    return q.to(torch.int8).flatten(-2), dx, dx * q.sum(-1)


def split_scales(values, per, rounding=torch.round):
    """values [out, n] float32 (a group's scales or lows; 6-bit: a half group's scales), per of them a superblock ->
    (d float16 [out, n / per], q int8 [out, n]): value = d x q, as packed. Exact where the values allow it (a K
    block's d times its 6-bit sc or m, or Q6_K's int8 sc: the greatest common step of a superblock's values); else
    d = the largest |value| / 127 and q = rounding(value / d)."""
    n = values.shape[1]
    padded = torch.nn.functional.pad(values.float(), (0, -n % per)).unflatten(1, (-1, per))  # [out, sb, per]
    amax = padded.abs().amax(-1, keepdim=True)
    # a K block's values have at most 19 significant bits and reach down to amax / 128: whole multiples of this
    unit = torch.exp2(torch.floor(torch.log2(amax.clamp(min=2**-100))) - 26)
    m = padded / unit
    whole = m.round()
    exact = (m == whole).all(-1, keepdim=True)
    m = whole.int()
    step = m[..., 0].abs()
    for j in range(1, per):
        step = torch.gcd(step, m[..., j])
    step = step.clamp(min=1)[..., None].double() * unit.double()  # [out, sb, 1]
    amax = amax.double()
    d = half_up(torch.where(amax > 0, amax / 127, torch.ones_like(amax)))
    top = padded.amax(-1, keepdim=True).double() / step
    bottom = padded.amin(-1, keepdim=True).double() / step
    at = (exact & (amax > 0) & (torch.maximum(top, -bottom) <= 128)).nonzero(as_tuple=True)
    d[at] = exact_step(step[at], top[at], bottom[at], d[at])
    d = d.float()
    q = rounding(padded / d).clamp(-128, 127)  # exact quotients where d is the common step
    return d[..., 0].half(), q.flatten(1)[:, :n].to(torch.int8)


def half_up(x):
    """float64 x > 0 -> the float16 at or above it nearest to it (at least float16's smallest step), as float64."""
    h = x.clamp(min=2.0**-24).half()
    below = h.double() < x
    h[below] = torch.nextafter(h[below], torch.full_like(h[below], float("inf")))
    return h.double()


def exact_step(step, top, bottom, fallback):
    """A superblock's common step over the smallest t (1, 2, ...) that float16 holds and that keeps its values
    within int8 (they reach top steps up and -bottom down), negated where only that does (Q6_K's d may be negative,
    its sc -128), else fallback. All float64 [k]."""
    d = fallback.clone()
    todo = torch.arange(len(step))  # those still searched: fewer each round
    for t in range(1, 128):
        candidate = step[todo] / t
        up = top[todo] * t
        down = -bottom[todo] * t
        held = candidate.half().double() == candidate
        positive = held & (up <= 127) & (down <= 128)
        negative = held & ~positive & (down <= 127) & (up <= 128)
        d[todo[positive]] = candidate[positive]
        d[todo[negative]] = -candidate[negative]
        todo = todo[~(positive | negative) & (torch.maximum(up, down) <= 128)]
        if not len(todo):
            break
    return d


def as_packed(values, per, rounding=torch.round):
    """values [out, n] -> float32: as the kernel sees them, split_scales' d x q."""
    d, q = split_scales(values, per, rounding)
    return d.float().repeat_interleave(per, 1)[:, :values.shape[1]] * q.float()


def dequantize(codes, scale, low):
    """codes [out, in] (0..15, 0..63 or 0..255), scale and low [out, in / 32] (6-bit: [out, in / 16], low = -32 x
    scale) -> float32 w [out, in] as the kernel sees it (scale and low as packed: split_scales')."""
    size = codes.shape[1] // scale.shape[1]  # inputs a scale
    scale = as_packed(scale, SUPER * GROUP // size)  # per superblock: 8 groups' scales, or 16 half groups'
    low = -32 * scale if size == 16 else as_packed(low, SUPER)
    w = codes.float().unflatten(1, (-1, size)) * scale[..., None] + low[..., None]
    return w.flatten(1)


def w4a8_linear_ref(x, codes, scale, low, outliers=None):
    """x [..., in] @ w.T for w = dequantize(codes, scale, low), x rounded as quantize_rows_ref rounds it. outliers (at
    int32 [n], w_at [n, out]): x's inputs at channels `at` kept out of the rounding (zero there) and times w_at, w's
    columns there, in float32."""
    aside = None
    if outliers is not None:
        at = outliers[0].long()
        aside = x[..., at]  # [..., n]
        x = x.index_fill(-1, at, 0)
    xq, dx, _ = quantize_rows_ref(x)
    x_hat = (xq.float().unflatten(-1, (-1, GROUP)) * dx[..., None]).flatten(-2)
    y = x_hat @ dequantize(codes, scale, low).T
    if aside is None:
        return y
    return y + aside @ outliers[1]


def columns(packed, bits, n, at):
    """w's columns at inputs `at` (int [k]) of packed = pack(codes, scale, low, bits) for n inputs -> float32 [k, out]:
    dequantize(codes, scale, low)[:, at].T, read from the packed bytes (a group's codes, its scales and lows)."""
    codes_bytes = bits * PANEL * GROUP // 8  # a group's codes, then its scales' int8 q (and its lows')
    group = codes_bytes + 2 * PANEL  # native.c's group_bytes
    head = 2 * PANEL if bits == 6 else 4 * PANEL  # head_bytes: the f16 d of a superblock's scales (and lows)
    out = []
    for c in at.tolist():
        g = c // GROUP
        i = c % GROUP  # the input within its group: vector i // 4 of 8, byte 4 x column + i % 4
        start = g // SUPER * (head + SUPER * group)
        d = packed[:, start:start + head].contiguous().view(torch.float16).float()  # [panels, 16 | 32]
        body = packed[:, start + head + g % SUPER * group:][:, :group].long()  # [panels, group bytes]
        t = i // 4
        lanes = torch.arange(PANEL) * 4 + i % 4
        if bits == 8:
            code = body[:, 64 * t + lanes]
        else:
            code = body[:, 64 * (t % 4) + lanes] >> 4 * (t // 4) & 15
        if bits == 6:
            code = code | (body[:, 256 + 64 * (t % 2) + lanes] >> 2 * (t // 2) & 3) << 4
            q = body[:, codes_bytes + PANEL * (i // 16) + torch.arange(PANEL)]  # its half group's
            scale = d * torch.where(q > 127, q - 256, q).float()
            low = -32 * scale
        else:
            q = body[:, codes_bytes + torch.arange(2 * PANEL)]
            q = torch.where(q > 127, q - 256, q).float()
            scale = d[:, :PANEL] * q[:, :PANEL]
            low = d[:, PANEL:] * q[:, PANEL:]
        out.append((code.float() * scale + low).flatten())  # [panels x 16]
    return torch.stack(out)


# ---------------------------------------------------------------- weights: quantized, packed
def quantize(w, bits):
    """w [out, in] -> (codes uint8 [out, in] in 0 .. 2^bits - 1, scale, low float32 [out, in / 32]): asymmetric per
    group of 32 inputs, w ~ scale x code + low, scale and low first made what the kernel stores (scale rounded up,
    low down: every group's range still covered) so the codes see them. 6 bits: as a GGUF file's Q6_K, symmetric per
    16 (quantize_6)."""
    if bits == 6:
        return quantize_6(w)
    n = max(1, 2**22 // w.shape[1])  # rows at a time: the float32 temporaries stay small
    chunks = (w[i:i + n].float().unflatten(1, (-1, GROUP)) for i in range(0, len(w), n))  # [n, in / 32, 32]
    low_high = torch.cat([torch.stack([wg.amin(-1), wg.amax(-1)]) for wg in chunks], 1)  # [2, out, in / 32]
    low = as_packed(low_high[0], SUPER, torch.floor)
    high = low_high[1]
    scale = as_packed(((high - low) / (2**bits - 1)).clamp(min=1e-7), SUPER, torch.ceil)
    codes = torch.empty(w.shape, dtype=torch.uint8)
    for i in range(0, len(w), n):
        steps = (w[i:i + n].float().unflatten(1, (-1, GROUP)) - low[i:i + n, :, None]) / scale[i:i + n, :, None]
        codes[i:i + n] = steps.round().clamp(0, 2**bits - 1).flatten(1)
    return codes, scale, low


def quantize_6(w):
    """w [out, in] -> (codes in 0 .. 63, scale [out, in / 16] float32, low = -32 x scale): w ~ scale x (code - 32),
    the largest |w| of each 16 inputs at 31 steps, the scale as the kernel stores it (rounded up)."""
    wg = w.float().unflatten(1, (-1, 16))  # [out, in / 16, 16]
    scale = as_packed((wg.abs().amax(-1) / 31).clamp(min=1e-7), 2 * SUPER, torch.ceil)
    codes = (wg / scale[..., None]).round().clamp(-32, 31) + 32
    return codes.to(torch.uint8).flatten(1), scale, -32 * scale


def pack(codes, scale, low, bits):
    """codes [out, in] of 4, 6 or 8 bits, scale and low [out, in / 32] (6-bit: quantize_6's) -> uint8 [out / 16,
    bytes a panel]: native.c's layout. A panel of 16 columns is superblocks of 8 groups of 32 inputs (the last
    maybe fewer): its 16 f16 d of the scales (and of the lows), then each group's codes as 8 vectors of 4 inputs x 16
    columns and its int8 q of the scales and lows (6-bit: of the scales of its first 16 inputs, then its last 16)."""
    out, n = codes.shape
    if out % PANEL or n % GROUP:
        raise ValueError(f"w4a8 needs matmul weights of 16k x 32k, not {tuple(codes.shape)}")
    panels = out // PANEL
    groups = n // GROUP
    v = codes.to(torch.uint8).reshape(panels, PANEL, groups, 8, 4).permute(0, 2, 3, 1, 4)
    v = v.reshape(panels, groups, 8, PANEL * 4)  # [panels, groups, vector t, 4 x column + input]
    if bits < 8:
        low_bits = v & 15
        high = v >> 4  # 6-bit codes' top two bits: vector t's at bits 2 (t // 2) of vector t % 2
        v = low_bits[:, :, :4] | low_bits[:, :, 4:] << 4  # vector t in the low nibbles, t + 4 in the high ones
    if bits == 6:
        high = high.unflatten(2, (4, 2))  # [panels, groups, t // 2, t % 2, 64]
        packed_high = high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6
        v = torch.cat([v, packed_high], 2)  # [panels, groups, 6, 64]
    parts = [(scale, 2 * SUPER if bits == 6 else SUPER)]
    if bits != 6:  # 6-bit lows are -32 x the scales
        parts.append((low, SUPER))
    heads = []
    qs = []
    for values, per in parts:
        d, q = split_scales(values, per)
        heads.append(d.reshape(panels, PANEL, -1).transpose(1, 2))  # [panels, superblocks, 16]
        qs.append(q.reshape(panels, PANEL, groups, -1).permute(0, 2, 3, 1).flatten(2))  # [panels, groups, 16 | 32]
    head = torch.cat(heads, -1).contiguous().view(torch.uint8)  # [panels, superblocks, 32 | 64]
    body = torch.cat([v.flatten(2), *(q.view(torch.uint8) for q in qs)], -1)  # [panels, groups, bytes a group]
    body = torch.nn.functional.pad(body, (0, 0, 0, -groups % SUPER)).unflatten(1, (-1, SUPER)).flatten(2)
    whole = torch.cat([head, body], -1).flatten(1)  # [panels, superblocks x (head + 8 groups)]
    return whole[:, :whole.shape[1] - (-groups % SUPER) * body.shape[-1] // SUPER].contiguous()


# ---------------------------------------------------------------- the compiled kernel
def compiler():
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(cc, flags=FLAGS):
    """-> the path of native.c compiled by cc with flags, built once into the cache folder, keyed on the source,
    the compiler and what -march=native means here (its predefined macros); raises OSError with the compiler's
    message."""
    ident = subprocess.run([cc, *flags[:2], "-dM", "-E", "-"], input="", capture_output=True, text=True)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(open(SOURCE, "rb").read() + (version + ident.stdout + " ".join(flags)).encode())
    path = os.path.join(store.cache_folder(), f"native-{platform.machine()}-{key.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    with store.atomically(path) as tmp:  # whole or not at all: another process may load it at once
        run = subprocess.run([cc, *flags, "-o", tmp, SOURCE], capture_output=True, text=True)
        if run.returncode != 0:
            said = run.stderr.strip().splitlines() or [f"exit status {run.returncode}"]
            raise OSError(f"{cc} failed: {said[-1]}")
    return path


def load(path):
    """The compiled library with its argument types. torch is imported first, so its OpenMP runtime is the one the
    library links: one pool of threads, not two fighting over the cores."""
    lib = ctypes.CDLL(path)
    i64 = ctypes.c_int64
    ptr = ctypes.c_void_p
    lib.quantize_rows.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.linear.argtypes = [ptr, ctypes.c_int, i64, ptr, ctypes.c_int, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_float,
                           ctypes.c_int, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.particle_attention.argtypes = [ptr] * 8 + [ctypes.c_float] + [i64] * 8 + [ptr, ctypes.c_int]
    lib.decoder_layer.argtypes = ([ptr, i64, i64, i64, ptr, ptr, ptr] + [ptr] * 7
                                  + [i64, i64, ptr, ptr, ptr, ctypes.c_int])
    lib.rows_logprobs.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.isa.restype = ctypes.c_char_p
    return lib


_library = {}


def library():
    """-> (the compiled kernel library or None, a one-line reason where None), built and loaded once a process."""
    if not _library:
        cc = compiler()
        try:
            if cc is None:
                raise OSError("no C compiler found (set CC, or install gcc)")
            _library["lib"] = load(build(cc))
            _library["why"] = ""
        except (OSError, subprocess.SubprocessError) as error:
            _library["lib"] = None
            _library["why"] = f"the w4a8 kernel cannot be built here ({error})"
    return _library["lib"], _library["why"]


def traced(name):
    """A torch.profiler record named native::name around a C call while a trace runs (the profiler cannot see
    ctypes calls otherwise, so bench.py profile would miss them); nothing otherwise."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"native::{name}")
    return contextlib.nullcontext()


def isa():
    """The instruction set the kernel was built for here ("avx512_vnni", "avx_vnni", "avx2", "portable"), or None."""
    lib, _ = library()
    return lib.isa().decode() if lib else None


def quantize_rows(x2):
    """x2 [rows, in] float32, contiguous -> quantize_rows_ref's (xq, dx, xs), by the compiled kernel: w4a8_linear's
    first half alone."""
    lib, _ = library()
    rows, n = x2.shape
    xq = torch.empty(n // GROUP, rows, GROUP, dtype=torch.int8)  # group-major, as the kernel keeps them
    dx = torch.empty(n // GROUP, rows)
    xs = torch.empty(n // GROUP, rows)
    xo = torch.empty(n // GROUP, rows, 2, dtype=torch.int32)  # 32 x the sum of each 16 codes: 6-bit matmuls' own
    with traced("quantize_rows"):
        lib.quantize_rows(x2.data_ptr(), rows, n, xq.data_ptr(), dx.data_ptr(), xs.data_ptr(), xo.data_ptr(),
                          torch.get_num_threads())
    return xq.transpose(0, 1).reshape(rows, n), dx.T, xs.T


_scratch = threading.local()  # each thread's room for its quantized rows (MineDraft's two halves run at once)


def scratch(size):
    """uint8 [at least size] of this thread's, grown as calls need."""
    if getattr(_scratch, "t", None) is None or len(_scratch.t) < size:
        _scratch.t = torch.empty(size, dtype=torch.uint8)
    return _scratch.t


OUTLIERS = 8  # the most outlier channels a weight may have: the room linear_scratch leaves for their inputs


def linear_scratch(rows, n):
    """Bytes of the C linear's scratch for rows of n inputs: xq; dx, xs, xo (two int32 a group); 1 / rms; each row's
    distinct row and their count; each row's outlier inputs."""
    return rows * n + 16 * rows * (n // GROUP) + 4 * rows + 4 * (rows + 1) + 4 * OUTLIERS * rows


def w4a8_linear(x, packed, bits, bias=None, norm=None, eps=0.0, gated=False, rope=None, tail=None, outliers=None):
    """x [..., in] float32 @ w.T + bias [out] for packed = pack(codes, scale, low, bits): w4a8_linear_ref's math by
    the compiled kernel (float32 sums in another order), x quantized and multiplied in one call. tail (packed,
    bits): more rows of w after packed's, in other bits (a fused q/k/v whose v a file holds wider). norm [in]: x's
    rows RMS-normalised first, times norm (F.rms_norm(x, (in,), norm, eps)). gated: x is [..., 2 in], gate then up,
    and the input silu(gate) x up (SwiGLU's). rope (cos, sin, heads): the output's first `heads` heads rotated after
    the bias (kernels.apply_rope's), cos and sin one [D] row per row of x. outliers (at, w_at): as the reference's, of
    the prepared input (after the norm or the gate). All in the same call."""
    if gated and norm is not None:
        raise ValueError("w4a8_linear gates or normalises its input, not both")
    x = x.float().contiguous()
    n = x.shape[-1] // (1 + gated)
    rows = x.numel() // x.shape[-1]
    head = packed.shape[0] * PANEL
    tail_packed = None
    tail_bits = 0
    if tail is not None:
        tail_packed, tail_bits = tail
    out = head + (0 if tail is None else tail_packed.shape[0] * PANEL)
    y = x.new_empty(*x.shape[:-1], out)
    room = scratch(linear_scratch(rows, n))
    cos = None
    sin = None
    heads = 0
    D = 0
    if rope is not None:
        cos, sin, heads = rope
        D = cos.shape[-1]
        if cos.numel() != rows * D or sin.shape != cos.shape or heads * D > out:
            raise ValueError(f"rope's cos and sin {tuple(cos.shape)} must give each of the {rows} rows its own, "
                             f"for {heads} heads of at most {out // max(D, 1)}")
    at, w_at, count = outlier_args(outliers, out)
    lib = _library.get("lib") or library()[0]
    with traced("linear"):
        lib.linear(packed.data_ptr(), bits, head, pointer(tail_packed, torch.uint8), tail_bits, out, n, x.data_ptr(),
                   rows, y.data_ptr(), pointer(bias), pointer(norm), eps, gated, pointer(cos), pointer(sin), heads, D,
                   at, w_at, count, room.data_ptr(), torch.get_num_threads())
    return y


def outlier_args(outliers, out):
    """(at, w_at) -> the C code's pointers and count, checked; None -> none."""
    if outliers is None:
        return None, None, 0
    at, w_at = outliers
    if len(at) > OUTLIERS or w_at.shape != (len(at), out):
        raise ValueError(f"w4a8's outliers are at most {OUTLIERS} channels and their columns [{len(at)}, {out}], "
                         f"not {tuple(w_at.shape)}")
    return pointer(at, torch.int32), pointer(w_at), len(at)


def pointer(t, dtype=torch.float32):
    """A contiguous tensor's data (w4a8's parameters: float32, packed weights uint8), or NULL for None."""
    if t is None:
        return None
    if t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"w4a8's bias, norm, cos and sin are contiguous float32, its weights uint8, not {t.dtype}")
    return t.data_ptr()


# ---------------------------------------------------------------- attention of a few new rows
SMALL_ATTENTION = 8192  # a KV group's query rows x keys up to which the compiled attention beats torch's fused one
# rows x keys up to which a step's layers stay whole in decoder_layer: past SMALL_ATTENTION its attention costs more
# than torch's, yet less than the layer's calls one by one cost (a long prompt's ar steps)
FUSED_ATTENTION = 1 << 16


def particle_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree=None,
                       large=None):
    """kernels.particle_attention_ref's contract (its shapes; float32, the caches contiguous): each request by the
    compiled kernel (a running softmax a query row, a call's fixed cost a few microseconds) where its KV group's rows
    x keys are at most SMALL_ATTENTION, else by large(the same arguments, that request's): torch's fused attention,
    whose blocked products win at long prompts. Per request, so a request's result never depends on the others'."""
    _, N, T, Hq, _ = q.shape
    G = Hq // prefix_k.shape[1]
    out = torch.empty_like(q)
    lengths = (prefix_len + suffix_len).tolist()
    if small(N * T * G, max(lengths) + T):  # every request small: one call
        attention_call(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree, out)
        return out
    for r, keys in enumerate(lengths):
        one = slice(r, r + 1)
        parts = (q[one], prefix_k[one], prefix_v[one], suffix_k[one], suffix_v[one], prefix_len[one], suffix_len[one])
        at_r = None if tree is None else tree[one]
        if not small(N * T * G, keys + T):
            out[one] = large(*parts, scale, at_r)
        else:
            attention_call(*parts, scale, at_r, out[one])
    return out


def small(rows, keys, limit=None):
    """Whether a request's attention of rows query rows a KV head over keys keys is the compiled kernel's to run
    (limit: the rows x keys it may take, default SMALL_ATTENTION's)."""
    return rows * keys <= (limit or SMALL_ATTENTION)


def attention_call(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale, tree, out):
    """out (contiguous) = the compiled kernel's particle attention of one request."""
    lib, _ = library()
    R, N, T, Hq, D = q.shape
    q = q.contiguous()
    tree_bytes = None
    if tree is not None:
        tree_bytes = tree.to(torch.uint8).contiguous()
    with traced("particle_attention"):
        lib.particle_attention(q.data_ptr(), prefix_k.data_ptr(), prefix_v.data_ptr(), suffix_k.data_ptr(),
                               suffix_v.data_ptr(), prefix_len.data_ptr(), suffix_len.data_ptr(),
                               pointer(tree_bytes, torch.uint8), scale, R, N, T, Hq, prefix_k.shape[1], D,
                               prefix_k.shape[2], suffix_k.shape[3], out.data_ptr(), torch.get_num_threads())


# ---------------------------------------------------------------- a decoder layer's step in one call
class Matmul(ctypes.Structure):
    """native.c's struct matmul: a w4a8 weight as w4a8_linear takes it (bias None: 0), its outliers' struct last."""
    _fields_ = [("w", ctypes.c_void_p), ("tail", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("head", ctypes.c_int64),
                ("out", ctypes.c_int64), ("in_", ctypes.c_int64), ("bits", ctypes.c_int32),
                ("tail_bits", ctypes.c_int32), ("at", ctypes.c_void_p), ("w_at", ctypes.c_void_p),
                ("outliers", ctypes.c_int64)]


class Layer(ctypes.Structure):
    """native.c's struct layer: a decoder layer's four w4a8 weights, its norms, eps, attention's scale and heads."""
    _fields_ = [("qkv", Matmul), ("wo", Matmul), ("w13", Matmul), ("w2", Matmul), ("attn_norm", ctypes.c_void_p),
                ("ffn_norm", ctypes.c_void_p), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64)]


def matmul(packed, bits, n, tail=None, bias=None, outliers=None):
    """-> Matmul of w4a8_linear's (packed, bits, tail, bias, outliers) for n inputs; the tensors must outlive it."""
    m = Matmul(w=packed.data_ptr(), bits=bits, head=packed.shape[0] * PANEL, in_=n, bias=pointer(bias))
    m.out = m.head
    if tail is not None:
        m.tail = tail[0].data_ptr()
        m.tail_bits = tail[1]
        m.out += tail[0].shape[0] * PANEL
    m.at, m.w_at, m.outliers = outlier_args(outliers, m.out)
    return m


LAYER_PARTS = ("matmuls", "attention and KV writes", "residual adds")
FUSED_LAYER = "decoder_layer"  # its trace record's name: a profile splits its time by LAYER_PARTS (timing())
_timings = []  # the arrays of the timing() blocks open now, the innermost last


@contextlib.contextmanager
def timing():
    """Yields seconds by part (LAYER_PARTS) that decoder_layer's calls in the block add to; outside every such block
    its C code reads no clock (bench.py parts asks, the engine does not)."""
    seconds = (ctypes.c_double * len(LAYER_PARTS))()
    _timings.append(seconds)
    try:
        yield seconds
    finally:
        _timings.pop()


def layer_timing():
    """-> the array decoder_layer adds its seconds to (the innermost timing() block's), or None: untimed."""
    if _timings:
        return _timings[-1]
    return None


def fused_step(x, layers, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, tree=None):
    """-> what each layer's call of a step of x [R, N, T, dim] float32 shares (decoder_layer's `step`), made once a
    step: layers (Layer each, the caches' [L, ...] in order), the caches (as particle_attention takes them, with the
    layers first) and their bytes from one layer to the next, tree's bytes (tree as there), the scratch room."""
    R, N, T, dim = x.shape
    rows = R * N * T
    first = layers[0]
    widest = max(first.qkv.in_, first.wo.in_, first.w13.in_, first.w2.in_)
    floats = rows * (first.qkv.out + first.Hq * first.D + dim + first.w13.out)  # decoder_layer's work
    tree_bytes = None
    if tree is not None:
        tree_bytes = tree.to(torch.uint8).contiguous()
    caches = (prefix_k, prefix_v, suffix_k, suffix_v)
    return types.SimpleNamespace(layers=layers, caches=[c.data_ptr() for c in caches],
                                 steps=[c.stride(0) * c.element_size() for c in caches], prefix_len=prefix_len,
                                 suffix_len=suffix_len, P=prefix_k.shape[3], S=suffix_k.shape[4], tree=tree_bytes,
                                 room=scratch(4 * floats + linear_scratch(rows, widest)), floats=floats)


def decoder_layer(step, i, x, cos, sin):
    """x [R, N, T, dim] float32 through layer i of step (fused_step's) in place, in one call: model.Block's step, its
    calls' arithmetic (the same tokens), its K/V written at suffix_len + t. cos, sin [R, N, T, 1, D]. Within a
    timing() block it adds its seconds by part (LAYER_PARTS) to the block's array."""
    lib = _library.get("lib") or library()[0]
    R, N, T, _ = x.shape
    at = [c + i * s for c, s in zip(step.caches, step.steps)]  # layer i's part of each cache
    room = step.room.data_ptr()
    with traced(FUSED_LAYER):
        lib.decoder_layer(x.data_ptr(), R, N, T, ctypes.addressof(step.layers[i]), cos.data_ptr(), sin.data_ptr(), *at,
                          step.prefix_len.data_ptr(), step.suffix_len.data_ptr(), pointer(step.tree, torch.uint8),
                          step.P, step.S, room, room + 4 * step.floats, layer_timing(), torch.get_num_threads())
    return x


# ---------------------------------------------------------------- sampling
SAMPLE_CHUNK = 256  # native.c's: the entries a partial sum covers (the work's size)


def rows_logprobs(logits, temperature, tokens, u=None):
    """The C rows_logprobs: logits [B, V] float32, temperature [B] float32 (a row's own), tokens int64 [B] (with u,
    float32 [B] uniforms in [0, 1): drawn into them) -> their log-probs float32 [B]. Nothing of [B, V] is allocated:
    its work is each row's largest logit, 1 / temperature, where the largest is (int64), and its sums a chunk."""
    B, V = logits.shape
    out = torch.empty(B)
    work = torch.empty(4 * B + B * -(-V // SAMPLE_CHUNK))
    lib = _library.get("lib") or library()[0]
    with traced("rows_logprobs"):
        lib.rows_logprobs(logits.data_ptr(), B, V, temperature.data_ptr(), pointer(u), tokens.data_ptr(),
                          out.data_ptr(), work.data_ptr(), torch.get_num_threads())
    return out


def sample(logits, temperature, u):
    """kernels.sample_ref's draw by the compiled code: logits [B, V] float32, temperature and u float32 [B] (a row's
    own, u uniform in [0, 1)) -> tokens int64 [B], log-probs float32 [B]."""
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    return tokens, rows_logprobs(logits, temperature, tokens, u)


def token_logprobs(logits, tokens, temperature):
    """kernels.token_logprobs_ref by the compiled code: logits [B, V] float32, tokens int64 [B], temperature float32
    [B] (a row's own) -> float32 [B]."""
    return rows_logprobs(logits, temperature, tokens)
