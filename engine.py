"""Generation: plain autoregressive decoding (ar), speculative sampling (sd) and sequential Monte Carlo
speculative decoding (smc), for one prompt or many, from the command line or from Python.

    python engine.py --prompt "def quicksort(xs):"                   # smc with the default pair in weights/
    python engine.py --method sd --temperature 0 --prompt-file p.txt
    python engine.py --prompt-file prompts.jsonl --slots 4            # one JSON result per line
    Engine("weights/qwen2.5-coder-1.5b-instruct", "weights/qwen2.5-coder-0.5b-instruct").generate("def f(x):")

Every method runs as the same loop: a fixed-shape cycle over a batch of slots that updates device tensors in
place (captured once as a CUDA graph on CUDA, called eagerly elsewhere), then one small read of every slot's
[done, settled, degenerate, length] by the host, which passes settled text on, ends finished requests and admits
waiting ones into the freed slots (continuous batching)."""
import argparse
import copy
import json
import math
import os
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

import kernels
import model
import racer

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPT = "def quicksort(xs):\n"
METHODS = ("smc", "sd", "easd", "ar")
EASD = (1.0, 5, 0.6)  # easd's rule: entropy (nats) both models must reach, top-m, share of the top-m they share


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
    power: float = 1.0
    easd: tuple = EASD
    tree: int = 0  # racer: draft tokens per cycle, a tree at most draft_len deep (0: a chain of draft_len)
    overlap: bool = False  # MineDraft: two half-batches, one drafting while the other verifies

    def shape(self, tree_drafts=False):
        """What the requests of one batch share: the cycle's shape."""
        return Shape(self.method, self.particles, self.draft_len, self.ess_threshold if self.method == "smc" else
                     None, self.cuda_graphs, self.power, tuple(self.easd) if self.method == "easd" else None,
                     tree=(self.tree or self.draft_len) if tree_drafts and self.method == "sd" else 0,
                     overlap=self.overlap)


@dataclass(frozen=True)
class Shape:
    method: str
    particles: int
    draft_len: int
    ess_threshold: float | None
    cuda_graphs: bool
    power: float = 1.0  # smc's target: the whole sequence's p ** power (normalised)
    easd: tuple | None = None  # easd's rule (`easd_trigger`)
    restrict: bool = False  # some request in the batch has top-k or top-p: the cycle restricts the target
    tree: int = 0  # racer: the draft tokens verified per cycle (their tree comes from the host)
    overlap: bool = False


@dataclass
class Result:
    text: str | None  # None when the engine was given models without a tokenizer
    tokens: list  # generated ids, without the EOS that ended them (a stop string cuts the text, not the ids)
    stats: dict


def shape(method, particles, draft_len, device):
    """A request's (N particles, K draft tokens) where not given: ar 1 x 1, sd K=4; smc by device, from the
    bench grid's cells that resample and so stream text (README, Results): on a CPU, where every verify row costs
    compute, N=3, K=2; on a GPU, where a verify of N x (K+1) rows reads the weights once, N=4, K=4."""
    if method == "ar":
        return 1, 1
    default_n, default_k = ((3, 2) if device.type == "cpu" else (4, 4)) if method == "smc" else (1, 4)  # sd, easd
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
    if not s.power > 0 or (s.power != 1 and s.method != "smc"):
        raise UsageError(f"power must be > 0 and is smc's (sd and ar sample the target itself), got {s.power}")
    if not 0 <= s.tree <= 64:
        raise UsageError(f"tree must lie in [0, 64] draft tokens, got {s.tree}")
    entropy, top, share = s.easd
    if not (entropy >= 0 and top >= 1 and 0 <= share <= 1):
        raise UsageError(f"easd takes ENTROPY >= 0, TOP >= 1 and SHARE in [0, 1], got {entropy},{top},{share}")


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


# ---------------------------------------------------------------- distributions (settings per request: [R])


def per_request(x, like):
    """x [R] viewed to broadcast against like [R, ..., V]."""
    return x.view(-1, *[1] * (like.dim() - 1))


def restrict(logits, temperature, top_k, top_p):
    """logits [R, ..., V] with the tokens outside request r's top-k (top_k [R], 0 = all) and outside its top-p
    nucleus of softmax(logits / T) (top_p [R]) set to -inf: the target distribution every method samples from."""
    ordered, order = logits.sort(-1, descending=True)
    k = per_request(torch.where(top_k > 0, top_k, logits.shape[-1]), logits) - 1
    ordered = ordered.masked_fill(ordered < ordered.gather(-1, k.expand(*logits.shape[:-1], 1)), float("-inf"))
    p = (ordered / per_request(torch.where(temperature > 0, temperature, 1.0), logits)).softmax(-1)
    top_p = per_request(top_p, logits)
    outside = ((top_p < 1) & (p.cumsum(-1) - p >= top_p)) | (ordered == float("-inf"))  # mass before reaches p
    return logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))


def probs(logits, temperature):
    """The distribution sampled at request r's temperature (temperature [R], logits [R, ..., V]):
    softmax(logits / T), one-hot on the argmax where T = 0."""
    t = per_request(temperature, logits)
    soft = (logits / torch.where(t > 0, t, 1.0)).softmax(-1)
    return torch.where(t > 0, soft, torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0))


def power_bonus(logits, temperature, power):
    """The bonus token's logits for the target p ** power (a sequence-level power of the tempered target: the
    SMC-SD paper's alpha) and its log weight [R, N]: b ~ p(b) ** alpha / Z, whose weight p ** alpha / proposal is
    Z, log Z = logsumexp(alpha l / T) - alpha logsumexp(l / T); logits [R, N, V], temperature [R]. At alpha = 1
    the target's own logits, weight 0."""
    if power == 1:
        return logits, logits.new_zeros(logits.shape[:-1])
    scaled = logits / per_request(temperature, logits)
    return logits * power, (power * scaled).logsumexp(-1) - power * scaled.logsumexp(-1)


def easd_trigger(p, q, t, rule):
    """EASD's rule (arXiv 2512.23765; its code was not available, so defined here): draft token t_k is rejected,
    and replaced by a draw from the target's p_k itself, where both models are uncertain (the entropies of p_k and
    q_k reach `entropy` nats) while their top-`top` tokens mostly agree (at least share x top in common) and t_k is
    one of those shared tokens: agreement in low confidence, which would otherwise pass through. p, q [R, K, V],
    t [R, K] -> bool [R, K]."""
    entropy, top, share = rule
    uncertain = lambda d: -(d * d.clamp(min=1e-30).log()).sum(-1) >= entropy  # noqa: E731
    top_p, top_q = p.topk(top, -1).indices, q.topk(top, -1).indices  # [R, K, top]
    shared = (top_p[..., :, None] == top_q[..., None, :]).any(-1)  # [R, K, top]: p's top tokens also q's
    aligned = (shared & (top_p == t[..., None])).any(-1)
    return uncertain(p) & uncertain(q) & (shared.sum(-1) >= share * top) & aligned


