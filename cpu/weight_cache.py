"""The weight cache: what the CPU platform converts a model file into, kept in the cache folder's weights/ as one
safetensors file per (model file, weight format, role) with its key and recipes, and mapped back at the next start.
Mapped, not copied into RAM: measured end to end, it starts sooner and decodes as fast (unread embedding rows stay on
disk). Any doubt gives a line and a normal load, never a wrong weight. CPU only, one process: CUDA and tensor-parallel
ranks (which would share a folder) convert at every start."""
import dataclasses
import hashlib
import json
import os
import shutil
import struct

import torch

import formats
import model
from cpu import formats as cpu_formats
from cpu import store

# the code that makes the tensors, and this file, which keeps them and builds the model from them
CODE = ("model.py", "formats.py", "loading.py", "kernels.py", "cpu/formats.py", "cpu/native.py", "cpu/native.c",
        "cpu/weight_cache.py")
HEAD_BYTES = 2**20  # of each model file hashed: a file rewritten in place with its old size and time is still caught
ALIGN = 64  # bytes: every tensor starts on a cache line, as torch's own allocations do
SPARE_BYTES = 2**28  # left free on the disk beyond a file written
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class Stale(Exception):
    """A kept file of another key: its message says what changed, in a few words."""


class Damaged(ValueError):
    """A kept file that is not whole or not what this module writes: its message says why, in a few words."""


# ---------------------------------------------------------------- the key
def head_digest(identity):
    """A sha256 of the first MiB of each file of a file_identity (a .gguf file, or a directory's weights and
    configs)."""
    h = hashlib.sha256()
    folder = identity["path"]
    if not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    for name, _, _ in identity["files"]:
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read(HEAD_BYTES))
    return h.hexdigest()


def code_digest():
    h = hashlib.sha256()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project's folder
    for name in CODE:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def cache_key(path, c, fmt, wider):
    """-> what the tensors kept for model file path (Config c) in weight format fmt depend on, as JSON reads it back."""
    identity = store.file_identity(path)
    key = {"model": identity | {"head": head_digest(identity)}, "config": dataclasses.asdict(c), "format": fmt,
           "wider": wider, "dtype": str(formats.FORMATS[fmt]), "tp": [0, 1], "torch": torch.__version__,
           "cpu": store.cpu_identity(), "code": code_digest()}
    return json.loads(json.dumps(key))


def cache_path(path, fmt, role):
    """-> the file that keeps model file path's weights in format fmt as the engine's role ("target", "draft"): one
    per triple, so a changed model file replaces its entry."""
    name = json.dumps([os.path.realpath(path), fmt, role])
    return os.path.join(store.cache_folder(), "weights", f"weights-{store.digest(name)}.safetensors")


# ---------------------------------------------------------------- writing
def kept_tensors(transformer):
    """-> ({name: tensor} the transformer is rebuilt from, {matmul name: recipe}): each matmul weight "plain",
    "onednn" (kept plain, packed again), "tied" (the embedding itself), "quantized" (formats.Quantized's tensors) or
    "w4a8" (cpu/formats.W4A8's); the embedding "rows" where it is cpu/formats.Rows."""
    tensors = {}
    recipes = {}
    if isinstance(transformer.embed, cpu_formats.Rows):
        parts = transformer.embed.tensors()
        recipes["embed"] = {"kind": "rows", "tensors": sorted(parts)}
        tensors |= {f"embed.{part}": t for part, t in parts.items()}
    for name, m, attr in formats.matmuls(transformer):
        w = getattr(m, attr)
        if isinstance(w, formats.Quantized):
            parts = w.tensors()
            recipes[name] = {"kind": "quantized", "fmt": w.fmt, "tensors": sorted(parts)}
            tensors |= {f"{name}.{part}": t for part, t in parts.items()}
        elif isinstance(w, cpu_formats.W4A8):
            parts = w.tensors()
            recipes[name] = {"kind": "w4a8", "bits": w.bits, "tail_bits": w.tail_bits, "tensors": sorted(parts)}
            tensors |= {f"{name}.{part}": t for part, t in parts.items()}
        elif w is transformer.embed:
            recipes[name] = {"kind": "tied"}
        elif w.is_mkldnn:
            recipes[name] = {"kind": "onednn"}
            tensors[name] = w.to_dense()
        else:
            recipes[name] = {"kind": "plain"}
            tensors[name] = w.data
    for name, p in transformer.named_parameters():
        if name.rpartition(".")[0] not in recipes and name not in recipes:
            tensors[name] = p.data
    return tensors, recipes


def header_bytes(tensors, metadata):
    """-> (safetensors' header of tensors, in name order, each at a multiple of ALIGN bytes: "pad.N" entries of
    zeros fill the gaps the format does not allow; the data's bytes)."""
    entries = {"__metadata__": metadata}
    at = 0
    for name in sorted(tensors):
        t = tensors[name]
        gap = -at % ALIGN
        if gap:
            entries[f"pad.{at}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [at, at + gap]}
        at += gap
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        at += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % ALIGN)  # the data starts on a cache line too
    return header, at


