"""Generation: autoregressive decoding (ar), speculative sampling (sd, mdsd, easd, racer drafts) and sequential
Monte Carlo speculative decoding (smc), for one prompt or many, from the command line or from Python.

    python engine.py --prompt "def quicksort(xs):"                   # smc with the default pair in weights/
    python engine.py --prompt-file prompts.jsonl --slots 4            # one JSON result per line
    Engine("weights/qwen2.5-coder-1.5b-instruct.gguf", "weights/qwen2.5-coder-0.5b-instruct.gguf").generate("def f(x):")

Top to bottom: Settings (a request's options) and Shape (a batch's key); Request; Batch and Pair (MineDraft's
halves); the Scheduler; Engine (the models, the API); the CLI. decode.py is the device side. Each round cycles
every busy batch, reads each slot's flags once, passes settled text on, refills finished slots (continuous batching)."""
import argparse
import json
import math
import os
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, fields, replace

import torch

import decode
import formats
import loading
import model
import racer

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPT = "def quicksort(xs):\n"
METHODS = ("smc", "sd", "mdsd", "easd", "ar")
EASD = (1.0, 5, 0.6)  # easd's rule: entropy (nats) both models must reach, top-m, share of the top-m they share
IDLE_S = 60.0  # a batch without a request for this long is dropped with its caches


class UsageError(Exception):
    """A one-line problem with a request, before any work; param: the option at fault."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


class DeviceFailed(Exception):
    """The device runs nothing more (a CUDA error poisons the context for every later call)."""


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class Shape:
    """What the requests of one batch share, and so its key: the cycle's shape."""
    method: str
    particles: int
    draft_len: int
    ess_threshold: float
    power: float
    easd: tuple | None
    restrict: bool  # some request has top-k or top-p: the cycle restricts the target
    tree: int  # racer: the draft tokens verified per cycle (a chain of draft_len, or a tree)
    cuda_graphs: bool
    overlap: bool


KINDS = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
         tuple: "three numbers ENTROPY,TOP,SHARE (TOP an integer)"}
OPTIONAL = {"draft_temperature": float, "target_temperature": float, "particles": int, "draft_len": int}


@dataclass(frozen=True)
class Settings:
    """A request's options; `resolve` fills the defaults that depend on the device, `check` is the one validation
    (command line, Python API, server), before any weight is read."""
    method: str = "smc"
    max_new_tokens: int = 64
    temperature: float = 0.7  # both models, unless draft_temperature / target_temperature are given
    draft_temperature: float | None = None
    target_temperature: float | None = None
    particles: int | None = None  # smc's N
    draft_len: int | None = None  # K
    ess_threshold: float = 0.5
    lag: int = 16  # smc: collapse onto one particle past this many unsettled tokens (0: never; README, Results)
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    select: str = "sample"  # smc's returned particle: "sample" (in proportion to its weight) or "argmax"
    cuda_graphs: bool = True
    power: float = 1.0  # smc's target: the whole sequence's p ** power (normalised)
    easd: tuple = EASD
    tree: int = 0  # racer: draft tokens per cycle, a tree at most draft_len deep (0: a chain of draft_len)
    overlap: bool = False  # MineDraft: two half-batches, one drafting while the other verifies

    def resolve(self, device, chosen=None):
        """Every default filled. (N, K): ar 1 x 1, sd 1 x 4; smc and mdsd 3 x 2 on a CPU, where every verify row
        costs compute, 4 x 4 on a GPU, where it reads the weights once (the bench grid); chosen {method: (N, K)}
        (auto's measured shapes) before those."""
        many, t = (3, 2) if torch.device(device).type == "cpu" else (4, 4), self.temperature
        n, k = (chosen or {}).get(self.method) or {"ar": (1, 1), "smc": many, "mdsd": many}.get(self.method, (1, 4))
        n = self.particles if self.method in ("smc", "mdsd") and self.particles is not None else n
        return replace(self, particles=n,
                       draft_len=k if self.method == "ar" or self.draft_len is None else self.draft_len,
                       draft_temperature=t if self.draft_temperature is None else self.draft_temperature,
                       target_temperature=t if self.target_temperature is None else self.target_temperature)

    def check(self, vocab=None, draft="model"):
        """-> self, or a UsageError; draft: "model", "racer" or None; vocab: None while unknown. Types first, so
        that a JSON "hot" is named, not compared."""
        for f in fields(self):
            value, kind = getattr(self, f.name), OPTIONAL.get(f.name, type(f.default))
            number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)  # noqa
            ok = value is None and f.default is None or (
                number(value) if kind is float else isinstance(value, (tuple, list)) and len(value) == 3 and
                all(map(number, value)) and isinstance(value[1], int) if kind is tuple else
                isinstance(value, kind) and (kind is bool or not isinstance(value, bool)))
            if not ok:
                raise UsageError(f"{f.name.replace('_', '-')} must be {KINDS[kind]}, got {value!r}", f.name)
        s, vocab = self.resolve("cpu"), vocab or math.inf
        entropy, top, share = s.easd
        for param, ok, message in (
                ("method", s.method in METHODS, f"unknown method {s.method!r} (choose from {', '.join(METHODS)})"),
                ("method", s.method == "ar" or draft, f"method {s.method} needs a draft model (--draft)"),
                ("temperature", min(s.draft_temperature, s.target_temperature) >= 0, "temperatures must be >= 0"),
                ("temperature", s.method != "smc" or 0 not in (s.draft_temperature, s.target_temperature),
                 "smc needs temperatures > 0 (greedy has no importance weights); use --method sd or --method ar"),
                ("particles", s.particles >= 1, f"particles must be at least 1, got {s.particles}"),
                ("draft_len", s.draft_len >= 1, f"draft-len must be at least 1, got {s.draft_len}"),
                ("ess_threshold", 0 <= s.ess_threshold <= 1, f"ess-threshold must lie in [0, 1], got "
                 f"{s.ess_threshold}"),
                ("max_new_tokens", s.max_new_tokens >= 1, f"max-new-tokens must be at least 1, got {s.max_new_tokens}"),
                ("lag", s.lag >= 0, f"lag must be at least 0 tokens (0: no bound), got {s.lag}"),
                ("top_k", 0 <= s.top_k <= vocab, f"top-k must lie in [0, {vocab}] (the vocabulary), got {s.top_k}"),
                ("top_p", 0 < s.top_p <= 1, f"top-p must lie in (0, 1], got {s.top_p}"),
                ("seed", 0 <= s.seed < 2 ** 63, f"seed must lie in [0, 2**63), got {s.seed}"),
                ("top_k", s.method != "smc" or not (s.top_k or s.top_p < 1), "smc cannot honour top-k/top-p (its "
                 "draft proposes tokens the restricted target forbids); use --method sd or --method ar with them"),
                ("select", s.select in ("sample", "argmax"), f"select must be 'sample' or 'argmax', got {s.select!r}"),
                ("power", s.power > 0 and (s.power == 1 or s.method == "smc"),
                 f"power must be > 0 and is smc's (sd and ar sample the target itself), got {s.power}"),
                ("tree", 0 <= s.tree <= 64, f"tree must lie in [0, 64] draft tokens, got {s.tree}"),
                ("easd", entropy >= 0 and 1 <= top <= vocab and 0 <= share <= 1, f"easd takes ENTROPY >= 0, TOP in "
                 f"[1, {vocab}] (the vocabulary) and SHARE in [0, 1], got {entropy},{top},{share}"),
                ("method", draft != "racer" or s.method in ("sd", "ar"), f"{s.method} needs a draft model's "
                 "distribution, and racer drafts are deterministic tokens; use --method sd with --draft racer"),
                ("tree", not s.tree or draft == "racer", "tree drafts come from racer: use --tree with --draft racer"),
                ("overlap", not s.overlap or draft == "model" and s.method != "ar", "overlap runs a draft model's "
                 "drafting beside the target's verifying: use it with a draft model and any method but ar")):
            if not ok:
                raise UsageError(message, param)
        return self

    @classmethod
    def of(cls, options):
        try:
            return cls(**options)
        except TypeError as e:  # an option that does not exist
            raise UsageError(str(e).replace("Settings.__init__() ", "")) from None

    def shape(self, racer_drafts=False):
        """The batch key of these resolved settings."""
        return Shape(self.method, self.particles, self.draft_len, self.ess_threshold if self.method == "smc" else
                     0.0, self.power, tuple(self.easd) if self.method == "easd" else None,
                     bool(self.top_k or self.top_p < 1), (self.tree or self.draft_len) if racer_drafts and
                     self.method == "sd" else 0, self.cuda_graphs, self.overlap)


