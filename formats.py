"""Weight formats: one holds every matmul weight (FORMATS), as packed bf16 or float32, int8, int4, w4a8 or calibrated
w8a8 (Quantized); converting a model's weights into one. Which one runs fastest on this machine is auto.py's question."""
import logging

import torch

import kernels
import model
from cpu import native

log = logging.getLogger("smcsd")

# One format holds every matmul weight (each block's wqkv, wo, w13, w2 and the head); activations, embeddings and norms
# are in the dtype its kernels are fast with. None is fastest everywhere (on AVX2 without native bf16, oneDNN cannot
# pack bf16, whose F.linear cost grows with rows; torch's int8 and int4 kernels want bf16 activations, much slower with
# float32; w8a8's int8 products need float32 ones, calibrated; w4a8's kernel rounds float32 ones to int8 itself):
# auto.py times them on the machine.
FORMATS = {"bf16": torch.bfloat16, "float32": torch.float32, "int8": torch.bfloat16, "int4": torch.bfloat16,
           "w8a8": torch.float32, "w4a8": torch.float32}
MATMULS = ("wqkv", "wo", "w13", "w2", "lm_head")  # a block's matmul weights, then the model's head


def weight_format(fmt, device="cpu"):
    """-> weight format fmt's activations dtype on device, or a one-line LoadError, before any weight is read."""
    if fmt not in FORMATS:
        raise model.LoadError(f"weights {fmt!r} is not a weight format; use one of {', '.join(FORMATS)}")
    kind = torch.device(device).type
    if fmt[:3] == "int" and not (kind == "cpu" or kind == "cuda" and kernels.triton):
        raise model.LoadError(f"{fmt} weights run on the CPU and on CUDA with Triton; use bf16 on {kind}")
    if fmt == "w8a8" and kind != "cpu":
        raise model.LoadError(f"w8a8 weights run on the CPU only (FBGEMM's int8 products); use int8 on {device}")
    if fmt == "w4a8" and kind != "cpu":
        raise model.LoadError(f"w4a8 weights run on the CPU only (native.c); use int4 on {device}")
    return FORMATS[fmt]


def usable(fmt):
    """fmt, or int4 where it is w4a8 and its kernel cannot be built here (a line on the "smcsd" log says why)."""
    lib, why = native.library()
    if fmt != "w4a8" or lib is not None:
        return fmt
    log.warning("%s; using int4 (torch's kernel) instead of w4a8", why)
    return "int4"


class Quantized(torch.nn.Module):
    """A matmul weight [out, in] in int8, int4, w4a8 or w8a8, built from the tensors it keeps (`quantized` makes them
    from a plain weight; `tensors()` gives them back, as weight_cache.py keeps them): int8 and int4 q and scale for
    kernels.quantized_linear; w4a8 native's packed codes of `bits` bits (and, tail_bits > 0, more rows in tail,
    of tail_bits: a fused q/k/v whose v a file holds wider) and, once calibrated (keep_outliers), its outlier input
    channels and their float32 columns; w8a8 q and scale, packed by FBGEMM at construction (`packed_bytes` of it),
    and float32 outlier columns (kernels.w8a8_linear). Parameters where it can, so weight_bytes counts them."""

    def __init__(self, fmt, tensors, bits=4, tail_bits=0):
        super().__init__()
        self.fmt = fmt
        self.bits = bits
        self.tail_bits = tail_bits
        self.packed_bytes = 0
        if fmt == "w8a8":
            q = tensors["q"]
            self.packed = kernels.pack_w8a8(q, tensors["scale"])
            self.outliers = tensors["outliers"]
            self.w_outliers = torch.nn.Parameter(tensors["w_outliers"], requires_grad=False)
            self.packed_bytes = q.numel() + 4 * len(q)  # int8 values, a float32 scale a row
            return
        for name, t in tensors.items():
            setattr(self, name, torch.nn.Parameter(t, requires_grad=False))

    def normed(self, x, norm, eps, bias=None, rope=None):
        """forward(model.rms_norm(x, norm, eps), bias), its first heads rotated by rope = (cos, sin, heads), w4a8's in
        one call of its kernel (model.normed_linear's)."""
        return native.w4a8_linear(x, self.packed, self.bits, bias, norm, eps, rope=rope, tail=self.tail(),
                                       outliers=self.float_inputs())

    def gated(self, x):
        """forward(silu(gate) x up) for x = [gate | up], w4a8's in one call of its kernel (model.gated_linear's)."""
        return native.w4a8_linear(x, self.packed, self.bits, gated=True, tail=self.tail(),
                                       outliers=self.float_inputs())

    def matmul(self, n, bias=None):
        """w4a8's weight of n inputs (and bias [out] or None) as native.decoder_layers takes it (a Matmul)."""
        return native.matmul(self.packed, self.bits, n, self.tail(), bias, self.float_inputs())

    def tail(self):
        """w4a8's rows in other bits, as its kernel takes them: (packed, bits), or None."""
        if not self.tail_bits:
            return None
        return self.tail_packed, self.tail_bits

    def float_inputs(self):
        """w4a8's outlier input channels and their columns, as its kernel takes them: (at, w_at), or None."""
        if "w_outliers" not in self._parameters:
            return None
        return self.outliers, self.w_outliers

    def keep_outliers(self, amax):
        """w4a8: the W4A8_OUTLIERS input channels of largest amax [in] (calibrated's) kept out of the activations'
        rounding from now on, with their columns of the weight (the file's values, as the kernel sees them)."""
        at = amax.float().topk(W4A8_OUTLIERS).indices.sort().values
        columns = native.columns(self.packed, self.bits, len(amax), at)  # [k, out]
        if self.tail_bits:
            columns = torch.cat([columns, native.columns(self.tail_packed, self.tail_bits, len(amax), at)], 1)
        self.outliers = torch.nn.Parameter(at.int(), requires_grad=False)
        self.w_outliers = torch.nn.Parameter(columns.contiguous(), requires_grad=False)

    def tensors(self):
        """-> {name: tensor}: what this weight is built from again (Quantized(fmt, tensors, bits))."""
        if self.fmt != "w8a8":
            return dict(self.named_parameters())
        qw = torch.ops.quantized.linear_unpack(self.packed)[0]
        return {"q": qw.int_repr(), "scale": qw.q_per_channel_scales(), "outliers": self.outliers,
                "w_outliers": self.w_outliers.data}

    def forward(self, x, bias=None):
        """x [..., in] @ the weight.T + bias [out] (model.linear's for this weight)."""
        if self.fmt == "w8a8":
            y = kernels.w8a8_linear(x, self.packed, self.outliers, self.w_outliers)
        elif self.fmt == "w4a8":
            return native.w4a8_linear(x, self.packed, self.bits, bias, tail=self.tail(),
                                           outliers=self.float_inputs())
        else:
            y = kernels.quantized_linear(x, self.q, self.scale)
        return y if bias is None else y + bias


