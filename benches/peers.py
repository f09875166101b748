"""bench.py peers: transformers (alone with a static cache, assisted by the draft) and llama.cpp on the speed
prompts, the engine's peers on the same models."""
import sys

import torch

import peers
from benches import common

HELP = ("transformers (alone, static cache; assisted by the draft) and llama.cpp (on the GGUF files, on a CPU, where "
        "llama-cpp-cffi is installed) on the speed prompts")
QUICK = dict(new_tokens=32, repeats=1)


def options(p):
    common.add_runs(p)


def peer_table(rows):
    return common.table(["prompt", "peer", "tok/s"], [[r["prompt"], r["method"], f"{r['tokens_per_s']:.2f}"]
                                                      for r in rows])


def run(args, device, rank, world, report):
    """transformers (alone and assisted) and llama.cpp (on a CPU) on the speed prompts."""
    if world > 1:
        sys.exit("bench.py peers: the peers run on one process, not under torchrun")
    e, paths = common.open_pair(args, device, world)
    ids_by_prompt = common.prompts(args, e)
    report["prompt_tokens"] = {name: len(ids) for name, ids in ids_by_prompt.items()}
    rows = []
    if common.transformers_usable(paths, world):
        models = peers.hf_models(paths, getattr(torch, args.dtype))
        rows += peers.hf_rows(models, ids_by_prompt, peers.pad_id(e), common.TEMPERATURE, args.new_tokens,
                              args.repeats)
    if device.type == "cpu":
        rows += peers.llama_cpp_rows(paths, ids_by_prompt, common.TEMPERATURE, args.new_tokens, args.repeats)
    if not rows:
        sys.exit("bench.py peers: no peer to run: install transformers (or llama-cpp-cffi, on a CPU)")
    report["peer"] = rows
    common.show(common.caption(report) + peer_table(rows))
