"""Loading a model: Hugging Face safetensors directories, GGUF files (the header, block dequantization, llama's rotary
un-permutation), the tokenizer of either; Hub ids as those files (local_paths: the Hugging Face cache, else the Hub);
open_weights checks a path and its headers before any weight is read; its getter reads them when asked (making a
model of them is formats.py's)."""
import json
import math
import mmap
import os
import re
import struct
import sys
import typing
from fnmatch import fnmatch
from functools import partial

import torch

import kernels
import model
from errors import LoadError, UsageError

# ---------------------------------------------------------------- Hugging Face config.json
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM"}
# Config field -> its name in a config.json
HF_FIELDS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "ffn_dim": "intermediate_size", "max_seq_len": "max_position_embeddings",
             "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta"}
HF_DEFAULTS = {"norm_eps": 1e-6, "max_seq_len": 4096}  # of the fields a config.json may leave out
ROPE_TYPES = ("default", "llama3", "linear")


def config_from_hf(hf, path, more_eos=()):
    """The Config of a config.json (more_eos: generation_config.json's end ids, which generation also stops at)."""
    arch = hf.get("model_type")
    if arch not in ARCHS:
        raise LoadError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHS)})")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise LoadError(f"{path}: attention_bias/mlp_bias on {arch} is not supported")
    if hf.get("use_sliding_window") or arch == "mistral" and hf.get("sliding_window") not in (None, 0):
        raise LoadError(f"{path}: sliding-window attention is not supported")
    if type(hf.get("tie_word_embeddings", False)) is not bool:
        raise LoadError(f"{path}: tie_word_embeddings is {hf['tie_word_embeddings']!r}, expected true or false")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers >= 5 | < 5
    if not isinstance(rope, dict):
        raise LoadError(f"{path}: rope_parameters/rope_scaling is {rope!r}, expected an object")
    rope = dict(rope)
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise LoadError(f"{path}: rope type {rope_type!r} is not supported (default, llama3, linear)")
    sizes = {f: hf.get(key, HF_DEFAULTS.get(f)) for f, key in HF_FIELDS.items()}
    if sizes["n_kv_heads"] is None:
        sizes["n_kv_heads"] = sizes["n_heads"]
    sizes["rope_theta"] = theta
    scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
    eos = list(dict.fromkeys(token_ids(hf.get("eos_token_id"), path) + list(more_eos)))
    c = model.Config(arch=arch, **sizes, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", rope_scaling=scaling,
                     tie_embeddings=hf.get("tie_word_embeddings", False), bos_id=hf.get("bos_token_id"), eos_ids=eos)
    return model.checked_config(c, HF_FIELDS, path)


def token_ids(eos, where):
    """An eos_token_id field (null, one id or a list of ids) as a list."""
    if eos is None:
        ids = []
    elif type(eos) is int:
        ids = [eos]
    else:
        ids = eos
    if not (isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)):
        raise LoadError(f"{where}: eos_token_id is {eos!r}, expected a token id or a list of them")
    return ids


# ---------------------------------------------------------------- a file's tensors, checked and read
def checked_getter(c, tensors, where):
    """Wrap tensors {name: (shape, fetch(index, dtype) -> tensor)} as get(name, part=(dim, k, n), dtype=None) -> the
    k-th of n equal chunks along dim of the tensor (default: all) in dtype (None: the file's), fetching only that chunk
    (a tuple of slices). dtype "format": the weight format holding the chunk as the file quantized it (int4 for 4-bit
    blocks, int6 for 5 or 6 bits, int8 for more, None for floats); "int4": those 4-bit blocks as they are (q,
    scale_low). Each tensor's presence and shape is checked first, from the headers, else a one-line LoadError before
    any weight is read."""
    shapes = model.expected_shapes(c)
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


# ---------------------------------------------------------------- Hugging Face directories
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
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise LoadError(f"{index}: no weight_map of tensor names to file names")
    for f in set(weight_map.values()):
        norm = os.path.normpath(f)
        if os.path.isabs(norm) or norm.split(os.sep)[0] == "..":
            raise LoadError(f"{index}: shard {f!r} lies outside the model directory; refusing to open it")
    return sorted(set(weight_map.values()))


