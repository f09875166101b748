"""bench.py profile: where one decoding cycle's time goes, for ar and smc at each N x K cell, on one request of
--new-tokens (its first cycles replayed). Each phase (the draft block, the verify) replayed alone as its own CUDA
graph and timed with CUDA events (a CPU: the host clock around each eager phase); a torch.profiler trace of whole-
cycle replays, its device time summed by kernel class (a CPU: the aten ops' own time); the host's gap, the engine's
real loop less the replays it runs; F.linear on every weight matrix of both models at a few row counts (each BLAS
library torch offers on CUDA); the copy bandwidth; and the roofline's ideal phase times (the bytes a phase reads
over that bandwidth) beside the measured ones."""
import contextlib
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

import decode
import methods
import roofline
import scheduler
from benches import common
from cpu import native
from errors import require

HELP = ("one cycle of ar and smc at each N x K cell taken apart: each phase's replay time, a profiler trace's "
        "device time by kernel class, the host's gap between replays, a GEMM sweep of the models' weight matrices "
        "against the copy bandwidth, and the roofline's ideal phase times")
QUICK = dict(grid=[(2, 2), (2, 1)], replays=2, new_tokens=12, prompt_len=8, rows=[1, 8])
BLAS = ("cublas", "cublaslt")  # the libraries torch.backends.cuda.preferred_blas_library chooses between
DEFAULT_BLAS = "default"  # a CPU's one library, left as it is
CPU_CALLS = 5  # timed calls of one matmul or copy on a CPU, after one that warms it
COPY_BYTES = {"cuda": 2**30, "cpu": 2**26}  # the copied buffer: larger than any cache
# Kernel classes by substrings of a kernel's (a CPU: an operator's) lower-cased name: the first that matches names it.
KERNEL_CLASSES = (
    ("GEMM", ("gemm", "gemv", "splitk", "matmul", "cutlass", "nvjet", "xmma", "cublas", "linear", "aten::mm",
              "aten::addmm", "aten::bmm", "_mm", "_quantized_matmul")),
    ("attention", ("_attention_split", "_merge_kernel", "flash", "attention")),
    ("sampling", ("_vocab_chunk", "rows_logprobs")),
    ("resample", ("_resample",)),
    ("gather/scatter", ("_gather_kernel", "gather", "scatter", "index")),
    ("other", ("memcpy", "memset", "copy", "fill", "reduce", "scan", "sort", "softmax", "logsumexp", "topk",
               "aten::sum", "aten::cumsum", "aten::amax", "aten::argmax")),
)
CLASS_NAMES = (*[name for name, _ in KERNEL_CLASSES], "elementwise")  # elementwise: every kernel not matched
CPU_OPS = ("aten::", "mkldnn::", "native::")  # a CPU trace's operators: torch's, oneDNN's linears, the C kernel's
FUSED_LAYER = f"native::{native.FUSED_LAYER}"


def options(p):
    common.add_methods(p, "ar,smc", common.SINGLE)
    p.add_argument("--grid", type=common.grid, default=common.grid("4x4,8x8,8x1"),
                   help="smc's (and mdsd's) N x K cells")
    common.add_sd_draft_len(p)
    p.add_argument("--new-tokens", type=int, default=256, help="the request's budget; the replays run its first cycles")
    common.add_prompt_len(p)
    p.add_argument("--replays", type=int, default=20, help="timed replays of each phase, and of the whole cycle")
    p.add_argument("--rows", type=common.numbers, default=common.numbers("1,4,8,16,72"), metavar="ROWS,...",
                   help="the GEMM sweep's rows (the tokens of a forward)")


# ---------------------------------------------------------------- timing


class Stopwatch:
    """Times calls on a device: a CUDA event pair around each, read once at the end (so that timing waits for nothing
    between calls): the device's time of each; the host clock around each elsewhere, where calls run synchronously."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.events = []  # (start, end) of each call on CUDA
        self.seconds = []  # each call's elsewhere

    def time(self, run):
        if not self.cuda:
            start = time.perf_counter()
            run()
            self.seconds.append(time.perf_counter() - start)
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        self.events.append((start, end))

    def ms(self):
        """Each call's ms (on CUDA once the last has ended)."""
        if not self.cuda:
            return [1e3 * s for s in self.seconds]
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in self.events]


def summary(ms):
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.mean(ms)}


