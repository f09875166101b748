"""Weight formats: one holds every matmul weight (FORMATS), plain bf16 or float32, int8 or int4 (Quantized, whose
kernels run on a CPU and on CUDA); a model built from a file's tensors in one of them, its rows filled as read and
its matmul weights converted. w4a8, the CPU's own format, is the CPU wing's (cpu/formats.py), built on these steps.
Which format runs fastest on a machine is cpu/auto.py's question."""
import math

import torch

import errors
import kernels
import model

# One format holds every matmul weight (each block's wqkv, wo, w13, w2 and the head); activations, embeddings and norms
# are in the dtype its kernels are fast with: torch's int8 and int4 kernels want bf16 activations, w4a8's kernel
# rounds float32 ones to int8 itself.
FORMATS = {"bf16": torch.bfloat16, "float32": torch.float32, "int8": torch.bfloat16, "int4": torch.bfloat16,
           "fp8": torch.bfloat16, "w4a8": torch.float32}
QUANTIZED = ("int8", "int4", "fp8")  # the formats of Quantized weights
MATMULS = ("wqkv", "wo", "w13", "w2", "lm_head")  # a block's matmul weights, then the model's head
EMBEDDING = "model.embed_tokens.weight"


def weight_format(fmt, device="cpu"):
    """-> weight format fmt's activations dtype on device, or a one-line LoadError, before any weight is read."""
    if fmt not in FORMATS:
        raise errors.LoadError(f"weights {fmt!r} is not a weight format; use one of {', '.join(FORMATS)}")
    kind = torch.device(device).type
    if fmt[:3] == "int" and not (kind == "cpu" or kind == "cuda" and kernels.triton):
        raise errors.LoadError(f"{fmt} weights run on the CPU and on CUDA with Triton; use bf16 on {kind}")
    if fmt == "fp8" and not (kind == "cpu" or kind == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)):
        raise errors.LoadError(f"fp8 weights run on the CPU and on CUDA of compute capability 8.9 or later (fp8 "
                               f"tensor cores); use int4 or bf16 on {device}")
    if fmt == "w4a8" and kind != "cpu":
        raise errors.LoadError(f"w4a8 weights run on the CPU only (cpu/native.c); use int4 on {device}")
    return FORMATS[fmt]


class Quantized(torch.nn.Module):
    """A matmul weight [out, in] in int8, int4 or fp8: q and scale for kernels.quantized_linear (`quantized` makes them
    from a plain weight; `tensors()` gives them back, as the weight cache keeps them). Parameters, so weight_bytes
    counts them."""

    def __init__(self, fmt, tensors):
        super().__init__()
        self.fmt = fmt
        for name, t in tensors.items():
            setattr(self, name, torch.nn.Parameter(t, requires_grad=False))

    def tensors(self):
        """-> {name: tensor}: what this weight is built from again (Quantized(fmt, tensors))."""
        return dict(self.named_parameters())

    def forward(self, x, bias=None):
        """x [..., in] @ the weight.T + bias [out] (the backend's linear for this weight)."""
        y = kernels.quantized_linear(x, self.q, self.scale)
        return y if bias is None else y + bias


def quantized(fmt, w, blocks=None):
    """-> Quantized: w [out, in] in int8, int4 or fp8, quantized and packed for its kernel. blocks: int4's (q,
    scale_zero) as read from a file (then w gives only the shape, device and dtype)."""
    if fmt == "int4" and (w.shape[0] % 16 or w.shape[1] % kernels.INT4_GROUP):  # the CPU kernel's tiles
        raise errors.LoadError(f"{fmt} needs matmul weights of 16k x 32k, not {tuple(w.shape)}; use int8")
    if fmt == "fp8" and (w.shape[0] % 16 or w.shape[1] % 16):  # torch._scaled_mm's
        raise errors.LoadError(f"{fmt} needs matmul weights of 16k x 16k, not {tuple(w.shape)}; use int8")
    if fmt == "fp8":
        q, scale = kernels.quantize_fp8(w)
        return Quantized(fmt, {"q": q, "scale": scale})  # the scale in float32, as torch._scaled_mm takes it
    if blocks is None:
        blocks = kernels.quantize_int8(w) if fmt == "int8" else kernels.quantize_int4(w)
    q, scale = blocks
    q = q.to(w.device)
    scale = scale.to(w.device, w.dtype)
    if fmt == "int4":  # uint8 [out, in / 2], packed for the device's kernel
        q = torch._convert_weight_to_int4pack_for_cpu(q.int(), 1) if w.is_cpu else kernels.pack_int4(q)
    return Quantized(fmt, {"q": q, "scale": scale})