def open_hf_dir(path):
    """-> (Config, get(name, part, dtype) -> tensor, Tokenizer) for a directory with config.json, *.safetensors
    (single or sharded with model.safetensors.index.json) and tokenizer.json."""
    from safetensors import safe_open
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise LoadError(f"{path}: no config.json (expected a Hugging Face model directory or a .gguf file)")
    gen = os.path.join(path, "generation_config.json")
    more_eos = []
    if os.path.isfile(gen):
        more_eos = token_ids(read_json(gen).get("eos_token_id"), gen)
    c = config_from_hf(read_json(os.path.join(path, "config.json")), path, more_eos)
    files = shard_files(path)
    if not files:
        raise LoadError(f"{path}: no *.safetensors weights (pickled .bin/.pt checkpoints are not loaded)")

    def fetch(file, name, index, dtype=None):
        # A handle per read, dropped at once: one kept open keeps each page read resident beside the model's copy (twice
        # the weights' memory). get_slice reads only the chunk, a view of the mapping alive as long as the tensor.
        if dtype == "format":
            return None
        return safe_open(file, "pt").get_slice(name)[index].to(dtype)
    tensors = {}
    for file in (os.path.join(path, f) for f in files):
        try:
            f = safe_open(file, "pt")
        except Exception as e:
            raise LoadError(f"{file}: cannot read safetensors ({e})") from None
        tensors |= {name: (f.get_slice(name).get_shape(), partial(fetch, file, name)) for name in f.keys()}
    return c, checked_getter(c, tensors, path), Tokenizer.from_hf_dir(path)


# ---------------------------------------------------------------- GGUF files
GGUF_NAMES = {"blk": "model.layers", "token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
              "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
              "attn_k_norm": "self_attn.k_norm"}
GGUF_ARCHS = ("llama", "qwen2", "qwen3")  # llama.cpp writes mistral as llama
# GGUF value type -> its struct format, but for the two others: strings and arrays
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGUF_STRING = 8
GGUF_ARRAY = 9
GGUF_BLOCK = 2**22  # values dequantized at a time, so that a big tensor's temporaries stay small
GGUF_INT4 = ("Q4_0", "Q4_1", "Q4_K")  # each group of 32 values a 4-bit code times a scale plus a low value: int4's
# each 16 values a 6-bit code minus 32 times a scale: w4a8's 6-bit codes, as they are (Q5_0's 5-bit ones plus 16)
GGUF_INT6 = ("Q6_K", "Q5_0")
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
    run = 16 if values == 32 else 32
    qs = b[..., size - values // 2:].unflatten(-1, (-1, run))  # [n, blocks, runs, 16 | 32]
    codes = torch.empty(*qs.shape[:-1], 2, run, dtype=torch.uint8)  # [n, blocks, runs, nibble, 16 | 32]
    torch.bitwise_and(qs, 15, out=codes[..., 0, :])  # written in place: a stack would copy both halves again
    torch.bitwise_right_shift(qs, 4, out=codes[..., 1, :])
    codes = codes.flatten(1)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    d2 = b[..., 2:4].contiguous().view(torch.float16).float()
    if kind.name == "Q4_K":
        scales, mins = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12).numpy())
        sc = torch.from_numpy(scales).view(len(b), -1, 8).float()
        m = torch.from_numpy(mins).view(len(b), -1, 8).float()
        return codes, (d * sc).flatten(1), (-d2 * m).flatten(1)
    low = -8 * d if kind.name == "Q4_0" else d2
    return codes, d.flatten(1), low.flatten(1)


def dequantized(raw, kind):
    """Rows of GGUF blocks, uint8 [n, bytes a row] -> float32 [n, columns]. The types of Q4_K_M and Q5_0 files (Q4_*,
    Q5_0, Q6_K, Q8_0) in torch, faster than the gguf package's numpy, which does the others."""
    import gguf
    if kind.name not in GGUF_INT4 + GGUF_INT6 + ("Q8_0",):
        return torch.from_numpy(gguf.quants.dequantize(raw, kind))
    if kind.name in GGUF_INT4:
        codes, scale, low = q4_groups(raw, kind)
        return codes.unflatten(1, (-1, 32)).float().mul_(scale[..., None]).add_(low[..., None]).flatten(1)
    if kind.name in GGUF_INT6:
        codes, scale = int6_groups(raw, kind)
        return codes.unflatten(1, (-1, 16)).float().sub_(32).mul_(scale[..., None]).flatten(1)
    b = torch.from_numpy(raw).view(len(raw), -1, 34)  # Q8_0: [n, blocks, f16 d and 32 int8]
    d = b[..., :2].contiguous().view(torch.float16).float()
    return b[..., 2:].view(torch.int8).float().mul_(d).flatten(1)


