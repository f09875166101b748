"""bench.py requests: end-to-end speed, prefill included, on short code-completion requests, each stopped where its
function ends, as the quality run stops it."""
import torch

import quality
from benches import common, scoring

HELP = ("end-to-end speed, prefill included, on short code-completion requests, each stopped at the end of its "
        "function")
QUICK = dict(problems=2, new_tokens=32)
SHORT_MAX_TOKENS = 256  # short requests stop at the end of their function, well within this


def options(p):
    common.add_methods(p, "ar,sd,smc", common.SINGLE)
    common.add_cells(p, "smc's (and mdsd's) N x K cells")
    common.add_sd_draft_len(p)
    p.add_argument("--problems", type=int, default=10, help="the first P code-completion problems")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per request with --random")


def body_end(text):
    return quality.body_complete(text) or any(stop in text for stop in scoring.BODY_END)


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
        texts = [torch.randint(0, e.vocab, (len(p["prompt"]) // 4,), generator=generator).tolist()
                 for p in problems]
    cells = common.configs(args, args.smc_cells)
    for method, N, K in cells:  # warm-up
        common.run_engine(e, texts[0], method, N, K, 4 * K, 0)
    totals = {cell: {"requests": 0, "new_tokens": 0, "seconds": 0.0, "prefill_s": 0.0} for cell in cells}
    for i, prompt in enumerate(texts):
        for method, N, K in cells:
            if e.tokenizer:
                [result] = scoring.completions(e, [problems[i]], [i], method, N, K, SHORT_MAX_TOKENS, {})
                stats = result.stats
                useful = body_tokens(e.tokenizer, result.tokens)
            else:
                stats = common.run_engine(e, prompt, method, N, K, args.new_tokens, i)
                useful = stats["new_tokens"]
            total = totals[method, N, K]
            total["requests"] += 1
            total["new_tokens"] += useful
            total["seconds"] += stats["seconds"]
            total["prefill_s"] += stats["prefill_seconds"]
    rows = [{"method": method, "N": N, "K": K, **total, "tokens_per_s": total["new_tokens"] / total["seconds"]}
            for (method, N, K), total in totals.items()]
    common.versus_ar(rows, ("tokens_per_s",))
    return rows


def short_table(rows):
    head = ["method", "N", "K", "requests", "body tokens per request", "tok/s (prefill included)", "x ar",
            "prefill s per request"]
    return common.table(head, [[r["method"], *common.cells_nk(r), r["requests"],
                                f"{r['new_tokens'] / r['requests']:.0f}", f"{r['tokens_per_s']:.2f}",
                                common.fmt(r.get("tokens_per_s_vs_ar")), f"{r['prefill_s'] / r['requests']:.2f}"]
                               for r in rows])


def run(args, device, rank, world, report):
    e, _ = common.load_pair(args, device, world)
    report["models"] = common.models_section(e)
    report["short_requests"] = short_requests(e, args)
    common.show(short_table(report["short_requests"]))
