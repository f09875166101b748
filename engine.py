"""Generation: plain autoregressive decoding (ar), speculative sampling (sd) and sequential Monte Carlo
speculative decoding (smc), from the command line or from Python.

    python engine.py --prompt "def quicksort(xs):"                   # smc with the default pair in weights/
    python engine.py --method sd --temperature 0 --prompt-file p.txt
    Engine("weights/qwen2.5-coder-1.5b-instruct", "weights/qwen2.5-coder-0.5b-instruct").generate("def f(x):")

Every method runs as the same loop: a fixed-shape cycle that updates device tensors in place (captured once
as a CUDA graph on CUDA, called eagerly elsewhere), then one small read of [done, settled] by the host."""
import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

import kernels
import model

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPT = "def quicksort(xs):\n"
METHODS = ("smc", "sd", "ar")


class UsageError(Exception):
    """A one-line problem with a request; the CLI prints it without a traceback."""


@dataclass
class Settings:
    method: str
    max_new_tokens: int
    draft_temperature: float
    target_temperature: float
    particles: int
    draft_len: int
    ess_threshold: float
    top_k: int
    top_p: float
    seed: int
    select: str
    cuda_graphs: bool


@dataclass
class Result:
    text: str | None  # None when the engine was given models without a tokenizer
    tokens: list  # generated ids, without the EOS that ended them
    stats: dict


def shape(method, particles, draft_len, device):
    """A request's (N particles, K draft tokens) where not given: ar 1 x 1, sd K=4; smc by device, from the
    bench grid's cells that resample and so stream text as they go (N=2 at the default threshold 0.5 never
    resamples: ESS >= 1 always). On a CPU every verify row costs compute: N=3, K=2 measured 1.65x `ar` on code
    and 1.51x on prose, 0.99 of the text streamed (README, Results). On a GPU decoding is memory-bound, a verify
    of N x (K+1) rows reads the same weights as one of a single row: N=4, K=4 (not yet measured)."""
    if method == "ar":
        return 1, 1
    default_n, default_k = ((3, 2) if device.type == "cpu" else (4, 4)) if method == "smc" else (1, 4)
    n = default_n if particles is None or method != "smc" else particles
    return n, default_k if draft_len is None else draft_len


def check_settings(s, has_draft):
    """Reject a bad request before anything is allocated."""
    if s.method not in METHODS:
        raise UsageError(f"unknown method {s.method!r} (choose from {', '.join(METHODS)})")
    if s.method != "ar" and not has_draft:
        raise UsageError(f"method {s.method} needs a draft model (--draft)")
    if min(s.draft_temperature, s.target_temperature) < 0:
        raise UsageError("temperatures must be >= 0")
    if s.method == "smc" and 0 in (s.draft_temperature, s.target_temperature):
        raise UsageError("smc needs temperatures > 0 (greedy decoding has no importance weights); "
                         "use --method sd or --method ar for greedy decoding")
    if s.particles < 1:
        raise UsageError(f"particles must be at least 1, got {s.particles}")
    if s.draft_len < 1:
        raise UsageError(f"draft-len must be at least 1, got {s.draft_len}")
    if not 0 <= s.ess_threshold <= 1:
        raise UsageError(f"ess-threshold must lie in [0, 1], got {s.ess_threshold}")
    if s.max_new_tokens < 1:
        raise UsageError(f"max-new-tokens must be at least 1, got {s.max_new_tokens}")
    if s.top_k < 0 or not 0 < s.top_p <= 1:
        raise UsageError("top-k must be >= 0 and top-p in (0, 1]")
    if s.method == "smc" and (s.top_k or s.top_p < 1):
        raise UsageError("smc cannot honour top-k/top-p: its draft proposes tokens the restricted target "
                         "forbids, whose weight is zero; use --method sd or --method ar with --top-k/--top-p")
    if s.select not in ("sample", "argmax"):
        raise UsageError(f"select must be 'sample' or 'argmax', got {s.select!r}")


