"""Generation. For now: load a draft/target pair and decode greedily with the target alone (plain AR).
SD and SMC-SD build on this file.

    python engine.py --prompt "def quicksort(xs):"
"""
import argparse
import os
import sys
import time

import torch

import model

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPT = "def quicksort(xs):\n"


def default_pair():
    """(draft, target) paths of the default Qwen2.5-Coder pair, fetched into weights/ if missing."""
    sys.path.insert(0, os.path.join(ROOT, "weights"))
    import fetch
    return tuple(fetch.fetch(name) for name in fetch.DEFAULT_PAIR)


@torch.inference_mode()
def greedy(m, prompt_ids, max_new_tokens, eos_ids):
    """Plain greedy AR decoding through the static cache -> generated ids."""
    cache = model.KVCache(m.config, 1, len(prompt_ids), max_new_tokens, m.device, m.embed.dtype)
    x = m.prefill(torch.tensor(prompt_ids, device=m.device), cache).argmax()
    out = [int(x)]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        x = m.step(x.view(1, 1, 1), cache)[0, 0, 0].argmax()
        cache.suffix_len += 1
        out.append(int(x))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", help="draft model: Hugging Face directory or .gguf file (default: weights/ pair)")
    p.add_argument("--target", help="target model: Hugging Face directory or .gguf file")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args(argv)
    try:
        draft_path, target_path = (args.draft, args.target) if args.target else default_pair()
        dtype = getattr(torch, args.dtype)
        target, tok = model.load(target_path, args.device, dtype)
        if draft_path:
            draft, _ = model.load(draft_path, args.device, dtype)
            if draft.config.vocab_size != target.config.vocab_size:
                raise model.LoadError(f"{draft_path}: vocabulary size {draft.config.vocab_size} differs from the "
                                      f"target's {target.config.vocab_size}")
    except model.LoadError as e:
        sys.exit(f"error: {e}")
    ids = tok.encode(args.prompt)
    start = time.perf_counter()
    out = greedy(target, ids, args.max_new_tokens, set(target.config.eos_ids))
    seconds = time.perf_counter() - start
    print(args.prompt + tok.decode(out))
    print(f"[ar greedy: {len(out)} new tokens, {len(out) / seconds:.1f} tok/s]", file=sys.stderr)


if __name__ == "__main__":
    main()
