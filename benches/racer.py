"""bench.py racer: sd with racer's retrieval drafts (no draft model), its chain and its trees, beside ar and sd with
the draft model, on a refactor request (whose answer restates its prompt) and on fresh code."""
import os
import statistics
import sys

import engine
import quality
from benches import common

HELP = ("sd with racer's retrieval drafts (no draft model), its chain and trees, beside ar and sd with the draft "
        "model, on a refactor request and on fresh code")
QUICK = dict(trees=[0], new_tokens=32, repeats=1)


def options(p):
    p.add_argument("--trees", type=common.numbers, default=common.numbers("0,8,16"), metavar="NODES,...",
                   help="racer's trees of these sizes, at most --sd-draft-len deep (0: the chain)")
    common.add_sd_draft_len(p)
    common.add_runs(p)


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
    return runner.generate(ids, method=key["method"], max_new_tokens=tokens, temperature=common.TEMPERATURE,
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
    common.versus_ar(rows, ("tokens_per_s",), key="prompt")
    sd = {r["prompt"]: r["tokens_per_s"] for r in rows if r["draft"] == cells[1][1]["draft"]}
    for row in rows:
        row["tokens_per_s_vs_sd"] = row["tokens_per_s"] / sd[row["prompt"]]
    return rows


def racer_table(rows):
    head = ["prompt", "method", "draft", "tree nodes", "K", "tok/s", "x ar", "x sd", "accepted/cycle", "tokens/cycle"]
    return common.table(head, [racer_cells(row) for row in rows])


def racer_cells(row):
    """A racer row's cells: the tree's size for racer's drafts ("chain": none), K for sd."""
    nodes = ""
    if row["draft"] == "racer":
        nodes = row["tree"] or "chain"
    K = ""
    if row["method"] != "ar":
        K = row["K"]
    return [row["prompt"], row["method"], row["draft"], nodes, K, f"{row['tokens_per_s']:.2f}",
            f"{row['tokens_per_s_vs_ar']:.2f}", f"{row['tokens_per_s_vs_sd']:.2f}",
            common.fmt(row["accepted_per_cycle"]), f"{row['tokens_per_cycle']:.2f}"]


def run(args, device, rank, world, report):
    e, paths = common.load_pair(args, device, world)
    if e.tokenizer is None:
        sys.exit("bench.py racer: racer drafts from text: give models with a tokenizer (a weights/ pair or "
                 "--target), not --random")
    report["models"] = common.models_section(e)
    draft_name = None
    if paths:
        draft_name = os.path.basename(os.path.normpath(paths[0]))
    report["racer"] = racer_rows(e, args, draft_name)
    common.show(racer_table(report["racer"]))