def free_bytes(device):
    """Memory free for new tensors on `device`, or None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_fits(need, device, what, advice):
    free = free_bytes(device)
    if free is not None and need > free:
        raise UsageError(f"{what} need {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free on "
                         f"{device}; {advice}")


# ---------------------------------------------------------------- distributions


def restrict(logits, temperature, top_k, top_p):
    """logits [..., V] with the tokens outside the top-k and outside the top-p nucleus of softmax(logits / T)
    set to -inf: the target distribution every method samples from."""
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1 and temperature > 0:
        ordered, order = logits.sort(-1, descending=True)
        p = (ordered / temperature).softmax(-1)
        outside = p.cumsum(-1) - p >= top_p  # the mass before this token already reaches top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


def probs(logits, temperature):
    """The distribution sampled at `temperature`: softmax(logits / T), one-hot on the argmax at T = 0."""
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return (logits / temperature).softmax(-1)


def bernoulli(p, rng):
    """True with probability p [B], drawn on the device from rng: a two-way categorical draw."""
    logits = torch.stack([p.log(), (-p).log1p()], -1)  # [B, 2]
    return kernels.sample(logits, 1.0, rng)[0] == 0


# ---------------------------------------------------------------- decoding state


class State:
    """Everything a cycle reads and writes, as device tensors updated in place: the static buffers a CUDA
    graph replays on. R = 1 request of N particles; hist [R, N, H] holds each particle's generated tokens, the
    last of which, x0, is pending (not in any cache yet); prev is the one before it."""

    def small_tensors(self):
        """All state except the K/V, which a warm-up only writes beyond the lengths it restores."""
        lengths = [c.suffix_len for c in (self.tcache, self.dcache) if c is not None]
        return [v for v in vars(self).values() if torch.is_tensor(v)] + lengths


def publish(st, max_new_tokens):
    """flags = [done, settled, degenerate]: done when every particle has ended or the budget is spent; settled =
    how many leading tokens all particles share (they can never change again, so they may be printed);
    degenerate (smc) when no particle has a positive weight left or a weight is NaN, which ends the run."""
    H = st.hist.shape[-1]
    done = st.finished.all() | (st.gen_len[0] >= max_new_tokens) | st.degenerate[0]
    shared = (st.hist == st.hist[:, :1]).all(1)[0] & (torch.arange(H, device=st.hist.device) < st.gen_len[0])
    st.flags.copy_(torch.stack([done.int(), shared.int().cumprod(0).sum().int(), st.degenerate[0].int()]))


def append(st, tokens, kept, is_eos):
    """Commit the first `kept` (int32 [R]) of tokens [R, N, T]: history, lengths, pending token, finished.
    The target already holds K/V for the pending token and the kept tokens but the last, the new pending one."""
    R, N, T = tokens.shape
    at = st.gen_len.long()[:, None, None] + torch.arange(T, device=tokens.device)  # [R, 1, T]
    st.hist.scatter_(2, at.expand(R, N, T), tokens)
    real = torch.arange(T, device=tokens.device) < kept[:, None, None]  # [R, 1, T]
    st.finished |= (is_eos[tokens] & real).any(-1)
    st.x0.copy_(tokens.gather(2, (kept.long() - 1)[:, None, None].expand(R, N, 1))[..., 0])
    st.gen_len += kept
    st.tcache.suffix_len += kept


def settle(x0, t, b, logp, logq, finished, is_eos, pad):
    """EOS is absorbing. The draft token t_k [R, N, K] weighs log p(t_k) - log q(t_k) unless an EOS came before
    it (in x0 [R, N] or t_<k, or the particle had already finished); after a particle's first EOS its new
    tokens become `pad` (an EOS). -> weight increments [R, N], the K + 1 new tokens [R, N, K+1] (t, then b).
    is_eos [V] bool: a table lookup costs the same for any number of EOS ids (torch.isin sorts, and syncs with
    the host, once there are about ten)."""
    K = t.shape[-1]
    block = torch.cat([x0[..., None], t, b[..., None]], -1)  # [R, N, K+2]
    ended = (is_eos[block].cumsum(-1) > 0) | finished[..., None]  # an EOS at or before each position
    increments = torch.where(ended[..., :K], 0.0, logp - logq).sum(-1)
    return increments, torch.where(ended[..., :K + 1], pad, block[..., 1:])


# ---------------------------------------------------------------- cuda graphs


def record(cycle):
    """-> the replay of a CUDA graph of cycle(), run once first on a side stream (Triton compiles, cuBLAS picks
    its kernels) so that the capture records warm kernels. The warm-up cycle advances the state."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cycle()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cycle()
    return graph.replay


