"""bench.py formats: the target alone in each weight format: what a weight costs at each row count, its greedy
text against bf16's, its speed, and its samples' log-probability under the unquantized target."""
import argparse
import copy
import math
import statistics
import time
import timeit

import torch

import engine
import formats
import model
import platforms
import quality
from benches import common, scoring
from cpu import auto
from cpu import backend as cpu_backend
from cpu import formats as cpu_formats

HELP = ("the target alone in each weight format: greedy text against bf16's, speed, and its samples' "
        "log-probability under the unquantized target")
QUICK = dict(problems=2, quality_tokens=64, rows=[1, 9])
FORMAT_PROMPTS = 20


def format_names(text):
    """"int8,int4" -> ["int8", "int4"], each one of formats.FORMATS."""
    names = [name for name in text.split(",") if name]
    if unknown := [name for name in names if name not in formats.FORMATS]:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not a weight format (use {','.join(formats.FORMATS)})")
    return names


def options(p):
    p.add_argument("--formats", type=format_names, default=format_names("float32,int8,int4"), metavar="FORMAT,...",
                   help=f"of {','.join(formats.FORMATS)} (bf16, the reference, always runs)")
    p.add_argument("--rows", type=common.numbers, default=common.numbers("1,2,3,4,6,9,12,16"), metavar="R,...",
                   help="row counts of the table of what a weight costs in each format")
    common.add_problem_set(p, FORMAT_PROMPTS)


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
    slots = min(scoring.QUALITY_SLOTS, len(prompts))
    ids = None
    reference = platforms.load(target, device, weights="float32")[0]  # also the float32 format's model
    for name in dict.fromkeys(["bf16", *names]):  # bf16 first: the greedy reference
        if name == "float32":
            e = engine.Engine.of_models(reference, None, name)
        else:
            e = engine.Engine(target, None, device, name).load()
        if ids is None:  # by bf16's engine, which has the tokenizer
            ids = [e.encode(p) for p in prompts]
        greedy = [r.tokens for r in e.generate(ids, slots=slots, method="ar", max_new_tokens=new_tokens,
                                                  temperature=0.0)]
        begin = time.perf_counter()
        seeded = [{"prompt": p, "seed": scoring.quality_seed(i, 0)} for i, p in enumerate(ids)]
        sampled = e.generate(seeded, slots=slots, method="ar", max_new_tokens=new_tokens,
                             temperature=common.TEMPERATURE)
        seconds = time.perf_counter() - begin
        samples[name] = [r.tokens for r in sampled]
        out[name] = {"greedy": greedy, "samples": samples[name], "tokens_per_s": sum(map(len, samples[name])) / seconds,
                    "self_logprobs": [scoring.target_logprobs(e.target, p, [t])[0] for p, t in zip(ids, samples[name])],
                    "prompt_kl": [next_token_kl(e.target, reference, p) for p in ids]}
        del e
    for i, p in enumerate(ids):  # each prompt read once for every format's sample
        for name, score in zip(out, scoring.target_logprobs(reference, p, [samples[name][i] for name in out])):
            out[name].setdefault("logprobs", []).append(score)
    scores = {name: scoring.per_problem([[v] for v in f["logprobs"]]) for name, f in out.items()}
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
    """{format: {rows: ps per weight}} of the CPU backend's linear in each format over copies of one [out, in] matrix
    (the 1.5B's gate/up) filling twice the last-level cache, so every pass reads them from memory; the best of
    `passes` passes, the row counts taking turns within each: a machine's drift moves them alike, not their ratios."""
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


def format_table(rows):
    head = ["weights", "tokens before greedy differs from bf16's (mean; identical texts)", "tok/s (4 at a time)",
            "log-prob under the unquantized target", "minus bf16's", "KL to the unquantized, per token",
            "the same on the prompts' text, exact"]
    return common.table(head, [format_cells(name, f) for name, f in rows.items()])


def format_cells(name, f):
    same = f"{statistics.fmean(f['first_difference']):.1f}; {f['identical']} of {len(f['first_difference'])}"
    return [name, same, f"{f['tokens_per_s']:.2f}", f"{f['logprob']:.3f} ± {f['logprob_stderr']:.3f}",
            f"{f['logprob_vs_bf16']:+.3f} ± {f['logprob_vs_bf16_stderr']:.3f}",
            f"{f['kl']:.4f} ± {f['kl_stderr']:.4f}",
            common.fmt(f.get("prompt_kl_mean"), ".5f")]  # older reports lack it


def weight_cost_table(costs):
    costs = {name: {int(r): ps for r, ps in by_rows.items()} for name, by_rows in costs.items()}  # JSON's keys: text
    rows = list(next(iter(costs.values())))
    ratios = [r for r in rows if r in (9, 16)] or rows[-1:]  # smc 3x2's verify and 16 rows, against one row
    head = ["weights"] + [f"{r} row{'s' * (r > 1)}" for r in rows] + [f"{r} rows / 1 row" for r in ratios]
    cells = [[name] + [f"{ps[r]:.1f}" for r in rows] + [f"{ps[r] / ps[rows[0]]:.2f}x" for r in ratios]
             for name, ps in costs.items()]
    return "ps per weight (a call's time over its weights) at each row count:\n\n" + common.table(head, cells)


def run(args, device, rank, world, report):
    report["weight_costs"] = weight_costs(["bf16", *args.formats], args.rows)
    common.show(weight_cost_table(report["weight_costs"]))
    common.write(report, args.out, rank)
    _, paths = common.open_pair(args, device, world)
    texts = [p["prompt"] for p in scoring.problem_set(args)[:args.problems]]
    report["formats"] = format_report(paths[1], texts, args.formats, args.quality_tokens, device)
    common.show(format_table(report["formats"]))