# ---------------------------------------------------------------- requests


class Request:
    """A checked prompt (ids) with its resolved Settings and Shape on its way through a batch, and its progress.
    Callbacks, called on the decoding thread: on_tokens(settled ids) as more settle (True stops the request),
    on_text(piece) with new settled text (whole characters; what may begin a stop string is held back),
    on_done(Result) at the end, on_cycle(batch, slot) after each cycle (traces). A stop string ends the text."""

    def __init__(self, ids, s, shape, capacity, stop=(), tokenizer=None, ends=(), drafter=None, on_tokens=None,
                 on_text=None, on_done=None, on_cycle=None):
        self.ids, self.s, self.shape, self.capacity, self.stop = ids, s, shape, capacity, list(stop)
        self.tokenizer, self.ends, self.drafter = tokenizer, ends, drafter  # ends: EOS ids, pad; drafter: racer's
        self.on_tokens, self.on_text, self.on_done, self.on_cycle = on_tokens, on_text, on_done, on_cycle
        self.settled, self.shown, self.streamed, self.cycles = [], 0, 0, 0
        self.start, self.prefill_seconds, self.particle, self.cancelled, self.result = 0.0, 0.0, 0, False, None

    def cancel(self):
        """Thread-safe: the request ends at its batch's next round, with stats["stop"] = "cancelled"."""
        self.cancelled = True

    def stats(self, tokens, stop):
        """The statistics every request has (its method's own: `decode.method_stats`)."""
        new, seconds = len(until_eos(tokens, self.ends)), time.perf_counter() - self.start if self.start else 0.0
        return {"method": self.s.method, "prompt_tokens": len(self.ids), "new_tokens": new,
                "seconds": round(seconds, 4), "prefill_seconds": round(self.prefill_seconds, 4),
                "streamed": min(self.streamed, new), "tokens_per_s": round(new / seconds, 2) if seconds > 0 else 0.0,
                "cycles": self.cycles, "stop": stop or ("eos" if new < len(tokens) else "length")}

    def settle(self, tokens):
        """More settled tokens -> "stopped" or "stop" when on_tokens or a stop string ends the request."""
        self.settled += tokens
        tokens = until_eos(self.settled, self.ends)
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
        may begin a stop string."""
        end = len(text)
        if not final:
            end = len(text.rstrip("\ufffd"))
            end -= max((k for s in self.stop for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
        if self.on_text and end > self.shown:
            self.on_text(text[self.shown:end])
        self.shown = max(self.shown, end)

    def finish(self, tokens, stats):
        """The Result from the returned particle's tokens; on_done."""
        tokens = until_eos(tokens, self.ends)
        text = self.tokenizer.decode(tokens) if self.tokenizer else None
        if text is not None:
            text, cut = self.cut(text)
            stats["stop"] = "stop" if cut else stats["stop"]
            self.show(text, final=True)
        self.result = Result(text, tokens, stats)
        if self.on_done:
            self.on_done(self.result)