def graphs_apply(s, st):
    """Whether cycles run as CUDA-graph replays (a function of its own so a test can take that path on a CPU)."""
    return s.cuda_graphs and st.hist.is_cuda


class Captured:
    """The cycle as a CUDA-graph replay, recorded at its first call: a request that is done before its first
    cycle (max_new_tokens=1) never runs the warm-up cycle, which would write past the end of its history. The
    state the warm-up advanced is restored, so a seed gives the eager output; `seconds` is the recording time,
    which is not decoding time."""

    def __init__(self, cycle, st):
        self.cycle, self.st, self.replay, self.seconds = cycle, st, None, 0.0

    def __call__(self):
        if self.replay is None:
            start = time.perf_counter()
            saved = [t.clone() for t in self.st.small_tensors()]
            self.replay = record(self.cycle)
            for t, value in zip(self.st.small_tensors(), saved):
                t.copy_(value)
            self.seconds = time.perf_counter() - start
        self.replay()


# ---------------------------------------------------------------- engine


class Engine:
    """A target model and an optional draft, each a path (Hugging Face directory or .gguf file) or a loaded
    model.Transformer (then prompts are token ids and results carry no text). Paths are opened at once (config,
    tokenizer, the weight files' headers), so that a bad request is refused before any weight is read; the
    weights are read by `load()`, which the first `generate` calls."""

    def __init__(self, target, draft=None, device=None, dtype=None):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError("CUDA is not available here; use --device cpu")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.bfloat16
        self.target, self.draft = (m if isinstance(m, model.Transformer) else None for m in (target, draft))
        self.opened = [None if m is None or isinstance(m, model.Transformer) else model.open_weights(m)
                       for m in (target, draft)]
        self.config, self.draft_config = (o[0] if o else m and m.config for m, o in zip((target, draft), self.opened))
        if self.draft_config and self.draft_config.vocab_size != self.config.vocab_size:
            raise UsageError(f"{draft}: vocabulary size {self.draft_config.vocab_size} differs from the target's "
                             f"{self.config.vocab_size}")
        self.device, self.dtype = (self.target.device, self.target.embed.dtype) if self.target else (device, dtype)
        check_fits(self.unread_bytes(), self.device, "the weights", "try a smaller model or another --device")
        self.tokenizer = self.opened[0] and self.opened[0][2]
        self.is_eos = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.device)  # [V]
        self.is_eos[self.config.eos_ids] = True
        self.pad = (self.config.eos_ids or [0])[0]

    def unread_bytes(self):
        """Memory the weights not yet read will take (on a CPU a tied head gets a packed copy of its own)."""
        opened = [o for o in self.opened if o]
        n = sum(math.prod(s) for o in opened for s in model.expected_shapes(o[0]).values())
        if self.device.type == "cpu":
            n += sum(o[0].vocab_size * o[0].dim for o in opened if o[0].tie_embeddings)
        return n * self.dtype.itemsize

    def load(self):
        """Read the weights (once) -> self."""
        if self.target is None:
            self.target = model.build(*self.opened[0][:2], self.device, self.dtype)
        if self.draft is None and self.opened[1]:
            self.draft = model.build(*self.opened[1][:2], self.device, self.dtype)
        self.opened = [None, None]
        return self

    def encode(self, prompt):
        if not isinstance(prompt, str):
            ids = [int(i) for i in prompt]
        elif self.tokenizer is None:
            raise UsageError("this engine has no tokenizer: give the prompt as token ids")
        elif not prompt.strip():
            raise UsageError("the prompt is empty or only whitespace")
        else:
            ids = self.tokenizer.encode(prompt)
        if not ids:
            raise UsageError("the prompt is empty")
        if not all(0 <= i < self.config.vocab_size for i in ids):
            raise UsageError(f"prompt token ids must lie in [0, {self.config.vocab_size})")
        return ids

    def request(self, prompt, method="smc", max_new_tokens=64, temperature=0.7, draft_temperature=None,
                target_temperature=None, particles=None, draft_len=None, ess_threshold=0.5, top_k=0, top_p=1.0,
                seed=0, select="sample", cuda_graphs=True):
        """Check a request against the models' configs and the free memory, before any weight is read ->
        (token ids, Settings, suffix capacity). Raises UsageError."""
        s = Settings(method, max_new_tokens, temperature if draft_temperature is None else draft_temperature,
                     temperature if target_temperature is None else target_temperature,
                     *shape(method, particles, draft_len, self.device), ess_threshold, top_k, top_p, seed, select,
                     cuda_graphs)
        check_settings(s, self.draft_config is not None)
        ids = self.encode(prompt)
        return ids, s, self.check_request(len(ids), s)

    def generate(self, prompt, on_tokens=None, **options):
        """prompt: text or token ids -> Result(text, tokens, stats). Options (see `request`): method, max_new_tokens,
        temperature (the draft's and the target's) or draft_temperature / target_temperature, particles (smc's N)
        and draft_len (K; None for either: `shape`'s defaults), ess_threshold, top_k, top_p (ar and sd), seed,
        select (the final particle by "sample", in proportion to its weight, or "argmax"), cuda_graphs.
        on_tokens, if given, is called with the settled tokens (up to the first EOS) whenever more have settled;
        returning True stops generation there (a stop condition: the settled tokens are the result). stats["stop"]
        says why it ended: "eos", "length", "stopped", "interrupted", or "degenerate" (smc: no particle kept a
        positive weight, or one is NaN; the result is what had settled before)."""
        ids, s, capacity = self.request(prompt, **options)
        self.load()
        with torch.inference_mode():
            start = time.perf_counter()
            st = self.start(ids, s, capacity)
            prefill = time.perf_counter() - start
            cycle = {"ar": self.ar_cycle, "sd": self.sd_cycle, "smc": self.smc_cycle}[s.method]

            def step():
                cycle(st, s)
                publish(st, s.max_new_tokens)
            if graphs_apply(s, st):
                step = Captured(step, st)
            settled, cycles, stop = self.decode(st, step, s, on_tokens)
            tokens = settled if settled is not None else self.pick(st, s)
            seconds = time.perf_counter() - start - getattr(step, "seconds", 0.0)  # recording is not decoding
            stats = self.statistics(st, s, cycles, seconds, prefill, tokens, stop)
        tokens = until_eos(tokens, self.config.eos_ids)
        text = self.tokenizer.decode(tokens) if self.tokenizer else None
        return Result(text, tokens, stats)

    def check_request(self, prompt_len, s):
        """Context and memory checks -> the suffix capacity: the budget plus a draft block of lookahead."""
        extra = 0 if s.method == "ar" else s.draft_len
        capacity = s.max_new_tokens + extra
        configs = [c for c in (self.config, self.draft_config if s.method != "ar" else None) if c is not None]
        context = min(c.max_seq_len for c in configs)
        if prompt_len >= context:
            raise UsageError(f"the prompt is {prompt_len} tokens, longer than the context of {context}")
        if prompt_len + capacity > context:
            raise UsageError(f"max-new-tokens {s.max_new_tokens} does not fit the context of {context} after a "
                             f"{prompt_len}-token prompt; use at most {context - prompt_len - extra}")
        need = sum(model.KVCache.nbytes(c, s.particles, prompt_len, capacity, self.dtype) for c in configs)
        need += 4 * s.particles * (extra + 1) * self.config.vocab_size * 4  # float32 logits, a few copies
        need += self.unread_bytes()  # free memory is measured before the weights are read
        check_fits(need, self.device, "the KV caches and logits" + (" with the weights" if self.opened[0] else ""),
                   "lower --particles or --max-new-tokens")
        return capacity

    def start(self, ids, s, capacity):
        """Allocate the caches, prefill the prompt once, sample every particle's first token x0 from the target."""
        device, dtype, N = self.device, self.dtype, s.particles
        st = State()
        st.tcache = model.KVCache(self.config, N, len(ids), capacity, device, dtype)
        st.dcache = None
        st.rng = kernels.make_rng(s.seed, device)
        prompt = torch.tensor(ids, device=device)
        logits = self.target.prefill(prompt, st.tcache)  # [V]
        logits = restrict(logits.expand(N, -1), s.target_temperature, s.top_k, s.top_p)
        st.x0 = kernels.sample(logits, s.target_temperature, st.rng)[0].view(1, N)
        if s.method != "ar":  # the draft leaves the last prompt token to the first draft step, beside x0
            st.dcache = model.KVCache(self.draft_config, N, max(len(ids) - 1, 1), capacity, device, dtype)
            if len(ids) > 1:  # a one-token prompt leaves the draft's prefix empty
                self.draft.prefill(prompt[:-1], st.dcache, logits=None)
        st.prev = prompt[-1:].expand(1, N).clone()
        st.hist = torch.zeros(1, N, capacity, dtype=torch.int64, device=device)
        st.hist[..., 0] = st.x0
        st.gen_len = torch.ones(1, dtype=torch.int32, device=device)
        st.finished = self.is_eos[st.x0]
        st.degenerate = torch.zeros(1, dtype=torch.bool, device=device)
        st.logw = torch.zeros(1, N, device=device)
        st.log_z = torch.zeros(1, device=device)
        st.accepted, st.resamples = (torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2))
        st.ess_sum = torch.zeros(1, device=device)
        st.flags = torch.zeros(3, dtype=torch.int32, device=device)
        st.streamed = 0
        publish(st, s.max_new_tokens)
        return st

    def decode(self, st, step, s, on_tokens):
        """Run cycles until done, reading the flags once per cycle and passing new settled tokens on.
        -> (None, cycles, None), or (the settled tokens, cycles, "stopped" | "interrupted" | "degenerate") when
        on_tokens asked to stop, after Ctrl-C, or when the last cycle left the weights degenerate (what it
        made is not passed on). st.streamed: how many tokens had settled before the last cycle, i.e. could be
        shown while generating rather than at the end."""
        settled, cycles = [], 0
        try:
            while True:
                done, count, degenerate = st.flags.tolist()
                if degenerate:
                    return settled, cycles, "degenerate"
                count = min(count, s.max_new_tokens)
                if count > len(settled):
                    settled += st.hist[0, 0, len(settled):count].tolist()
                    if on_tokens and on_tokens(until_eos(settled, self.config.eos_ids)):
                        st.streamed = len(settled)
                        return settled, cycles, "stopped"
                if done:
                    return None, cycles, None
                st.streamed = len(settled)
                step()
                cycles += 1
        except KeyboardInterrupt:
            return settled, cycles, "interrupted"

    def pick(self, st, s):
        """The returned particle's tokens: drawn in proportion to its weight, or the heaviest."""
        if s.select == "argmax":
            i = st.logw.argmax(-1)
        else:
            i = kernels.sample(st.logw, 1.0, st.rng)[0]
        return st.hist[0, i[0], :min(int(st.gen_len[0]), s.max_new_tokens)].tolist()

    def statistics(self, st, s, cycles, seconds, prefill, tokens, stop):
        """seconds: from the start of the prefill to the last token; prefill: until the first token was drawn."""
        new = len(until_eos(tokens, self.config.eos_ids))
        stats = {"method": s.method, "new_tokens": new, "seconds": round(seconds, 4),
                 "prefill_seconds": round(prefill, 4), "streamed": min(st.streamed, new),
                 "tokens_per_s": round(new / seconds, 2) if seconds > 0 else 0.0, "cycles": cycles,
                 "stop": stop or ("eos" if new < len(tokens) else "length")}
        if s.method == "sd":
            accepted = int(st.accepted[0])
            stats |= {"draft_len": s.draft_len, "accepted": accepted,
                      "acceptance": round(accepted / max(cycles * s.draft_len, 1), 4)}
        if s.method == "smc":
            final = st.logw.logsumexp(-1) - math.log(s.particles)  # the weights since the last resampling
            stats |= {"particles": s.particles, "draft_len": s.draft_len, "resamples": int(st.resamples[0]),
                      "mean_ess": round(float(st.ess_sum[0]) / max(cycles, 1), 3),
                      "log_z": round(float(st.log_z[0] + final[0]), 4)}
        return stats

    # ------------------------------------------------------------ cycles: fixed shapes, no host sync

    def ar_cycle(self, st, s):
        """One target step on the pending token."""
        logits = self.target.step(st.x0[..., None], st.tcache)[:, :, 0]  # [1, 1, V]
        logits = restrict(logits[0], s.target_temperature, s.top_k, s.top_p)
        x = kernels.sample(logits, s.target_temperature, st.rng)[0]  # [1]
        append(st, x.view(1, 1, 1), torch.ones_like(st.gen_len), self.is_eos)

    def draft_block(self, st, s):
        """K draft steps for every particle, the first on [prev, x0], whose draft K/V the last cycle left
        unwritten. -> tokens [R, N, K], their log q under the draft temperature [R, N, K], the K logits
        [R, N, V]. Advances the draft's suffix_len by K + 1."""
        R, N = st.x0.shape
        x = torch.stack([st.prev, st.x0], -1)  # [R, N, 2]
        tokens, logq, logits = [], [], []
        for _ in range(s.draft_len):
            out = self.draft.step(x, st.dcache, last_only=True)  # [R, N, V]
            st.dcache.suffix_len += x.shape[-1]
            t, lq = kernels.sample(out.flatten(0, 1), s.draft_temperature, st.rng)
            x = t.view(R, N, 1)
            tokens.append(x)
            logq.append(lq.view(R, N, 1))
            logits.append(out)
        return torch.cat(tokens, -1), torch.cat(logq, -1), logits

    def verify(self, st, t, s):
        """One target forward over [x0, t_1..t_K] -> restricted logits [R, N, K+1, V]: row k - 1 scores t_k,
        row K is the bonus token's distribution."""
        logits = self.target.step(torch.cat([st.x0[..., None], t], -1), st.tcache)
        return restrict(logits, s.target_temperature, s.top_k, s.top_p)

    def sd_cycle(self, st, s):
        """Speculative sampling: accept t_k with probability min(1, p/q); the first rejection is replaced by a
        draw from normalise(max(p - q, 0)); if all K pass, a bonus token from p. Exact at any temperature."""
        K, device = s.draft_len, st.x0.device
        t, _, q_logits = self.draft_block(st, s)
        p = probs(self.verify(st, t, s)[0, 0], s.target_temperature)  # [K+1, V]
        q = probs(torch.cat(q_logits)[:, 0], s.draft_temperature)  # [K, V]
        t = t[0, 0]  # [K]
        pt, qt = p[:K].gather(1, t[:, None])[:, 0], q.gather(1, t[:, None])[:, 0]
        accept = bernoulli(torch.where(pt >= qt, 1.0, pt / qt), st.rng)  # [K]
        n = accept.int().cumprod(0).sum(0, keepdim=True)  # [1] draft tokens accepted
        fix = torch.cat([(p[:K] - q).clamp(min=0), p[K:]]).index_select(0, n)  # [1, V]
        fix = torch.where(fix.sum(-1, keepdim=True) > 0, fix, p.index_select(0, n))  # p == q: nothing to fix
        c = kernels.sample(fix.log(), 1.0, st.rng)[0]  # [1]
        st.prev.copy_(torch.cat([st.x0[0], t]).index_select(0, n)[None])
        tokens = torch.where(torch.arange(K + 1, device=device) < n, torch.cat([t, c]), c)  # t_1..t_n, c, filler
        st.dcache.suffix_len -= (K - n).int()  # the draft keeps K/V up to t_{n-1}
        st.accepted += n
        append(st, tokens.view(1, 1, K + 1), (n + 1).int(), self.is_eos)

    def smc_cycle(self, st, s):
        """Draft K tokens per particle, score them with the target in one forward, weight, append K + 1
        tokens (the last a bonus token from the target), resample when the ESS falls below the threshold."""
        K, (R, N) = s.draft_len, st.x0.shape
        t, logq, _ = self.draft_block(st, s)
        logits = self.verify(st, t, s)  # [R, N, K+1, V]
        logp = kernels.token_logprobs(logits[:, :, :K].flatten(0, 2), t.flatten(), s.target_temperature)
        b = kernels.sample(logits[:, :, K].flatten(0, 1), s.target_temperature, st.rng)[0].view(R, N)
        increments, tokens = settle(st.x0, t, b, logp.view(R, N, K), logq, st.finished, self.is_eos, self.pad)
        st.logw += increments
        st.prev.copy_(tokens[..., K - 1])
        append(st, tokens, torch.full_like(st.gen_len, K + 1), self.is_eos)
        self.resample(st, s)

    def resample(self, st, s):
        """Systematic resampling where ESS < threshold * N: each particle's suffix K/V (target and draft),
        history, pending tokens and finished flag become its ancestor's; the log-normaliser takes the mean
        weight, and the weights restart at 0. A population with no positive weight (the target forbids every
        particle's draft tokens) or a NaN weight (non-finite logits) is degenerate: resampling it would be a
        uniform draw that hides the failure, so the run ends (publish)."""
        ancestors, ess, resampled, degenerate = kernels.resample(st.logw, s.ess_threshold, st.rng)
        st.degenerate |= degenerate
        st.log_z += torch.where(resampled, st.logw.logsumexp(-1) - math.log(s.particles), 0.0)
        st.logw.masked_fill_(resampled[:, None], 0.0)
        for cache in (st.tcache, st.dcache):
            for kv in (cache.suffix_k, cache.suffix_v):
                kernels.gather_suffix(kv, ancestors, cache.suffix_len)
        kernels.gather_suffix(st.hist, ancestors, st.gen_len)
        for x in (st.x0, st.prev, st.finished):
            x.copy_(x.gather(1, ancestors))
        st.resamples += resampled
        st.ess_sum += ess


