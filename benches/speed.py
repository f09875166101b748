"""bench.py speed: each method's tokens/s one request at a time on a code and a prose prompt, smc at each N x K
cell, against the memory-bandwidth roofline (the bytes a cycle reads over its time), llama.cpp's ar beside it on a
CPU; and the phase split of an smc cycle."""
import statistics
import sys
import time

import engine
import methods
import roofline
import scheduler
import settings
from benches import common

HELP = ("tok/s of each method one request at a time on a code and a prose prompt, smc at each N x K cell, against "
        "the memory-bandwidth roofline; the phase split of an smc cycle")
QUICK = dict(grid=[(4, 4)], new_tokens=32, repeats=1)


def options(p):
    common.add_methods(p, "ar,sd,smc", common.SINGLE)
    p.add_argument("--grid", type=common.grid, default=common.grid("2x2,2x4,3x2,3x4,4x2,4x4,4x8,8x4,8x8"),
                   help="smc's (and mdsd's) N x K cells")
    common.add_sd_draft_len(p)
    common.add_runs(p)
    common.add_prompt_len(p)


def ar_engine(pair, paths, args):
    """-> the engine ar runs on: with --weights auto, the target in the format auto picks for ar itself (one row a
    step, where a verify's several rows may favour another), so that speed-ups are against the engine's best ar, as
    the command line's `--method ar` would run it; otherwise pair."""
    if not pair.auto or "ar" not in args.methods:
        return pair
    ar_shape = settings.Settings(method="ar").resolve(pair.device).shape()
    (fmt, _), line = engine.Engine(paths[1], None, pair.device, "auto").measurement.choose_weights(ar_shape)
    print(f"ar's {line}", file=sys.stderr)
    if fmt == pair.weights:
        return pair
    return common.past_eos(engine.Engine(paths[1], None, pair.device, fmt), paths).load()


def bytes_per_cycle(e, method, N, K, prompt_len, new_tokens):
    """Bytes one cycle reads (roofline.cycle_reads), the suffix at its mean length over the run: ar 1 target
    forward; sd and smc K draft forwards over N rows and 1 target forward."""
    if methods.METHODS[method].draft_model:
        reads = roofline.cycle_reads(e.target, e.draft, K, N, prompt_len, new_tokens / 2)
    else:
        reads = roofline.cycle_reads(e.target, None, 0, 1, prompt_len, new_tokens / 2)
    return sum(reads.values())


def against_the_roof(e, row, prompt_len, new_tokens, bandwidth):
    """Achieved GB/s (bytes per cycle / cycle time) and the tokens/s the copy bandwidth would allow."""
    stats = row["stats"]
    cycles = max(stats["cycles"], 1)
    per_cycle = bytes_per_cycle(e, row["method"], row["N"], row["K"], prompt_len, new_tokens)
    cycle_s = stats["seconds"] / cycles  # the prefill is spread over the cycles: a slight underestimate
    tokens_per_cycle = stats["new_tokens"] / cycles
    return {"gb_per_cycle": per_cycle / 1e9, "cycle_ms": 1e3 * cycle_s, "tokens_per_cycle": tokens_per_cycle,
            "achieved_gbs": per_cycle / cycle_s / 1e9,
            "ideal_tokens_per_s": bandwidth * 1e9 * tokens_per_cycle / per_cycle}