def bernoulli(p, rng):
    """True with probability p [R, M], drawn on the device from each request's rng: a two-way categorical."""
    logits = torch.stack([p.log(), (-p).log1p()], -1)  # [R, M, 2]
    return (kernels.sample(logits.flatten(0, 1), 1.0, rng)[0] == 0).view(p.shape)


# ---------------------------------------------------------------- requests


class Request:
    """A checked prompt (ids) with its settings on its way through a batch. Callbacks, all called on the
    thread that decodes: on_tokens(settled ids) whenever more have settled (returning True stops the request
    there), on_text(piece) with new settled text (whole UTF-8 characters; text that may begin a stop string is
    held back), on_done(Result) once at the end, on_cycle(batch, slot) after each cycle (traces). A stop string
    in the text ends the request; the text ends before it."""

    def __init__(self, ids, s, capacity, stop=(), on_tokens=None, on_text=None, on_done=None, on_cycle=None,
                 tokenizer=None):
        self.ids, self.s, self.capacity, self.stop, self.tokenizer = ids, s, capacity, list(stop), tokenizer
        self.on_tokens, self.on_text, self.on_done, self.on_cycle = on_tokens, on_text, on_done, on_cycle
        self.particle = 0
        self.restricts = bool(s.top_k or s.top_p < 1)
        self.settled, self.shown, self.streamed, self.cycles, self.prefill_seconds = [], 0, 0, 0, 0.0
        self.cancelled, self.result = False, None

    def cancel(self):
        """Thread-safe: the request ends at its batch's next cycle, with stats["stop"] = "cancelled"."""
        self.cancelled = True

    def stats(self, tokens, stop, eos_ids, seconds):
        """The statistics every request has (a method's own come from its batch)."""
        new = len(until_eos(tokens, eos_ids))
        return {"method": self.s.method, "prompt_tokens": len(self.ids), "new_tokens": new,
                "seconds": round(seconds, 4), "prefill_seconds": round(self.prefill_seconds, 4),
                "streamed": min(self.streamed, new), "tokens_per_s": round(new / seconds, 2) if seconds > 0 else 0.0,
                "cycles": self.cycles, "stop": stop or ("eos" if new < len(tokens) else "length")}

    def settle(self, tokens, eos_ids):
        """More settled tokens -> "stopped" or "stop" when on_tokens or a stop string ends the request."""
        self.settled += tokens
        tokens = until_eos(self.settled, eos_ids)
        if self.on_tokens and self.on_tokens(tokens):
            self.streamed = len(self.settled)
            return "stopped"
        if self.tokenizer and (self.on_text or self.stop):
            text, cut = self.cut(self.tokenizer.decode(tokens))
            self.show(text, final=cut)
            return "stop" if cut else None

    def cut(self, text):
        """-> (text before the first stop string, whether there was one)."""
        at = min((i for i in (text.find(s) for s in self.stop if s) if i >= 0), default=-1)
        return (text, False) if at < 0 else (text[:at], True)

    def show(self, text, final):
        """Pass on the text not shown yet, holding back (until final) a half-decoded character and a tail that
        may be the start of a stop string."""
        end = len(text)
        if not final:
            end = len(text.rstrip("\ufffd"))
            end -= max((k for s in self.stop for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
        if self.on_text and end > self.shown:
            self.on_text(text[self.shown:end])
        self.shown = max(self.shown, end)

    def finish(self, tokens, stats, eos_ids):
        """The result from the returned particle's tokens; on_done."""
        tokens = until_eos(tokens, eos_ids)
        text = self.tokenizer.decode(tokens) if self.tokenizer else None
        if text is not None:
            text, cut = self.cut(text)
            stats["stop"] = "stop" if cut else stats["stop"]
            self.show(text, final=True)
        self.result = Result(text, tokens, stats)
        if self.on_done:
            self.on_done(self.result)


def until_eos(tokens, eos_ids):
    """tokens up to, without, the first EOS."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos_ids), tokens)


def sizes(requests):
    """The (prompt, suffix) tokens a slot needs to hold any of requests."""
    return max(len(req.ids) for req in requests), max(req.capacity for req in requests)


# ---------------------------------------------------------------- decoding state


class State:
    """Everything a cycle reads and writes, as device tensors updated in place: the static buffers a CUDA
    graph replays on. R slots of N particles; hist [R, N, H] holds each particle's generated tokens, the last
    of which, x0, is pending (not in any cache yet); prev is the one before it. Each slot has its own settings
    (temperatures, top-k, top-p, budget) and rng row, so a request's draws do not depend on its neighbours."""

    def small_tensors(self):
        """All state except the K/V, which a warm-up only writes beyond the lengths it restores."""
        lengths = [c.suffix_len for c in (self.tcache, self.dcache) if c is not None]
        return [v for v in vars(self).values() if torch.is_tensor(v)] + lengths


def first_slots(x, n):
    """A State or KVCache narrowed to its first n slots, as views, so a cycle over them updates x in place.
    The K/V tensors [L, R, ...] (5 or 6 dimensions) have the slot second, every other tensor first."""
    part = copy.copy(x)
    for name, v in vars(x).items():
        if isinstance(v, model.KVCache):
            setattr(part, name, first_slots(v, n))
        elif torch.is_tensor(v):
            setattr(part, name, v.narrow(int(v.dim() >= 5), 0, n))
    return part


def publish(st):
    """flags [R, 4] = [done, settled, degenerate, length] per slot: done when every particle has ended or the
    budget is spent; settled = how many leading tokens all particles share (they can never change again, so they
    may be shown); degenerate (smc) when no particle has a positive weight left or a weight is NaN."""
    H = st.hist.shape[-1]
    done = st.finished.all(-1) | (st.gen_len >= st.max_new) | st.degenerate  # [R]
    shared = (st.hist == st.hist[:, :1]).all(1) & (torch.arange(H, device=st.hist.device) < st.gen_len[:, None])
    st.flags.copy_(torch.stack([done.int(), shared.int().cumprod(-1).sum(-1).int(), st.degenerate.int(),
                                st.gen_len], -1))


def append(st, tokens, kept, is_eos):
    """Commit the first `kept` (int32 [R]; none in an empty slot) of tokens [R, N, T]: history, lengths,
    pending token, finished. The target already holds K/V for the pending token and the kept tokens but the
    last, the new pending one."""
    R, N, T = tokens.shape
    kept = kept * st.live
    st.block[..., :T].copy_(tokens)
    st.kept.copy_(kept)
    at = st.gen_len.long()[:, None, None] + torch.arange(T, device=tokens.device)  # [R, 1, T]
    st.hist.scatter_(2, at.expand(R, N, T), tokens)
    real = torch.arange(T, device=tokens.device) < kept[:, None, None]  # [R, 1, T]
    st.finished |= (is_eos[tokens] & real).any(-1)
    st.x0.copy_(torch.where(st.live[:, None], tokens.gather(2, (kept.long() - 1).clamp(min=0)[:, None, None]
                                                            .expand(R, N, 1))[..., 0], st.x0))
    st.gen_len += kept
    st.tcache.suffix_len += kept


def compact(cache, base, path):
    """Move the suffix K/V of an accepted tree path down to consecutive positions: node path[r, d] of the tree
    written from base[r] (int [R]) to base[r] + d; path [R, D]. Parents come before children, so path[r, d] >= d
    and one gather then one scatter do it."""
    for kv in (cache.suffix_k, cache.suffix_v):  # [L, R, N, H, S, D]
        L, R, N, H, S, D = kv.shape
        at = lambda i: (base.long()[:, None] + i)[None, :, None, None, :, None].expand(L, R, N, H, i.shape[-1], D)
        kv.scatter_(4, at(torch.arange(path.shape[1], device=kv.device)[None]), kv.gather(4, at(path)))


def settle(x0, t, b, logp, logq, finished, is_eos, pad, log_bonus=0.0):
    """EOS is absorbing. The draft token t_k [R, N, K] weighs log p(t_k) - log q(t_k) unless an EOS came before
    it (in x0 [R, N] or t_<k, or the particle had already finished), the bonus token b log_bonus [R, N]
    likewise; after a particle's first EOS its new tokens become `pad` (an EOS). -> weight increments [R, N],
    the K + 1 new tokens [R, N, K+1] (t, then b).
    is_eos [V] bool: a table lookup costs the same for any number of EOS ids (torch.isin sorts, and syncs with
    the host, once there are about ten)."""
    K = t.shape[-1]
    block = torch.cat([x0[..., None], t, b[..., None]], -1)  # [R, N, K+2]
    ended = (is_eos[block].cumsum(-1) > 0) | finished[..., None]  # an EOS at or before each position
    increments = torch.where(ended[..., :K], 0.0, logp - logq).sum(-1) + torch.where(ended[..., K], 0.0, log_bonus)
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


# ---------------------------------------------------------------- batches


class Batch:
    """`slots` requests of one shape decoded together (continuous batching): a request is prefilled into a free
    slot between cycles and leaves its slot when it ends. An empty slot has lengths 0 and appends nothing, so
    it costs no attention work; on a CUDA graph (captured once for all slots) it still costs its rows of the
    matmuls, which memory-bound decoding does not notice, while an eager cycle (the CPU) runs only the slots up
    to the last busy one, since there every row costs compute."""

    def __init__(self, engine, shape, slots, prefix_cap, suffix_cap):
        e, N, R = engine, shape.particles, slots
        self.engine, self.shape, self.requests, self.graphs = e, shape, [None] * R, {}
        configs = [e.config] + ([e.draft_config] if shape.method != "ar" and e.draft_config else [])
        need = sum(model.KVCache.nbytes(c, N, prefix_cap, suffix_cap, e.dtype, R) for c in configs)
        need += 4 * R * N * (max(shape.draft_len, shape.tree) + 1) * e.config.vocab_size * 4  # logits, copies
        check_fits(need, e.device, f"{R} slots' KV caches and logits", "lower --slots, --particles or the budget")
        new = lambda *size, dtype=torch.float32, value=0: torch.full(size, value, dtype=dtype, device=e.device)
        st = self.st = State()
        st.tcache, st.dcache = [model.KVCache(c, N, prefix_cap, suffix_cap, e.device, e.dtype, R) for c in configs] \
            + [None] * (2 - len(configs))
        st.rng = new(R, 2, dtype=torch.int64)
        st.temp_d, st.temp_t, st.top_p = new(R), new(R), new(R, value=1.0)
        st.top_k, st.max_new = new(R, dtype=torch.int64), new(R, dtype=torch.int32)
        st.live, st.degenerate = new(R, dtype=torch.bool), new(R, dtype=torch.bool)
        st.finished = new(R, N, dtype=torch.bool, value=True)
        st.x0, st.prev = new(R, N, dtype=torch.int64, value=e.pad), new(R, N, dtype=torch.int64, value=e.pad)
        st.hist = new(R, N, suffix_cap, dtype=torch.int64)
        st.gen_len = new(R, dtype=torch.int32)
        st.logw, st.log_z, st.ess_sum = new(R, N), new(R), new(R)
        st.accepted, st.resamples, st.triggers = (new(R, dtype=torch.int64) for _ in range(3))
        st.flags = new(R, 4, dtype=torch.int32)
        # the last cycle, for traces: appended tokens and how many were kept, draft tokens, weights before
        # resampling, ESS, whether it resampled and the ancestors (device copies: no host sync)
        st.block, st.kept = new(R, N, shape.draft_len + 1, dtype=torch.int64), new(R, dtype=torch.int32)
        st.logw_before, st.ess, st.resampled = new(R, N), new(R), new(R, dtype=torch.bool)
        st.ancestors = new(R, N, dtype=torch.int64)
        # the draft phase's output, which the verify phase reads (MineDraft runs them apart): tokens, log q, and
        # for sd the draft's logits
        st.drafted, st.logq = new(R, N, shape.draft_len, dtype=torch.int64), new(R, N, shape.draft_len)
        st.q_logits = new(R, shape.draft_len, e.config.vocab_size) if shape.method != "smc" else None
        if shape.tree:  # racer: the host's draft tree ([R, T]: node 0 the pending token) and the target's cues
            T = shape.tree + 1
            st.nodes, st.parent, st.depth = (new(R, T, dtype=torch.int64) for _ in range(3))
            st.mask = new(R, T, T, dtype=torch.bool)  # [r, i, j]: node j is node i or one of its ancestors
            st.cues, st.cue_p = new(R, T, racer.CUES, dtype=torch.int64), new(R, T, racer.CUES)

    def busy(self):
        return any(self.requests)

    def admit(self, req):
        """Prefill the prompt into a free slot (False if none), sample every particle's first token x0 from the
        target, and reset the slot's state."""
        if None not in self.requests:
            return False
        e, st, s, r, N = self.engine, self.st, req.s, self.requests.index(None), self.shape.particles
        req.start, req.capture_start = time.perf_counter(), self.capture_seconds()
        prompt = torch.tensor(req.ids, device=e.device)
        logits = e.target.prefill(prompt, st.tcache, r)  # [V]
        st.rng[r] = torch.tensor([s.seed, 0])
        st.temp_d[r], st.temp_t[r], st.top_k[r], st.top_p[r] = (s.draft_temperature, s.target_temperature,
                                                                s.top_k, s.top_p)
        settings = [x[r:r + 1] for x in (st.temp_t, st.top_k, st.top_p)]
        logits, log_first = power_bonus(logits.expand(1, N, -1), st.temp_t[r:r + 1], s.power)
        st.log_z[r] = log_first[0, 0]  # the first token's normaliser, the same for every particle
        logits = restrict(logits, *settings) if req.restricts else logits
        x0 = kernels.sample(logits[0], st.temp_t[r:r + 1], st.rng[r:r + 1])[0]  # [N]
        if st.dcache:  # the draft leaves the last prompt token to the first draft step, beside x0
            st.dcache.prefix_len[r], st.dcache.suffix_len[r] = 0, 0  # a one-token prompt leaves it empty
            if len(req.ids) > 1:
                e.draft.prefill(prompt[:-1], st.dcache, r, logits=None)
        st.x0[r], st.prev[r], st.hist[r], st.hist[r, :, 0] = x0, prompt[-1], 0, x0
        st.gen_len[r], st.max_new[r], st.finished[r] = 1, s.max_new_tokens, e.is_eos[x0]
        for x in (st.degenerate, st.logw, st.ess_sum, st.accepted, st.resamples, st.triggers):
            x[r] = 0
        st.live[r] = True
        self.requests[r] = req
        publish(st)
        req.prefill_seconds = time.perf_counter() - req.start
        return True

    def leave(self, r):
        """Empty slot r: lengths 0, every particle finished, nothing pending."""
        st = self.st
        self.requests[r] = None
        for c in (st.tcache, st.dcache):
            if c:
                c.prefix_len[r], c.suffix_len[r] = 0, 0
        st.live[r], st.gen_len[r], st.finished[r], st.degenerate[r], st.logw[r] = False, 0, True, False, 0
        st.x0[r], st.prev[r] = self.engine.pad, self.engine.pad

    def capture_seconds(self):
        return sum(g.seconds for g in self.graphs.values())

    def cycle(self, phase=None):
        """One cycle of every busy slot (phase "draft" or "verify": that half of it alone)."""
        s = replace(self.shape, restrict=any(r and r.restricts for r in self.requests))
        if s.tree:
            self.plant(s)
        if graphs_apply(s, self.st) and phase is None:
            if s not in self.graphs:
                self.graphs[s] = Captured(lambda: self.engine.cycle(self.st, s), self.st)
            self.graphs[s]()
        else:
            self.engine.cycle(first_slots(self.st, 1 + max(i for i, r in enumerate(self.requests) if r)), s, phase)
        if phase == "draft":
            return
        for r, req in enumerate(self.requests):
            if req:
                req.cycles += 1
                if req.on_cycle:
                    req.on_cycle(self, r)

    def plant(self, s):
        """Racer: every busy slot's draft tree from its request's Retrieval into the cycle's tensors: node tokens
        (-1: no node), parents (node 0, the pending token, is its own), depths, ancestor-or-self masks."""
        R, T = self.st.nodes.shape
        nodes, parent = [[-1] * T for _ in range(R)], [[0] * T for _ in range(R)]
        for r, req in enumerate(self.requests):
            if req:
                tokens, parents = req.drafter.draft(s.draft_len, s.tree)
                nodes[r][1:len(tokens) + 1], parent[r][1:len(tokens) + 1] = tokens, parents
        parent, rows = torch.tensor(parent), torch.arange(R)
        mask, depth = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1), torch.zeros(R, T, dtype=torch.int64)
        for j in range(1, T):  # parents come before children
            mask[:, j] |= mask[rows, parent[:, j]]
            depth[:, j] = depth[rows, parent[:, j]] + 1
        for x, value in ((self.st.nodes, torch.tensor(nodes)), (self.st.parent, parent), (self.st.depth, depth),
                         (self.st.mask, mask)):
            x.copy_(value)

    def collect(self, stop=None):
        """Read every slot's flags (the host's one read of a cycle), pass settled tokens on, end the requests
        that are done, cancelled, or (stop given, e.g. "interrupted") all of them."""
        flags = self.st.flags.tolist()
        busy = [(r, req) for r, req in enumerate(self.requests) if req]
        rows = self.st.hist[:, 0, :max((flags[r][3] for r, _ in busy), default=0)].tolist() if busy else []
        cues = [x.tolist() for x in (self.st.cues, self.st.cue_p)] if self.shape.tree and busy else None
        for r, req in busy:
            done, count, degenerate, length = flags[r]
            if req.drafter:
                fresh = req.cycles > req.drafter.cycles
                req.drafter.observe(rows[r][req.drafter.seen:length], zip(cues[0][r], cues[1][r]) if fresh else None)
                req.drafter.cycles = req.cycles
            why = stop or ("degenerate" if degenerate else "cancelled" if req.cancelled else None)
            count = min(count, req.s.max_new_tokens)
            if why is None and count > len(req.settled):
                why = req.settle(rows[r][len(req.settled):count], self.engine.config.eos_ids)
            if why is None and not done and req.stop and self.shape.particles > 1:
                done = self.stop_particles(r, req, length)
            if why or done:
                tokens = req.settled if why else self.pick(r, req.s)
                req.finish(tokens, self.statistics(r, req, tokens, why), self.engine.config.eos_ids)
                self.leave(r)
            else:
                req.streamed = len(req.settled)

    def stop_particles(self, r, req, length):
        """A particle whose text holds a stop string ends there as at an EOS: it stops drafting and its later
        tokens carry no weight (those it drafted past the string in that cycle weigh p/q, which is 1 in
        expectation, so the prefix keeps its distribution). -> whether every particle has ended. Without this
        a request would end only once its particles agree on the text up to the string."""
        texts = [self.engine.tokenizer.decode(until_eos(tokens, self.engine.config.eos_ids))
                 for tokens in self.st.hist[r, :, :length].tolist()]
        ended = [i for i, text in enumerate(texts) if req.cut(text)[1]]
        if ended:
            self.st.finished[r, ended] = True
        return bool(self.st.finished[r].all())

    def pick(self, r, s):
        """Slot r's returned particle: drawn in proportion to its weight, or the heaviest."""
        st = self.st
        if s.select == "argmax":
            i = int(st.logw[r].argmax())
        else:
            i = int(kernels.sample(st.logw[r:r + 1], 1.0, st.rng[r:r + 1])[0][0])
        self.requests[r].particle = i
        return st.hist[r, i, :min(int(st.gen_len[r]), s.max_new_tokens)].tolist()

    def statistics(self, r, req, tokens, stop):
        """seconds: from the start of the prefill to the last token; prefill: until the first token was drawn."""
        st, s = self.st, req.s
        seconds = time.perf_counter() - req.start - (self.capture_seconds() - req.capture_start)
        stats = req.stats(tokens, stop, self.engine.config.eos_ids, seconds)
        if s.method in ("sd", "easd"):
            accepted = int(st.accepted[r])
            stats |= {"draft_len": s.draft_len, "accepted": accepted,
                      "acceptance": round(accepted / max(req.cycles * s.draft_len, 1), 4)}
        if s.method == "easd":
            triggers = int(st.triggers[r])
            stats |= {"triggers": triggers, "trigger_rate": round(triggers / max(req.cycles, 1), 4)}
        if s.method == "smc":
            final = st.logw[r].logsumexp(-1) - math.log(s.particles)  # the weights since the last resampling
            stats |= {"particles": s.particles, "particle": req.particle, "draft_len": s.draft_len,
                      "resamples": int(st.resamples[r]),
                      "mean_ess": round(float(st.ess_sum[r]) / max(req.cycles, 1), 3),
                      "log_z": round(float(st.log_z[r] + final), 4)}
        return stats


class Pair:
    """MineDraft (arXiv 2603.18016): a batch's slots as two halves that take turns, drafting one while the
    target verifies the other, on two threads: on a CPU each with half of the cores, on CUDA each on a stream of
    its own (eager cycles: the phases are not graph-captured). A request's tokens are those it gets without the
    overlap (its randomness is its own). A half is read, ended and refilled only between its verify and its next
    draft; it drafts alone when neither half holds drafts (the start), after which the halves alternate."""

    def __init__(self, engine, shape, slots, prefix_cap, suffix_cap):
        if slots < 2:
            raise UsageError("overlap needs at least 2 slots, one for each half")
        self.halves = [Batch(engine, shape, (slots + i) // 2, prefix_cap, suffix_cap) for i in (1, 0)]
        self.drafted, self.cuda = [False, False], engine.device.type == "cuda"
        where = torch.cuda.current_device() if self.cuda else max(1, torch.get_num_threads() // 2)
        self.pool = ThreadPoolExecutor(2, initializer=self.start_thread, initargs=(where,))

    def start_thread(self, where):
        """A worker's own CUDA stream on the engine's device, or on a CPU its share of the cores."""
        if self.cuda:
            torch.cuda.set_device(where)
            torch.cuda.set_stream(torch.cuda.Stream())
        else:
            torch.set_num_threads(where)

    @property
    def requests(self):
        return self.halves[0].requests + self.halves[1].requests

    def busy(self):
        return any(h.busy() for h in self.halves)

    def admit(self, req):
        return any(not d and h.admit(req) for h, d in zip(self.halves, self.drafted))

    def collect(self, stop=None):
        for h, d in zip(self.halves, self.drafted):
            if stop or not d:
                h.collect(stop)

    def run(self, half, phase):
        with torch.inference_mode():
            half.cycle(phase)
            if self.cuda:
                torch.cuda.current_stream().synchronize()

    def cycle(self):
        """The drafted half verifies while the other drafts, or (none drafted) the first busy half drafts."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # prefills on this thread's stream come first
        phases = ["verify" if d else "draft" if h.busy() else None for h, d in zip(self.halves, self.drafted)]
        if "verify" not in phases and phases[0] == "draft":
            phases[1] = None  # the halves start apart
        jobs = [self.pool.submit(self.run, h, p) for h, p in zip(self.halves, phases) if p]
        for job in jobs:
            job.result()
        self.drafted = [p == "draft" for p in phases]


# ---------------------------------------------------------------- engine


class Engine:
    """A target model and an optional draft, each a path (Hugging Face directory or .gguf file) or a loaded
    model.Transformer (then prompts are token ids and results carry no text). Paths are opened at once (config,
    tokenizer, the weight files' headers), so that a bad request is refused before any weight is read; the
    weights are read by `load()`, which the first `generate` calls. Under torchrun every rank builds this engine
    with its shard of the target (tensor parallel, `model.shard_config`) and a whole draft, and decodes the same
    requests: identical logits and rng on every rank give every rank the same decisions."""

    def __init__(self, target, draft=None, device=None, dtype=None):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError("CUDA is not available here; use --device cpu")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.bfloat16
        self.racer, draft = (True, None) if draft == "racer" else (False, draft)  # drafts without a draft model
        self.target, self.draft = (m if isinstance(m, model.Transformer) else None for m in (target, draft))
        self.opened = [None if m is None or isinstance(m, model.Transformer) else model.open_weights(m)
                       for m in (target, draft)]
        self.rank, self.world = model.init_distributed(device) if self.opened[0] else (0, 1)
        self.config, self.draft_config = (o[0] if o else m and m.config for m, o in zip((target, draft), self.opened))
        self.config = model.shard_config(self.config, self.world) if self.opened[0] else self.config  # this rank's
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
        configs = [c for c, o in zip((self.config, self.draft_config), self.opened) if o]
        n = sum(math.prod(s) for c in configs for s in model.expected_shapes(c).values())
        if self.device.type == "cpu":
            n += sum(c.vocab_size * c.dim for c in configs if c.tie_embeddings)
        return n * self.dtype.itemsize

    def load(self):
        """Read the weights (once) -> self."""
        if self.target is None:
            self.target = model.build(*self.opened[0][:2], self.device, self.dtype, (self.rank, self.world))
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
                seed=0, select="sample", cuda_graphs=True, power=1.0, easd=EASD, tree=0, overlap=False, stop=(),
                on_tokens=None, on_text=None, on_done=None, on_cycle=None, context=None):
        """Check a request against the models' configs and the free memory, before any weight is read ->
        Request. Raises UsageError. context: the most tokens (prompt, new ones and a draft block) a slot of the
        serving batch holds, when that is below the models' context."""
        s = Settings(method, max_new_tokens, temperature if draft_temperature is None else draft_temperature,
                     temperature if target_temperature is None else target_temperature,
                     *shape(method, particles, draft_len, self.device), ess_threshold, top_k, top_p, seed, select,
                     cuda_graphs, power, easd, tree, overlap)
        check_settings(s, self.draft_config is not None or self.racer)
        if self.racer and s.method in ("smc", "easd"):
            raise UsageError(f"{s.method} needs a draft model's distribution, and racer drafts are deterministic "
                             "tokens; use --method sd with --draft racer")
        if s.tree and not self.racer:
            raise UsageError("tree drafts come from racer: use --tree with --draft racer --method sd")
        if s.overlap and (self.racer or s.method == "ar"):
            raise UsageError("overlap runs a draft model's drafting beside the target's verifying: use it with "
                             "--method sd, easd or smc and a draft model")
        if stop and self.tokenizer is None:
            raise UsageError("stop strings need a tokenizer: this engine's models have none")
        ids, key = self.encode(prompt), s.shape(self.racer)
        req = Request(ids, s, self.check_request(len(ids), s, key, context), [stop] if isinstance(stop, str) else
                      stop, on_tokens, on_text, on_done, on_cycle, self.tokenizer)
        req.key, req.drafter = key, racer.Retrieval(ids, chain=not s.tree) if key.tree else None
        return req

    def check_request(self, prompt_len, s, key, context=None):
        """Context and memory checks -> the suffix capacity: the budget plus a draft block of lookahead."""
        extra = 0 if s.method == "ar" else max(key.tree, s.draft_len)  # what a cycle writes ahead
        capacity = s.max_new_tokens + extra
        configs = [c for c in (self.config, self.draft_config if s.method != "ar" else None) if c is not None]
        context = min([c.max_seq_len for c in configs] + [context or math.inf])
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

    def requests(self, prompts, **options):
        """Checked Requests for a list of prompts, each text, ids, or {"prompt": ..., **options of its own}."""
        out = []
        for i, p in enumerate(prompts):
            try:
                out.append(self.request(**{**options, **p}) if isinstance(p, dict) else self.request(p, **options))
            except TypeError as e:  # an option that does not exist
                raise UsageError(f"prompt {i + 1}: {str(e).replace('Engine.request() ', '')}") from None
        return out

    def generate(self, prompt, on_tokens=None, slots=None, **options):
        """prompt: text or token ids -> Result(text, tokens, stats); or a list of prompts (each text, ids, or a
        dict {"prompt": ..., **options of its own}) -> [Result], decoded together, `slots` at a time (default: up
        to 8), each request with its own randomness: its output does not depend on its neighbours.
        Options (see `request`): method, max_new_tokens, temperature (the draft's and the target's) or
        draft_temperature / target_temperature, particles (smc's N) and draft_len (K; None for either: `shape`'s
        defaults), ess_threshold, top_k, top_p (ar and sd), seed, select (the final particle by "sample", in
        proportion to its weight, or "argmax"), cuda_graphs, power (smc's target p ** power), easd (easd's rule),
        tree (racer's draft tokens per cycle as a tree), overlap (MineDraft's halves), stop (strings that end the
        text).
        on_tokens, if given, is called with the settled tokens (up to the first EOS) whenever more have settled;
        returning True stops generation there (the settled tokens are the result). stats["stop"] says why it
        ended: "eos", "length", "stop" (a stop string), "stopped", "interrupted", or "degenerate" (smc: no
        particle kept a positive weight, or one is NaN; the result is what had settled before)."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, dict, list, tuple)):
            return self.run(self.requests(prompt, **options), slots)
        return self.run([self.request(prompt, on_tokens=on_tokens, **options)], 1)[0]

    def run(self, requests, slots=None):
        """Decode checked Requests to the end -> their Results."""
        inbox = queue.Queue()
        for req in requests:
            inbox.put(req)
        self.serve(inbox, slots or min(len(requests), 8), sizes(requests), until_idle=True)
        return [req.result for req in requests]

    def stream(self, prompts, slots=None, **options):
        """generate's list form as it goes: yields (i, text, None) as the i-th prompt's text settles, then
        (i, "", Result) when it ends (models without a tokenizer: the Results only)."""
        events, requests = [], self.requests(prompts, **options)
        inbox = queue.Queue()
        for i, req in enumerate(requests):
            req.on_text = lambda piece, i=i: events.append((i, piece, None))
            req.on_done = lambda result, i=i: events.append((i, "", result))
            inbox.put(req)
        for _ in self.serving(inbox, slots or min(len(requests), 8), sizes(requests), True):
            yield from events
            events.clear()
        yield from events

    def serve(self, inbox, slots=4, context=2048, until_idle=False):
        """Decode the Requests put in inbox (a queue.Queue) until None arrives (requests still running end
        "cancelled") or, with until_idle, until none is left. Requests of one shape (method, particles,
        draft_len, ess_threshold) share a batch of `slots` slots and join it as slots free up; batches of
        different shapes take turns cycle by cycle. context: the tokens a slot holds (prompt, new tokens and a
        draft block; a pair (prompt, the rest) for each apart); check requests against it (`request(context=)`).
        A failure in one batch ends its requests "error" (until_idle: raises) and serving goes on."""
        for _ in self.serving(inbox, slots, context if isinstance(context, tuple) else (context,) * 2, until_idle):
            pass

    def serving(self, inbox, slots, caps, until_idle):
        """serve, as a generator that yields after every round of cycles."""
        self.load()
        batches, waiting = {}, []
        with torch.inference_mode():
            try:
                while True:
                    busy = bool(waiting) or any(b.busy() for b in batches.values())
                    if until_idle and not busy and inbox.empty():
                        return
                    items = [] if busy else [inbox.get()]  # idle: wait for work
                    while not inbox.empty():  # this loop is the queue's one reader
                        items.append(inbox.get())
                    waiting += [item for item in items if item is not None]
                    if None in items:
                        return self.end(batches, waiting, "cancelled")
                    for b in batches.values():
                        b.collect()  # frees the slots of requests the last cycle ended
                    self.admit(waiting, batches, slots, caps, until_idle)
                    for key, b in list(batches.items()):
                        try:
                            b.collect()  # a request can be done as it is admitted (max_new_tokens=1)
                            if b.busy():
                                b.cycle()
                        except Exception as e:
                            if until_idle:
                                raise
                            self.end({key: batches.pop(key)}, [], "error", e)
                    yield
            except KeyboardInterrupt:
                self.end(batches, waiting, "interrupted")

    def admit(self, waiting, batches, slots, caps, until_idle):
        """Move waiting requests into free slots of their shape's batch, made at its shape's first request."""
        for req in list(waiting):
            key = req.key
            try:
                if not req.cancelled and key not in batches:
                    batches[key] = (Pair if key.overlap else Batch)(self, key, slots, *caps)
                if not req.cancelled and (len(req.ids) > caps[0] or req.capacity > caps[1]):
                    raise UsageError(f"the request needs {len(req.ids)} + {req.capacity} tokens; a slot holds "
                                     f"{caps[0]} + {caps[1]}: check requests with request(context=...)")
                admitted = req.cancelled or batches[key].admit(req)  # a failed prefill leaves the slot free
            except Exception as e:
                if until_idle:
                    raise
                waiting.remove(req)
                self.end({}, [req], "error", e)
                continue
            if admitted:
                waiting.remove(req)
                if req.cancelled:
                    self.end({}, [req], "cancelled")

    def end(self, batches, waiting, why, error=None):
        """End every request in batches and in waiting with what it made so far and stats["stop"] = why; after
        an error (its message in stats["error"]) the batches' device state is not read again."""
        for b in batches.values():
            if error is None:
                b.collect(stop=why)
            waiting = waiting + ([req for req in b.requests if req] if error is not None else [])
        for req in waiting:
            stats = req.stats(req.settled, why, self.config.eos_ids, 0.0)
            req.finish(req.settled, stats | ({"error": " ".join(str(error).split())} if error else {}),
                       self.config.eos_ids)

    # ------------------------------------------------------------ cycles: fixed shapes, no host sync

    def cycle(self, st, s, phase=None):
        """One cycle of s.method for the slots of st, then their flags for the host; phase "draft" or "verify":
        that half of it alone (MineDraft's overlap)."""
        if phase != "verify" and s.method != "ar" and not s.tree:
            self.draft_block(st, s)
        if phase != "draft":
            methods = {"ar": self.ar_cycle, "sd": self.sd_cycle, "easd": self.sd_cycle, "smc": self.smc_cycle}
            (self.racer_cycle if s.tree else methods[s.method])(st, s)
            if st.dcache:
                st.dcache.suffix_len.mul_(st.live)  # an empty slot drafted into nothing
            publish(st)

    def restricted(self, logits, st, s):
        return restrict(logits, st.temp_t, st.top_k, st.top_p) if s.restrict else logits

    def ar_cycle(self, st, s):
        """One target step on the pending token."""
        logits = self.restricted(self.target.step(st.x0[..., None], st.tcache)[:, 0, 0], st, s)  # [R, V]
        x = kernels.sample(logits, st.temp_t, st.rng)[0]  # [R]
        append(st, x.view(-1, 1, 1), torch.ones_like(st.gen_len), self.is_eos)

    def draft_block(self, st, s):
        """K draft steps for every particle, the first on [prev, x0], whose draft K/V the last cycle left
        unwritten -> st.drafted [R, N, K], their log q under the draft temperature st.logq [R, N, K], and for sd
        the draft's logits st.q_logits [R, K, V]. Advances the draft's suffix_len by K + 1."""
        R, N = st.x0.shape
        x = torch.stack([st.prev, st.x0], -1)  # [R, N, 2]
        for k in range(s.draft_len):
            out = self.draft.step(x, st.dcache, last_only=True)  # [R, N, V]
            st.dcache.suffix_len += x.shape[-1]
            t, lq = kernels.sample(out.flatten(0, 1), st.temp_d, st.rng)
            x = t.view(R, N, 1)
            st.drafted[..., k], st.logq[..., k] = t.view(R, N), lq.view(R, N)
            if st.q_logits is not None:
                st.q_logits[:, k] = out[:, 0]

    def verify(self, st, t, s):
        """One target forward over [x0, t_1..t_K] -> restricted logits [R, N, K+1, V]: row k - 1 scores t_k,
        row K is the bonus token's distribution."""
        return self.restricted(self.target.step(torch.cat([st.x0[..., None], t], -1), st.tcache), st, s)

    def sd_cycle(self, st, s):
        """Speculative sampling, each request accepting its own number of tokens: accept t_k with probability
        min(1, p/q); the first rejection is replaced by a draw from normalise(max(p - q, 0)); if all K pass, a
        bonus token from p. Exact at any temperature. easd: also rejects where `easd_trigger` fires, replacing
        the token by a draw from p (not exact: it trades the draft's low-confidence agreement for the target)."""
        K, R, device = s.draft_len, st.x0.shape[0], st.x0.device
        p = probs(self.verify(st, st.drafted, s)[:, 0], st.temp_t)  # [R, K+1, V]
        q = probs(st.q_logits, st.temp_d)  # [R, K, V]
        t = st.drafted[:, 0]  # [R, K]
        pt, qt = p[:, :K].gather(2, t[..., None])[..., 0], q.gather(2, t[..., None])[..., 0]
        accept = bernoulli(torch.where(pt >= qt, 1.0, pt / qt), st.rng)  # [R, K]
        residual = (p[:, :K] - q).clamp(min=0)
        if s.easd:
            triggered = easd_trigger(p[:, :K], q, t, s.easd)
            accept &= ~triggered
            residual = torch.where(triggered[..., None], p[:, :K], residual)
        n = accept.int().cumprod(-1).sum(-1)  # [R] draft tokens accepted
        if s.easd:
            st.triggers += triggered.gather(1, n.long().clamp(max=K - 1)[:, None])[:, 0] & (n < K)
        at = n.long()[:, None, None].expand(R, 1, p.shape[-1])
        fix = torch.cat([residual, p[:, K:]], 1).gather(1, at)[:, 0]  # [R, V]
        fix = torch.where(fix.sum(-1, keepdim=True) > 0, fix, p.gather(1, at)[:, 0])  # p == q: nothing to fix
        c = kernels.sample(fix.log(), 1.0, st.rng)[0]  # [R]
        st.prev.copy_(torch.cat([st.x0, t], 1).gather(1, n.long()[:, None]))
        tokens = torch.where(torch.arange(K + 1, device=device) < n[:, None], torch.cat([t, c[:, None]], 1),
                             c[:, None])  # t_1..t_n, c, filler
        st.dcache.suffix_len -= K - n  # the draft keeps K/V up to t_{n-1}
        st.accepted += n
        append(st, tokens[:, None], n + 1, self.is_eos)

    def racer_cycle(self, st, s):
        """sd on racer's draft tree (racer.py), verified exactly in one target forward: a node sees the prefix,
        its ancestors and itself (st.mask), at position length + depth. Walking down from the root, y ~ p is drawn
        at each node; the child whose token is y is followed, else y is emitted: the text follows p exactly
        (greedy: y is the argmax, ar's token), a chain being the tree of one child per node. The path's K/V then
        moves down to consecutive positions. Each node's top tokens become the host's cues."""
        (R, T), K, device = st.nodes.shape, s.draft_len, st.x0.device
        nodes = torch.cat([st.x0, st.nodes[:, 1:]], 1)  # [R, T]: -1 marks no node
        base = st.tcache.suffix_len.clone()
        logits = self.target.step(nodes.clamp(min=0)[:, None], st.tcache, depth=st.depth, tree=st.mask)[:, 0]
        logits = self.restricted(logits, st, s)  # [R, T, V]
        y = kernels.sample(logits.flatten(0, 1), st.temp_t, st.rng)[0].view(R, T)  # a draw from p at every node
        follows = (nodes == y.gather(1, st.parent)) | (torch.arange(T, device=device) == 0)  # [R, T]
        on_path = ~(st.mask & ~follows[:, None]).any(-1)  # [R, T]: the node and all its ancestors followed
        d = torch.arange(K + 1, device=device)
        path = (on_path[:, None] & (st.depth[:, None] == d[:, None])).int().argmax(-1)  # [R, K+1]: 0 past the end
        n = (st.depth * on_path).amax(-1)  # [R] draft tokens accepted
        c = y.gather(1, path.gather(1, n[:, None]))[:, 0]  # the last node's draw
        tokens = torch.where(d < n[:, None], torch.cat([nodes.gather(1, path[:, 1:]), c[:, None]], 1), c[:, None])
        compact(st.tcache, base, path)
        top = logits.topk(racer.CUES)  # their probabilities without a softmax over the vocabulary
        st.cues.copy_(top.indices)
        st.cue_p.copy_((top.values - logits.logsumexp(-1, keepdim=True)).exp())
        st.accepted += n
        append(st, tokens[:, None], n.int() + 1, self.is_eos)

    def smc_cycle(self, st, s):
        """Draft K tokens per particle, score them with the target in one forward, weight, append K + 1
        tokens (the last a bonus token from the target), resample where the ESS falls below the threshold.
        A power target p ** alpha (s.power) weighs a draft token alpha log p - log q (`power_bonus`)."""
        K, (R, N), t = s.draft_len, st.x0.shape, st.drafted
        logits = self.verify(st, t, s)  # [R, N, K+1, V]
        logp = kernels.token_logprobs(logits[:, :, :K].flatten(0, 2), t.flatten(), st.temp_t).view(R, N, K)
        bonus, log_bonus = power_bonus(logits[:, :, K], st.temp_t, s.power)
        b = kernels.sample(bonus.flatten(0, 1), st.temp_t, st.rng)[0].view(R, N)
        increments, tokens = settle(st.x0, t, b, s.power * logp, st.logq, st.finished, self.is_eos, self.pad,
                                    log_bonus)
        st.logw += increments
        st.prev.copy_(tokens[..., K - 1])
        append(st, tokens, torch.full_like(st.gen_len, K + 1), self.is_eos)
        self.resample(st, s)

    def resample(self, st, s):
        """Systematic resampling of each slot whose ESS < threshold * N: each particle's suffix K/V (target and
        draft), history, pending tokens and finished flag become its ancestor's; the log-normaliser takes the
        mean weight, and the weights restart at 0. A population with no positive weight (the target forbids
        every particle's draft tokens) or a NaN weight (non-finite logits) is degenerate: resampling it would be
        a uniform draw that hides the failure, so the request ends (publish)."""
        ancestors, ess, resampled, degenerate = kernels.resample(st.logw, s.ess_threshold, st.rng)
        st.degenerate |= degenerate & st.live
        for saved, x in ((st.logw_before, st.logw), (st.ancestors, ancestors), (st.ess, ess),
                         (st.resampled, resampled)):
            saved.copy_(x)
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


# ---------------------------------------------------------------- command line


def default_pair():
    """(draft, target) paths of the default Qwen2.5-Coder pair, fetched into weights/ if missing."""
    sys.path.insert(0, os.path.join(ROOT, "weights"))
    import fetch
    return tuple(fetch.fetch(name) for name in fetch.DEFAULT_PAIR)


def apply_chat(tokenizer, messages):
    """messages (a list of {"role", "content"}, or one text: a user message) in the tokenizer's chat template,
    ending where the reply begins; the texts joined by newlines when there is no template."""
    messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    if not tokenizer or not tokenizer.chat_template:
        return "\n".join(m["content"] for m in messages)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def fail(message):
        raise UsageError(f"chat template: {message}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = fail
    return env.from_string(tokenizer.chat_template).render(messages=messages, add_generation_prompt=True,
                                                           bos_token="", eos_token="")


def summary(stats):
    line = f"[{stats['method']}: {stats['new_tokens']} new tokens, {stats['tokens_per_s']:.1f} tok/s"
    if stats["method"] in ("sd", "easd"):
        line += f", {stats['cycles']} cycles, acceptance {stats['acceptance']:.2f}"
    if stats["method"] == "easd":
        line += f", {stats['triggers']} easd rejections"
    if stats["method"] == "smc":
        line += (f", {stats['cycles']} cycles, {stats['resamples']} resamples, mean ESS {stats['mean_ess']:.2f}"
                 f"/{stats['particles']}, log Z {stats['log_z']:.3f}")
    return line + ("" if stats["stop"] != "interrupted" else ", interrupted") + "]"


def easd_rule(text):
    try:
        entropy, top, share = text.split(",")
        return float(entropy), int(top), float(share)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ENTROPY,TOP,SHARE like 1.0,5,0.6, got {text!r}") from None


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


def read_jsonl(path):
    """The prompts of a JSONL file: one object per line, {"prompt": text, ...its own options}."""
    items = []
    for n, line in enumerate(read_prompt(path).splitlines(), 1):
        if line.strip():
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise UsageError(f'{path}:{n}: expected an object with a "prompt" string')
            items.append(item)
    if not items:
        raise UsageError(f"{path}: no prompts")
    return items


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model: Hugging Face directory or .gguf file (default: weights/ pair)")
    p.add_argument("--draft", help="draft model, same vocabulary as the target; racer: drafts from retrieval and "
                   "the target's own logits, no draft model (sd)")
    p.add_argument("--method", choices=METHODS, default="smc")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--prompt-file", help="read the prompt from this file instead; a .jsonl file holds one "
                   '{"prompt": ...} per line (with options of its own) and gives one JSON result per line')
    p.add_argument("--slots", type=int, default=4, help="prompts of a .jsonl file decoded together")
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
    p.add_argument("--easd", type=easd_rule, default=EASD, metavar="ENTROPY,TOP,SHARE",
                   help="easd: reject the draft token where both models' entropies reach ENTROPY nats and their "
                   "top-TOP tokens share SHARE x TOP, the token among them (default %(default)s)")
    p.add_argument("--power", type=float, default=1.0, help="smc: sample whole sequences from p ** power "
                   "(normalised; > 1 sharper than the target)")
    p.add_argument("--tree", type=int, default=0, metavar="NODES", help="--draft racer: draft a tree of up to "
                   "NODES tokens, at most --draft-len deep, verified in one forward (default: a chain)")
    p.add_argument("--overlap", action="store_true", help="MineDraft: split the slots into two halves, drafting "
                   "one while the target verifies the other")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every cycle eagerly")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")
    p.add_argument("--trace", metavar="PATH", help="write one JSON line per cycle to PATH: what each particle "
                   "appended, its weights, ESS, ancestors, settled length, phase times (python plot.py PATH)")
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
                   cuda_graphs=not args.no_cuda_graphs, power=args.power, easd=args.easd, tree=args.tree,
                   overlap=args.overlap)
    batch = bool(args.prompt_file and args.prompt_file.endswith(".jsonl"))
    rank, world = model.init_distributed(device)  # under torchrun; only rank 0 speaks
    if rank:
        sys.stdout = open(os.devnull, "w")
    try:
        if world > 1 and not args.target:
            raise UsageError("under torchrun give --target (and --draft): fetch the default pair first with "
                             "python weights/fetch.py, so that the ranks do not fetch it at once")
        check_settings(Settings(**options, select="sample"), has_draft=True)  # before the default pair is fetched
        if args.draft not in (None, "racer") and not args.target:
            raise UsageError("--draft needs --target")
        if args.slots < 1:
            raise UsageError(f"--slots must be at least 1, got {args.slots}")
        if args.trace and batch:
            raise UsageError("--trace follows one prompt; give --prompt or a text --prompt-file")
        prompt = read_jsonl(args.prompt_file) if batch else read_prompt(args.prompt_file) if args.prompt_file \
            else args.prompt
        if not batch and not prompt.strip():
            raise UsageError(f"{args.prompt_file or '--prompt'}: the prompt is empty or only whitespace")
        draft, target = (args.draft, args.target) if args.target else default_pair()
        draft = "racer" if args.draft == "racer" else draft  # retrieval drafts for the default target
        engine = Engine(target, draft, device, args.dtype)  # opens the files; reads no weights yet
        chat = (lambda text: apply_chat(engine.tokenizer, text)) if args.chat else (lambda text: text)
        items = [item | {"prompt": chat(item["prompt"])} for item in (prompt if batch else [{"prompt": prompt}])]
        requests = engine.requests(items, **options)  # every check, before the weights are read or the prompt echoed
        if not (batch or args.json):
            requests[0].on_text = lambda piece: print(piece, end="", flush=True)
            print("" if args.chat else prompt, end="", flush=True)
        if args.trace and rank == 0:
            import plot
            tracer = plot.Tracer(args.trace, engine, requests[0])
            requests[0].on_cycle, requests[0].on_done = tracer.cycle, tracer.done
        results = engine.run(requests, args.slots)
    except (model.LoadError, UsageError) as e:
        sys.exit(1 if rank else f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    if world > 1:
        torch.distributed.destroy_process_group()
    result = results[0]
    if batch or args.json:
        for r in results:
            print(json.dumps({"text": r.text, "tokens": r.tokens, "stats": r.stats}), flush=True)
    else:
        print()
        print(summary(result.stats), file=sys.stdout if rank else sys.stderr)
    if result.stats["stop"] == "interrupted":
        sys.exit(130)
    if result.stats["stop"] == "degenerate" and not batch:  # a batch reports it in its JSON lines
        sys.exit(1 if rank else "error: smc stopped: no particle kept a positive weight, or one is NaN (the models' "
                 "log-probabilities are not finite); the text above is what had settled")


if __name__ == "__main__":
    main()