def write_file(path, tensors, metadata):
    """tensors and metadata as a safetensors file at path, through a temporary file renamed over it: a reader finds
    the old file or the new, whole; the temporary never outlives a failure (KeyboardInterrupt included)."""
    header, data = header_bytes(tensors, metadata)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < len(header) + data + SPARE_BYTES:
        raise OSError(f"{free / 1e9:.1f} GB free, {(len(header) + data) / 1e9:.1f} GB needed")
    with store.atomically(path) as temporary, open(temporary, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name, entry in json.loads(header).items():
            if name.startswith("pad."):
                f.write(bytes(entry["shape"][0]))
            elif name != "__metadata__":
                f.write(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())


def keep(transformer, path, key, say):
    """The transformer's tensors in the cache file path for key, or a line why not (a normal start, then)."""
    tensors, recipes = kept_tensors(transformer)
    metadata = {"key": json.dumps(key), "recipes": json.dumps(recipes)}
    try:
        write_file(path, tensors, metadata)
    except OSError as e:
        say(f"weights not kept: cannot write {path} ({e.strerror or e}); the next start converts again")
        return
    say(f"weights kept in {path} ({os.path.getsize(path) / 1e9:.2f} GB); the next start reads it back")


# ---------------------------------------------------------------- reading back
def mapped(path):
    """-> uint8 [bytes] of the whole file at path, memory-mapped (private: nothing is written back)."""
    size = os.path.getsize(path)
    if size < 8:
        raise Damaged(f"{size} bytes, no header")
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def read_header(whole):
    """-> (the header's {name: entry}, its metadata, where the data starts) of a mapped safetensors file, checked to
    end where the file ends."""
    length = struct.unpack("<Q", whole[:8].numpy().tobytes())[0]
    if length > len(whole) - 8:
        raise Damaged("a truncated header")
    header = json.loads(whole[8:8 + length].numpy().tobytes())
    metadata = header.pop("__metadata__")
    end = max(entry["data_offsets"][1] for entry in header.values())
    if 8 + length + end != len(whole):
        raise Damaged(f"{len(whole)} bytes where its header says {8 + length + end}")
    return header, metadata, 8 + length


def view(whole, start, entry):
    """One tensor of a header entry, a view into the mapped file."""
    first, last = entry["data_offsets"]
    dtype = DTYPES[entry["dtype"]]
    t = whole[start + first:start + last].view(dtype)
    return t.reshape(entry["shape"])


def changes(kept, key):
    """-> what differs between a kept file's key and this start's, in words."""
    if kept.get("model") != key["model"]:
        return "the model file changed"
    others = [field for field in key if kept.get(field) != key[field]]
    return f"other {', '.join(others)}"


def restored(recipe, name, tensors, transformer):
    """-> matmul weight `name` from its recipe (kept_tensors') and the file's tensors."""
    kind = recipe["kind"]
    if kind == "tied":
        return transformer.embed
    parts = {part: tensors[f"{name}.{part}"] for part in recipe.get("tensors", ())}
    if kind == "quantized":
        return formats.Quantized(recipe["fmt"], parts)
    if kind == "w4a8":
        return cpu_formats.W4A8(parts, recipe["bits"], recipe["tail_bits"])
    if kind == "onednn":
        return cpu_formats.packed(tensors[name])
    return torch.nn.Parameter(tensors[name], requires_grad=False)


def rebuilt(c, fmt, tensors, recipes, backend):
    """-> the Transformer of Config c in format fmt with its parameters from tensors and its matmul weights from
    recipes; a parameter missing or of another shape or dtype raises Damaged."""
    transformer = model.Transformer(c, "cpu", formats.FORMATS[fmt], backend)  # torch.empty: no memory touched
    for name, p in list(transformer.named_parameters()):
        if name in recipes:
            continue
        t = tensors.get(name)
        if t is None or t.shape != p.shape or t.dtype != p.dtype:
            raise Damaged(f"{name} missing or of another shape")
        owner, _, attr = name.rpartition(".")
        formats.replace(transformer.get_submodule(owner), attr, torch.nn.Parameter(t, requires_grad=False))
    if "embed" in recipes:
        parts = {part: tensors[f"embed.{part}"] for part in recipes["embed"]["tensors"]}
        formats.replace(transformer, "embed", cpu_formats.Rows(parts, formats.FORMATS[fmt]))
    for name, m, attr in formats.matmuls(transformer):
        formats.replace(m, attr, restored(recipes[name], name, tensors, transformer))
    return transformer


def read_back(path, key, c, fmt, backend):
    """-> the Transformer kept in path for key; Stale where it is another key's, Damaged (or a parse error) where it
    is not whole."""
    whole = mapped(path)
    header, metadata, start = read_header(whole)
    kept = json.loads(metadata["key"])
    if kept != key:
        raise Stale(changes(kept, key))
    tensors = {name: view(whole, start, entry) for name, entry in header.items() if not name.startswith("pad.")}
    return rebuilt(c, fmt, tensors, json.loads(metadata["recipes"]), backend)


# ---------------------------------------------------------------- the engine's entry
def first_line(e):
    """An exception's message as one short line (torch's run over several)."""
    lines = str(e).splitlines() or [type(e).__name__]
    return lines[0][:120]


def build(path, opened, role, fmt, wider, say, platform):
    """-> platform.convert's Transformer of model file path (opened: its loading.Opened) on the CPU in weight format
    fmt (formats.FORMATS'), read back from the cache where kept for this very file, format, torch, CPU and code, else
    converted and kept; role ("target", "draft") names the entry. say(line): read back, stale, damaged, kept, not
    kept. platform: platforms.Cpu, whose backend runs the model."""
    where = cache_path(path, fmt, role)
    key = cache_key(path, opened.config, fmt, wider)
    if os.path.exists(where):
        try:
            transformer = read_back(where, key, opened.config, fmt, platform.backend)
            say(f"weights read back from {where}")
            return transformer
        except Stale as e:
            say(f"{where} is stale ({e}): converting again, replacing it")
        except store.UNREADABLE as e:
            say(f"{where} is unreadable or truncated ({first_line(e)}): loading {path} as usual, replacing it")
    transformer = platform.convert(opened.config, opened.get, weights=fmt, wider=wider)
    keep(transformer, where, key, say)
    return transformer