def quantized(fmt, w, blocks=None, amax=None, bits=4):
    """-> Quantized: w [out, in] in format fmt, quantized and packed for its kernel. blocks: int4's (q, scale_zero) or
    w4a8's (codes, scale, low) as read from a file (then w gives only the shape, device and dtype); amax [in]: w8a8's
    calibration (None: no outliers known)."""
    if fmt in ("int4", "w4a8") and (w.shape[0] % 16 or w.shape[1] % kernels.INT4_GROUP):  # the CPU kernels' tiles
        raise model.LoadError(f"{fmt} needs matmul weights of 16k x 32k, not {tuple(w.shape)}; use int8")
    if fmt == "w4a8":
        codes, scale, low = blocks or native.quantize(w, bits)
        return Quantized(fmt, {"packed": native.pack(codes, scale, low, bits)}, bits)
    if fmt == "w8a8":
        if amax is None:
            amax = w.new_ones(w.shape[1])
        q, scale, outliers, w_outliers = kernels.quantize_w8a8(w, amax)
        return Quantized(fmt, {"q": q, "scale": scale, "outliers": outliers, "w_outliers": w_outliers})
    if blocks is None:
        blocks = kernels.quantize_int8(w) if fmt == "int8" else kernels.quantize_int4(w)
    q, scale = blocks
    q = q.to(w.device)
    scale = scale.to(w.device, w.dtype)
    if fmt == "int4":  # uint8 [out, in / 2], packed for the device's kernel
        q = torch._convert_weight_to_int4pack_for_cpu(q, 1) if w.is_cpu else kernels.pack_int4(q)
    return Quantized(fmt, {"q": q, "scale": scale})


def w4a8_in_two(head, tail):
    """w4a8's Quantized of a weight whose first rows are a file's 4-bit blocks and the rest its 6-bit ones, each
    given as w4a8's (codes, scale, low) and kept as it is: the rest is its tail."""
    tensors = {"packed": native.pack(*head, 4), "tail_packed": native.pack(*tail, 6)}
    return Quantized("w4a8", tensors, 4, tail_bits=6)


