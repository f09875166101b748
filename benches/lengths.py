"""bench.py lengths: decode and prefill speed against the prompt's length, prompts cut from real code."""
import statistics

import torch

import quality
from benches import common

HELP = "decode and prefill speed at each prompt length, prompts cut from real code"
QUICK = dict(prompt_lengths=[100, 1000], new_tokens=32, repeats=1)


def options(p):
    common.add_methods(p, "ar,sd,smc", common.SINGLE)
    common.add_cells(p, "smc's (and mdsd's) N x K cells")
    common.add_sd_draft_len(p)
    common.add_runs(p)
    p.add_argument("--prompt-lengths", type=common.numbers, default=common.numbers("100,1000,4000"))


def long_prompts(e, lengths):
    """length -> token ids: the code-completion set's functions end to end (repeated if need be), cut to length;
    random ids for random models."""
    if e.tokenizer is None:
        generator = torch.Generator().manual_seed(1)
        return {n: torch.randint(0, e.vocab, (n,), generator=generator).tolist() for n in lengths}
    ids = e.encode("\n\n".join(p["prompt"] + p["solution"] for p in quality.load_problems()))
    ids *= max(lengths) // len(ids) + 1
    return {n: ids[:n] for n in lengths}


def decode_rate(stats):
    """Tokens/s after the prefill, which draws the first token."""
    return (stats["new_tokens"] - 1) / max(stats["seconds"] - stats["prefill_seconds"], 1e-9)


def length_axis(e, args, peer=None):
    """Every method at every prompt length, interleaved, `repeats` times -> one row per (length, config) with the
    median decode tokens/s (prefill excluded), prefill seconds (both models') and seconds to the first settled
    token, and their ratios to ar's at that length; and
    llama.cpp's ar on the target's file in the same loop where peer (a peers.LlamaCpp) is given."""
    ids_by_length = long_prompts(e, args.prompt_lengths)
    cells = common.configs(args, args.smc_cells)
    shortest = ids_by_length[min(args.prompt_lengths)]
    for method, N, K in cells:  # warm-up: first calls allocate and pick kernels
        common.run_engine(e, shortest, method, N, K, 4 * K, 0)
    if peer:
        peer.run(shortest, common.TEMPERATURE, 4, 0)
    runs = {}
    for repeat in range(args.repeats):
        for n, ids in ids_by_length.items():
            for method, N, K in cells:
                stats = common.run_engine(e, ids, method, N, K, args.new_tokens, repeat)
                runs.setdefault((n, method, N, K), []).append(stats)
            if peer:
                stats = peer.run(ids, common.TEMPERATURE, args.new_tokens, repeat)
                runs.setdefault((n, common.LLAMA_CPP_AR, 1, 1), []).append(stats)
    rows = [{"prompt_tokens": n, "method": method, "N": N, "K": K,
             "decode_tokens_per_s": statistics.median(decode_rate(s) for s in all_stats),
             "prefill_s": statistics.median(s["prefill_seconds"] for s in all_stats),
             "first_token_s": statistics.median(s["first_token_s"] for s in all_stats),
             "runs": [decode_rate(s) for s in all_stats]} for (n, method, N, K), all_stats in runs.items()]
    common.versus_ar(rows, ("decode_tokens_per_s", "prefill_s", "first_token_s"), key="prompt_tokens")
    return rows


def length_table(rows):
    head = ["prompt tokens", "method", "N", "K", "decode tok/s", "x ar", "prefill s", "prefill x ar", "first token s"]
    return common.table(head, [[r["prompt_tokens"], r["method"], *common.cells_nk(r),
                                f"{r['decode_tokens_per_s']:.2f}", common.fmt(r.get("decode_tokens_per_s_vs_ar")),
                                f"{r['prefill_s']:.2f}", common.fmt(r.get("prefill_s_vs_ar")),
                                f"{r['first_token_s']:.2f}"] for r in rows])


def run(args, device, rank, world, report):
    e, paths = common.load_pair(args, device, world)
    report["models"] = common.models_section(e)
    peer = common.llama_cpp_peer(paths, device, report)
    report["lengths"] = length_axis(e, args, peer)
    common.show(common.caption(report) + length_table(report["lengths"]))
