"""Completions of the code-completion problems and their scores, shared by quality, requests and formats: sampled
completions stopped where the function body ends, the target's log-probability of a continuation, the seeds and
the problem sets."""
import math
import statistics
import string

import torch

import kernels
import model
import quality
from benches import common

# Stop strings where a completion's function body ends: a line that starts at the margin (quality.ends_body cuts
# there). As stop strings they end every method there, smc's particles one by one included; the settled-text check
# (on_tokens) also catches a completed margin line or a code fence.
BODY_END = ["\n" + c for c in string.printable if not c.isspace()]
QUALITY_SLOTS = 4  # requests decoded together in the quality run (continuous batching keeps the slots full)


def completions(runner, problems, seeds, method, N, K, max_new_tokens, options):
    """Sampled completions of the problems' prompts, decoded QUALITY_SLOTS at a time, each stopped as
    soon as its function body is complete."""
    def done(tokens):
        return quality.body_complete(runner.tokenizer.decode(tokens))
    requests = [{"prompt": p["prompt"], "seed": seed, "on_tokens": done} for p, seed in zip(problems, seeds)]
    return runner.generate(requests, slots=min(QUALITY_SLOTS, len(requests)), method=method,
                           max_new_tokens=max_new_tokens, temperature=common.TEMPERATURE, particles=N, draft_len=K,
                           stop=BODY_END, **options)


def target_logprobs(m, prompt, continuations, temperature=common.TEMPERATURE):
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
        rest = first[:0]  # [T-1, V]
        if len(tokens) > 1:
            rest = m.step(ids[None, None, :-1], cache)[0, 0]
        logits = torch.cat([first[None], rest])  # [T, V]: the logits that predicted each token
        out.append(kernels.token_logprobs(logits, ids, temperature).mean().item())
    return out


def quality_seed(problem, sample):
    """A seed of its own for every (problem, sample): seeding sample j of every problem alike would correlate
    the samples across problems and make the standard errors optimistic."""
    return 1000 * problem + sample


def problem_set(args):
    if args.problem_set == "humaneval":
        return quality.load_humaneval()
    return quality.load_problems()


def per_problem(values):
    """[[per-sample value or None]] -> [[the problem's mean]]: what pass_at_1's arithmetic takes."""
    out = []
    for samples in values:
        known = [v for v in samples if v is not None]
        if known:
            out.append([statistics.fmean(known)])
        else:
            out.append([math.nan])
    return out