def converted(w, fmt, amax=None, wide=0):
    """w [out, in] (plain, activations' dtype) in weight format fmt for model.linear: int8, int4, w4a8, w8a8 quantized
    (amax: w8a8's calibration; None: no outliers known, as for timing; wide: the bits of a file's wider blocks, 6 or 8,
    which int4 holds in int8 and w4a8 in codes of as many bits); on the CPU, bf16 and float32 in oneDNN's blocked
    layout if it packs the dtype (bf16: AVX-512, AVX-NE-CONVERT), faster than F.linear at decoding's few rows."""
    if fmt == "w4a8":
        return quantized(fmt, w, bits=wide or 4)
    if fmt == "int4" and wide:
        fmt = "int8"
    if fmt in ("int8", "int4", "w8a8"):
        return quantized(fmt, w, amax=amax)
    packs = w.dtype == torch.float32 or w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if w.device.type == "cpu" and torch.backends.mkldnn.is_available() and packs:
        return packed(w)
    return w


def packed(w):
    """w [out, in] bf16 or float32 on the CPU as a parameter in oneDNN's blocked layout (`.to_dense()` gives w back)."""
    return torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1), requires_grad=False)


def replace(m, name, w):
    delattr(m, name)  # a module's parameter cannot be replaced by a module by assignment
    setattr(m, name, w)


def matmuls(transformer):
    """-> [(name, module, attribute)] of every matmul weight: ('layers.3.w2', transformer.layers[3], 'w2'), ..."""
    blocks = [(f"layers.{i}.{n}", b, n) for i, b in enumerate(transformer.layers) for n in MATMULS[:4]]
    return blocks + [("lm_head", transformer, "lm_head")]


def held_wide(c, get):
    """{matmul weight ('layers.3.w2', 'lm_head'): bits} of those in a file's wider blocks (get's "format"): 6 where
    all of it is in 6-bit blocks (Q6_K, which w4a8 holds as they are), else 8. int4 holds them in int8, w4a8 in codes
    of as many bits."""
    held = {}
    for param, tensors, _ in model.layout(c):
        if not (param.endswith(MATMULS) or param == "embed" and c.tie_embeddings):
            continue
        kinds = {get(name, (0, 0, 1), "format") for name, _ in tensors}
        name = "lm_head" if param == "embed" else param
        if kinds == {"int6"}:
            held[name] = 6
        elif kinds & {"int6", "int8"}:
            held[name] = 8
    return held


# ---------------------------------------------------------------- calibration: w8a8's and w4a8's outlier channels
# The input channels w4a8 keeps out of its activations' rounding: a model's few massive activations (a channel of
# Qwen2.5's residual stream) set their groups' steps and round the other inputs there to a step or two.
W4A8_OUTLIERS = 2


class Probe(torch.nn.Module):
    """A matmul weight w in calibration: as model.linear multiplies by it, keeps amax [in], the largest |input| per
    channel it has seen (None before its first input)."""

    def __init__(self, w):
        super().__init__()
        self.w = w
        self.amax = None

    def forward(self, x, bias=None):
        seen = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()  # [in]
        if self.amax is not None:
            seen = torch.maximum(self.amax, seen)
        self.amax = seen
        return model.linear(x, self.w, bias)


@torch.no_grad()
def calibrated(transformer, length=64):
    """-> {matmul name: amax [in]} over a prefill of `length` seeded random tokens: the model alone decides where w8a8
    and w4a8 keep floats (its large channels are much the same for any text)."""
    probes = {name: (m, attr, Probe(getattr(m, attr))) for name, m, attr in matmuls(transformer)}
    for m, attr, p in probes.values():
        replace(m, attr, p)
    c = transformer.config
    tokens = torch.randint(c.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    cache = model.KVCache(c, 1, length, 1, transformer.device, transformer.embed.dtype)
    transformer.prefill(tokens.to(transformer.device), cache, logits="all")
    for m, attr, p in probes.values():
        replace(m, attr, p.w)
    return {name: p.amax for name, (_, _, p) in probes.items()}


@torch.no_grad()
def convert_weights(transformer, fmt=None, held=None):
    """Every matmul weight not yet Quantized into format fmt (None: its dtype's), the wider ones of held (a file's:
    held_wide's {name: bits}) wide, in place; w8a8 and w4a8 calibrated first (w4a8's outliers kept after; not on a
    tensor-parallel rank), a tied head copied (lookups need plain rows)."""
    held = held or {}
    if fmt is None:
        fmt = "float32" if transformer.embed.dtype == torch.float32 else "bf16"
    amax = {}
    if fmt == "w8a8" or fmt == "w4a8" and transformer.config.tp == 1:  # w4a8's rank alone could not run the forward
        amax = calibrated(transformer)
    for name, m, attr in matmuls(transformer):
        w = getattr(m, attr)
        if not isinstance(w, Quantized):
            replace(m, attr, converted(w, fmt, amax.get(name), wide=held.get(name, 0)))
        if fmt == "w4a8" and name in amax:
            getattr(m, attr).keep_outliers(amax[name])
