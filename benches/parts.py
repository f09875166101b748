"""bench.py parts: where each method's cycle spends its time, seen at the seam between the engine and the machine.
For the run, bench puts a timer around each call of the models' backend (kernels.Backend, or the CPU wing's) and
around the models' forwards: a call's own time, less that of the timed calls inside it, counts in its part
(PARTS), a forward's own time in "other model ops"; the rest of each phase of a cycle (the engine's observer times
them) is the rule's, and the time between cycles the host's."""
import collections
import contextlib
import statistics
import time
import types

from benches import common
from cpu import native

HELP = ("where each method's cycle spends its time: matmuls (with the norms, RoPE and SwiGLU in their calls), "
        "attention, other model ops, sampling, the rule, the host (each call of the models' backend timed)")
QUICK = dict(new_tokens=16, repeats=1)
PART_NAMES = ("matmuls", "attention", "other model ops", "sampling", "the rule", "host")
# Every call of kernels.Backend by its part; a name the backend lacks fails when it is wrapped. A layer's own time
# is its glue, less the C code of a w4a8 layer in one call, which it splits by part (ONE_CALL).
PARTS = {"linear": "matmuls", "normed_linear": "matmuls", "residual_normed_linear": "matmuls",
         "gated_linear": "matmuls", "rms_norm": "matmuls", "add_rms_norm": "matmuls", "rope": "matmuls",
         "qk_norm_rope": "matmuls", "silu_mul": "matmuls",
         "prefill_attention": "attention", "particle_attention": "attention",
         "fused_layers": "other model ops", "layer": "other model ops",
         "sample": "sampling", "token_logprobs": "sampling",
         "resample": "the rule", "gather_suffix": "the rule", "compact": "the rule"}
FORWARDS = {"step": "other model ops"}  # a model's forward in a cycle
ONE_CALL = {"matmuls": "matmuls", "attention and KV writes": "attention", "residual adds": "other model ops"}


def options(p):
    common.add_methods(p, "ar,sd,smc", common.SINGLE)
    p.add_argument("--grid", type=common.grid, default=common.grid("3x2"), help="smc's (and mdsd's) N x K cells")
    common.add_sd_draft_len(p)
    common.add_runs(p, new_tokens=48)
    common.add_prompt_len(p)


class Seam:
    """Timers around named methods, and the engine's observer that adds up, by part, the calls inside each phase."""

    def __init__(self):
        self.wrapped = []  # (owner, name) of each timer, to take off again
        self.open = []  # the seconds of the timed calls inside each call under way, the innermost last
        self.calls = []  # each outermost call since the last phase: its end and its own seconds by part
        self.spent = collections.Counter()  # seconds by part of the phases' calls, and the rule's
        self.cycles_s = 0.0  # the phases' seconds
        self.first = None  # when the first phase began
        self.last = None  # when the last phase ended

    def wrap(self, owner, names):
        """Each method of owner that names {name: part} lists, timed into part (on owner itself, till unwrap)."""
        for name, part in names.items():
            method = getattr(owner, name, None)
            if not callable(method):
                raise AttributeError(f"bench.py parts: {type(owner).__name__} has no {name}() to time (PARTS)")
            setattr(owner, name, self.timer(method, part))
            self.wrapped.append((owner, name))

    def unwrap(self):
        for owner, name in self.wrapped:
            delattr(owner, name)
        self.wrapped.clear()

    def timer(self, method, part):
        def timed(*args, **kwargs):
            return self.call(method, part, args, kwargs)
        return timed

    def call(self, method, part, args, kwargs):
        """method(*args, **kwargs), its own time (less the timed calls inside it) added to part."""
        if not self.open:
            self.calls.append(types.SimpleNamespace(end=0.0, spent=collections.Counter()))
        record = self.calls[-1]
        self.open.append(0.0)
        with native.timing() as layers:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.close(record, part, start, layers)

    def close(self, record, part, start, layers):
        """The call begun at start ends: its own seconds into record, a layer in one call's C code by its parts."""
        end = time.perf_counter()
        took = end - start
        own = took - self.open.pop()
        for name, seconds in zip(native.LAYER_PARTS, layers):
            record.spent[ONE_CALL[name]] += seconds
            own -= seconds
        record.spent[part] += own
        record.end = end
        if self.open:
            self.open[-1] += took

    def phase(self, batch, name, seconds):
        """The engine's observer: a phase of a cycle ended now. The calls that ended in it count by part, the rest
        of it in the rule; earlier ones (a prefill's) fall between cycles, the host's."""
        end = time.perf_counter()
        start = end - seconds
        inside = [c for c in self.calls if c.end > start]
        self.calls.clear()
        for c in inside:
            self.spent.update(c.spent)
        self.spent["the rule"] += seconds - sum(sum(c.spent.values()) for c in inside)
        self.cycles_s += seconds
        if self.first is None:
            self.first = start
        self.last = end

    def parts_ms(self, cycles):
        """{part: ms per cycle}, "host" the time from the first phase's start to the last's end outside them."""
        spent = {part: self.spent[part] for part in PART_NAMES}
        spent["host"] = self.last - self.first - self.cycles_s
        return {part: 1e3 * seconds / cycles for part, seconds in spent.items()}


