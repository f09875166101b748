"""The one seam between the engine and the machine it runs on, chosen once, when the engine is built: what runs a
model's operations (its Backend), which weight formats it takes, how a model file becomes a model there, and whether
`--weights auto` measures. A CPU is the CPU wing's (cpu/: its compiled kernels, w4a8, the measuring, the weight
cache); any other device Triton's kernels and formats.py's weights, converted at every start."""
import torch

import formats
import kernels
import loading
from cpu import auto, weight_cache
from cpu import backend as cpu_backend
from cpu import formats as cpu_formats


class Gpu:
    """A CUDA device (or any but a CPU): kernels.py's Backend (its Triton kernels where they run), formats.py's
    weights."""
    name = "gpu"  # the key of methods.Method.shapes: each method's (N, K) by default here

    def __init__(self, device):
        self.device = device
        self.backend = kernels.for_device(device)

    def usable(self, fmt):
        """fmt as it runs here: a one-line LoadError where it does not."""
        formats.weight_format(fmt, self.device)
        return fmt

    def build(self, path, opened, role, fmt, wider, tp, say):
        """-> the Transformer of model file path (opened: its loading.Opened), tp = (rank, world)'s shard of it, in
        format fmt (convert's), as the engine's role ("target", "draft"); say(line): what it reads or keeps."""
        return self.convert(opened.config, opened.get, None, tp, fmt, wider)

    def convert(self, c, get, dtype=None, tp=(0, 1), weights=None, wider=True):
        """-> formats.build's Transformer of Config c's tensors get(name), run by this platform's backend."""
        return formats.build(c, get, self.device, dtype, tp, weights, wider, self.backend)

    def measurement(self, *args):
        """--weights auto measures on a CPU only: here bf16 serves."""
        return None

    convert_weights = staticmethod(formats.convert_weights)  # a model's matmul weights into a format, in place
    model_bytes = staticmethod(formats.model_bytes)  # what a model takes in a format, from its file's headers


class Cpu(Gpu):
    """A CPU: the CPU wing's Backend and weight formats; a model in one process kept by the weight cache."""
    name = "cpu"

    def __init__(self, device):
        self.device = device
        self.backend = cpu_backend.Backend()

    def usable(self, fmt):
        """fmt, or int4 where it is w4a8 and its kernel cannot be built here (a line on the "smcsd" log says why)."""
        return super().usable(cpu_formats.usable(fmt))

    def build(self, path, opened, role, fmt, wider, tp, say):
        """In one process through the weight cache (read back where kept, else converted and kept)."""
        if tp[1] == 1:
            return weight_cache.build(path, opened, role, fmt, wider, say, self)
        return self.convert(opened.config, opened.get, None, tp, fmt, wider)

    def convert(self, c, get, dtype=None, tp=(0, 1), weights=None, wider=True):
        """-> cpu/formats.build's Transformer (any format of formats.FORMATS), run by the CPU wing's backend."""
        return cpu_formats.build(c, get, dtype, tp, weights, wider, self.backend)

    def measurement(self, *args):
        """-> auto.Measurement(*args): --weights auto's timings and choices on this machine."""
        return auto.Measurement(*args)

    convert_weights = staticmethod(cpu_formats.convert_weights)
    model_bytes = staticmethod(cpu_formats.model_bytes)


def for_device(device):
    """-> the platform (Cpu or Gpu) of `device` (a torch.device or its name)."""
    device = torch.device(device)
    if device.type == "cpu":
        return Cpu(device)
    return Gpu(device)


def build(c, get, device="cpu", dtype=None, tp=(0, 1), weights=None, wider=True):
    """-> the Transformer of Config c's tensors get(name) on device, as its platform converts them: with every weight
    in memory, its matmul weights in format `weights` (formats.FORMATS; None: dtype's, bf16 unless dtype is
    torch.float32); tp = (rank, world): the rank's shard; wider=False: int4 even where a GGUF file has more bits."""
    return for_device(device).convert(c, get, dtype, tp, weights, wider)


def load(path, device="cpu", dtype=None, tp=(0, 1), weights=None):
    """-> (Transformer, Tokenizer) of the model file at path (build's), its weight format checked before any read."""
    formats.weight_format(weights or "bf16", device)
    c, get, tok = loading.open_weights(path)
    return build(c, get, device, dtype, tp, weights), tok
