"""The scheduler, beneath the engine: a Batch of slots that run one cycle shape together, MineDraft's Pair of half
batches, the Scheduler's rounds that admit, cycle and end requests; what their memory takes; the errors they raise.
Imports nothing of engine.py, which builds on it."""
import contextlib
import functools
import math
import queue
import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch

import decode
import formats
import model
from errors import DeviceFailed, LoadError, UsageError, require

IDLE_S = 60.0  # a batch without a request for this long is dropped with its caches


# ---------------------------------------------------------------- batches


def synchronize(device):
    """Wait for the device's queued work, so that a host clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Batch:
    """`slots` requests of one shape, each prefilled into a free slot between cycles. The caches and the CUDA graphs
    of its phases (the whole cycle, or MineDraft's draft and verify) are made once, here, over empty slots, which
    append nothing. A graph runs every slot; an eager phase (a CPU, where every row costs) up to the last busy one.
    observers: each called (batch, phase's name, seconds) after every phase, the device synchronised around it, and
    after the graphs are recorded ("record"); they time what runs, and change nothing of it."""

    def __init__(self, models, shape, slots, prefix_cap, suffix_cap, phases=None, observers=()):
        self.models = models
        self.shape = shape
        self.observers = observers
        self.requests = [None] * slots
        self.idle_since = time.monotonic()
        self.st = decode.new_state(models, shape, slots, prefix_cap, suffix_cap)
        graphed = decode.graphs(shape, models.device)
        self.phases = phases or plain_phases(self.st, graphed)  # decode's functions, run in turn each cycle
        start = time.perf_counter()
        self.graphs = {}  # a phase -> its CUDA graph's replay
        if graphed:
            for phase in self.phases:
                self.graphs[phase] = decode.record(functools.partial(phase, models, self.st, shape))
        if self.graphs:
            self.tell("record", time.perf_counter() - start)

    def busy(self):
        return any(self.requests)

    def admit(self, req):
        """Prefill req into a free slot (False if none); a failure leaves the slot empty. Its first token settles
        (and streams) after the target's prefill, before the draft's, which a long prompt's first token need not
        wait for."""
        if None not in self.requests:
            return False
        r = self.requests.index(None)
        req.start = time.perf_counter()
        try:
            decode.prefill_slot(self.models, self.st, self.shape, r, req)
            self.requests[r] = req
            req.prefill_seconds = time.perf_counter() - req.start
            self.collect(only=r)  # may end req: an EOS first, or one token asked for
            if self.requests[r] is req:
                decode.prefill_draft(self.models, self.st, r, req)
                req.prefill_seconds = time.perf_counter() - req.start
        except BaseException:
            self.leave(r)
            raise
        return True

    def leave(self, r):
        self.requests[r] = None
        self.idle_since = time.monotonic()
        decode.empty_slot(self.st, r)

    def cycle(self):
        if self.st.nodes is not None:  # racer: the host grows each slot's draft tree first
            decode.plant(self.st, self.requests, self.shape)
        for phase in self.phases:
            self.run_phase(phase)
        self.cycled()

    def run_phase(self, phase):
        """A phase (a function of decode's) as its graph's replay, or eagerly up to the last busy slot; timed for the
        observers, if there are any."""
        run = self.graphs.get(phase)
        if run is None:
            busy = 1 + max(r for r, req in enumerate(self.requests) if req)
            run = functools.partial(phase, self.models, self.st.narrow(busy), self.shape)
        if not self.observers:
            run()
            return
        synchronize(self.models.device)
        start = time.perf_counter()
        run()
        synchronize(self.models.device)
        self.tell(phase.__name__, time.perf_counter() - start)

    def tell(self, phase, seconds):
        for observer in self.observers:
            observer(self, phase, seconds)

    def cycled(self):
        for r, req in enumerate(self.requests):
            if req:
                req.cycles += 1
                if req.on_cycle:
                    req.on_cycle(self, r)

    def collect(self, reason=None, only=None):
        """Read every slot's flags and the history's new part (the host's one read of a round), pass settled
        tokens on, end the requests that are done, cancelled, or (reason given, e.g. "interrupted") all of them.
        only: slot `only`'s request alone (one just admitted)."""
        busy = [(r, req) for r, req in enumerate(self.requests) if req and only in (None, r)]
        if not busy:
            return
        flags = self.st.flags.tolist()  # [R, 4]: done, settled count, degenerate, length
        lo = min(unread(req) for _, req in busy)
        hi = max(flags[r][3] for r, _ in busy)
        rows = self.st.hist[:, 0, 1 + lo:1 + hi].tolist()  # [R, hi - lo] particle 0's: settled tokens are everyone's
        cues = None
        if self.st.cues is not None:  # racer: the target's top tokens after each node, for the drafters
            cues = [x.tolist() for x in (self.st.cues, self.st.cue_p)]
        for r, req in busy:
            done, count, degenerate, length = flags[r]
            if req.drafter:
                req.drafter.update(rows[r][req.drafter.seen - lo:length - lo], zip(cues[0][r], cues[1][r]), req.cycles)
            why = reason
            if not why and degenerate:
                why = "degenerate"
            elif not why and req.cancelled:
                why = "cancelled"
            count = min(count, req.settings.max_new_tokens)
            if why is None and count > len(req.settled):
                why = req.release(rows[r][len(req.settled) - lo:count - lo])
            if why is None and not done and req.stop_strings and self.shape.particles > 1:
                done = self.stop_particles(r, req, length)
            if why or done:
                self.finish_slot(r, req, why)
            else:
                req.streamed = len(req.settled)

    def finish_slot(self, r, req, why):
        """Finish slot r's request: with what settled when `why` ends it early, else with its returned particle."""
        if why:
            tokens = req.settled
        else:
            tokens = self.returned(r, req)
        req.finish(tokens, req.stats(tokens, why) | self.shape.method.stats(self.st, r, req))
        self.leave(r)

    def stop_particles(self, r, req, length):
        """A particle whose text holds a stop string ends there, as at an EOS (its tokens drafted past it that
        cycle weigh p/q, 1 in expectation, so the prefix keeps its distribution) -> whether all have ended.
        Otherwise a request would end only once its particles agree on the text up to the string."""
        histories = self.st.hist[r, :, 1:1 + length].tolist()  # [N, length]
        ended = [i for i, tokens in enumerate(histories) if req.holds_stop(tokens)]
        self.st.finished[r, ended] = True
        return bool(self.st.finished[r].all())

    def returned(self, r, req):
        """Slot r's returned particle's tokens."""
        req.particle = decode.pick(self.models, self.st, r, req.settings.select)
        length = min(int(self.st.gen_len[r]), req.settings.max_new_tokens)
        return self.st.hist[r, req.particle, 1:1 + length].tolist()

    def close(self):
        """A plain batch holds no threads."""


def plain_phases(st, graphed):
    """A plain batch's phases: on CUDA graphs the whole cycle as one graph, else the cycle's phases in turn."""
    if graphed:
        return (decode.cycle,)
    return decode.phases(st)


def unread(req):
    """The first generated token req has not read yet (racer's drafter reads unsettled ones too)."""
    if req.drafter:
        return min(len(req.settled), req.drafter.seen)
    return len(req.settled)


class Pair:
    """MineDraft (arXiv 2603.18016): a batch's slots as two halves, one drafting while the target verifies the
    other, on two threads (a CPU: half of the cores each; CUDA: a stream each, replaying the half's graphs). A
    request's tokens are those it gets without the overlap. A half is read and refilled only between its verify
    and its next draft; the first busy one drafts alone at the start, then the halves alternate."""

    def __init__(self, models, shape, slots, prefix_cap, suffix_cap, observers=()):
        check_slots(slots, overlap=True)
        self.phases = (decode.draft_block, decode.verify_cycle)
        first = Batch(models, shape, (slots + 1) // 2, prefix_cap, suffix_cap, self.phases, observers)
        second = Batch(models, shape, slots // 2, prefix_cap, suffix_cap, self.phases, observers)
        self.halves = [first, second]
        self.drafted = [False, False]  # whether a half's drafts wait for their verify
        self.cuda = models.device.type == "cuda"
        if self.cuda:
            where = torch.cuda.current_device()
        else:
            where = max(1, torch.get_num_threads() // 2)
        self.pool = ThreadPoolExecutor(2, initializer=self.start_thread, initargs=(where,))

    def start_thread(self, where):
        """A pool thread's device and stream (CUDA), or its share of the cores (a CPU)."""
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

    def collect(self, reason=None):
        for h, d in zip(self.halves, self.drafted):
            if reason or not d:
                h.collect(reason)

    def run_half(self, half, phase):
        """half's phase, on a pool thread."""
        with torch.inference_mode():
            half.run_phase(phase)
            if self.cuda:
                torch.cuda.current_stream().synchronize()

    def cycle(self):
        """The drafted half verifies while the other drafts; both jobs end before an error in either is raised."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # prefills on this thread's stream come first
        draft, verify = self.phases
        phases = [next_phase(h, d) for h, d in zip(self.halves, self.drafted)]
        if verify not in phases and phases[0] is draft:
            phases[1] = None  # the halves start apart
        jobs = [self.pool.submit(self.run_half, h, p) for h, p in zip(self.halves, phases) if p]
        wait(jobs)
        for job in jobs:
            job.result()
        self.drafted = [p is draft for p in phases]
        for h, p in zip(self.halves, phases):
            if p is verify:
                h.cycled()

    def close(self):
        self.pool.shutdown()


def next_phase(half, drafted):
    """A half's next phase (of its draft and verify): a drafted half verifies, a busy one drafts, an empty one rests
    (None)."""
    if drafted:
        return half.phases[1]
    if half.busy():
        return half.phases[0]
    return None


# ---------------------------------------------------------------- scheduler


class Scheduler:
    """One serving loop's requests, waiting and running. Requests of one shape share a batch of `slots` slots of
    caps (prompt, rest) tokens, made at the shape's first request, dropped once idle for idle_s. raise_errors
    (generate): a failure raises; else (serve) it ends its batch's requests "error", unless the device failed."""

    def __init__(self, e, slots, caps, raise_errors, idle_s=IDLE_S):
        self.e = e
        self.slots = slots
        self.caps = caps
        self.raise_errors = raise_errors
        self.idle_s = idle_s
        self.batches = {}  # Shape -> its Batch or Pair
        self.waiting = []

    def busy(self):
        return bool(self.waiting) or any(b.busy() for b in self.batches.values())

    def rounds(self, inbox, until_idle):
        """Take Requests from inbox until None arrives (what still runs ends "cancelled") or, with until_idle,
        until none is left; yields after every round."""
        while not until_idle or self.busy() or not inbox.empty():
            items = self.take(inbox)
            self.waiting += [item for item in items if item is not None]
            if None in items:
                self.end_all("cancelled")
                return
            self.round()
            yield

    def take(self, inbox):
        """Everything in inbox; when idle, first wait for work, waking to drop idle batches."""
        items = []
        if not self.busy():
            timeout = self.idle_s if self.batches else None
            with contextlib.suppress(queue.Empty):
                items.append(inbox.get(timeout=timeout))
        while not inbox.empty():  # this loop is the queue's one reader
            items.append(inbox.get())
        return items

    def round(self):
        """Collect every batch (ending what the last cycle finished), admit waiting requests (and collect their
        batches: a request can be done as it is admitted), cycle the busy batches, drop idle ones."""
        for key, b in list(self.batches.items()):
            self.guarded(key, b.collect)
        for key in self.admit_waiting():
            self.guarded(key, self.batches[key].collect)
        for key, b in list(self.batches.items()):
            if b.busy():
                self.guarded(key, b.cycle)
        self.evict(self.idle_s)

    def guarded(self, key, fn):
        try:
            fn()
        except Exception as error:
            if self.raise_errors:
                raise
            b = self.batches.pop(key)
            b.close()
            self.failed([req for req in b.requests if req], error)

    def failed(self, requests, error):
        self.end(requests, "error", error)
        if not self.e.device_ok():
            raise DeviceFailed(f"the device failed and can run nothing more: {' '.join(str(error).split())}")

    def admit_waiting(self):
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
            except UsageError as error:  # the request's own: it cannot fit a slot, or the memory free
                if self.raise_errors:
                    raise
                self.waiting.remove(req)
                self.end([req], "refused", error)
            except Exception as error:
                if self.raise_errors:
                    raise
                self.waiting.remove(req)
                self.failed([req], error)
        return took

    def batch(self, shape):
        """shape's batch, made if there is none (after dropping idle batches if memory is short)."""
        if shape not in self.batches:
            need = batch_bytes(self.e, shape, self.slots, self.caps)
            if need > free_bytes(self.e.device):
                self.evict(0.0)
            check_fits(need, self.e.device, f"{self.slots} slots' KV caches and logits",
                       "lower the slots, particles, draft length or context")
            kind = Pair if shape.overlap else Batch
            self.batches[shape] = kind(self.e.models, shape, self.slots, *self.caps, observers=self.e.observers)
        return self.batches[shape]

    def evict(self, idle_s):
        """Drop the batches idle for idle_s or more: a long-running server keeps no cache per shape it has seen."""
        for key, b in list(self.batches.items()):
            if not b.busy() and time.monotonic() - b.idle_since >= idle_s:
                self.batches.pop(key).close()

    def end(self, requests, why, error=None):
        """End requests with what they made so far, stats["stop"] = why (an error's message in stats["error"])."""
        said = {}
        if error:
            said = {"error": " ".join(str(error).split())}
        for req in requests:
            req.finish(req.settled, req.stats(req.settled, why) | said)

    def end_all(self, why, error=None):
        """End every request, running and waiting; after an error the device is not read again."""
        running = []
        for b in self.batches.values():
            if error is None:
                b.collect(why)
            running += [req for req in b.requests if req]
            b.close()
        self.end(running + self.waiting, why, error)
        self.batches = {}
        self.waiting = []


# ---------------------------------------------------------------- memory


def free_bytes(device):
    """Memory free for new tensors on device: on CUDA with what torch has cached but does not use; unknown: inf."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    return meminfo("MemAvailable")


def total_bytes(device):
    """The device's whole memory; unknown: inf."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return meminfo("MemTotal")


def meminfo(field):
    """Bytes of /proc/meminfo's field; inf where there is none."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return math.inf



def unread_bytes(e, fmts=None):
    """Memory the weights not yet read will take: each model's in its format (fmts: (the target's, the draft's); None:
    the engine's) as the platform holds it (model_bytes, from the file's headers); "auto" not yet chosen: the least of
    any format the platform runs."""
    total = 0
    fmts = fmts or (e.weights, e.draft_weights)
    for c, opened, fmt, wider in zip((e.config, e.draft_config), e.opened, fmts, (True, False)):
        if not opened:
            continue
        kinds = formats.file_kinds(c, opened.get)
        candidates = [fmt]
        if fmt == "auto":
            candidates = [f for f in formats.FORMATS if runs_on(f, e.device)]
        total += min(e.platform.model_bytes(c, f, kinds, wider) for f in candidates)
    return total


def runs_on(fmt, device):
    """Whether weight format fmt runs on device (formats.weight_format's check)."""
    try:
        formats.weight_format(fmt, device)
    except LoadError:
        return False
    return True


def batch_bytes(e, shape, slots, caps):
    """Memory a batch takes: its KV caches, each in its model's activations' dtype, and a cycle's working memory
    (`cycle_bytes`). On CUDA graphs every graph keeps that in a private pool of its own: one for a batch, four for
    MineDraft's pair (a draft and a verify graph for each half)."""
    draft_dtype = e.draft.embed.dtype if e.draft else formats.FORMATS.get(e.draft_weights, e.dtype)
    drafted = e.draft_config and shape.method.draft_model
    models = [(e.config, e.dtype)] + ([(e.draft_config, draft_dtype)] if drafted else [])
    need = sum(model.KVCache.nbytes(c, shape.particles, *caps, dtype, slots) for c, dtype in models)
    if not decode.graphs(shape, e.device):
        return need + cycle_bytes(e, shape, slots)
    if shape.overlap:
        return need + 4 * cycle_bytes(e, shape, -(-slots // 2))
    return need + cycle_bytes(e, shape, slots)


def cycle_bytes(e, shape, slots):
    """A cycle's working memory over `slots` slots: its float32 logits [R, N, K+1, V] with a few copies, and where
    requests restrict (top-k, top-p) what `restrict` sorts: their float32 values and int64 indices."""
    logits = slots * max(shape.method.rows(shape), shape.particles * (shape.draft_len + 1)) * e.config.vocab_size
    return 4 * logits * 4 + shape.restrict * logits * (4 + 8)


def check_fits(need, device, what, advice):
    if need > free_bytes(device):
        raise UsageError(f"{what} need {need / 2**30:.2f} GiB but only {free_bytes(device) / 2**30:.2f} GiB is "
                         f"free on {device}; {advice}")


def check_slots(slots, overlap):
    """Slots a batch can run: one at least, two under overlap (a half each)."""
    require(slots >= 1, f"--slots must be at least 1, got {slots}", "slots")
    require(slots >= 2 or not overlap, "overlap needs at least 2 slots, one for each half", "overlap")


def check_memory(e, requests, slots):
    """The unread weights and the batches these requests need fit in free memory (or a UsageError) -> the caps
    (prompt, suffix) of a slot that holds any of them."""
    caps = (max(len(r.ids) for r in requests), max(r.capacity for r in requests))
    shapes = {r.shape for r in requests}
    need = unread_bytes(e) + sum(batch_bytes(e, shape, slots, caps) for shape in shapes)
    what = f"{slots} slots' KV caches and logits"
    if e.opened[0]:
        what = "the weights, " + what
    check_fits(need, e.device, what, "lower --slots, --particles, --draft-len or --max-new-tokens")
    return caps