def speed_rows(e, ids_by_prompt, args, ar, peer=None):
    """Every config on every prompt, interleaved, `repeats` times -> one row per (prompt, config) with the
    median tokens/s and the statistics of the median run; ar on its engine (ar_engine's: e or its own); and
    llama.cpp's ar on the target's file in the same loop where peer (a peers.LlamaCpp) is given."""
    def engine_of(method):
        if method == "ar":
            return ar
        return e
    for ids in ids_by_prompt.values():  # warm-up: first calls allocate and pick kernels
        for method, N, K in common.configs(args, args.grid):
            common.run_engine(engine_of(method), ids, method, N, K, 4 * K, 0)
        if peer:
            peer.run(ids, common.TEMPERATURE, 4, 0)
    runs = {}
    peer_runs = {}
    for repeat in range(args.repeats):
        for name, ids in ids_by_prompt.items():
            for method, N, K in common.configs(args, args.grid):
                stats = common.run_engine(engine_of(method), ids, method, N, K, args.new_tokens, repeat)
                runs.setdefault((name, method, N, K), []).append(stats)
            if peer:
                stats = peer.run(ids, common.TEMPERATURE, args.new_tokens, repeat)
                peer_runs.setdefault(name, []).append(stats["tokens_per_s"])
    rows = [{"prompt": name, "method": common.LLAMA_CPP_AR, "N": 1, "K": 1, "tokens_per_s": statistics.median(rates),
             "runs": rates, "weights": "its GGUF file", "build": peer.build} for name, rates in peer_runs.items()]
    for (name, method, N, K), all_stats in runs.items():
        ordered = sorted(all_stats, key=lambda s: s["tokens_per_s"])
        rows.append({"prompt": name, "method": method, "N": N, "K": K, "stats": ordered[len(ordered) // 2],
                     "tokens_per_s": statistics.median(s["tokens_per_s"] for s in all_stats),
                     "runs": [s["tokens_per_s"] for s in all_stats], "weights": common.weights_of(engine_of(method))})
    return rows


def annotate(e, rows, ids_by_prompt, args, bandwidth, ar_e):
    """Speed-up over ar on the same prompt, method statistics per cycle, and the roofline (of ar's own engine)."""
    ar = {r["prompt"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    for row in rows:
        if row["prompt"] in ar:
            row["speedup"] = row["tokens_per_s"] / ar[row["prompt"]]
        if row["method"] == common.LLAMA_CPP_AR:
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
        row |= against_the_roof(runner, row, len(ids_by_prompt[row["prompt"]]), args.new_tokens, bandwidth)


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
        with common.phase_times(e) as spent:
            stats = e.generate(ids, method="smc", max_new_tokens=new_tokens, temperature=common.TEMPERATURE,
                               particles=N, draft_len=K, cuda_graphs=False).stats
    finally:
        del e.target.step
    cycles = max(stats["cycles"], 1)
    draft_ms = 1e3 * sum(spent["draft_block"]) / cycles
    verify_phase_ms = 1e3 * sum(spent["verify_cycle"]) / cycles
    forward_ms = 1e3 * sum(forward) / cycles
    return {"N": N, "K": K, "draft_ms": draft_ms, "verify_ms": forward_ms,
            "weights_resample_ms": verify_phase_ms - forward_ms, "cycle_ms": draft_ms + verify_phase_ms}


def speed_table(rows, bandwidth):
    head = ["prompt", "method", "N", "K", "tok/s", "x ar", "tokens/cycle", "SD accepted/cycle", "resample rate",
            "mean ESS", "streamed", "first token s", "cycle ms", "GB/cycle", "achieved GB/s", "ideal tok/s"]
    several = len({r.get("weights") for r in rows}) > 1  # ar on its own format (ar_engine): say each row's
    cells = [speed_cells(row, several) for row in rows]
    return f"copy bandwidth {bandwidth:.1f} GB/s (read + write)\n\n" + common.table(head, cells)


def speed_cells(row, weights):
    """A speed row's cells, its method's weights beside its name where `weights`."""
    fmt = common.fmt
    method = row["method"]
    if weights:
        method += f" ({row['weights']})"
    return [row["prompt"], method, *common.cells_nk(row), fmt(row["tokens_per_s"]), fmt(row.get("speedup")),
            fmt(row.get("tokens_per_cycle")), fmt(row.get("accepted_per_cycle")), fmt(row.get("resample_rate")),
            fmt(row.get("mean_ess")), fmt(row.get("streamed")), fmt(row.get("first_token_s")),
            fmt(row.get("cycle_ms"), ".0f"), fmt(row.get("gb_per_cycle")), fmt(row.get("achieved_gbs"), ".1f"),
            fmt(row.get("ideal_tokens_per_s"), ".1f")]


def phase_table(phases):
    head = ["N", "K", "draft ms", "verify ms", "weights + resampling ms", "cycle ms"]
    return common.table(head, [[p["N"], p["K"], f"{p['draft_ms']:.1f}", f"{p['verify_ms']:.1f}",
                                f"{p['weights_resample_ms']:.1f}", f"{p['cycle_ms']:.1f}"] for p in phases])


def run(args, device, rank, world, report):
    """The speed table with its roofline, and the phase split of each smc cell on the first prompt."""
    e, paths = common.load_pair(args, device, world)
    report["models"] = common.models_section(e)
    ids_by_prompt = common.prompts(args, e)
    report["prompt_tokens"] = {name: len(ids) for name, ids in ids_by_prompt.items()}
    bandwidth = roofline.copy_bandwidth(device)
    ar = ar_engine(e, paths, args)
    peer = common.llama_cpp_peer(paths, device, report)
    rows = speed_rows(e, ids_by_prompt, args, ar, peer)
    annotate(e, rows, ids_by_prompt, args, bandwidth, ar)
    report["copy_bandwidth_gbs"] = bandwidth
    report["speed"] = rows
    common.show(common.caption(report) + speed_table(rows, bandwidth))
    if "smc" in args.methods:
        first = next(iter(ids_by_prompt.values()))
        tokens = min(args.new_tokens, 64)  # enough cycles for a steady mean, in less time
        report["phases"] = [profile_phases(e, first, N, K, tokens) for N, K in args.grid]
        common.show(common.caption(report) + phase_table(report["phases"]))