@contextlib.contextmanager
def timed_seam(e):
    """Yields a Seam around e's models' forwards and their backends' calls, told of e's phases; as they were after."""
    seam = Seam()
    models = [m for m in (e.target, e.draft) if m is not None]
    backends = {id(m.backend): m.backend for m in models}  # the models may share one
    try:
        for m in models:
            seam.wrap(m, FORWARDS)
        for backend in backends.values():
            seam.wrap(backend, PARTS)
        with e.watching(seam.phase):
            yield seam
    finally:
        seam.unwrap()


def cycle_parts(e, ids, method, N, K, new_tokens):
    """One request of method, eager, its backend's calls timed (timed_seam) -> ({part: ms per cycle}, its stats).
    The timers slow the small calls most, so the small parts read high: the matmuls' share is a lower bound."""
    with timed_seam(e) as seam:
        stats = e.generate(ids, method=method, max_new_tokens=new_tokens, temperature=common.TEMPERATURE,
                           particles=N, draft_len=K, cuda_graphs=False).stats
    return seam.parts_ms(max(stats["cycles"], 1)), stats


def part_rows(e, ids, args):
    """For each method: its cycle's ms untimed (the median of `repeats` runs), and split by part (cycle_parts)."""
    rows = []
    for method, N, K in common.configs(args, args.grid):
        common.run_engine(e, ids, method, N, K, 4 * K, 0)  # warm-up
        untimed = []
        for repeat in range(args.repeats):
            stats = common.run_engine(e, ids, method, N, K, args.new_tokens, repeat)
            untimed.append(1e3 * (stats["seconds"] - stats["prefill_seconds"]) / max(stats["cycles"], 1))
        split, stats = cycle_parts(e, ids, method, N, K, args.new_tokens)
        rows.append({"method": method, "N": N, "K": K, "weights": common.weights_of(e),
                     "tokens_per_cycle": stats["new_tokens"] / max(stats["cycles"], 1),
                     "cycle_ms": statistics.median(untimed), "profiled_ms": sum(split.values()), "parts_ms": split})
    return rows


def parts_table(rows):
    head = ["method", "N", "K", "tokens/cycle", "cycle ms", "profiled ms", *PART_NAMES, "matmuls' share"]
    return common.table(head, [[f"{r['method']} ({r['weights']})", *common.cells_nk(r), f"{r['tokens_per_cycle']:.2f}",
                                f"{r['cycle_ms']:.1f}", f"{r['profiled_ms']:.1f}",
                                *[f"{r['parts_ms'][p]:.1f}" for p in PART_NAMES],
                                f"{r['parts_ms']['matmuls'] / r['profiled_ms']:.0%}"] for r in rows])


def run(args, device, rank, world, report):
    """Each method's cycle split by part, on the code prompt."""
    e, _ = common.load_pair(args, device, world)
    report["models"] = common.models_section(e)
    ids = next(iter(common.prompts(args, e).values()))
    report["parts"] = part_rows(e, ids, args)
    common.show(parts_table(report["parts"]))
