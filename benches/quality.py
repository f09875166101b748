"""bench.py quality: the accuracy-speed frontier. pass@1 and the target's log-probability of each method's
completions, paired with ar's and the draft alone's on the same problems, and their speed."""
import json
import math
import sys
import time

import engine
import quality
from benches import common, scoring

HELP = ("pass@1 and the target's log-probability of each method's completions, paired with ar's and the draft "
        "alone's, and their speed")
QUICK = dict(problems=2, samples=1, quality_tokens=64)


def options(p):
    common.add_methods(p, "ar,sd,smc,draft", common.SINGLE + ("draft",))
    common.add_cells(p, "smc's and mdsd's N x K cells, sd at each cell's K too")
    common.add_sd_draft_len(p)
    p.add_argument("--lag", type=common.numbers, default=common.numbers("16"), metavar="L,...",
                   help="smc at the first cell with each of these bounded lags too (0: none)")
    p.add_argument("--samples", type=int, default=2, help="samples per problem")
    common.add_problem_set(p, None)
    p.add_argument("--resume", action="store_true", help="go on with the run in --out from the problem where it "
                   "stopped (the same settings; its figures keep accumulating)")


def draft_alone(pair, paths):
    """An engine of the pair's draft alone, in the format the pair's draft has."""
    return engine.Engine(paths[0], None, pair.device, pair.draft_weights).load()


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


def pass_rates(e, draft_e, args, previous=None):
    """pass@1 and fidelity (the target's mean log-probability per generated token) with their standard errors,
    speed (tok/s over the run, tokens per cycle) for each runner, on the first --problems of --problem-set. Every
    runner decodes the same QUALITY_SLOTS problems in turn, so the figures stay paired and machine noise is
    shared; yields after each group (main rewrites --out then, so a run stopped early still reports what it
    measured), and previous (such a report's quality section, --resume) goes on where it stopped."""
    problems = scoring.problem_set(args)[:args.problems]
    runners = quality_runners(e, draft_e, args)
    out = previous or {label: {"problems": 0, "samples": args.samples, "seconds": 0.0, "new_tokens": 0, "cycles": 0,
                               "streamed": 0, "texts": [], "logprobs": [], "results": []} for label in runners}
    for start in range(min(q["problems"] for q in out.values()), len(problems), scoring.QUALITY_SLOTS):
        group = problems[start:start + scoring.QUALITY_SLOTS]
        tokens = {}
        jobs = [(start + i, p, j) for i, p in enumerate(group) for j in range(args.samples)]
        for label, (runner, method, N, K, options) in runners.items():
            begin = time.perf_counter()
            seeds = [scoring.quality_seed(i, j) for i, _, j in jobs]
            results = scoring.completions(runner, [p for _, p, _ in jobs], seeds, method, N, K, args.quality_tokens,
                                          options)
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
            scored = iter(scoring.target_logprobs(e.target, e.encode(p["prompt"]), continuations))
            for label in runners:
                out[label]["logprobs"].append([next(scored) for _ in range(args.samples)])
        summarize(out)
        yield out


def summarize(out):
    """Each runner's pass@1 and mean log-probability with standard errors, and paired against ar (and, for the
    log-probability, its shift as a fraction of the draft alone's shift), its tok/s as a ratio to ar's."""
    for scores in out.values():
        scores["pass_at_1"], scores["pass_at_1_stderr"] = quality.pass_at_1(scores["results"])
        scores["logprob"], scores["logprob_stderr"] = quality.pass_at_1(scoring.per_problem(scores["logprobs"]))
        scores["tokens_per_s"] = scores["new_tokens"] / scores["seconds"]
        scores["tokens_per_cycle"] = scores["new_tokens"] / max(scores["cycles"], 1)
        scores["streamed_share"] = scores["streamed"] / max(scores["new_tokens"], 1)  # shown before its request ended
    ar = out.get("ar")
    draft = out.get("draft alone")
    for scores in out.values():
        if ar and scores is not ar:
            scores["vs_ar"], scores["vs_ar_stderr"] = quality.paired_difference(scores["results"], ar["results"])
            scores["logprob_vs_ar"], scores["logprob_vs_ar_stderr"] = quality.paired_difference(
                scoring.per_problem(scores["logprobs"]), scoring.per_problem(ar["logprobs"]))
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


def with_stderr(scores, key, spec=".3f"):
    """"value ± standard error" of a quality figure, blank where the runner has none (the value alone in reports
    from before the standard errors were kept beside it)."""
    if key not in scores:
        return ""
    if key + "_stderr" not in scores:
        return f"{scores[key]:{spec}}"
    return f"{scores[key]:{spec}} ± {scores[key + '_stderr']:{spec.lstrip('+')}}"


def quality_table(out):
    head = ["method", "pass@1", "minus ar (paired)", "target log-prob per token", "minus ar (paired)",
            "shift / draft's", "tok/s", "x ar", "tokens/cycle", "streamed", "problems x samples"]
    return common.table(head, [[label, with_stderr(q, "pass_at_1"), with_stderr(q, "vs_ar", "+.3f"),
                                with_stderr(q, "logprob"), with_stderr(q, "logprob_vs_ar", "+.3f"),
                                with_stderr(q, "shift_of_draft", ".2f"), common.fmt(q.get("tokens_per_s")),
                                common.fmt(q.get("speedup")), common.fmt(q.get("tokens_per_cycle")),
                                common.fmt(q.get("streamed_share")), f"{q['problems']} x {q['samples']}"]
                               for label, q in out.items()])


def run(args, device, rank, world, report):
    """The accuracy-speed frontier; --out rewritten after each group of problems."""
    previous = None
    if args.resume:
        previous = resumed(args)
    e, paths = common.load_pair(args, device, world)
    report["models"] = common.models_section(e)
    draft_e = None
    if "draft" in args.methods:
        draft_e = draft_alone(e, paths)
    report["quality"] = previous
    for report["quality"] in pass_rates(e, draft_e, args, previous):
        common.write(report, args.out, rank)
    if report["quality"]:
        common.show(quality_table(report["quality"]))