def until_eos(tokens, eos_ids):
    """tokens up to, without, the first EOS."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos_ids), tokens)


# ---------------------------------------------------------------- command line


def default_pair():
    """(draft, target) paths of the default Qwen2.5-Coder pair, fetched into weights/ if missing."""
    sys.path.insert(0, os.path.join(ROOT, "weights"))
    import fetch
    return tuple(fetch.fetch(name) for name in fetch.DEFAULT_PAIR)


def apply_chat(tokenizer, text):
    """The text as a user message in the tokenizer's chat template, ending where the reply begins; the text
    itself when there is no template."""
    if not tokenizer or not tokenizer.chat_template:
        return text
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def fail(message):
        raise UsageError(f"chat template: {message}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = fail
    return env.from_string(tokenizer.chat_template).render(
        messages=[{"role": "user", "content": text}], add_generation_prompt=True, bos_token="", eos_token="")


class TextStream:
    """Prints the text of the settled tokens as it grows, holding back a half-decoded UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.shown = tokenizer, 0

    def __call__(self, tokens):
        text = self.tokenizer.decode(tokens)
        if not text.endswith("\ufffd"):
            print(text[self.shown:], end="", flush=True)
            self.shown = len(text)


def summary(stats):
    line = f"[{stats['method']}: {stats['new_tokens']} new tokens, {stats['tokens_per_s']:.1f} tok/s"
    if stats["method"] == "sd":
        line += f", {stats['cycles']} cycles, acceptance {stats['acceptance']:.2f}"
    if stats["method"] == "smc":
        line += (f", {stats['cycles']} cycles, {stats['resamples']} resamples, mean ESS {stats['mean_ess']:.2f}"
                 f"/{stats['particles']}, log Z {stats['log_z']:.3f}")
    return line + ("" if stats["stop"] != "interrupted" else ", interrupted") + "]"


