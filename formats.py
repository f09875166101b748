"""Weight formats: one holds every matmul weight (FORMATS), as packed bf16 or float32, int8, int4 or calibrated w8a8
(Quantized); converting a model's weights into one; and --weights auto's Measurement, which times this machine's
matmuls in each format and chooses the formats and the smc and sd cycle shapes that run fastest."""
import collections
import copy
import math
import timeit

import torch

import kernels
import model

# One format holds every matmul weight (each block's wqkv, wo, w13, w2 and the head); activations, embeddings and norms
# are in the dtype its kernels are fast with. None is fastest everywhere (on AVX2 without native bf16, oneDNN cannot
# pack bf16, whose F.linear cost grows with rows; torch's int8 and int4 kernels want bf16 activations, much slower with
# float32; w8a8's int8 products need float32 ones, calibrated): a Measurement times them on the machine.
FORMATS = {"bf16": torch.bfloat16, "float32": torch.float32, "int8": torch.bfloat16, "int4": torch.bfloat16,
           "w8a8": torch.float32}
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
    return FORMATS[fmt]


class Quantized(torch.nn.Module):
    """A matmul weight [out, in] in int8 or int4 for kernels.quantized_linear; parameters, so weight_bytes counts it.
    blocks: int4's (q, scale_zero) as read from a file (then w gives only the shape, device and dtype). w8a8: FBGEMM's
    packed int8 (`packed_bytes` of it) and float32 outlier columns (kernels.w8a8_linear), amax [in] calibration's."""

    def __init__(self, fmt, w, blocks=None, amax=None):
        super().__init__()
        self.fmt = fmt
        self.packed_bytes = 0
        if fmt == "w8a8":
            if amax is None:
                amax = w.new_ones(w.shape[1])
            self.packed, self.outliers, w_outliers = kernels.quantize_w8a8(w, amax)
            self.w_outliers = torch.nn.Parameter(w_outliers, requires_grad=False)
            self.packed_bytes = w.numel() + 4 * len(w)  # int8 values, a float32 scale a row
            return
        if fmt == "int4" and (w.shape[0] % 16 or w.shape[1] % kernels.INT4_GROUP):  # the CPU kernel's tiles
            raise model.LoadError(f"int4 needs matmul weights of 16k x 32k, not {tuple(w.shape)}; use int8")
        if blocks is None:
            blocks = kernels.quantize_int8(w) if fmt == "int8" else kernels.quantize_int4(w)
        q, scale = blocks
        q = q.to(w.device)
        scale = scale.to(w.device, w.dtype)
        if fmt == "int4":  # uint8 [out, in / 2], packed for the device's kernel
            q = torch._convert_weight_to_int4pack_for_cpu(q, 1) if w.is_cpu else kernels.pack_int4(q)
        self.q = torch.nn.Parameter(q, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)

    def forward(self, x, bias=None):
        """x [..., in] @ the weight.T + bias [out] (model.linear's for this weight)."""
        if self.fmt == "w8a8":
            y = kernels.w8a8_linear(x, self.packed, self.outliers, self.w_outliers)
        else:
            y = kernels.quantized_linear(x, self.q, self.scale)
        return y if bias is None else y + bias


def converted(w, fmt, amax=None):
    """w [out, in] (plain, activations' dtype) in weight format fmt for model.linear: int8, int4, w8a8 quantized (amax:
    w8a8's calibration; None: no outliers known, as for timing); on the CPU, bf16 and float32 in oneDNN's blocked layout
    if it packs the dtype (bf16: AVX-512, AVX-NE-CONVERT), faster than F.linear at decoding's few rows."""
    if fmt in ("int8", "int4", "w8a8"):
        return Quantized(fmt, w, amax=amax)
    packs = w.dtype == torch.float32 or w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if w.device.type == "cpu" and torch.backends.mkldnn.is_available() and packs:
        return torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1), requires_grad=False)
    return w


def replace(m, name, w):
    delattr(m, name)  # a module's parameter cannot be replaced by a module by assignment
    setattr(m, name, w)


def matmuls(transformer):
    """-> [(name, module, attribute)] of every matmul weight: ('layers.3.w2', transformer.layers[3], 'w2'), ..."""
    blocks = [(f"layers.{i}.{n}", b, n) for i, b in enumerate(transformer.layers) for n in MATMULS[:4]]
    return blocks + [("lm_head", transformer, "lm_head")]