@dataclass
class Result:
    text: str | None  # None when the engine's models have no tokenizer
    tokens: list  # generated ids, without the EOS that ended them (a stop string cuts the text, not the ids)
    stats: dict


def until_eos(tokens, ends):
    """tokens up to, without, the first of `ends` (the EOS ids and the pad)."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in ends), tokens)


# ---------------------------------------------------------------- batches


class Batch:
    """`slots` requests of one shape, each prefilled into a free slot between cycles. The caches and the CUDA graphs
    of `phases` (the cycle, or MineDraft's draft and verify) are made once, here, over empty slots, which append
    nothing. A graph runs every slot; an eager cycle (a CPU, where every row costs) up to the last busy one."""

    def __init__(self, e, shape, slots, prefix_cap, suffix_cap, phases=("cycle",)):
        self.e, self.shape, self.requests, self.idle_since = e, shape, [None] * slots, time.monotonic()
        self.st = decode.new_state(e, shape, slots, prefix_cap, suffix_cap)
        self.graphs = {fn: decode.record(lambda fn=fn: getattr(decode, fn)(e, self.st, shape)) for fn in phases} \
            if decode.graphs(shape, e.device) else {}

    def busy(self):
        return any(self.requests)

    def admit(self, req):
        """Prefill req into a free slot (False if none); a failure leaves the slot empty."""
        if None not in self.requests:
            return False
        r, req.start = self.requests.index(None), time.perf_counter()
        try:
            decode.prefill_slot(self.e, self.st, self.shape, r, req)
        except BaseException:
            self.leave(r)
            raise
        self.requests[r], req.prefill_seconds = req, time.perf_counter() - req.start
        return True

    def leave(self, r):
        self.requests[r], self.idle_since = None, time.monotonic()
        decode.empty_slot(self.st, r)

    def cycle(self):
        if self.shape.tree:  # racer: each busy slot's draft tree from its request's Retrieval (host work)
            decode.plant(self.st, [req and req.drafter.draft(self.shape.draft_len, self.shape.tree)
                                   for req in self.requests])
        self.run("cycle")
        self.cycled()

    def run(self, fn):
        """decode's fn ("cycle" or a phase of it) as its graph's replay, or eagerly up to the last busy slot."""
        if fn in self.graphs:
            self.graphs[fn]()
        else:
            busy = 1 + max(i for i, r in enumerate(self.requests) if r)
            getattr(decode, fn)(self.e, self.st.narrow(busy), self.shape)

    def cycled(self):
        for r, req in enumerate(self.requests):
            if req:
                req.cycles += 1
                if req.on_cycle:
                    req.on_cycle(self, r)

    def collect(self, stop=None):
        """Read every slot's flags and the history's new part (the host's one read of a round), pass settled
        tokens on, end the requests that are done, cancelled, or (stop given, e.g. "interrupted") all of them."""
        busy = [(r, req) for r, req in enumerate(self.requests) if req]
        if not busy:
            return
        flags = self.st.flags.tolist()
        lo = min(min(len(req.settled), req.drafter.seen if req.drafter else math.inf) for _, req in busy)
        rows = self.st.hist[:, 0, 1 + lo:1 + max(flags[r][3] for r, _ in busy)].tolist()
        cues = [x.tolist() for x in (self.st.cues, self.st.cue_p)] if self.shape.tree else None
        for r, req in busy:
            done, count, degenerate, length = flags[r]
            if req.drafter:
                req.drafter.update(rows[r][req.drafter.seen - lo:length - lo], zip(cues[0][r], cues[1][r]), req.cycles)
            why = stop or ("degenerate" if degenerate else "cancelled" if req.cancelled else None)
            count = min(count, req.s.max_new_tokens)
            if why is None and count > len(req.settled):
                why = req.settle(rows[r][len(req.settled) - lo:count - lo])
            if why is None and not done and req.stop and self.shape.particles > 1:
                done = self.stop_particles(r, req, length)
            if why or done:
                tokens = req.settled if why else self.returned(r, req)
                req.finish(tokens, req.stats(tokens, why) | decode.method_stats(self.st, r, req))
                self.leave(r)
            else:
                req.streamed = len(req.settled)

    def stop_particles(self, r, req, length):
        """A particle whose text holds a stop string ends there, as at an EOS (its tokens drafted past it that
        cycle weigh p/q, 1 in expectation, so the prefix keeps its distribution) -> whether all have ended.
        Otherwise a request would end only once its particles agree on the text up to the string."""
        ended = [i for i, tokens in enumerate(self.st.hist[r, :, 1:1 + length].tolist())
                 if req.cut(self.e.tokenizer.decode(until_eos(tokens, req.ends)))[1]]
        self.st.finished[r, ended] = True
        return bool(self.st.finished[r].all())

    def returned(self, r, req):
        """Slot r's returned particle's tokens."""
        req.particle = decode.pick(self.st, r, req.s.select)
        return self.st.hist[r, req.particle, 1:1 + min(int(self.st.gen_len[r]), req.s.max_new_tokens)].tolist()

    def close(self):
        pass


class Pair:
    """MineDraft (arXiv 2603.18016): a batch's slots as two halves, one drafting while the target verifies the
    other, on two threads (a CPU: half of the cores each; CUDA: a stream each, replaying the half's graphs). A
    request's tokens are those it gets without the overlap. A half is read and refilled only between its verify
    and its next draft; the first busy one drafts alone at the start, then the halves alternate."""

    def __init__(self, engine, shape, slots, prefix_cap, suffix_cap):
        if slots < 2:
            raise UsageError("overlap needs at least 2 slots, one for each half")
        self.halves = [Batch(engine, shape, (slots + i) // 2, prefix_cap, suffix_cap, ("draft_block", "verify_cycle"))
                       for i in (1, 0)]
        self.drafted, self.cuda = [False, False], engine.device.type == "cuda"
        where = torch.cuda.current_device() if self.cuda else max(1, torch.get_num_threads() // 2)
        self.pool = ThreadPoolExecutor(2, initializer=self.start_thread, initargs=(where,))

    def start_thread(self, where):
        if self.cuda:
            torch.cuda.set_device(where)
            torch.cuda.set_stream(torch.cuda.Stream())
        else:
            torch.set_num_threads(where)

    @property
    def requests(self):
        return self.halves[0].requests + self.halves[1].requests

    @property
    def idle_since(self):
        return max(h.idle_since for h in self.halves)

    def busy(self):
        return any(h.busy() for h in self.halves)

    def admit(self, req):
        return any(not d and h.admit(req) for h, d in zip(self.halves, self.drafted))

    def collect(self, stop=None):
        for h, d in zip(self.halves, self.drafted):
            if stop or not d:
                h.collect(stop)

    def run(self, half, fn):
        with torch.inference_mode():
            half.run(fn)
            if self.cuda:
                torch.cuda.current_stream().synchronize()

    def cycle(self):
        """The drafted half verifies while the other drafts; both jobs end before an error in either is raised."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # prefills on this thread's stream come first
        phases = ["verify_cycle" if d else "draft_block" if h.busy() else None
                  for h, d in zip(self.halves, self.drafted)]
        if "verify_cycle" not in phases and phases[0] == "draft_block":
            phases[1] = None  # the halves start apart
        jobs = [self.pool.submit(self.run, h, p) for h, p in zip(self.halves, phases) if p]
        wait(jobs)
        for job in jobs:
            job.result()
        self.drafted = [p == "draft_block" for p in phases]
        for h, p in zip(self.halves, phases):
            if p == "verify_cycle":
                h.cycled()

    def close(self):
        self.pool.shutdown()


# ---------------------------------------------------------------- scheduler


class Scheduler:
    """One serving loop's requests, waiting and running. Requests of one shape share a batch of `slots` slots of
    caps (prompt, rest) tokens, made at the shape's first request, dropped once idle for idle_s. raise_errors
    (generate): a failure raises; else (serve) it ends its batch's requests "error", unless the device failed."""

    def __init__(self, engine, slots, caps, raise_errors, idle_s=IDLE_S):
        self.engine, self.slots, self.caps, self.raise_errors, self.idle_s = engine, slots, caps, raise_errors, idle_s
        self.batches, self.waiting = {}, []

    def busy(self):
        return bool(self.waiting) or any(b.busy() for b in self.batches.values())

    def serving(self, inbox, until_idle):
        """Take Requests from inbox until None arrives (what still runs ends "cancelled") or, with until_idle,
        until none is left; yields after every round."""
        while not until_idle or self.busy() or not inbox.empty():
            try:  # idle: wait for work, waking to drop idle batches
                items = [] if self.busy() else [inbox.get(timeout=self.idle_s if self.batches else None)]
            except queue.Empty:
                items = []
            while not inbox.empty():  # this loop is the queue's one reader
                items.append(inbox.get())
            self.waiting += [item for item in items if item is not None]
            if None in items:
                return self.stop("cancelled")
            self.round()
            yield

    def round(self):
        """Collect every batch (ending what the last cycle finished), admit waiting requests (and collect their
        batches: a request can be done as it is admitted), cycle the busy batches, drop idle ones."""
        for key, b in list(self.batches.items()):
            self.guarded(key, b.collect)
        for key in self.admit():
            self.guarded(key, self.batches[key].collect)
        for key, b in list(self.batches.items()):
            if b.busy():
                self.guarded(key, b.cycle)
        self.evict(self.idle_s)

    def guarded(self, key, fn):
        try:
            fn()
        except Exception as e:
            if self.raise_errors:
                raise
            b = self.batches.pop(key)
            b.close()
            self.failed([req for req in b.requests if req], e)

    def failed(self, requests, error):
        self.end(requests, "error", error)
        if not self.engine.device_ok():
            raise DeviceFailed(f"the device failed and can run nothing more: {' '.join(str(error).split())}")

    def admit(self):
        """Move waiting requests into free slots of their shape's batch -> the keys of the batches that took one."""
        took = set()
        for req in list(self.waiting):
            if req.cancelled:
                self.waiting.remove(req)
                self.end([req], "cancelled")
                continue
            try:
                if len(req.ids) > self.caps[0] or req.capacity > self.caps[1]:
                    raise UsageError(f"the request needs {len(req.ids)} + {req.capacity} tokens; a slot holds "
                                     f"{self.caps[0]} + {self.caps[1]}: check requests with request(context=...)")
                if self.batch(req.shape).admit(req):
                    self.waiting.remove(req)
                    took.add(req.shape)
            except Exception as e:
                if self.raise_errors:
                    raise
                self.waiting.remove(req)
                self.failed([req], e)
        return took

    def batch(self, shape):
        """shape's batch, made if there is none (after dropping idle batches if memory is short)."""
        if shape not in self.batches:
            need = decode.batch_bytes(self.engine, shape, self.slots, self.caps)
            if need > decode.free_bytes(self.engine.device):
                self.evict(0.0)
            check_fits(need, self.engine.device, f"{self.slots} slots' KV caches and logits",
                       "lower the slots, particles, draft length or context")
            self.batches[shape] = (Pair if shape.overlap else Batch)(self.engine, shape, self.slots, *self.caps)
        return self.batches[shape]

    def evict(self, idle_s):
        """Drop the batches idle for idle_s or more: a long-running server keeps no cache per shape it has seen."""
        for key, b in list(self.batches.items()):
            if not b.busy() and time.monotonic() - b.idle_since >= idle_s:
                self.batches.pop(key).close()

    def end(self, requests, why, error=None):
        """End requests with what they made so far, stats["stop"] = why (an error's message in stats["error"])."""
        error = {"error": " ".join(str(error).split())} if error else {}
        for req in requests:
            req.finish(req.settled, req.stats(req.settled, why) | error)

    def stop(self, why, error=None):
        """End every request, running and waiting; after an error the device is not read again."""
        running = []
        for b in self.batches.values():
            if error is None:
                b.collect(stop=why)
            running += [req for req in b.requests if req]
            b.close()
        self.end(running + self.waiting, why, error)
        self.batches, self.waiting = {}, []


def check_fits(need, device, what, advice):
    if need > decode.free_bytes(device):
        raise UsageError(f"{what} need {need / 2**30:.2f} GiB but only {decode.free_bytes(device) / 2**30:.2f} GiB is "
                         f"free on {device}; {advice}")


def check_memory(e, requests, slots):
    """The unread weights and the batches these requests need fit in free memory (or a UsageError) -> the caps
    (prompt, suffix) of a slot that holds any of them."""
    caps, shapes = (max(len(r.ids) for r in requests), max(r.capacity for r in requests)), {r.shape for r in requests}
    need = decode.unread_bytes(e) + sum(decode.batch_bytes(e, shape, slots, caps) for shape in shapes)
    check_fits(need, e.device, ("the weights, " if e.opened[0] else "") + f"{slots} slots' KV caches and logits",
               "lower --slots, --particles, --draft-len or --max-new-tokens")
    return caps


def capacity(e, prompt_len, s, shape, context=None):
    """The context's checks -> the suffix a request needs: its budget and a draft block of lookahead."""
    extra = 0 if s.method == "ar" else max(shape.tree, s.draft_len)  # what a cycle writes ahead
    configs = [c for c in (e.config, e.draft_config if s.method != "ar" else None) if c is not None]
    context = min([c.max_seq_len for c in configs] + [context or math.inf])
    if prompt_len >= context:
        raise UsageError(f"the prompt is {prompt_len} tokens, longer than the context of {context}")
    if prompt_len + extra + 1 > context:
        raise UsageError(f"{'tree' if shape.tree > s.draft_len else 'draft-len'} {extra} does not fit the context "
                         f"of {context} after a {prompt_len}-token prompt; use at most {context - prompt_len - 1}",
                         "draft_len")
    if prompt_len + s.max_new_tokens + extra > context:
        raise UsageError(f"max-new-tokens {s.max_new_tokens} does not fit the context of {context} after a "
                         f"{prompt_len}-token prompt; use at most {context - prompt_len - extra}", "max_new_tokens")
    return s.max_new_tokens + extra


# ---------------------------------------------------------------- engine


class Engine:
    """A target and an optional draft, each a path (Hugging Face directory or .gguf file) or a model.Transformer (then
    prompts are ids, results have no text); draft "racer" drafts without a model. Paths open at once: a bad request
    is refused before `load()` reads a weight. weights: formats.FORMATS' (both models) or "auto" (paths on a CPU: each
    model's measured). Under torchrun each rank holds its target shard and decodes alike (same logits and rng)."""

    def __init__(self, target, draft=None, device=None, weights=None):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError("CUDA is not available here; use --device cpu")
        self.racer = draft == "racer"
        if self.racer:
            draft = None
        self.target = target if isinstance(target, model.Transformer) else None
        self.draft = draft if isinstance(draft, model.Transformer) else None
        # [target, draft]: a path's (Config, get, Tokenizer) until load() reads its weights; None for a model or none
        self.opened = [None if m is None or isinstance(m, model.Transformer) else loading.open_weights(m)
                       for m in (target, draft)]
        target_file = self.opened[0]
        draft_file = self.opened[1]
        self.rank = 0
        self.world = 1
        if target_file:
            self.rank, self.world = model.init_distributed(device)
        self.auto = weights in (None, "auto") and device.type == "cpu" and self.world == 1 and bool(target_file)
        if self.auto:
            self.weights = "auto"
        elif weights in (None, "auto"):
            self.weights = "bf16"
        else:
            self.weights = weights
        self.draft_weights = self.weights
        self.chosen = {}  # method -> the (N, K) auto measured for it
        dtype = torch.bfloat16 if self.auto else formats.weight_format(self.weights, device)
        if target_file:
            self.config = model.shard_config(target_file[0], self.world)  # this rank's
        else:
            self.config = target.config
        self.draft_config = None
        if draft_file:
            self.draft_config = draft_file[0]
        elif draft is not None:
            self.draft_config = draft.config
        if self.draft_config and self.draft_config.vocab_size != self.config.vocab_size:
            raise UsageError(f"{draft}: vocabulary size {self.draft_config.vocab_size} differs from the target's "
                             f"{self.config.vocab_size}")
        self.device = device
        self.dtype = dtype
        if self.target:
            self.device = self.target.device
            self.dtype = self.target.embed.dtype
        unread = decode.unread_bytes(self)
        check_fits(unread, self.device, "the weights", "try a smaller model or another --device")
        self.measurement = None  # weights auto's: asked by load() and by request() for smc's and sd's shapes
        if self.auto:
            self.measurement = formats.Measurement(self.opened, self.draft_config, unread,
                                                   decode.free_bytes(self.device))
        self.tokenizer = target_file[2] if target_file else None
        self.failure = None
        self.pad = self.config.vocab_size
        self.is_eos = torch.zeros(self.pad + 1, dtype=torch.bool, device=self.device)
        self.is_eos[self.config.eos_ids + [self.pad]] = True
        self.ends = set(self.config.eos_ids) | {self.pad}

    def load(self, shape=None):
        """Read the weights (once) -> self; with weights "auto", first measure which format suits shape's cycles."""
        if self.weights == "auto" and self.target is None:
            shape = shape or Settings().resolve(self.device).shape(self.racer)
            (self.weights, self.draft_weights), line = self.measurement.choose_weights(shape)
            self.dtype = formats.FORMATS[self.weights]
            print(line, file=sys.stderr)
        target_file = self.opened[0]
        draft_file = self.opened[1]
        if self.target is None and target_file:
            self.target = loading.build(*target_file[:2], self.device, self.dtype, tp=(self.rank, self.world),
                                        weights=self.weights)
        if self.draft is None and draft_file:
            self.draft = loading.build(*draft_file[:2], self.device, self.dtype, weights=self.draft_weights,
                                       wider=False)
        self.opened = [None, None]
        return self

    def encode(self, prompt):
        if isinstance(prompt, str) and self.tokenizer is None:
            raise UsageError("this engine has no tokenizer: give the prompt as token ids")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UsageError("a prompt is text or a list of token ids")
        if not ids or isinstance(prompt, str) and not prompt.strip():
            raise UsageError("the prompt is empty or only whitespace")
        if not all(0 <= i < self.config.vocab_size for i in ids):
            raise UsageError(f"prompt token ids must lie in [0, {self.config.vocab_size})")
        return list(ids)

    def request(self, prompt, stop=(), on_tokens=None, on_text=None, on_done=None, on_cycle=None, context=None,
                **options):
        """A prompt (text or ids) and options (Settings' fields) -> a checked Request, before any weight is read;
        or a UsageError. stop: strings that end the text. context: the most tokens (prompt, new ones and a draft
        block) a slot of the serving batch holds, where that is below the models' context."""
        s = Settings.of(options).check(self.config.vocab_size, "racer" if self.racer else self.draft_config and "model")
        if s.method in ("smc", "sd") and not (s.draft_len and (s.particles or s.method == "sd")) and self.auto and \
                self.draft_config and s.method not in self.chosen:  # measured once, at the method's first request
            self.chosen[s.method], line = self.measurement.choose_shape(s.method, self.weights, self.draft_weights)
            print(line, file=sys.stderr)
        s, stop = s.resolve(self.device, self.chosen), [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise UsageError("stop must be a string or a list of non-empty strings", "stop")
        if stop and self.tokenizer is None:
            raise UsageError("stop strings need a tokenizer: this engine's models have none", "stop")
        ids, shape = self.encode(prompt), s.shape(self.racer)
        return Request(ids, s, shape, capacity(self, len(ids), s, shape, context), stop, self.tokenizer, self.ends,
                       racer.Retrieval(ids, chain=not s.tree) if shape.tree else None, on_tokens, on_text, on_done,
                       on_cycle)

    def requests(self, prompts, **options):
        """Checked Requests for a list of prompts, each text, ids, or {"prompt": ..., **options of its own}."""
        out = []
        for i, p in enumerate(prompts):
            try:
                out.append(self.request(**(options | p)) if isinstance(p, dict) else self.request(p, **options))
            except (UsageError, TypeError) as e:
                raise UsageError(f"prompt {i + 1}: {e}", getattr(e, "param", None)) from None
        return out

    def generate(self, prompt, on_tokens=None, slots=None, **options):
        """prompt: text, ids or {"prompt": ..., **its options} -> Result(text, tokens, stats); a list of prompts ->
        [Result], decoded together, `slots` at a time (default: up to 8), each with its own randomness. options:
        Settings' fields, and stop. on_tokens(settled tokens), called as more settle, stops the request by returning
        True. stats["stop"]: "eos", "length", "stop", "stopped", "interrupted", or "degenerate" (smc: no weight)."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, dict, list, tuple)):
            return self.run(self.requests(prompt, **options), slots)
        one = options | prompt if isinstance(prompt, dict) else options | {"prompt": prompt}
        return self.run([self.request(on_tokens=on_tokens, **one)], 1)[0]

    def run(self, requests, slots=None):
        """Decode checked Requests to the end -> their Results."""
        for _ in self.serving(requests, slots):
            pass
        return [req.result for req in requests]

    def stream(self, prompts, slots=None, **options):
        """generate's list form as it goes: yields (i, text, None) as the i-th prompt's text settles, then
        (i, "", Result) when it ends (models without a tokenizer: the Results only)."""
        events, requests = [], self.requests(prompts, **options)
        for i, req in enumerate(requests):
            req.on_text = lambda piece, i=i: events.append((i, piece, None))
            req.on_done = lambda result, i=i: events.append((i, "", result))
        for _ in self.serving(requests, slots):
            yield from events
            events.clear()
        yield from events

    def serve(self, inbox, slots=4, context=2048, idle_s=IDLE_S):
        """Decode the Requests put in inbox (a queue.Queue) until None arrives (what still runs ends "cancelled").
        context: the tokens a slot holds (a pair (prompt, rest) for each apart; check requests with request(context=)).
        A failing batch ends its requests "error" and serving goes on; a failed device ends them all: DeviceFailed."""
        for _ in self.serving(inbox, slots, context if isinstance(context, tuple) else (context,) * 2, idle_s):
            pass

    def serving(self, inbox, slots=None, caps=None, idle_s=IDLE_S):
        """The Scheduler's loop, yielding after every round, over a list of Requests (checked to fit, `slots` at a
        time, default up to 8, until all end) or a queue.Queue (slots of caps tokens, until None arrives)."""
        if until_idle := isinstance(inbox, list):
            requests, slots, inbox = inbox, slots or min(len(inbox), 8), queue.Queue()
            caps = check_memory(self, requests, slots)
            self.load(requests[0].shape)
            for req in requests:
                inbox.put(req)
        sched = Scheduler(self.load(), slots, caps, until_idle, idle_s)
        with torch.inference_mode():
            try:
                yield from sched.serving(inbox, until_idle)
            except KeyboardInterrupt:
                sched.stop("interrupted")
            except DeviceFailed as e:
                self.failure = str(e)
                sched.stop("error", e)
                raise
            finally:  # what an error left (until_idle raises): the overlap's threads
                for b in sched.batches.values():
                    b.close()

    def device_ok(self):
        """Whether the device still runs work (a CUDA error is sticky: every later call fails)."""
        try:
            return self.device.type != "cuda" or torch.cuda.synchronize(self.device) is None
        except RuntimeError:
            return False


# ---------------------------------------------------------------- command line


def default_pair():
    """(draft, target) GGUF files of the default Qwen2.5-Coder pair, fetched into weights/ if missing."""
    from weights import fetch
    return tuple(fetch.fetch_gguf(name) for name in fetch.DEFAULT_PAIR)


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


SUMMARY = {"easd": ", {triggers} easd rejections", "mdsd": ", {particles} drafts a cycle",
           "smc": ", {cycles} cycles, {resamples} resamples, mean ESS {mean_ess:.2f}/{particles}, log Z {log_z:.3f}"}


def summary(stats):
    more = ", {cycles} cycles, acceptance {acceptance:.2f}" if "acceptance" in stats else ""
    line = "[{method}: {new_tokens} new tokens, {tokens_per_s:.1f} tok/s" + more + SUMMARY.get(stats["method"], "")
    return line.format(**stats) + (", interrupted" if stats["stop"] == "interrupted" else "") + "]"


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
    """The prompts of a JSONL file: one {"prompt": text, ...its own options} per line."""
    items = []
    for n, line in enumerate(read_prompt(path).splitlines(), 1):
        try:
            item = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not JSON ({e.msg})") from None
        if item is not None and not (isinstance(item, dict) and isinstance(item.get("prompt"), str)):
            raise UsageError(f'{path}:{n}: expected an object with a "prompt" string')
        items += [item] if item else []
    if not items:
        raise UsageError(f"{path}: no prompts")
    return items


def easd_rule(text):
    try:
        entropy, top, share = text.split(",")
        return float(entropy), int(top), float(share)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ENTROPY,TOP,SHARE like 1.0,5,0.6, got {text!r}") from None


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--target", help="target model: Hugging Face directory or .gguf file (default: weights/ pair)")
    add("--draft", help="draft model, same vocabulary as the target; racer: drafts from retrieval and the target's "
        "own logits, no draft model (sd)")
    add("--method", choices=METHODS, default="smc")
    add("--prompt", default=DEFAULT_PROMPT)
    add("--prompt-file", help='read the prompt from this file instead; a .jsonl file holds one {"prompt": ...} per '
        "line (with options of its own) and gives one JSON result per line")
    add("--slots", type=int, default=4, help="prompts of a .jsonl file decoded together")
    add("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    add("--max-new-tokens", type=int, default=64)
    add("--temperature", type=float, default=0.7, help="draft and target temperature; 0 = greedy")
    add("--draft-temperature", type=float)
    add("--target-temperature", type=float)
    add("--top-k", type=int, default=0, help="keep the k likeliest target tokens (0 = all)")
    add("--top-p", type=float, default=1.0, help="keep the target's top-p nucleus")
    add("--particles", type=int, help="smc: particles N; mdsd: drafts N (default: 3 on a CPU, 4 on a GPU)")
    add("--draft-len", type=int, help="draft tokens K per cycle (default: sd 4; smc, mdsd 2 on a CPU, 4 on a GPU)")
    add("--ess-threshold", type=float, default=0.5, help="smc: resample when ESS < this * N")
    add("--lag", type=int, default=Settings.lag, help="smc: collapse onto one particle past this many unsettled tokens")
    add("--easd", type=easd_rule, default=EASD, metavar="ENTROPY,TOP,SHARE", help="easd: reject the draft token "
        "where both models' entropies reach ENTROPY nats and their top-TOP tokens share SHARE x TOP, the token "
        "among them (default %(default)s)")
    add("--power", type=float, default=1.0, help="smc: sample whole sequences from p ** power (normalised; > 1 "
        "sharper than the target)")
    add("--tree", type=int, default=0, metavar="NODES", help="--draft racer: draft a tree of up to NODES tokens, at "
        "most --draft-len deep, verified in one forward (default: a chain)")
    add("--overlap", action="store_true", help="MineDraft: one half of the slots drafts while the other verifies")
    add("--seed", type=int, default=0)
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--weights", choices=["auto", *formats.FORMATS], default="auto", help="matmul weights' format "
        "(activations in the dtype its kernels want); auto: each model's fastest, smc's N x K, sd's K, measured (CPU)")
    add("--no-cuda-graphs", action="store_true", help="run every cycle eagerly")
    add("--json", action="store_true", help="print one JSON object: text, tokens, stats")
    add("--trace", metavar="PATH", help="one JSON line per cycle to PATH: tokens, weights, ancestors, phase times")
    return p


def prepare(args, batch, world):
    """-> (engine, requests, prompt), every check done before a weight is read or the prompt echoed."""
    options = {f.name: getattr(args, f.name) for f in fields(Settings) if f.name not in ("select", "cuda_graphs")}
    options["cuda_graphs"] = not args.no_cuda_graphs
    Settings.of(options).check(None, "racer" if args.draft == "racer" else "model")  # before the pair is fetched
    for bad, message in ((world > 1 and not args.target, "under torchrun give --target (and --draft): fetch the "
                          "default pair first with python weights/fetch.py, so that the ranks do not fetch it at once"),
                         (args.draft not in (None, "racer") and not args.target, "--draft needs --target"),
                         (args.slots < 1, f"--slots must be at least 1, got {args.slots}"),
                         (args.trace and batch, "--trace follows one prompt; give --prompt or a text --prompt-file")):
        if bad:
            raise UsageError(message)
    prompt = (read_jsonl if batch else read_prompt)(args.prompt_file) if args.prompt_file else args.prompt
    if not batch and not prompt.strip():
        raise UsageError(f"{args.prompt_file or '--prompt'}: the prompt is empty or only whitespace")
    draft, target = (args.draft, args.target) if args.target else default_pair()
    e = Engine(target, "racer" if args.draft == "racer" else draft, args.device, args.weights)
    if args.chat and not (e.tokenizer and e.tokenizer.chat_template):
        raise UsageError(f"--chat: {target} has no chat template; give the prompt as the model should read it")
    chat = (lambda text: apply_chat(e.tokenizer, text)) if args.chat else (lambda text: text)
    requests = e.requests([item | {"prompt": chat(item["prompt"])} for item in prompt], **options) if batch \
        else [e.request(chat(prompt), **options)]
    args.slots = args.slots if args.overlap else min(args.slots, len(requests))  # no caches for absent prompts
    check_memory(e, requests, args.slots)
    return e, requests, prompt


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        args.device = torch.device(args.device)
    except RuntimeError:
        sys.exit(f"error: unknown device {args.device!r}; use cpu or cuda")
    batch = bool(args.prompt_file and args.prompt_file.endswith(".jsonl"))
    rank, world = model.init_distributed(args.device)  # under torchrun; only rank 0 speaks
    sys.stdout = open(os.devnull, "w") if rank else sys.stdout
    try:
        e, requests, prompt = prepare(args, batch, world)
        if not (batch or args.json):
            requests[0].on_text = lambda piece: print(piece, end="", flush=True)
            print("" if args.chat else prompt, end="", flush=True)
        if args.trace and rank == 0:
            import plot
            tracer = plot.Tracer(args.trace, e, requests[0])
            requests[0].on_cycle, requests[0].on_done = tracer.cycle, tracer.done
        results = e.run(requests, args.slots)
    except (model.LoadError, UsageError) as error:
        sys.exit(1 if rank else f"error: {error}")
    except KeyboardInterrupt:
        sys.exit(130)
    if world > 1:
        torch.distributed.destroy_process_group()
    for r in results if batch or args.json else []:
        print(json.dumps({"text": r.text, "tokens": r.tokens, "stats": r.stats}), flush=True)
    if not (batch or args.json):
        print()
        print(summary(results[0].stats), file=sys.stdout if rank else sys.stderr)
    stop = results[0].stats["stop"]
    if stop == "interrupted":
        sys.exit(130)
    if stop == "degenerate" and not batch:  # a batch reports it in its JSON lines
        sys.exit(1 if rank else "error: smc stopped: no particle kept a positive weight, or one is NaN (the models' "
                 "log-probabilities are not finite); the text above is what had settled")


if __name__ == "__main__":
    main()