def read_prompt(path):
    """The text of a prompt file, UTF-8; a missing, unreadable or non-UTF-8 file is a one-line UsageError."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save it "
                         "as UTF-8") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model: Hugging Face directory or .gguf file (default: weights/ pair)")
    p.add_argument("--draft", help="draft model, same vocabulary as the target")
    p.add_argument("--method", choices=METHODS, default="smc")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--prompt-file", help="read the prompt from this file instead")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7, help="draft and target temperature; 0 = greedy")
    p.add_argument("--draft-temperature", type=float)
    p.add_argument("--target-temperature", type=float)
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest target tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the target's top-p nucleus")
    p.add_argument("--particles", type=int, help="smc: particles N (default: 3 on a CPU, 4 on a GPU)")
    p.add_argument("--draft-len", type=int, help="sd, smc: draft tokens K per cycle (default: sd 4; smc 2 on a "
                   "CPU, 4 on a GPU)")
    p.add_argument("--ess-threshold", type=float, default=0.5, help="smc: resample when ESS < this * N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every cycle eagerly")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")
    args = p.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        sys.exit(f"error: unknown device {args.device!r}; use cpu or cuda")
    draft_temperature, target_temperature = (args.temperature if t is None else t
                                             for t in (args.draft_temperature, args.target_temperature))
    particles, draft_len = shape(args.method, args.particles, args.draft_len, device)
    options = dict(method=args.method, max_new_tokens=args.max_new_tokens, draft_temperature=draft_temperature,
                   target_temperature=target_temperature, particles=particles, draft_len=draft_len,
                   ess_threshold=args.ess_threshold, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   cuda_graphs=not args.no_cuda_graphs)
    try:
        check_settings(Settings(**options, select="sample"), has_draft=True)  # before the default pair is fetched
        if args.draft and not args.target:
            raise UsageError("--draft needs --target")
        prompt = read_prompt(args.prompt_file) if args.prompt_file else args.prompt
        if not prompt.strip():
            raise UsageError(f"{args.prompt_file or '--prompt'}: the prompt is empty or only whitespace")
        draft, target = (args.draft, args.target) if args.target else default_pair()
        engine = Engine(target, draft, device, args.dtype)  # opens the files; reads no weights yet
        if args.chat:
            prompt = apply_chat(engine.tokenizer, prompt)
        engine.request(prompt, **options)  # every check, before the weights are read and the prompt is echoed
        stream = None if args.json else TextStream(engine.tokenizer)
        if stream and not args.chat:
            print(prompt, end="", flush=True)
        result = engine.generate(prompt, on_tokens=stream, **options)
    except (model.LoadError, UsageError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, "stats": result.stats}))
    else:
        stream(result.tokens)
        print()
        print(summary(result.stats), file=sys.stderr)
    if result.stats["stop"] == "interrupted":
        sys.exit(130)
    if result.stats["stop"] == "degenerate":
        sys.exit("error: smc stopped: no particle kept a positive weight, or one is NaN (the models' "
                 "log-probabilities are not finite); the text above is what had settled")


if __name__ == "__main__":
    main()
