"""GGUF files of real models' shapes with random weights, for measuring speed where no model hub is reachable: the
tensor types llama.cpp's Q4_K_M gives that model (Q4_K, Q6_K where it keeps more bits, F32 norms and biases), blocks
quantized from normal values of a real model's spread, and a real GGUF file's tokenizer and metadata, so that the
engine and llama.cpp read the same bytes and a real draft of that tokenizer pairs with it. Written tensor by tensor:
a file of any size is made in little memory. `bench.py make-gguf` runs it."""
import os
import shutil
import sys
import typing

import torch

import errors
import loading
from cpu import formats as cpu_formats

RANDOM_KEY = "smcsd.random_weights"  # true in every file made here: bench.py's tables say "random weights"
RANDOM_NOTE = "random weights: speed only (the text is noise; sd's acceptance means nothing)"
STD = 0.02  # of the values quantized: a trained model's matrices spread about so
Q4_K = "Q4_K"
Q6_K = "Q6_K"
CHUNK_VALUES = 2**23  # generated and quantized at a time
Q4_K_M_FILE_TYPE = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M


class Shape(typing.NamedTuple):
    """A qwen2 model's sizes."""
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    context: int = 32768
    rope_theta: float = 1e6
    eps: float = 1e-6


SHAPES = {  # Qwen2.5's, as their config.json files give them (widths of whole 256-value blocks: not the 0.5B's)
    "qwen2.5-1.5b": Shape(151936, 1536, 28, 12, 2, 8960, True),
    "qwen2.5-3b": Shape(151936, 2048, 36, 16, 2, 11008, True),
    "qwen2.5-7b": Shape(152064, 3584, 28, 28, 4, 18944, False),
    "qwen2.5-14b": Shape(152064, 5120, 48, 40, 8, 13824, False),
}


# ---------------------------------------------------------------- which tensors llama.cpp's Q4_K_M keeps in Q6_K
def more_bits(i, n):
    """llama.cpp's use_more_bits: the i-th of n attn_v (or ffn_down) tensors, counted in the order it quantizes them,
    gets Q6_K in Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def six_bit_layers(n):
    """The layers whose attn_v and ffn_down Q4_K_M holds in Q6_K: llama.cpp counts them in its file's order, the
    names' sorted order (blk.0, blk.1, blk.10, ...), not the layers'."""
    order = sorted(range(n), key=str)
    return {layer for at, layer in enumerate(order) if more_bits(at, n)}


def tensors(s):
    """[(GGUF name, shape [rows, columns], type)] of shape s in Q4_K_M, in the file's order: a tied model's embedding
    is its head too, so it takes the head's Q6_K."""
    q = s.dim
    kv = s.dim // s.heads * s.kv_heads
    out = [("token_embd.weight", (s.vocab, s.dim), Q6_K if s.tied else Q4_K)]
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.dim), Q6_K))
    out.append(("output_norm.weight", (s.dim,), "F32"))
    wide = six_bit_layers(s.layers)
    for i in sorted(range(s.layers), key=str):
        more = Q6_K if i in wide else Q4_K
        out += [(f"blk.{i}.attn_q.weight", (q, s.dim), Q4_K), (f"blk.{i}.attn_k.weight", (kv, s.dim), Q4_K),
                (f"blk.{i}.attn_v.weight", (kv, s.dim), more), (f"blk.{i}.attn_output.weight", (s.dim, q), Q4_K),
                (f"blk.{i}.ffn_gate.weight", (s.ffn, s.dim), Q4_K), (f"blk.{i}.ffn_up.weight", (s.ffn, s.dim), Q4_K),
                (f"blk.{i}.ffn_down.weight", (s.dim, s.ffn), more),
                (f"blk.{i}.attn_q.bias", (q,), "F32"), (f"blk.{i}.attn_k.bias", (kv,), "F32"),
                (f"blk.{i}.attn_v.bias", (kv,), "F32"),
                (f"blk.{i}.attn_norm.weight", (s.dim,), "F32"), (f"blk.{i}.ffn_norm.weight", (s.dim,), "F32")]
    return out


