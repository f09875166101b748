"""The CPU's weight formats: w4a8 (W4A8: native.py's packed 4-, 6- or 8-bit codes, multiplied by int8 activations,
each matmul's largest input channels calibrated and kept in float32), bf16 and float32 in oneDNN's packed layout,
and a model file made into a model in them (formats.py's steps, with a GGUF file's 4- and 6-bit blocks kept as
they are, an untied embedding's too: Rows); what a model takes in each (model_bytes)."""
import contextlib
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
PACK_ROWS = 4096  # rows of a weight packed at a time (a multiple of native.PANEL)


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
    return W4A8({"packed": pack_rows(codes, scale, low, bits)}, bits)


def w4a8_in_two(head, tail):
    """W4A8 of a weight whose first rows are a file's 4-bit blocks and the rest its 6-bit ones, each given as w4a8's
    (codes, scale, low) and kept as it is: the rest is its tail."""
    tensors = {"packed": pack_rows(*head, 4), "tail_packed": pack_rows(*tail, 6)}
    return W4A8(tensors, 4, tail_bits=6)


def pack_rows(codes, scale, low, bits):
    """native.pack's layout of codes [out, in] (scale and low [out, in / 32]), PACK_ROWS rows at a time: its
    temporaries, several times a weight's codes, stay small."""
    out, n = codes.shape
    if out % native.PANEL or n % native.GROUP:
        return native.pack(codes, scale, low, bits)  # its error names the shape
    packed = torch.empty(out // native.PANEL, w4a8_bytes(native.PANEL, n, bits), dtype=torch.uint8)
    for i in range(0, out, PACK_ROWS):
        rows = slice(i, i + PACK_ROWS)
        packed[i // native.PANEL:(i + PACK_ROWS) // native.PANEL] = native.pack(codes[rows], scale[rows], low[rows],
                                                                                bits)
    return packed


def stacked(tensors):
    """The tensors one after another along their rows (one alone as it is: no copy of a big one)."""
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat(tensors)


class Rows(torch.nn.Module):
    """An embedding table [vocab, dim] held as a file's 4-bit blocks: codes two a byte (the even column's the low
    nibble), float32 scale and low [vocab, dim / 32]. rows[tokens] are their values (code x scale + low) in dtype,
    the file's own, as the model's embedding gives them. Parameters, so the weight cache keeps them."""

    def __init__(self, tensors, dtype):
        super().__init__()
        self.values_dtype = dtype
        for name, t in tensors.items():
            setattr(self, name, torch.nn.Parameter(t, requires_grad=False))

    @property
    def dtype(self):
        return self.values_dtype

    @property
    def device(self):
        return self.codes.device

    def __getitem__(self, tokens):
        pairs = self.codes[tokens]  # [..., dim / 2]
        codes = torch.stack([pairs & 15, pairs >> 4], -1).flatten(-2).unflatten(-1, (-1, native.GROUP))
        values = codes.float() * self.scale[tokens][..., None] + self.low[tokens][..., None]  # [..., dim / 32, 32]
        return values.flatten(-2).to(self.values_dtype)

    def tensors(self):
        """-> {name: tensor}: what these rows are built from again (Rows(tensors, dtype))."""
        return dict(self.named_parameters())


def keeps_rows(fmt, kinds):
    """Whether w4a8 holds an untied embedding its file has in 4-bit blocks (kinds: file_kinds' of it) as Rows."""
    return fmt == "w4a8" and kinds == ["int4"]


def rows_bytes(vocab, dim):
    """Bytes Rows takes for an embedding of vocab x dim."""
    return vocab * dim // 2 + 8 * vocab * (dim // native.GROUP)


def embedding_rows(get, fmt, part, dst):
    """The Rows of the embedding dst (its dtype) where keeps_rows, the file's blocks as they are; else None."""
    if not keeps_rows(fmt, [get(formats.EMBEDDING, part, "format")]):
        return None
    q, scale_low = get(formats.EMBEDDING, part, "int4")
    scale, low = scale_low.unbind(-1)  # [dim / 32, vocab]
    codes = q[:, 0::2] | q[:, 1::2] << 4
    return Rows({"codes": codes, "scale": scale.T.contiguous(), "low": low.T.contiguous()}, dst.dtype)


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
    if packs(w.dtype):
        return packed(w)
    return w


def packs(dtype):
    """Whether oneDNN packs plain weights of dtype here."""
    supported = dtype == torch.float32 or dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.backends.mkldnn.is_available() and supported


# ---------------------------------------------------------------- what a model takes in each format
def w4a8_bytes(out, n, bits):
    """Bytes native.pack's layout takes for [out, n] in codes of `bits` bits: each panel of PANEL columns a
    superblock's head of f16 d (of the scales, and of the lows but at 6 bits) and each group's codes and int8 q."""
    groups = n // native.GROUP
    superblocks = -(-groups // native.SUPER)
    head = 2 * native.PANEL * (1 if bits == 6 else 2)
    group = native.GROUP * native.PANEL * bits // 8 + 2 * native.PANEL
    return out // native.PANEL * (superblocks * head + groups * group)


def matmul_bytes(fmt, out, n, bits=0):
    """formats.matmul_bytes, and w4a8's: its packed codes (bits: 4 unless its file's are wider) and the calibrated
    outlier channels' float32 columns; bf16 and float32 in oneDNN's blocked layout take their plain bytes."""
    if fmt != "w4a8":
        return formats.matmul_bytes(fmt, out, n, bits)
    return w4a8_bytes(out, n, bits or 4) + W4A8_OUTLIERS * (4 + 4 * out)


def held_bits(fmt, kinds, wider):
    """formats.held_bits, and w4a8's, as file_blocks keeps them: 4-bit blocks in 4 bits, 6-bit ones (wider) in 6,
    alone or after 4-bit ones; anything else wider in 8 (wider), else in 4."""
    if fmt != "w4a8":
        return formats.held_bits(fmt, kinds, wider)
    fours = kinds.count("int4")
    if fours == len(kinds) or not wider:
        return [4] * len(kinds)
    if kinds == ["int4"] * fours + ["int6"] * (len(kinds) - fours):
        return [4] * fours + [6] * (len(kinds) - fours)
    if set(kinds) & {"int6", "int8"}:
        return [8] * len(kinds)
    return [4] * len(kinds)


def model_bytes(c, fmt, kinds=None, wider=True):
    """formats.model_bytes on the CPU: w4a8 priced too, an embedding it keeps as Rows so, and a tied head packed
    (oneDNN) a copy of its own."""
    total = formats.model_bytes(c, fmt, kinds, wider, matmul_bytes, held_bits, packs(formats.FORMATS[fmt]))
    if keeps_rows(fmt, (kinds or {}).get("embed")):
        total += rows_bytes(c.vocab_size, c.dim) - c.vocab_size * c.dim * formats.FORMATS[fmt].itemsize
    return total


# ---------------------------------------------------------------- a model from a file's tensors
def file_blocks(get, fmt, names, part, wide, wider, dst):
    """formats.file_blocks, and w4a8's W4A8 of matmul weight dst whose tensors (names, in order) the file holds in
    blocks it keeps as they are: 4-bit ones; with wider, 6-bit ones (wide: held_wide's 6 for them) and 4-bit then
    6-bit ones (q/k/v whose v a Q4_K_M file holds in Q6_K: the wider rows its tail, where the kernel's panels of 16
    divide both). None where it keeps none. The embedding's Rows where it keeps those (embedding_rows)."""
    if names == [formats.EMBEDDING]:
        return embedding_rows(get, fmt, part, dst)
    if fmt != "w4a8":
        return formats.file_blocks(get, fmt, names, part, wide, wider, dst)
    kinds = [get(name, part, "format") for name in names]
    fours = kinds.count("int4")
    if fours == len(kinds):
        return w4a8(dst, four_bit_blocks(get, names, part))
    if not wider or kinds != ["int4"] * fours + ["int6"] * (len(kinds) - fours):
        return None
    codes, scale = zip(*(get(name, part, "int6") for name in names[fours:]))
    codes = stacked(codes)
    scale = stacked(scale)
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
    return stacked(q), scale.T, low.T


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


@contextlib.contextmanager
def one_thread():
    """torch on one thread in the block, then as many as before."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build(c, get, dtype=None, tp=(0, 1), weights=None, wider=True, backend=None):
    """formats.build's Transformer on the CPU, in any format of formats.FORMATS (w4a8's kernel: `usable`)."""
    weights = weights or ("float32" if dtype == torch.float32 else "bf16")
    rank, world = tp
    dtype = formats.weight_format(weights, "cpu")
    transformer = model.Transformer(model.shard_config(c, world), "cpu", dtype, backend)
    with one_thread():  # reading and packing: many short operations, each of which would wait on a busy core
        held = formats.fill_weights(transformer, get, rank, weights, wider, file_blocks)
    convert_weights(transformer, weights, held)
    return transformer