def bench_ms(run, device):
    """ms of run(): triton's do_bench median on CUDA (it flushes the L2 cache before each call), the median of a few
    calls by the host clock on a CPU."""
    if device.type == "cuda":
        import triton.testing  # where CUDA runs; a CPU may have no triton

        return triton.testing.do_bench(run, return_mode="median")
    run()
    watch = Stopwatch(device)
    for _ in range(CPU_CALLS):
        watch.time(run)
    return statistics.median(watch.ms())


# ---------------------------------------------------------------- one request's cycles in a batch of one slot


def most_tokens(method, K):
    """The most tokens a cycle of method emits: K + 1 where a draft model drafts, else one."""
    if methods.METHODS[method].draft_model:
        return K + 1
    return 1


def split_phases(method):
    """The phases of a cycle of method, each recorded as a CUDA graph of its own: the draft block where a draft model
    drafts, then the verify."""
    if methods.METHODS[method].draft_model:
        return (decode.draft_block, decode.verify_cycle)
    return (decode.verify_cycle,)


def new_request(e, ids, method, N, K, new_tokens):
    return e.request(ids, method=method, particles=N, draft_len=K, max_new_tokens=new_tokens,
                     temperature=common.TEMPERATURE, seed=0)


def started(e, req, phases=None):
    """A Batch of one slot for req (the caps the scheduler gives it: its prompt, its suffix), req in it (`warm`).
    phases None: the batch's own (on CUDA one graph of the whole cycle)."""
    caps = scheduler.check_memory(e, [req], 1)
    batch = scheduler.Batch(e.models, req.shape, 1, *caps, phases)
    warm(batch, req)
    return batch


def warm(batch, req):
    """req admitted into the batch's free slot and one cycle run: a CPU's first eager calls allocate."""
    batch.admit(req)
    batch.cycle()


def suffix_tokens(batch):
    """The target's suffix in the batch's slot: the tokens generated, less the pending one."""
    return int(batch.st.tcache.suffix_len[0])


def phase_times(batch, replays):
    """{phase's name: median and mean ms} of `replays` cycles, each of batch's phases timed on its own."""
    watches = {phase: Stopwatch(batch.models.device) for phase in batch.phases}
    for _ in range(replays):
        for phase, watch in watches.items():
            watch.time(functools.partial(batch.run_phase, phase))
    return {phase.__name__: summary(watch.ms()) for phase, watch in watches.items()}


def cycle_ms(batch, replays):
    """ms of each of `replays` whole cycles of batch."""
    watch = Stopwatch(batch.models.device)
    for _ in range(replays):
        watch.time(batch.cycle)
    return watch.ms()


def class_of(name):
    lower = name.lower()
    for kind, parts in KERNEL_CLASSES:
        if any(part in lower for part in parts):
            return kind
    return "elementwise"


def own_us(event, cuda):
    """An event's own microseconds in the profile: a kernel's device time on CUDA (a CPU op's there is only its
    kernels' again), on a CPU an operator's (aten's, oneDNN's, the C kernel's) time less that of the ops it calls;
    0 for any other event, and for the C kernel's fused layer, whose parts fused_layer_ms gives."""
    if cuda and event.device_type == DeviceType.CUDA:
        return event.self_device_time_total
    if not cuda and event.key.startswith(CPU_OPS) and event.key != FUSED_LAYER:
        return event.self_cpu_time_total
    return 0


def fused_layer_ms(seconds, replays):
    """{kernel class: ms a cycle} of the C kernel's fused layers from native.timing()'s seconds by LAYER_PARTS."""
    classes = dict(zip(native.LAYER_PARTS, ("GEMM", "attention", "elementwise")))
    return {classes[part]: 1e3 * s / replays for part, s in zip(native.LAYER_PARTS, seconds)}


def traced_cycles(batch, replays):
    """A torch.profiler trace of `replays` whole cycles of batch -> {"wall_ms": the host clock's ms a traced cycle,
    from before the first to after the last has ended, "classes_ms": {kernel class: ms a cycle}}."""
    device = batch.models.device
    cuda = device.type == "cuda"
    activity = ProfilerActivity.CPU
    if cuda:
        activity = ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[activity]) as trace, native.timing() as layers:
        scheduler.synchronize(device)
        start = time.perf_counter()
        for _ in range(replays):
            batch.cycle()
        scheduler.synchronize(device)
        wall = time.perf_counter() - start
    spent = dict.fromkeys(CLASS_NAMES, 0.0)
    for event in trace.key_averages():
        spent[class_of(event.key)] += own_us(event, cuda) / 1e3 / replays
    for kind, ms in fused_layer_ms(layers, replays).items():
        spent[kind] += ms
    return {"wall_ms": 1e3 * wall / replays, "classes_ms": spent}