def converted(w, fmt, wide=0):
    """w [out, in] (plain, activations' dtype) in weight format fmt: int8, int4 and fp8 quantized (wide: the bits
    of a file's wider blocks, which int4 holds in int8), bf16 and float32 as they are."""
    if fmt == "int4" and wide:
        fmt = "int8"
    if fmt in QUANTIZED:
        return quantized(fmt, w)
    return w


def replace(m, name, w):
    delattr(m, name)  # a module's parameter cannot be replaced by a module by assignment
    setattr(m, name, w)


def matmuls(transformer):
    """-> [(name, module, attribute)] of every matmul weight: ('layers.3.w2', transformer.layers[3], 'w2'), ..."""
    blocks = [(f"layers.{i}.{n}", b, n) for i, b in enumerate(transformer.layers) for n in MATMULS[:4]]
    return blocks + [("lm_head", transformer, "lm_head")]


def file_kinds(c, get):
    """{matmul weight ('layers.3.wqkv', 'lm_head') or the embedding ('embed', or 'lm_head' where it is the head too):
    [the weight format holding each of its file tensors as the file quantized it (get's "format": int4, int6, int8,
    or None for floats)]}, from the headers alone."""
    kinds = {}
    for param, tensors, _ in model.layout(c):
        if param.endswith(MATMULS) or param == "embed":
            name = "lm_head" if param == "embed" and c.tie_embeddings else param
            kinds[name] = [get(tensor, (0, 0, 1), "format") for tensor, _ in tensors]
    return kinds


def held_wide(c, get):
    """{matmul weight ('layers.3.w2', 'lm_head'): bits} of those in a file's wider blocks (get's "format"): 6 where
    all of it is in 6-bit blocks (Q6_K, which w4a8 holds as they are), else 8. int4 holds them in int8, w4a8 in codes
    of as many bits."""
    held = {}
    for name, kinds in file_kinds(c, get).items():
        if name == "embed":
            continue
        if set(kinds) == {"int6"}:
            held[name] = 6
        elif set(kinds) & {"int6", "int8"}:
            held[name] = 8
    return held


# ---------------------------------------------------------------- what a model takes in each format
def matmul_bytes(fmt, out, n, bits=0):
    """Bytes matmul weight [out, n] takes in format fmt as `converted` holds it (bits: its file's wider blocks', which
    int4 holds in int8): int8 a bf16 scale a row, fp8 a float32 one, int4 two codes a byte and a bf16 scale and
    zero a group of INT4_GROUP."""
    if fmt == "int4" and bits:
        fmt = "int8"
    if fmt == "int4":
        return out * n // 2 + 4 * out * (n // kernels.INT4_GROUP)
    if fmt == "int8":
        return out * n + 2 * out
    if fmt == "fp8":
        return out * n + 4 * out
    return out * n * FORMATS[fmt].itemsize


def held_bits(fmt, kinds, wider):
    """[the bits each tensor of a matmul weight is held in, 0 for fmt's own], from the file's kinds (file_kinds'):
    int4 keeps a file's 4-bit blocks, and holds wider ones (wider) in int8."""
    if wider and fmt == "int4" and set(kinds) & {"int6", "int8"}:
        return [8] * len(kinds)
    return [0] * len(kinds)


def model_bytes(c, fmt, kinds=None, wider=True, price=matmul_bytes, bits=held_bits, tied_copy=False):
    """Bytes a Transformer of Config c takes with its matmul weights in format fmt: each priced by price(fmt, out, n,
    bits) in the bits(fmt, kinds, wider) its file's tensors are held in (kinds: file_kinds'; None: a file of floats),
    everything else in fmt's activations dtype; a tied head converted (tied_copy: a plain one too) is a copy."""
    kinds = kinds or {}
    size = FORMATS[fmt].itemsize
    total = 0
    for param, tensors, _ in model.layout(c):
        name = param
        if param == "embed" and c.tie_embeddings:
            name = "lm_head"
        if not name.endswith(MATMULS):
            total += size * sum(math.prod(shape) for _, shape in tensors)
            continue
        if name != param:  # the embedding stays, its head a copy where converted
            total += size * math.prod(tensors[0][1])
            if fmt not in QUANTIZED + ("w4a8",) and not tied_copy:
                continue
        held = bits(fmt, kinds.get(name, [None] * len(tensors)), wider)
        total += sum(price(fmt, *shape, b) for (_, shape), b in zip(tensors, held))
    return total


