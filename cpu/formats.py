"""The CPU's weight formats: w4a8 (W4A8: native.py's packed 4-, 6- or 8-bit codes, multiplied by int8 activations,
each matmul's largest input channels calibrated and kept in float32), bf16 and float32 in oneDNN's packed layout,
and a model file made into a model in them (formats.py's steps, with a GGUF file's 4- and 6-bit blocks kept as
they are)."""
import logging

import torch

import errors
import formats
import model
from cpu import native

log = logging.getLogger("smcsd")
# The input channels w4a8 keeps out of its activations' rounding: a model's few massive activations (a channel of
# Qwen2.5's residual stream) set their groups' steps and round the other inputs there to a step or two.
W4A8_OUTLIERS = 2


def usable(fmt):
    """fmt, or int4 where it is w4a8 and its kernel cannot be built here (a line on the "smcsd" log says why)."""
    lib, why = native.library()
    if fmt != "w4a8" or lib is not None:
        return fmt
    log.warning("%s; using int4 (torch's kernel) instead of w4a8", why)
    return "int4"


class W4A8(torch.nn.Module):
    """A matmul weight [out, in] in w4a8: native.pack's codes of `bits` bits (and, tail_bits > 0, more rows in
    tail_packed, of tail_bits: a fused q/k/v whose v a file holds wider) and, once calibrated (keep_outliers), its
    outlier input channels and their float32 columns. Built from the tensors it keeps (`tensors()` gives them back,
    as the weight cache keeps them); parameters, so weight_bytes counts them."""
    fmt = "w4a8"

    def __init__(self, tensors, bits=4, tail_bits=0):
        super().__init__()
        self.bits = bits
        self.tail_bits = tail_bits
        for name, t in tensors.items():
            setattr(self, name, torch.nn.Parameter(t, requires_grad=False))

    def normed(self, x, norm, eps, bias=None, rope=None):
        """forward(kernels.rms_norm_ref(x, norm, eps), bias), its first heads rotated by rope = (cos, sin, heads), in
        one call of the kernel (the backend's normed_linear)."""
        return native.w4a8_linear(x, self.packed, self.bits, bias, norm, eps, rope=rope, tail=self.tail(),
                                  outliers=self.float_inputs())

    def gated(self, x):
        """forward(silu(gate) x up) for x = [gate | up], in one call of the kernel (the backend's gated_linear)."""
        return native.w4a8_linear(x, self.packed, self.bits, gated=True, tail=self.tail(), outliers=self.float_inputs())

    def matmul(self, n, bias=None):
        """This weight of n inputs (and bias [out] or None) as native.decoder_layer takes it (a Matmul)."""
        return native.matmul(self.packed, self.bits, n, self.tail(), bias, self.float_inputs())

    def tail(self):
        """The rows in other bits, as the kernel takes them: (packed, bits), or None."""
        if not self.tail_bits:
            return None
        return self.tail_packed, self.tail_bits

    def float_inputs(self):
        """The outlier input channels and their columns, as the kernel takes them: (at, w_at), or None."""
        if "w_outliers" not in self._parameters:
            return None
        return self.outliers, self.w_outliers

    def keep_outliers(self, amax):
        """The W4A8_OUTLIERS input channels of largest amax [in] (calibrated's) kept out of the activations' rounding
        from now on, with their columns of the weight (the file's values, as the kernel sees them)."""
        at = amax.float().topk(W4A8_OUTLIERS).indices.sort().values
        columns = native.columns(self.packed, self.bits, len(amax), at)  # [k, out]
        if self.tail_bits:
            columns = torch.cat([columns, native.columns(self.tail_packed, self.tail_bits, len(amax), at)], 1)
        self.outliers = torch.nn.Parameter(at.int(), requires_grad=False)
        self.w_outliers = torch.nn.Parameter(columns.contiguous(), requires_grad=False)

    def tensors(self):
        """-> {name: tensor}: what this weight is built from again (W4A8(tensors, bits, tail_bits))."""
        return dict(self.named_parameters())

    def forward(self, x, bias=None):
        """x [..., in] @ the weight.T + bias [out] (the backend's linear for this weight)."""
        return native.w4a8_linear(x, self.packed, self.bits, bias, tail=self.tail(), outliers=self.float_inputs())


def w4a8(w, blocks=None, bits=4):
    """-> W4A8 of w [out, in], quantized (native.quantize) or from blocks: w4a8's (codes, scale, low) as read from a
    file (then w gives only the shape)."""
    if w.shape[0] % native.PANEL or w.shape[1] % native.GROUP:  # the kernel's tiles
        raise errors.LoadError(f"w4a8 needs matmul weights of 16k x 32k, not {tuple(w.shape)}; use int8")
    codes, scale, low = blocks or native.quantize(w, bits)
    return W4A8({"packed": native.pack(codes, scale, low, bits)}, bits)


def w4a8_in_two(head, tail):
    """W4A8 of a weight whose first rows are a file's 4-bit blocks and the rest its 6-bit ones, each given as w4a8's
    (codes, scale, low) and kept as it is: the rest is its tail."""
    tensors = {"packed": native.pack(*head, 4), "tail_packed": native.pack(*tail, 6)}
    return W4A8(tensors, 4, tail_bits=6)


def packed(w):
    """w [out, in] bf16 or float32 as a parameter in oneDNN's blocked layout (`.to_dense()` gives w back)."""
    return torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1), requires_grad=False)


