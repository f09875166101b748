"""bench.py batch: R requests decoded together, as a server decodes R concurrent requests. A cycle over R slots reads
the weights once for all of them, so throughput grows with R almost for free until the rows of a forward (ar: R,
sd: R x (K+1), smc: R x N x (K+1) per verify) make it compute-bound. A GPU takes many rows before that: the aim is
that smc keeps its lead over ar as R grows, where sd loses it. On a CPU every row costs compute and only a few rows
are nearly free: ar (one row a request) gains most from batching, while sd and smc, which already verify several
rows a request, turn compute-bound after a few requests."""
import statistics
import time

import torch

import methods
import peers
import quality
import settings
from benches import common

HELP = ("throughput and per-request latency of R requests decoded together (smc at the engine's default cell for "
        "the device), transformers' batched generate beside them; with \"+overlap\" methods MineDraft's overlap and "
        "the phase split of its cycle")
QUICK = dict(concurrency=[1, 2], new_tokens=32, repeats=1)


def options(p):
    common.add_methods(p, "ar,sd,smc", common.SINGLE + common.OVERLAPPED)
    p.add_argument("--concurrency", type=common.numbers, default=common.numbers("1,2,4,8"), metavar="R,...")
    common.add_sd_draft_len(p)
    common.add_runs(p)
    common.add_prompt_len(p)
    p.add_argument("--no-peer", action="store_true", help="without transformers' rows")


def batch_prompts(e, args, n):
    """n distinct prompts as token ids, the same for every method and R (R takes the first R): the first n
    code-completion problems, alike in kind and length, so that R=1 and R=8 differ in concurrency rather than in
    what is asked (sd is fast on code, slow on prose); random ids of --prompt-len tokens for random models."""
    if e.tokenizer is None:
        generator = torch.Generator().manual_seed(3)
        return [torch.randint(0, e.vocab, (args.prompt_len,), generator=generator).tolist()
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
    with common.phase_times(e) as spent:
        start = time.perf_counter()
        results = e.generate(requests, slots=len(prompts), method=method.removesuffix("+overlap"),
                             max_new_tokens=new_tokens, temperature=common.TEMPERATURE, particles=N, draft_len=K,
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
    default = settings.Settings().resolve(e.device)
    return common.configs(args, [(default.particles, default.draft_len)], overlap=max(args.concurrency) >= 2)


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
        rows += peers.hf_batch_rows(hf_target, prompts, peers.pad_id(e), e.config.eos_ids, common.TEMPERATURE,
                                    args.concurrency, args.new_tokens, args.repeats)
    common.versus_ar(rows, ("tokens_per_s",), key="R")
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
    with common.phase_times(e) as spent:
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


def batch_table(rows):
    head = ["R", "method", "N", "K", "total tok/s", "x ar", "x R=1", "x plain", "tok/s per request",
            "mean latency s", "latency x plain", "max latency s", "prefill share", "new tokens", "EOS stops"]
    return common.table(head, [batch_cells_of(row) for row in rows])


def batch_cells_of(row):
    """A batch row's cells: N and K blank in a peer's row."""
    N = ""
    K = ""
    if row["method"].removesuffix("+overlap") in methods.METHODS:  # not a peer's row
        N, K = common.cells_nk(row)
    return [row["R"], row["method"], N, K, f"{row['tokens_per_s']:.2f}", common.fmt(row.get("tokens_per_s_vs_ar")),
            common.fmt(row.get("tokens_per_s_vs_r1")), common.fmt(row.get("tokens_per_s_vs_plain")),
            f"{row['request_tokens_per_s']:.2f}", f"{row['mean_latency_s']:.2f}",
            common.fmt(row.get("mean_latency_s_vs_plain")), f"{row['max_latency_s']:.2f}",
            common.fmt(row.get("prefill_share")), row["new_tokens"], row["eos_stops"]]


def overlap_table(rows):
    head = ["R", "method", "N", "K", "run", "slots per phase", "threads per phase", "draft ms", "verify ms",
            "ms per cycle of R slots", "x plain"]
    cells = [[r["R"], r["method"], *common.cells_nk(r), r["run"], r["slots"], common.fmt(r["threads"], "d"),
              common.fmt(r["draft_ms"], ".1f"), common.fmt(r["verify_ms"], ".1f"), f"{r['cycle_ms']:.1f}",
              f"{r['speed_vs_plain']:.2f}"] for r in rows]
    note = ("(half alone: an overlap half's phases one after the other, the halves in turn; overlap bound: 2 x "
            "max(draft, verify) of the half alone, overlap that slows neither phase; overlapped: 2 x max of the "
            "phases measured side by side)")
    return common.table(head, cells) + "\n\n" + note


def run(args, device, rank, world, report):
    """The batch rows (and transformers' batched generate beside them, unless --no-peer), and the phase split of
    overlap where a "+overlap" method runs."""
    e, paths = common.load_pair(args, device, world)
    report["models"] = common.models_section(e)
    hf_target = None
    if not args.no_peer and common.transformers_usable(paths, world):
        hf_target = peers.hf_model(paths[1], getattr(torch, args.dtype))
    report["batch"] = batch_report(e, hf_target, args)
    common.show(batch_table(report["batch"]))
    if any(method.endswith("+overlap") for method, _, _ in batch_cells(e, args)):
        report["overlap_phases"] = overlap_phases(e, args)
        common.show(overlap_table(report["overlap_phases"]))