def int6_groups(raw, kind):
    """Rows of Q6_K or Q5_0 blocks -> (codes [n, columns] in 0..63, scale [n, columns / 16]): each 16 values are
    (code - 32) x scale."""
    if kind.name == "Q6_K":
        return q6_groups(raw)
    return q5_groups(raw)


def q5_groups(raw):
    """Rows of Q5_0 blocks, uint8 [n, bytes a row] -> int6_groups': a block of 32 is its f16 d, 32 high bits (qh),
    then 16 bytes of low nibbles (values j and j + 16); value = (5-bit q - 16) x d, so code = q + 16 and both
    halves' scale d."""
    b = torch.from_numpy(raw).view(len(raw), -1, 22)  # [n, blocks, bytes a block]
    d = b[..., :2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    high = (b[..., 2:6, None] >> torch.arange(8, dtype=torch.uint8) & 1).flatten(-2)  # [n, blocks, 32] (bits)
    q = torch.cat([b[..., 6:] & 15, b[..., 6:] >> 4], -1) | high << 4  # [n, blocks, 32] in 0..31
    return (q + 16).flatten(1), d.expand(-1, -1, 2).flatten(1)


def q6_groups(raw):
    """Rows of Q6_K blocks, uint8 [n, bytes a row] -> (codes [n, columns] in 0..63, scale [n, columns / 16]): each 16
    values are (code - 32) x scale. A block of 256: in each half of 128, quarter j's low bits are ql[(j % 2) x 32 +
    l]'s nibble j // 2, its high qh >> 2j; then 16 int8 sc and the f16 d (scale: d x sc)."""
    b = torch.from_numpy(raw).view(len(raw), -1, 210)  # [n, blocks, bytes a block]
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    ql = b[..., :128].unflatten(-1, (2, 2, 32))
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32))
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    q = torch.stack([ql & 15, ql >> 4], -3).flatten(-3, -2) | (qh >> shifts & 3) << 4  # [n, blocks, half, j, l]
    return q.flatten(1), (b[..., 192:208].view(torch.int8).float() * d).flatten(1)