def loop_ms(e, ids, method, N, K, new_tokens):
    """ms a cycle of the engine's own loop (e.generate, no observers: the scheduler's rounds, the host's reads of the
    flags), from the end of the prefill to the request's end."""
    stats = e.generate(ids, method=method, max_new_tokens=new_tokens, temperature=common.TEMPERATURE, particles=N,
                       draft_len=K, seed=0).stats
    return 1e3 * (stats["seconds"] - stats["prefill_seconds"]) / max(stats["cycles"], 1)


def ideal_ms(e, method, N, K, prompt_len, suffix, gbs):
    """{phase: ms} were each phase as fast as the copy bandwidth: the bytes it reads (roofline.cycle_reads: every
    weight once a forward, the KV cache) over gbs; "cycle": both."""
    to_ms = 1e3 / (gbs * 1e9)
    verify = sum(roofline.cycle_reads(e.target, None, 0, N, prompt_len, suffix).values())
    ideal = {"verify_cycle": verify * to_ms, "cycle": verify * to_ms}
    if methods.METHODS[method].draft_model:
        whole = sum(roofline.cycle_reads(e.target, e.draft, K, N, prompt_len, suffix).values())
        ideal["draft_block"] = (whole - verify) * to_ms
        ideal["cycle"] = whole * to_ms
    return ideal


def split_cycle(e, new, method, replays):
    """The phases of cycles of new() (a request) replayed alone -> ({phase: median and mean ms}, the target's mean
    suffix over the timed cycles)."""
    batch = started(e, new(), split_phases(method))
    before = suffix_tokens(batch)
    phases = phase_times(batch, replays)
    return phases, (before + suffix_tokens(batch)) / 2


def whole_cycle(e, new, replays):
    """Whole cycles of new() (a request) replayed, timed, then again from the same start traced -> (their mean ms,
    the trace's `traced_cycles`)."""
    batch = started(e, new())
    replay_ms = statistics.mean(cycle_ms(batch, replays))
    batch.leave(0)
    warm(batch, new())
    return replay_ms, traced_cycles(batch, replays)


def config_row(e, ids, method, N, K, args, gbs):
    """One config taken apart: its phases replayed alone, its whole cycle replayed (timed, then traced), each in a
    batch of its own (freed before the next records), the engine's loop over as many cycles, and the ideal phase
    times at the suffix the phases were timed at."""
    new = functools.partial(new_request, e, ids, method, N, K, args.new_tokens)
    phases, suffix = split_cycle(e, new, method, args.replays)
    replay_ms, profile = whole_cycle(e, new, args.replays)
    loop = loop_ms(e, ids, method, N, K, (1 + args.replays) * most_tokens(method, K))
    return {"method": method, "N": N, "K": K, "prompt_tokens": len(ids), "suffix_tokens": suffix,
            "phases_ms": phases, "cycle_ms": sum(p["mean_ms"] for p in phases.values()),
            "ideal_ms": ideal_ms(e, method, N, K, len(ids), suffix, gbs),
            "profile": profile,
            "host_gap": {"loop_ms": loop, "replay_ms": replay_ms, "gap_ms": loop - replay_ms}}


# ---------------------------------------------------------------- the GEMM sweep and the copy bandwidth


def matrices(c):
    """A model's weight matrices as its layers multiply by them (out features, in features), of its model.Config."""
    return {"wqkv": ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim), "wo": (c.dim, c.n_heads * c.head_dim),
            "w13": (2 * c.ffn_dim, c.dim), "w2": (c.dim, c.ffn_dim), "lm_head": (c.vocab_size, c.dim)}


def libraries(device):
    """The BLAS libraries the sweep times: each torch offers on CUDA, the default one elsewhere."""
    if device.type == "cuda":
        return BLAS
    return (DEFAULT_BLAS,)