def held_in_int8(c, get):
    """The matmul weights ('layers.3.w2', 'lm_head') int4 holds in int8: a file's wider blocks (get's "format")."""
    held = set()
    for param, tensors, _ in model.layout(c):
        if not (param.endswith(MATMULS) or param == "embed" and c.tie_embeddings):
            continue
        if "int8" in {get(name, (0, 0, 1), "format") for name, _ in tensors}:
            held.add("lm_head" if param == "embed" else param)
    return held


# ---------------------------------------------------------------- w8a8 calibration
class Probe(torch.nn.Module):
    """A matmul weight w in calibration: as model.linear multiplies by it, keeps amax [in], the largest |input| per
    channel it has seen."""

    def __init__(self, w):
        super().__init__()
        self.w = w
        self.amax = torch.zeros(w.shape[1], device=w.device)

    def forward(self, x, bias=None):
        self.amax = torch.maximum(self.amax, x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float())
        return model.linear(x, self.w, bias)


@torch.no_grad()
def calibrated(transformer, length=64):
    """-> {matmul name: amax [in]} over a prefill of `length` seeded random tokens: the model alone decides where w8a8
    keeps floats (its large channels are much the same for any text)."""
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
    """Every matmul weight not yet Quantized into format fmt (None: its dtype's) or held's for it, in place (held:
    loading.fill_weights' {'layers.3.w2': 'int8'}); w8a8 calibrated first, a tied head copied (lookups need plain
    rows)."""
    if fmt is None:
        fmt = "float32" if transformer.embed.dtype == torch.float32 else "bf16"
    held = held or {}
    amax = calibrated(transformer) if fmt == "w8a8" else {}
    for name, m, attr in matmuls(transformer):
        w = getattr(m, attr)
        if not isinstance(w, Quantized):
            replace(m, attr, converted(w, held.get(name, fmt), amax.get(name)))


# ---------------------------------------------------------------- --weights auto: the formats this machine runs fastest
BYTES = {"float32": 4, "bf16": 2, "int8": 1, "w8a8": 1, "int4": 0.5}  # a weight's
SMC_SHAPES = ((3, 2), (3, 4), (4, 2), (4, 4))  # the bench grid's cells that resample (N >= 3)
ACCEPTANCE = 0.7  # a prior for sd: the chance that the target accepts a draft token


def cache_bytes():
    """This CPU's last-level cache (sysfs), 32 MiB where that does not say."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            return int(f.read().strip().removesuffix("K")) * 1024
    except (OSError, ValueError):
        return 32 * 2**20


def file_format(opened):
    """int4 when most of a model file's matmul values are 4-bit blocks (a Q4_K_M GGUF file, which int4 holds as they
    are: nearer the file than int8), else bf16: the format auto keeps unless another is clearly faster. opened: the
    file's (Config, get, Tokenizer) as loading.open_weights gives them."""
    c, get, _ = opened
    sizes = {name: math.prod(s) for name, s in model.expected_shapes(c).items() if len(s) == 2}
    four = sum(n for name, n in sizes.items() if get(name, (0, 0, 1), "format") == "int4")
    return "int4" if 2 * four > sum(sizes.values()) else "bf16"


def clear_winner(costs, home):
    """The cheapest format in costs ({format: ms}) if it beats home by a fifth and 5 ms (a scheduler's time slice),
    else home: so that timing noise does not change the format, and with it the tokens of a fixed seed."""
    best = min(costs, key=costs.get)
    gain = costs[home] - costs[best]
    return best if gain > 0.2 * costs[home] and gain > 5 else home