def read_gguf_header(path):
    """-> (metadata {key: value}, tensors {GGUF name: (shape, GGML type, file offset, bytes a row)}) from the header
    alone. Parsed here, not by gguf.GGUFReader: that builds a numpy view of every vocabulary string (slow for a
    vocabulary's many tokens and merges) and trusts every count, failing on a damaged one with 'index 0 is out of
    bounds'. ValueError names the first count, length or offset the file's size makes impossible."""
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
            if vtype == GGUF_STRING:  # a vocabulary's tokens and merges are most of a header: no more work than this
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
        n_tensors = count("the tensor count", 24)  # a tensor's smallest entry
        n_kv = count("the key-value count", 13)  # a key-value pair's smallest entry
        meta = {}
        infos = {}
        for i in range(n_kv):
            key = value(GGUF_STRING, f"metadata key {i}")
            meta[key] = value(unpack("I", f"the type of metadata {key!r}")[0], f"metadata {key!r}")
        for i in range(n_tensors):
            name = value(GGUF_STRING, f"tensor name {i}")
            n_dims = unpack("I", f"tensor {name!r} n_dims")[0]
            if n_dims > 4:
                raise ValueError(f"tensor {name!r} n_dims is {n_dims}, more than GGUF's 4")
            *dims, kind, offset = unpack(f"{n_dims}QIQ", f"tensor {name!r} dimensions, type and offset")
            if name in infos:
                raise ValueError(f"tensor {name!r} appears twice")
            infos[name] = dims, kind, offset
    align = meta.get("general.alignment", 32)
    if not (type(align) is int and align > 0 and align & (align - 1) == 0):
        raise ValueError(f"general.alignment is {align!r}, not a power of two")
    start = -(-pos // align) * align
    tensors = {}
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
    Tokenizer), reading the header only (and rope_freqs' few factors): tensors are read and dequantized when got."""
    import gguf
    import numpy as np

    class Metadata(dict):  # a missing required key is a one-line LoadError naming the file
        def __missing__(self, key):
            raise LoadError(f"{path}: GGUF metadata has no {key}")
    try:
        values, infos = read_gguf_header(path)
    except ValueError as e:
        raise LoadError(f"{path}: not a readable GGUF file, truncated or corrupt? ({e})") from None
    meta = Metadata(values)
    found = {hf_name(n): t for n, t in infos.items()}
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise LoadError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise LoadError(f"{path}: GGUF rope scaling {scaling!r} is not supported (none, linear)")
    if scaling == "linear" and "rope_freqs.weight" in found:
        raise LoadError(f"{path}: GGUF rope scaling is both linear and rope_freqs; one of them is supported at a time")
    for kind in {t[1] for t in found.values()}:  # one zero block of each type, so that none fails mid-load
        try:
            gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
        except NotImplementedError:
            raise LoadError(f"{path}: the gguf package cannot dequantize {kind.name} tensors; upgrade it") from None

    def read(name, first, n):  # the blocks of rows first .. first + n - 1: uint8 [n, bytes a row]
        _, kind, offset, row_bytes = found[name]
        return np.fromfile(path, np.uint8, n * row_bytes, offset=offset + first * row_bytes).reshape(n, row_bytes)
    keys = {f: key.format(arch) for f, key in GGUF_KEYS.items()}
    defaults = {"n_kv_heads": meta[keys["n_heads"]], "head_dim": None, "rope_theta": 10000.0}
    sizes = {f: meta.get(key, defaults[f]) if f in defaults else meta[key] for f, key in keys.items()}
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    if "<|endoftext|>" in meta["tokenizer.ggml.tokens"]:  # instruct models still end plain completions with it
        eos.append(meta["tokenizer.ggml.tokens"].index("<|endoftext|>"))
    if "model.embed_tokens.weight" not in found:
        raise LoadError(f"{path}: missing tensor token_embd.weight")
    embed = found["model.embed_tokens.weight"][0]
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
    if "rope_freqs.weight" in found:  # llama3's scaling as llama.cpp writes it: a factor a frequency
        shape, kind = found["rope_freqs.weight"][:2]
        factors = dequantized(read("rope_freqs.weight", 0, math.prod(shape[:-1])), kind).flatten()
        rope_scaling = {"rope_type": "factors", "factors": factors.tolist()}
    c = model.Config(arch=arch, vocab_size=embed[0] if len(embed) == 2 else None, **sizes, rope_scaling=rope_scaling,
                     tie_embeddings="lm_head.weight" not in found, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                     bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_ids=list(dict.fromkeys(token_ids(eos, path))))
    c = model.checked_config(c, {"vocab_size": "token_embd.weight's row count", **keys}, path)
    rotary = meta.get(f"{arch}.rope.dimension_count", c.head_dim)
    if rotary != c.head_dim:
        raise LoadError(f"{path}: {arch}.rope.dimension_count is {rotary!r}, not the head size {c.head_dim}: "
                        "partial rotary embeddings are not supported")

    def fetch(name, index, dtype=None):
        """Quantized blocks run along rows: a chunk of rows (q/k/v, gate/up of a tensor-parallel rank) dequantizes
        only those rows, a chunk of columns (o, down) every row, then keeps its columns. GGUF_BLOCK values at a
        time go into the result, so a big tensor is never held whole in float32, or twice. dtype "int4" (Q4 blocks
        only): (q [rows, columns], scale_low [columns / 32, rows, 2]: value = q x scale + low); "int6"
        (Q6_K or Q5_0): int6_groups' (codes, scale [rows, columns / 16])."""
        from tqdm import tqdm
        shape, kind = found[name][:2]
        if dtype == "format":
            if kind.name in GGUF_FLOATS:
                return None
            if kind.name in GGUF_INT4:
                return "int4"
            if kind.name in GGUF_INT6:
                return "int6"
            return "int8"
        if len(shape) == 1:  # a norm or a bias: one short row
            return dequantized(read(name, 0, 1), kind)[0][index].to(dtype)
        four = dtype == "int4"
        codes = dtype in ("int4", "int6")
        rows = range(shape[0])[index[0]]
        g = kernels.INT4_GROUP if four else 16  # values a scale
        out_shape = torch.empty(shape, device="meta")[index].shape
        out = torch.empty(out_shape, dtype=torch.uint8 if codes else dtype or torch.float32)
        groups = None
        if codes:  # [rows, columns / g, (scale, zero) | (scale,)]
            groups = torch.empty(len(out), out.shape[1] // g, 2 if four else 1)
        step = c.head_dim * max(1, GGUF_BLOCK // (c.head_dim * shape[1]))  # whole heads: each block un-permutes alone
        permuted = arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))
        at_groups = (slice(None), *(slice(i.start // g, i.stop // g) for i in index[1:]))
        blocks = range(rows.start, rows.stop, step)
        for s in tqdm(blocks, desc=name, leave=False, disable=True if len(blocks) < 8 else None):
            n = min(step, rows.stop - s)
            raw = read(name, s, n)
            at = slice(s - rows.start, s - rows.start + n)
            if four:
                w, scale, low = q4_groups(raw, kind)
                sz = torch.stack([scale, low], -1)  # [n, columns / 32, 2]
            elif codes:
                w, scale = int6_groups(raw, kind)
                sz = scale[..., None]  # [n, columns / 16, 1]
            else:
                w = dequantized(raw, kind)
            if codes and permuted:
                sz = unpermute_rope(sz, n // c.head_dim)
            if codes:
                groups[at] = sz[at_groups]
            if permuted:
                w = unpermute_rope(w, n // c.head_dim)
            out[at] = w[(slice(None), *index[1:])]
        if four:
            return out, groups.transpose(0, 1)
        if codes:
            return out, groups[..., 0]
        return out
    tok = Tokenizer.from_gguf(meta, path)
    getters = {name: (t[0], partial(fetch, name)) for name, t in found.items()}
    return c, checked_getter(c, getters, path), tok


# ---------------------------------------------------------------- tokenizer
# Pre-tokenizer regexes by llama.cpp's `tokenizer.ggml.pre` name, as in each model's own tokenizer.json.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # qwen2's but for digits, in runs of up to three


def gguf_pre_tokenizer(name, where):
    """-> (normalizer, pre-tokenizer) of llama.cpp's pre-tokenizer `name`."""
    from tokenizers import Regex, normalizers, pre_tokenizers as pre
    if name == "qwen2":
        return normalizers.NFC(), pre.Sequence([pre.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    if name == "llama-bpe":
        return None, pre.Sequence([pre.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                   pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    if name == "smollm":
        return None, pre.Sequence([pre.Digits(individual_digits=True),
                                   pre.ByteLevel(add_prefix_space=False, use_regex=True)])
    raise LoadError(f"{where}: GGUF pre-tokenizer {name!r} is not supported (supported: qwen2, llama-bpe, smollm)")


class Tokenizer:
    """A `tokenizers` BPE tokenizer plus what generation needs from around it: the chat template."""

    def __init__(self, tok, chat_template=None):
        self.tok = tok
        self.chat_template = chat_template

    @classmethod
    def from_hf_dir(cls, path):
        from tokenizers import Tokenizer as HFTokenizer
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise LoadError(f"{path}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(file)
        except Exception as e:
            raise LoadError(f"{file}: cannot read tokenizer ({e})") from None
        template = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(template):
            with open(template) as f:
                return cls(tok, f.read())
        config = os.path.join(path, "tokenizer_config.json")
        if not os.path.isfile(config):
            return cls(tok, None)
        return cls(tok, read_json(config).get("chat_template"))

    @classmethod
    def from_gguf(cls, meta, where):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, processors
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise LoadError(f"{where}: GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} is not "
                            "supported (byte-level BPE, 'gpt2', only)")
        normalizer, pre = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"), where)
        tokens = meta["tokenizer.ggml.tokens"]
        types = meta["tokenizer.ggml.token_type"]
        merges = meta["tokenizer.ggml.merges"]
        try:  # a damaged vocabulary fails in `tokenizers` (a merge of unknown tokens) or here (a bos id past the end)
            merges = [tuple(m.split(" ", 1)) for m in merges]
            tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
            tok.normalizer = normalizer
            tok.pre_tokenizer = pre
            tok.decoder = decoders.ByteLevel()
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

    def strings(self):
        """[the string of each id], up to the largest id the tokenizer knows (None: an id without one)."""
        vocab = self.tok.get_vocab(with_added_tokens=True)
        out = [None] * (max(vocab.values(), default=-1) + 1)
        for string, i in vocab.items():
            out[i] = string
        return out


def shared_vocabulary(configs, tokenizers, paths):
    """-> how many ids the target and its draft share (configs: the target's and the draft's if any; tokenizers: their
    Tokenizers, none for models built in memory; paths: their files): the ids below every model's rows and every
    tokenizer's tokens, the rows past a tokenizer's being padding. The draft's tokens must be the target's first ones
    (or the target's the draft's), else a one-line UsageError."""
    rows = [c.vocab_size for c in configs]
    tables = [t.strings() for t in tokenizers]
    n = min(rows + [len(table) for table in tables])
    if len(tables) < 2 or tables[0][:n] == tables[1][:n]:
        return n
    i = next(i for i in range(n) if tables[0][i] != tables[1][i])
    raise UsageError(f"the draft {paths[1]} tokenizes differently from the target {paths[0]}: id {i} is "
                     f"{tables[1][i]!r} in the draft, {tables[0][i]!r} in the target; take a draft of the target's "
                     "tokenizer family", "draft")


# ---------------------------------------------------------------- Hugging Face Hub ids
# org/name, then @revision, then :FILE.gguf or a quant tag in a GGUF file's name, as llama.cpp's -hf takes it
HUB_ID = re.compile(r"(?P<repo>\w[\w.-]*/\w[\w.-]*)(@(?P<revision>[\w./-]+))?(:(?P<pick>[^:@]+))?")
# A Hugging Face directory's files that open_hf_dir reads: safetensors weights, never a pickle (.bin, .pt)
HUB_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "*.safetensors", "model.safetensors.index.json")
HUB_QUANT = "Q4_K_M"  # of a repo's several GGUF files, the one taken when none is named, as llama.cpp's -hf does
PATH_FORM = "or give the path of a model directory or .gguf file"
HUB_TIMEOUT_S = 10  # for the Hub's answer about a model: a network that drops its packets would hang without it


class Download(typing.NamedTuple):
    """A Hub id's files to fetch: the name as given, its repo and revision, the files and their bytes."""
    name: str
    repo: str
    revision: str | None
    files: list
    size: int


def local_paths(names):
    """[target, draft] as given (paths, Hub ids, or None) -> local paths: a path that exists as it is, a Hub id's files
    from the Hugging Face cache, else downloaded from the Hub; every id is found before any is downloaded."""
    found = [located(name) for name in names]
    return [download(f) if isinstance(f, Download) else f for f in found]


def hub_parts(name):
    """(repo, revision, pick) of a Hub id 'org/name[@revision][:pick]'; None for a name read as a path."""
    match = HUB_ID.fullmatch(name)
    if match is None or (name.endswith(".gguf") and match["pick"] is None):
        return None
    return match["repo"], match["revision"], match["pick"]


def located(name):
    """name's local path (itself where it exists or is no Hub id; a Hub id's files in the cache), or the Download that
    fetches a Hub id's files; a one-line LoadError where neither the cache nor the Hub has them."""
    if not isinstance(name, str) or os.path.exists(name):
        return name
    parts = hub_parts(name)
    if parts is None:
        return name  # open_weights says that it is missing
    from huggingface_hub import constants
    cached = in_cache(name, *parts)
    if cached:
        return cached
    if constants.HF_HUB_OFFLINE:
        raise LoadError(f"{name}: no such file or directory, nor in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
                        f"and HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE to download it, {PATH_FORM}")
    return on_the_hub(name, *parts)


def in_cache(name, repo, revision, pick):
    """The local path of name's model in the Hugging Face cache, or None where the cache lacks some of it."""
    from huggingface_hub import snapshot_download
    try:
        folder = snapshot_download(repo, revision=revision, allow_patterns=list(HUB_FILES), local_files_only=True)
    except FileNotFoundError:  # huggingface_hub's LocalEntryNotFoundError: no snapshot of that revision
        return None
    files = [os.path.relpath(os.path.join(at, f), folder) for at, _, names in os.walk(folder) for f in names]
    chosen = hub_choice(name, repo, [f for f in files if os.path.isfile(os.path.join(folder, f))], pick)
    if not chosen:
        return None
    if chosen[0].endswith(".gguf"):
        return os.path.join(folder, chosen[0])
    if all(os.path.isfile(os.path.join(folder, f)) for f in shard_files(folder)):
        return folder
    return None


def hub_choice(name, repo, files, pick):
    """Of a repo's files, those the engine reads for name: [a .gguf file] (pick: its name, or a quant tag in it; none
    picked, the only one, else HUB_QUANT's), or a Hugging Face directory's (unpicked); [] where it has none of them."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    top = [f for f in files if "/" not in f]
    if pick is None and {"config.json", "tokenizer.json"} <= set(top) and any(f.endswith(".safetensors") for f in top):
        return [f for f in top if any(fnmatch(f, pattern) for pattern in HUB_FILES)]
    if pick and pick.endswith(".gguf"):
        return [f for f in ggufs if f == pick]
    if pick is None and len(ggufs) == 1:
        return ggufs
    tag = (pick or HUB_QUANT).lower()
    matches = [f for f in ggufs if tag in os.path.basename(f).lower()]
    if len(matches) > 1:
        raise LoadError(f"{name}: {len(matches)} GGUF files of {repo} match {tag} ({', '.join(matches)}): name one as "
                        f"{repo}:FILE")
    return matches


def on_the_hub(name, repo, revision, pick):
    """The Download of name's files as the Hub lists them, or a one-line LoadError saying why there is none."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise LoadError(f"{name}: {repo} is gated: accept its terms on the Hub and set HF_TOKEN, {PATH_FORM}") from None
    except RepositoryNotFoundError:
        raise LoadError(f"{name}: no such file or directory, nor a model on the Hub (a private one needs HF_TOKEN); "
                        f"{PATH_FORM}") from None
    except RevisionNotFoundError:
        raise LoadError(f"{name}: {repo} has no revision {revision!r}") from None
    except Exception as error:  # the HTTP client's own errors, which differ between huggingface_hub's versions
        raise LoadError(f"{name}: no such file or directory, nor in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
                        f"and the Hub cannot be reached ({type(error).__name__}): fetch it into that cache where the "
                        f"Hub is reachable (HF_HUB_OFFLINE=1 reads it without asking), {PATH_FORM}") from None
    sizes = {s.rfilename: s.size or 0 for s in info.siblings}
    files = hub_choice(name, repo, list(sizes), pick)
    if not files:
        raise LoadError(no_model_in(name, repo, list(sizes), pick))
    return Download(name, repo, revision, files, sum(sizes[f] for f in files))


def no_model_in(name, repo, files, pick):
    """Why hub_choice found nothing the engine reads among a repo's files, and which GGUF files there are."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if not ggufs:
        return (f"{name}: {repo} has neither config.json, tokenizer.json and *.safetensors nor a .gguf file (pickled "
                ".bin/.pt weights are never loaded)")
    if pick and pick.endswith(".gguf"):
        why = f"{repo} has no file {pick}"
    else:
        why = f"no GGUF file of {repo} has {pick or HUB_QUANT} in its name"
    return f"{name}: {why}; its GGUF files: {', '.join(ggufs)}; name one as {repo}:FILE"


def download(d):
    """The local path of a Download's files, fetched into the Hugging Face cache under its progress bars."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    print(f"{d.name}: downloading {len(d.files)} file(s), {d.size / 1e6:,.0f} MB, from the Hugging Face Hub into "
          f"{constants.HF_HUB_CACHE}", file=sys.stderr, flush=True)
    try:
        if d.files[0].endswith(".gguf"):
            return hf_hub_download(d.repo, d.files[0], revision=d.revision)
        return snapshot_download(d.repo, revision=d.revision, allow_patterns=d.files)
    except Exception as error:  # as in on_the_hub; a download stopped part-way resumes on the next run
        raise LoadError(f"{d.name}: the download from the Hub failed ({type(error).__name__}: run again to resume "
                        f"it), {PATH_FORM}") from None


# ---------------------------------------------------------------- opening
class Opened(typing.NamedTuple):
    """A model file opened, its weights not yet read."""
    config: model.Config
    get: typing.Callable  # checked_getter's: a tensor by its Hugging Face name, read when asked
    tokenizer: typing.Any


def open_weights(path):
    """-> Opened (Config, get, Tokenizer) for a Hugging Face directory or a .gguf file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise LoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return Opened(*open_hf_dir(path))
    if path.endswith(".gguf"):
        return Opened(*open_gguf(path))
    raise LoadError(f"{path}: not a model directory or a .gguf file")