# ---------------------------------------------------------------- a model from a file's tensors
def file_blocks(get, fmt, names, part, wide, wider, dst):
    """int4's Quantized of matmul weight dst (its shape, device and dtype) whose tensors (names, in order) the file
    holds in 4-bit blocks, kept as they are; else None, and for the embedding (the other arguments: w4a8's,
    cpu/formats.py)."""
    if fmt != "int4" or names == [EMBEDDING] or any(get(name, part, "format") != "int4" for name in names):
        return None
    q, scale_low = zip(*(get(name, part, "int4") for name in names))
    scale, low = torch.cat(scale_low, 1).unbind(-1)  # [in / 32, out]: w = q x scale + low
    return quantized(fmt, dst, (torch.cat(q), torch.stack([scale, low + 8 * scale], -1)))  # (q - 8) x scale + zero


@torch.no_grad()
def fill_weights(transformer, get, rank=0, fmt=None, wider=True, blocks=file_blocks):
    """Copy every tensor into the model, in RAM (never left memory-mapped) and its dtype, straight into its rows of the
    fused q/k/v and gate/up weights: no tensor is held twice in full. A tensor-parallel rank reads only its chunks
    (model.layout's); a terminal shows a progress bar. A matmul weight the file holds in blocks that format fmt keeps
    as they are (blocks(get, fmt, names, part, wide, wider, dst) -> its weight, or None; an untied embedding is asked
    too) is kept so, one in more bits wide (held_wide; wider=False: cut to 4 too): the returned {name: bits}, for
    convert_weights."""
    from tqdm import tqdm
    c = transformer.config
    total = sum(p.numel() for p in transformer.parameters())  # a tied head is the embedding: counted once
    held = {}
    if fmt in ("int4", "w4a8") and wider:
        held = held_wide(c, get)
    with tqdm(total=total, desc="loading weights", unit="", unit_scale=True, leave=False, disable=None) as bar:
        for param, tensors, dim in model.layout(c):
            dst = transformer.get_parameter(param)
            part = (0, 0, 1) if dim is None else (dim, rank, c.tp)
            as_they_are = None
            if param.endswith(MATMULS) or param == "embed" and not c.tie_embeddings:
                as_they_are = blocks(get, fmt, [name for name, _ in tensors], part, held.get(param), wider, dst)
            if as_they_are is not None:
                owner, _, attr = param.rpartition(".")
                replace(transformer.get_submodule(owner), attr, as_they_are)
                bar.update(dst.numel())
                continue
            at = 0
            for name, _ in tensors:
                t = get(name, part, dst.dtype)
                dst[at:at + len(t)] = t
                at += len(t)
                bar.update(t.numel())
    return held


@torch.no_grad()
def convert_weights(transformer, fmt=None, held=None):
    """Every matmul weight not yet Quantized into format fmt (None: its dtype's), the wider ones of held (a file's:
    held_wide's {name: bits}) wide, in place."""
    held = held or {}
    if fmt is None:
        fmt = "float32" if transformer.embed.dtype == torch.float32 else "bf16"
    for name, m, attr in matmuls(transformer):
        w = getattr(m, attr)
        if not isinstance(w, Quantized):
            replace(m, attr, converted(w, fmt, wide=held.get(name, 0)))


def build(c, get, device="cuda", dtype=None, tp=(0, 1), weights=None, wider=True, backend=None):
    """-> Transformer with every weight from get(name) in memory on `device`, its matmul weights in format `weights`
    (FORMATS; None: dtype's, bf16 unless dtype is torch.float32) and its activations in that format's dtype; with tp =
    (rank, world), the rank's tensor-parallel shard of it (model.shard_config), reading only the rank's chunks.
    wider=False: int4 even where a GGUF file has more bits (a draft's: its format changes only the proposals).
    backend: what runs it (model.Transformer's). A CPU's models are the CPU wing's (cpu/formats.build)."""
    weights = weights or ("float32" if dtype == torch.float32 else "bf16")
    rank, world = tp
    transformer = model.Transformer(model.shard_config(c, world), device, weight_format(weights, device), backend)
    held = fill_weights(transformer, get, rank, weights, wider)
    convert_weights(transformer, weights, held)
    return transformer