def converted(w, fmt, wide=0):
    """formats.converted's, for the CPU: w4a8 in codes of its file's bits (wide: 6 or 8, else 4); bf16 and float32
    in oneDNN's blocked layout where it packs the dtype (bf16: AVX-512, AVX-NE-CONVERT), faster than F.linear at
    decoding's few rows."""
    if fmt == "w4a8":
        return w4a8(w, bits=wide or 4)
    if fmt not in ("bf16", "float32"):
        return formats.converted(w, fmt, wide)
    packs = w.dtype == torch.float32 or w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if torch.backends.mkldnn.is_available() and packs:
        return packed(w)
    return w


# ---------------------------------------------------------------- a model from a file's tensors
def file_blocks(get, fmt, names, part, wide, wider, dst):
    """formats.file_blocks, and w4a8's W4A8 of matmul weight dst whose tensors (names, in order) the file holds in
    blocks it keeps as they are: 4-bit ones; with wider, 6-bit ones (wide: held_wide's 6 for them) and 4-bit then
    6-bit ones (q/k/v whose v a Q4_K_M file holds in Q6_K: the wider rows its tail, where the kernel's panels of 16
    divide both). None where it keeps none."""
    if fmt != "w4a8":
        return formats.file_blocks(get, fmt, names, part, wide, wider, dst)
    kinds = [get(name, part, "format") for name in names]
    fours = kinds.count("int4")
    if fours == len(kinds):
        return w4a8(dst, four_bit_blocks(get, names, part))
    if not wider or kinds != ["int4"] * fours + ["int6"] * (len(kinds) - fours):
        return None
    codes, scale = zip(*(get(name, part, "int6") for name in names[fours:]))
    codes = torch.cat(codes).to(torch.uint8)
    scale = torch.cat(scale)
    if fours == 0 and wide == 6:  # Q6_K's codes and scales as they are
        return w4a8(dst, (codes, scale, -32 * scale), bits=6)
    if fours == 0 or len(codes) % native.PANEL:
        return None
    head = four_bit_blocks(get, names[:fours], part)
    if len(head[0]) % native.PANEL:
        return None
    return w4a8_in_two(head, (codes, scale, -32 * scale))


def four_bit_blocks(get, names, part):
    """A file's 4-bit blocks of tensors `names`, stacked (get's "int4": w = q x scale + low), as w4a8 keeps them:
    (codes [out, in], scale, low [out, in / 32]), the file's own values (a K block's d x sc and dmin x m), which its
    packing keeps exactly."""
    q, scale_low = zip(*(get(name, part, "int4") for name in names))
    scale, low = torch.cat(scale_low, 1).unbind(-1)  # [in / 32, out]
    return torch.cat(q).to(torch.uint8), scale.T, low.T


class Probe(torch.nn.Module):
    """A matmul weight w in calibration: as linear (the backend's) multiplies by it, keeps amax [in], the largest
    |input| per channel it has seen (None before its first input)."""

    def __init__(self, w, linear):
        super().__init__()
        self.w = w
        self.linear = linear
        self.amax = None

    def forward(self, x, bias=None):
        seen = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()  # [in]
        if self.amax is not None:
            seen = torch.maximum(self.amax, seen)
        self.amax = seen
        return self.linear(x, self.w, bias)


@torch.no_grad()
def calibrated(transformer, length=64):
    """-> {matmul name: amax [in]} over a prefill of `length` seeded random tokens: the model alone decides where w4a8
    keeps floats (its large channels are much the same for any text)."""
    linear = transformer.backend.linear
    probes = {name: (m, attr, Probe(getattr(m, attr), linear)) for name, m, attr in formats.matmuls(transformer)}
    for m, attr, p in probes.values():
        formats.replace(m, attr, p)
    c = transformer.config
    tokens = torch.randint(c.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    cache = model.KVCache(c, 1, length, 1, transformer.device, transformer.embed.dtype)
    transformer.prefill(tokens.to(transformer.device), cache, logits="all")
    for m, attr, p in probes.values():
        formats.replace(m, attr, p.w)
    return {name: p.amax for name, (_, _, p) in probes.items()}


@torch.no_grad()
def convert_weights(transformer, fmt=None, held=None):
    """formats.convert_weights for the CPU: its converted; w4a8 calibrated first and its outliers kept after (not on
    a tensor-parallel rank, which alone could not run the forward)."""
    held = held or {}
    if fmt is None:
        fmt = "float32" if transformer.embed.dtype == torch.float32 else "bf16"
    amax = {}
    if fmt == "w4a8" and transformer.config.tp == 1:
        amax = calibrated(transformer)
    for name, m, attr in formats.matmuls(transformer):
        w = getattr(m, attr)
        if not isinstance(w, (formats.Quantized, W4A8)):
            formats.replace(m, attr, converted(w, fmt, wide=held.get(name, 0)))
        if name in amax:
            getattr(m, attr).keep_outliers(amax[name])


def build(c, get, dtype=None, tp=(0, 1), weights=None, wider=True, backend=None):
    """formats.build's Transformer on the CPU, in any format of formats.FORMATS (w4a8's kernel: `usable`)."""
    weights = weights or ("float32" if dtype == torch.float32 else "bf16")
    rank, world = tp
    dtype = formats.weight_format(weights, "cpu")
    transformer = model.Transformer(model.shard_config(c, world), "cpu", dtype, backend)
    held = formats.fill_weights(transformer, get, rank, weights, wider, file_blocks)
    convert_weights(transformer, weights, held)
    return transformer