class Measurement:
    """--weights auto for an engine's pair: one forward's matmuls timed in each weight format on this machine, each
    (matrix shape, format, threads, rows) once (self.timings, the one place a cache of them lives), and from those
    timings the formats to load (choose_weights) and the smc and sd cycle shapes (choose_shape).

    Built when the engine opens its files, from what they hold: opened, the engine's [target, draft] as
    loading.open_weights opened them (the draft's None: a draft model given, or none); draft_config, the draft's
    Config, file or model, or None; unread_bytes, what the files' weights take in bf16; free_bytes, the memory free."""

    def __init__(self, opened=(None, None), draft_config=None, unread_bytes=0, free_bytes=math.inf):
        target_file = opened[0]
        draft_file = opened[1]
        self.config = None
        self.home = "bf16"  # the target file's own format (file_format)
        self.held = collections.Counter()  # {matrix: how many} of the target's that int4 holds in int8
        if target_file:
            self.config = target_file[0]
            self.home = file_format(target_file)
            names = held_in_int8(*target_file[:2])
            self.held = collections.Counter(name.rpartition(".")[2] for name in names)
        self.draft_home = file_format(draft_file) if draft_file else None  # None: no draft file to choose a format of
        self.draft_config = draft_config
        self.unread_bytes = unread_bytes
        self.free_bytes = free_bytes
        self.timings = {}  # (out, in, format, threads, rows) -> seconds of one call of model.linear

    def timed_calls(self, shape, fmt, rows):
        """-> {rows: seconds of one call of model.linear on a weight of shape [out, in] in format fmt}: the best of two
        passes over copies of it, back to back, that fill 1.5 times the CPU's last-level cache, so that each pass reads
        every copy from memory (at most 256 copies: matrices that small are a tiny model's, whose forward hits the
        cache too)."""
        key = (*shape, fmt, torch.get_num_threads())
        todo = [r for r in rows if key + (r,) not in self.timings]
        if todo:
            values = torch.linspace(-0.05, 0.05, shape[1], dtype=FORMATS[fmt])  # they alter no timing
            w = values.repeat(shape[0], 1)
            first = converted(w, fmt)
            copies = min(255, int(1.5 * cache_bytes() // (w.numel() * BYTES[fmt])))
            ws = [first]
            for _ in range(copies):  # oneDNN's packed tensors cannot be copied: packed again
                ws.append(copy.deepcopy(first) if isinstance(first, Quantized) else converted(w, fmt))
            for r in todo:
                x = torch.randn(r, shape[1], dtype=FORMATS[fmt])
                passes = timeit.repeat(lambda: [model.linear(x, w) for w in ws], repeat=2, number=1)
                self.timings[key + (r,)] = min(passes) / len(ws)
        return {r: self.timings[key + (r,)] for r in rows}

    def measure_formats(self, c, rows, formats=("bf16", "float32", "int8", "int4"), threads=None, held=None):
        """-> {format: {rows: ms}}: one forward's matmuls on this CPU at each row count (1 for ar and draft steps,
        R x N x (K + 1) for a verify), in each format that can hold c's shapes (w8a8, slow to pack, only if asked).
        Each of a layer's matrices (q/k/v, o, gate/up, down) and an eighth of the head's rows is timed (timed_calls)
        and counted as often as a forward runs it: whole matrices streamed from memory, as a forward's are (a small
        sample read alone costs more a weight). held {matrix: how many}: those int4 holds in int8 (a GGUF file's
        wider blocks: held_in_int8), priced in int8."""
        q = c.n_heads * c.head_dim
        kv = c.n_kv_heads * c.head_dim
        head = -(-c.vocab_size // 128) * 16
        sizes = [(q + 2 * kv, c.dim), (c.dim, q), (2 * c.ffn_dim, c.dim), (c.dim, c.ffn_dim), (head, c.dim)]
        shapes = dict(zip(MATMULS, sizes))
        counts = {m: c.n_layers for m in MATMULS[:4]} | {"lm_head": c.vocab_size / head}
        held_int4 = bool(held and "int4" in formats)
        threads_before = torch.get_num_threads()
        per_call = {}
        torch.set_num_threads(threads or threads_before)
        try:
            for fmt in dict.fromkeys(list(formats) + ["int8"] * held_int4):
                try:
                    per_call[fmt] = {m: self.timed_calls(shape, fmt, rows) for m, shape in shapes.items()}
                except model.LoadError:  # int4 on sizes it cannot pack
                    continue
        finally:
            torch.set_num_threads(threads_before)
        costs = {fmt: {r: 1e3 * sum(counts[m] * t[m][r] for m in t) for r in rows} for fmt, t in per_call.items()}
        if held and "int4" in costs:  # its held share of each matrix at int8's cost
            for r in rows:
                extra = sum(counts[m] * n / (1 if m == "lm_head" else c.n_layers) *
                            (per_call["int8"][m][r] - per_call["int4"][m][r]) for m, n in held.items())
                costs["int4"][r] += 1e3 * extra
        return {fmt: costs[fmt] for fmt in formats if fmt in costs}

    def candidates(self):
        """-> (the formats auto times for the target: bf16, float32 and int8 where they fit, and int4 for a 4-bit file
        (elsewhere int4 changes the model more: on request only, as w8a8, whose rounded activations change it as
        much); for the draft, those and int4, since its format changes only the proposals)."""
        tried = ("bf16", "float32", "int8")
        if self.home == "int4":
            tried += ("int4",)
        fits = [f for f in tried
                if self.unread_bytes * FORMATS[f].itemsize / torch.bfloat16.itemsize <= self.free_bytes]
        drafts = fits + ["int4"] * ("int4" not in fits)
        return fits, drafts

    def cycle_costs(self, shapes, formats, draft_formats):
        """-> ({format: {(N, K): ms}} of a target forward of N x (K + 1) rows (K = 0: N rows), the same of K draft
        steps of N rows): the matmuls of an (N, K) cycle, each model's timed on its own shapes (measure_formats), in
        bf16 where none of its formats can hold them."""
        def timed(c, rows, fmts, held=None):
            return self.measure_formats(c, rows, tuple(fmts), held=held) or self.measure_formats(c, rows, ("bf16",))
        target_rows = sorted({n * (k + 1) for n, k in shapes})
        target = timed(self.config, target_rows, formats, self.held)
        steps = {}
        if self.draft_config and any(k for _, k in shapes):
            steps = timed(self.draft_config, sorted({n for n, k in shapes if k}), draft_formats)
        target_costs = {f: {(n, k): ms[n * (k + 1)] for n, k in shapes} for f, ms in target.items()}
        step_costs = {f: {(n, k): k * ms.get(n, 0) for n, k in shapes} for f, ms in steps.items()}
        return target_costs, step_costs

    def choose_weights(self, shape):
        """-> ((the target's format, the draft's), the line that says so): for each model the format (FORMATS) whose
        part of shape's cycle (cycle_costs; ar: one row, racer: the tree's rows, no draft) costs least on this machine,
        if clearly (clear_winner), else its file's own (file_format). The draft may also be int4: its format changes
        only the proposals, which sd and mdsd correct exactly and smc's weights account for (and it is int4
        throughout, where the target keeps a Q4_K_M file's wider blocks in int8, priced so: self.held)."""
        if shape.method == "ar":
            rows = 1
        elif shape.tree:
            rows = shape.tree + 1
        else:
            rows = shape.particles * (shape.draft_len + 1)
        drafted = self.draft_home is not None and shape.method != "ar" and not shape.tree
        cell = (shape.particles, shape.draft_len) if drafted else (rows, 0)
        target, steps = self.cycle_costs([cell], *self.candidates())
        home = self.home if self.home in target else "bf16"
        chosen = clear_winner({f: ms[cell] for f, ms in target.items()}, home)
        draft = chosen
        if drafted:
            draft = clear_winner({f: ms[cell] for f, ms in steps.items()}, self.draft_home)

        def listed(costs):
            return ", ".join(f"{f} {ms[cell]:.0f}" for f, ms in costs.items())
        draft_part = f", draft {draft}" if drafted else ""
        steps_part = f"; its {cell[1]} draft steps at {cell[0]} rows: {listed(steps)}" if drafted else ""
        line = (f"weights: {chosen}{draft_part} (measured ms per {shape.method} cycle at {rows} rows: "
                f"{listed(target)}{steps_part})")
        return (chosen, draft), line

    def choose_shape(self, method, weights="auto", draft_weights="auto"):
        """smc without --particles or --draft-len, sd without --draft-len -> ((N, K), the line that says so): of
        SMC_SHAPES (smc) or K = 2 .. 6 (sd), the cycle that costs least per token, each model in its cheapest format
        (weights "auto": of candidates; else the loaded weights' and draft_weights'), if clearly (clear_winner) below
        the CPU default's (3x2; sd 4). An smc cycle always emits K + 1 tokens, an sd cycle (1 - a^(K+1)) / (1 - a) on
        average if the target accepts each draft token with chance a = ACCEPTANCE. The matmuls alone: the glue outside
        them grows with the rows too, so a wider cycle gains less than predicted; and each forward has its own, so
        sd's K = 1, twice the forwards a token, is left out."""
        if method == "smc":
            cells = SMC_SHAPES
            home = (3, 2)
        else:
            cells = [(1, k) for k in range(2, 7)]
            home = (1, 4)
        if weights == "auto":
            formats = self.candidates()
        else:
            formats = ([weights], [draft_weights])
        target, steps = self.cycle_costs(cells, *formats)
        if method == "smc":
            emits = {(n, k): k + 1 for n, k in cells}
        else:
            emits = {(n, k): (1 - ACCEPTANCE ** (k + 1)) / (1 - ACCEPTANCE) for n, k in cells}
        per_token = {c: (min(ms[c] for ms in target.values()) + min(ms[c] for ms in steps.values())) / emits[c]
                     for c in cells}
        chosen = clear_winner(per_token, home)

        def name(c):
            return f"{c[0]}x{c[1]}" if method == "smc" else f"K={c[1]}"
        prior = "" if method == "smc" else f", {ACCEPTANCE} of draft tokens accepted"
        costs = ", ".join(f"{name(c)} {ms:.0f}" for c, ms in per_token.items())
        return chosen, (f"{method} shape: {name(chosen)} (measured ms per token, a cycle's matmuls in its cheapest "
                        f"formats{prior}: {costs})")