@contextlib.contextmanager
def preferred_blas(library):
    """torch's matmuls on library in the block (DEFAULT_BLAS: as they are), as they were after."""
    if library == DEFAULT_BLAS:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def matrix_rows(role, name, w, rows, library, gbs):
    """F.linear(x, w) at each row count of rows, random x in w's dtype -> a sweep row each: ms, and GB/s of the
    bytes it moves (w, x and the output) over that time, against the copy's gbs."""
    out = []
    for n in rows:
        x = torch.randn(n, w.shape[1], device=w.device, dtype=w.dtype)
        ms = bench_ms(functools.partial(F.linear, x, w), w.device)
        moved = (w.numel() + x.numel() + n * w.shape[0]) * w.element_size()
        achieved = moved / (ms / 1e3) / 1e9
        out.append({"model": role, "matrix": name, "out_features": w.shape[0], "in_features": w.shape[1], "rows": n,
                    "library": library, "ms": ms, "gbs": achieved, "of_copy": achieved / gbs})
    return out


def sweep(e, rows, device, gbs):
    """Every weight matrix of the draft's and the target's shapes, random in the model's dtype, at each row count
    and BLAS library."""
    out = []
    for role, m in (("draft", e.draft), ("target", e.target)):
        if m is None:
            continue
        for name, shape in matrices(m.config).items():
            w = torch.randn(shape, device=device, dtype=m.embed.dtype)
            for library in libraries(device):
                with preferred_blas(library):
                    out += matrix_rows(role, name, w, rows, library, gbs)
    return out