# ---------------------------------------------------------------- blocks
def q4_k_blocks(x):
    """x float32 [rows, columns] -> Q4_K blocks uint8 [rows, columns / 256 x 144]: each group of 32 values is q x
    d x sc - dmin x m, low and step rounded outwards so the 16 codes span the group, d and dmin a block's f16, sc and
    m its groups' 6-bit multiples. A block: d, dmin, 12 bytes of sc and m, then 4 runs of 32 bytes (groups 2r and
    2r + 1 in the low and high nibbles)."""
    g = x.unflatten(1, (-1, 8, 32))  # [rows, blocks, 8, 32]
    low = g.amin(-1).clamp(max=0)  # [rows, blocks, 8]
    dmin = ((-low).amax(-1, keepdim=True) / 63).clamp(min=1e-6).half()  # [rows, blocks, 1]
    m = (-low / dmin.float()).ceil().clamp(0, 63)
    low = -dmin.float() * m
    step = ((g.amax(-1) - low) / 15).clamp(min=1e-6)
    d = (step.amax(-1, keepdim=True) / 63).half()
    sc = (step / d.float()).ceil().clamp(1, 63)
    q = ((g - low[..., None]) / (d.float() * sc)[..., None]).round().clamp(0, 15).to(torch.uint8)
    sc = sc.to(torch.uint8)
    m = m.to(torch.uint8)
    scales = torch.cat([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
                        (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], -1)  # [rows, blocks, 12]
    qs = (q[..., 0::2, :] | q[..., 1::2, :] << 4).flatten(-2)  # [rows, blocks, 128]
    halves = [d.view(torch.uint8), dmin.view(torch.uint8), scales, qs]
    return torch.cat(halves, -1).flatten(1)


def q6_k_blocks(x):
    """x float32 [rows, columns] -> Q6_K blocks uint8 [rows, columns / 256 x 210]: each 16 values are (code - 32) x
    d x sc, their largest within 31 steps, d a block's f16 and sc its int8 multiples (rounded up). A block: in each
    half of 128, quarter j's low 4 bits in ql[(j % 2) x 32 + l]'s nibble j // 2, its high 2 in qh[l] at bit 2j
    (loading.q6_groups reads them so); then the 16 sc, then d."""
    g = x.unflatten(1, (-1, 16, 16))  # [rows, blocks, 16, 16]
    scale = (g.abs().amax(-1) / 31).clamp(min=1e-6)  # [rows, blocks, 16]
    d = (scale.amax(-1, keepdim=True) / 127).half()  # [rows, blocks, 1]
    sc = (scale / d.float()).ceil().clamp(1, 127)
    codes = ((g / (d.float() * sc)[..., None]).round().clamp(-32, 31) + 32).to(torch.uint8)
    q = codes.flatten(-2).unflatten(-1, (2, 4, 32))  # [rows, blocks, half, quarter j, l]
    ql = (q[..., :2, :] & 15) | (q[..., 2:, :] & 15) << 4  # [rows, blocks, half, j % 2, l]
    qh = q[..., 0, :] >> 4 | (q[..., 1, :] >> 4) << 2 | (q[..., 2, :] >> 4) << 4 | (q[..., 3, :] >> 4) << 6
    parts = [ql.flatten(-3), qh.flatten(-2), sc.to(torch.int8).view(torch.uint8), d.view(torch.uint8)]
    return torch.cat(parts, -1).flatten(1)


BLOCKS = {Q4_K: q4_k_blocks, Q6_K: q6_k_blocks}


def chunks(name, shape, kind, generator):
    """The bytes of tensor `name` as the file holds them, a few million values at a time: norms 1, biases and
    matrices normal of std STD (matrices quantized to kind's blocks)."""
    if kind == "F32":
        values = torch.ones(shape) if "norm" in name else torch.randn(shape, generator=generator) * STD
        yield values.numpy()
        return
    rows, columns = shape
    step = max(1, CHUNK_VALUES // columns)
    for at in range(0, rows, step):
        x = torch.randn(min(step, rows - at), columns, generator=generator) * STD
        yield BLOCKS[kind](x).numpy()


def nbytes(shape, kind):
    import gguf
    if kind == "F32":
        return 4 * shape[0]
    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return shape[0] * shape[1] // values * size


# ---------------------------------------------------------------- the file
def copied_tokenizer(meta, vocab):
    """A GGUF file's tokenizer.* metadata {key: value}, its token list cut or padded to vocab ids as llama.cpp's
    converter pads a vocabulary: "[PAD<id>]" of type 5 (unused), never produced."""
    kept = {key: value for key, value in meta.items() if key.startswith("tokenizer.")}
    tokens = kept["tokenizer.ggml.tokens"][:vocab]
    types = kept["tokenizer.ggml.token_type"][:vocab]
    extra = range(len(tokens), vocab)
    kept["tokenizer.ggml.tokens"] = tokens + [f"[PAD{i}]" for i in extra]
    kept["tokenizer.ggml.token_type"] = types + [5] * len(extra)
    return kept


def add_value(w, key, value):
    """One metadata key in its GGUF type: ids uint32, flags bool, token types int32, strings and lists of them."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def metadata(name, s, tokenizer_meta):
    """-> {key: value} of a Q4_K_M file of shape s named name (marked RANDOM_KEY), with tokenizer_meta's tokenizer."""
    arch = {"block_count": s.layers, "context_length": s.context, "embedding_length": s.dim,
            "feed_forward_length": s.ffn, "attention.head_count": s.heads, "attention.head_count_kv": s.kv_heads,
            "rope.freq_base": s.rope_theta, "attention.layer_norm_rms_epsilon": s.eps}
    general = {"general.type": "model", "general.name": f"{name} (random weights)",
               "general.file_type": Q4_K_M_FILE_TYPE, "general.quantization_version": 2, RANDOM_KEY: True}
    return general | {f"qwen2.{key}": value for key, value in arch.items()} | copied_tokenizer(tokenizer_meta, s.vocab)


def file_bytes(s):
    """What the tensors of shape s take in the file (its header aside)."""
    return sum(nbytes(shape, kind) for _, shape, kind in tensors(s))


def write(path, name, s, tokenizer_path, seed=0, progress=True):
    """A GGUF file of shape s at path: the header first (every tensor's size follows from the shapes), then each
    tensor's blocks as they are made (on one thread: short operations, as cpu/formats.build's), under a temporary
    name renamed into place at the end."""
    import gguf
    from tqdm import tqdm
    if s.dim % 256 or s.ffn % 256:
        raise errors.LoadError(f"{name}: dim {s.dim} and ffn {s.ffn} must be multiples of 256, the values of a Q4_K "
                               "or Q6_K block")
    meta, _ = loading.read_gguf_header(tokenizer_path)
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise errors.LoadError(f"{tokenizer_path}: no byte-level BPE tokenizer to copy; give a Qwen2.5 GGUF file")
    folder = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(folder).free
    if free < file_bytes(s) + 2**28:
        raise errors.LoadError(f"{name} needs {file_bytes(s) / 1e9:.1f} GB free in {folder}, which has "
                               f"{free / 1e9:.1f} GB: free some space or choose another --dir")
    generator = torch.Generator().manual_seed(seed)
    temporary = path + ".part"
    w = gguf.GGUFWriter(temporary, "qwen2")
    try:
        for key, value in metadata(name, s, meta).items():
            add_value(w, key, value)
        for tensor, shape, kind in tensors(s):
            w.add_tensor_info(tensor, shape, None, nbytes(shape, kind), gguf.GGMLQuantizationType[kind])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        bar = tqdm(total=file_bytes(s), desc=f"making {os.path.basename(path)}", unit="B", unit_scale=True,
                   disable=not progress)
        with cpu_formats.one_thread(), bar:
            for tensor, shape, kind in tensors(s):
                w.write_padding(f, f.tell())
                for data in chunks(tensor, shape, kind, generator):
                    data.tofile(f)
                    bar.update(data.nbytes)
                w.write_padding(f, nbytes(shape, kind))
        w.close()
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


# ---------------------------------------------------------------- bench.py make-gguf
HELP = "make a GGUF file of a real model's shape with random weights (Q4_K_M's types), for speed only"


def options(p):
    p.add_argument("shape", choices=list(SHAPES), help="the model whose shape the file takes")
    p.add_argument("--dir", required=True, help="the folder to write it in (a 7B's file is about 5 GB)")
    p.add_argument("--tokenizer", help="a GGUF file whose tokenizer and its metadata the file copies (default: the "
                   "weights/ pair's target, fetched if missing)")
    p.add_argument("--seed", type=int, default=0)


def file_name(shape):
    return f"{shape}-random-q4_k_m.gguf"


def run(args):
    """Make the file (kept where it exists already) and print its path."""
    from weights import fetch
    path = os.path.join(args.dir, file_name(args.shape))
    if os.path.exists(path):
        print(f"{path} exists: kept (remove it to make it again)", file=sys.stderr)
    else:
        tokenizer = args.tokenizer or fetch.fetch_gguf(fetch.DEFAULT_PAIR[1])
        write(path, args.shape, SHAPES[args.shape], tokenizer, args.seed)
    print(path)