def copy_section(device):
    """The engine's copy bandwidth (roofline.copy_bandwidth, one timed copy) beside a large buffer's copy timed as
    the sweep times its matmuls: GB/s = bytes read + written over the time."""
    nbytes = COPY_BYTES[device.type]
    src = torch.ones(nbytes // 2, device=device, dtype=torch.bfloat16)  # written: no page reads as the zero page
    dst = torch.empty_like(src)
    ms = bench_ms(functools.partial(dst.copy_, src), device)
    return {"engine_gbs": roofline.copy_bandwidth(device), "buffer_bytes": nbytes,
            "buffer_gbs": 2 * nbytes / (ms / 1e3) / 1e9}


# ---------------------------------------------------------------- tables: each of the report's "profile" section


def phase_table(section):
    how = "each phase run eagerly, the host clock around each call"
    if section["device"] == "cuda":
        how = "each phase's CUDA graph replayed alone, its device time by a CUDA event pair around each replay"
    gbs = section["copy"]["buffer_gbs"]
    note = (f"Phases, {section['replays']} replays: {how}; cycle = the phases' means. Ideal: the bytes a phase reads "
            f"(weights once a forward, the KV cache) over the copy bandwidth, {gbs:.1f} GB/s.")
    head = ["method", "N", "K", "suffix tokens", "draft ms (median / mean)", "verify ms (median / mean)",
            "cycle ms", "ideal draft ms", "ideal verify ms", "ideal cycle ms", "ideal / measured"]
    return note + "\n\n" + common.table(head, [phase_cells(r) for r in section["configs"]])


def phase_cells(r):
    phases = r["phases_ms"]
    ideal = r["ideal_ms"]
    draft = ""
    if "draft_block" in phases:
        draft = f"{phases['draft_block']['median_ms']:.3f} / {phases['draft_block']['mean_ms']:.3f}"
    verify = f"{phases['verify_cycle']['median_ms']:.3f} / {phases['verify_cycle']['mean_ms']:.3f}"
    return [r["method"], *common.cells_nk(r), f"{r['suffix_tokens']:.0f}", draft, verify, f"{r['cycle_ms']:.3f}",
            common.fmt(ideal.get("draft_block"), ".3f"), f"{ideal['verify_cycle']:.3f}", f"{ideal['cycle']:.3f}",
            f"{ideal['cycle'] / r['cycle_ms']:.0%}"]


def profile_table(section):
    what = "the aten ops' own CPU time (less the ops they call) summed by op over eager whole cycles"
    if section["device"] == "cuda":
        what = "device time summed by kernel (each kernel's own, from CUPTI) over CUDA-graph replays of the whole cycle"
    note = (f"Profile, {section['replays']} whole cycles under torch.profiler: {what}; by class, ms a cycle (share of "
            "the wall time of a traced cycle: the host clock over the cycles, divided by them). Other: copies, fills, "
            "reductions, scans and sorts.")
    head = ["method", "N", "K", "wall ms", *CLASS_NAMES, "sum"]
    return note + "\n\n" + common.table(head, [profile_cells(r) for r in section["configs"]])


def profile_cells(r):
    wall = r["profile"]["wall_ms"]
    spent = r["profile"]["classes_ms"]
    total = sum(spent.values())
    shares = [f"{spent[name]:.3f} ({spent[name] / wall:.0%})" for name in CLASS_NAMES]
    return [r["method"], *common.cells_nk(r), f"{wall:.3f}", *shares, f"{total:.3f} ({total / wall:.0%})"]


def gap_table(section):
    note = ("Host gap: ms a cycle of the engine's own loop (e.generate over as many cycles, no observers) less the "
            "mean whole-cycle replay's: what the host adds between replays (the scheduler's rounds, the flags read).")
    head = ["method", "N", "K", "loop ms", "replay ms", "gap ms", "gap share"]
    cells = []
    for r in section["configs"]:
        gap = r["host_gap"]
        cells.append([r["method"], *common.cells_nk(r), f"{gap['loop_ms']:.3f}", f"{gap['replay_ms']:.3f}",
                      f"{gap['gap_ms']:.3f}", f"{gap['gap_ms'] / gap['loop_ms']:.0%}"])
    return note + "\n\n" + common.table(head, cells)


def sweep_table(section):
    rows = section["sweep"]
    how = f"the median of {CPU_CALLS} calls by the host clock"
    if section["device"] == "cuda":
        how = "do_bench's median"
    note = (f"GEMM sweep, F.linear(x [rows, in], w [out, in]) with random tensors in the model's dtype, {how}: ms "
            "(the share of the copy bandwidth its bytes, w + x + out, move at).")
    counts = sorted({r["rows"] for r in rows})
    head = ["model", "matrix", "out x in", "library", *[f"{n} rows" for n in counts]]
    lines = {}
    for r in rows:
        key = (r["model"], r["matrix"], f"{r['out_features']} x {r['in_features']}", r["library"])
        lines.setdefault(key, []).append(f"{r['ms']:.4f} ({r['of_copy']:.0%})")
    return note + "\n\n" + common.table(head, [[*key, *cells] for key, cells in lines.items()])


def copy_table(section):
    copy = section["copy"]
    head = ["copy", "bytes", "GB/s (read + write)"]
    cells = [["the engine's (roofline.copy_bandwidth)", "", f"{copy['engine_gbs']:.1f}"],
             ["a large buffer, timed as the sweep", copy["buffer_bytes"], f"{copy['buffer_gbs']:.1f}"]]
    return common.table(head, cells)


TABLES = (copy_table, phase_table, profile_table, gap_table, sweep_table)  # in the order run prints them


def tables(section):
    """The section's tables again (bench.py report)."""
    return "\n\n".join(table(section) for table in TABLES)


def check_budget(args, cells):
    """Every config's cycles (a warm one, then the replays) fit the request's budget: none replays a finished one."""
    cycles = 1 + args.replays
    for method, N, K in cells:
        most = most_tokens(method, K)
        require(cycles * most <= args.new_tokens, f"--new-tokens {args.new_tokens} is less than {cycles} cycles (a "
                f"warm one and --replays) of {method} at N={N}, K={K}, up to {most} tokens each: raise it or lower "
                "--replays", "new_tokens")


def run(args, device, rank, world, report):
    """Each config taken apart on the first prompt, then the GEMM sweep, into the report's "profile" section; the
    copy bandwidth first, which the ideal times and the sweep are set against."""
    cells = common.configs(args, args.grid)
    check_budget(args, cells)
    e, _ = common.load_pair(args, device, world)
    report["models"] = common.models_section(e)
    ids = next(iter(common.prompts(args, e).values()))
    section = {"device": device.type, "replays": args.replays, "copy": copy_section(device)}
    report["profile"] = section
    common.show(copy_table(section))
    gbs = section["copy"]["buffer_gbs"]
    with torch.inference_mode():
        section["configs"] = [config_row(e, ids, method, N, K, args, gbs) for method, N, K in cells]
        for table in (phase_table, profile_table, gap_table):
            common.show(table(section))
        section["sweep"] = sweep(e, args.rows, device, gbs)
    common.show(sweep_table(section))
