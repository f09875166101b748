"""--weights auto: the timing of one forward's matmuls in each weight
format (formats.py), the formats and the smc and sd cycle shapes chosen from those timings, and the choices kept on
disk once per machine and pair of models, so that a fixed seed gives the same tokens in every process."""
import collections
import copy
import dataclasses
import json
import math
import os
import sys
import timeit

import torch

import errors
import formats
import kernels
import methods
import model
from cpu import backend as cpu_backend
from cpu import formats as cpu_formats
from cpu import native, store

# ---------------------------------------------------------------- this machine
def cache_bytes():
    """This CPU's last-level cache (sysfs), 32 MiB where that does not say."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            return int(f.read().strip().removesuffix("K")) * 1024
    except (OSError, ValueError):
        return 32 * 2**20


# ---------------------------------------------------------------- the formats this machine runs fastest
FOUR_BITS = ("int4", "w4a8")  # the formats that hold a file's 4-bit blocks as they are, its wider ones wide


def file_format(opened):
    """The format auto keeps unless another is clearly faster. Where most of a model file's matmul values are 4-bit
    blocks (a Q4_K_M GGUF file), w4a8, which holds them as they are and multiplies them as llama.cpp does (int8
    activations), or int4 where w4a8's kernel cannot be built; else bf16. opened: the file's loading.Opened."""
    c = opened.config
    get = opened.get
    sizes = {name: math.prod(s) for name, s in model.expected_shapes(c).items() if len(s) == 2}
    four = sum(n for name, n in sizes.items() if get(name, (0, 0, 1), "format") == "int4")
    if 2 * four <= sum(sizes.values()):
        return "bf16"
    if native.library()[0] is None:
        return "int4"
    return "w4a8"


def clear_winner(costs, home):
    """The cheapest format in costs ({format: ms}) if it beats home by a fifth and 5 ms (a scheduler's time slice),
    else home: so that timing noise does not change the format, and with it the tokens of a fixed seed."""
    best = min(costs, key=costs.get)
    gain = costs[home] - costs[best]
    return best if gain > 0.2 * costs[home] and gain > 5 else home


# ---------------------------------------------------------------- auto's choices, kept once per machine


def machine_key(paths, draft_config):
    """What decides auto's choices: this CPU, its threads, torch's version, the code that times and chooses (the C
    kernels' too), and the models (paths: [target, draft] files; a draft without a file by its Config), as JSON reads
    it back."""
    modules = (sys.modules[__name__], formats, kernels, cpu_formats, cpu_backend, native)
    sources = [m.__file__ for m in modules] + [native.SOURCE]
    code = "".join(open(path).read() for path in sources)
    draft = None
    if paths[1]:
        draft = store.file_identity(paths[1])
    elif draft_config:
        draft = dataclasses.asdict(draft_config)
    key = store.cpu_identity() | {"threads": torch.get_num_threads(), "torch": torch.__version__,
                                  "code": store.digest(code), "target": store.file_identity(paths[0]), "draft": draft}
    return json.loads(json.dumps(key))


def read_kept(path, key):
    """-> ({decision: (choice, line)}, {timings' key: seconds}) kept in path for key; empty where there is no file.
    A file that is not JSON, not whole, or another key's raises one of store.UNREADABLE."""
    try:
        with open(path) as f:
            kept = json.load(f)
    except FileNotFoundError:
        return {}, {}
    if kept["key"] != key:
        raise ValueError("another machine's or models' choices")
    choices = {}
    for decision, (choice, line) in kept["choices"].items():
        if isinstance(choice, list):  # JSON's arrays: the tuples they were
            choice = tuple(choice)
        choices[decision] = (choice, str(line))
    timings = {tuple(t[:5]): float(t[5]) for t in kept["timings"]}
    return choices, timings


class Measurement:
    """--weights auto for an engine's pair: one forward's matmuls timed in each weight format on this machine, each
    (matrix shape, format, threads, rows) once (self.timings), and from those timings the formats to load
    (choose_weights), the smc and sd cycle shapes (choose_shape) and how fast a shape is predicted to run beside ar
    (speed_note). Each choice is kept on disk (recall), so that a fixed seed gives the same tokens in every process.

    Built when the engine opens its files, from what they hold: opened, the engine's [target, draft] as
    loading.open_weights opened them (the draft's None: a draft model given, or none); draft_config, the draft's
    Config, file or model, or None; price((the target's format, the draft's)), what the files' weights take in them
    (scheduler.unread_bytes); free_bytes, the memory free;
    paths, the [target, draft] files (the target's None: nothing kept); remeasure: measure what the file keeps again;
    say(line): where its one-time lines go (measuring, read back, not kept)."""

    def __init__(self, opened=(None, None), draft_config=None, price=None, free_bytes=math.inf, paths=(None, None),
                 remeasure=False, say=None):
        target_file = opened[0]
        draft_file = opened[1]
        self.config = None
        self.home = "bf16"  # the target file's own format (file_format)
        self.held = collections.Counter()  # {matrix: how many} of the target's that int4 holds in int8
        self.wide = 8  # the bits w4a8 holds them in: 6 where the file's are 5 or 6 bits (formats.held_wide)
        if target_file:
            self.config = target_file.config
            self.home = file_format(target_file)
            held = formats.held_wide(target_file.config, target_file.get)
            self.held = collections.Counter(name.rpartition(".")[2] for name in held)
            self.wide = max(held.values(), default=8)
        self.draft_home = file_format(draft_file) if draft_file else None  # None: no draft file to choose a format of
        self.draft_config = draft_config
        self.price = price or (lambda fmts: 0)
        self.free_bytes = free_bytes
        self.timings = {}  # (out, in, format, threads, rows) -> seconds of one call of the CPU backend's linear
        self.remeasure = remeasure
        self.path = None  # the file that keeps the choices: one per machine and pair of models
        self.kept = {}  # decision -> (choice, line) read from that file
        self.measured = {}  # decision -> (choice, line) measured by this process, for that file
        self.say = say  # say(line): where the lines below go (None: nowhere)
        self.said = set()  # the one-time lines said: "measuring", "read back", "not kept"
        if paths[0]:
            self.key = machine_key(paths, draft_config)
            name = f"auto-{store.digest(json.dumps(self.key, sort_keys=True))}.json"
            self.path = os.path.join(store.cache_folder(), name)
        if self.path and not remeasure:
            self.read_file()

    def say_once(self, what, line):
        if what not in self.said and self.say:
            self.said.add(what)
            self.say(line)

    def read_file(self):
        """The choices and timings self.path keeps, if it is readable (else one line: measured again)."""
        try:
            self.kept, timings = read_kept(self.path, self.key)
        except store.UNREADABLE as error:
            self.say_once("unreadable", f"weights auto: {self.path} is unreadable ({error}); measuring again")
            return
        self.timings.update(timings)

    def recall(self, decision, measure, usable=None):
        """-> decision's (choice, line): read back where the file keeps it (and usable(choice) holds), else
        measure() -> (choice, line), kept in the file for the processes after this one."""
        if decision in self.kept and (usable is None or usable(self.kept[decision][0])):
            self.say_once("read back", f"weights auto: read back from {self.path} (measured once on this machine; "
                          "--remeasure measures again)")
            return self.kept[decision]
        once = "again, as asked" if self.remeasure else "once"
        where = f" ({once}; kept in {self.path})" if self.path else ""
        self.say_once("measuring", f"weights auto: measuring the weight formats on this CPU{where} ...")
        choice, line = measure()
        if self.path:
            self.keep(decision, choice, line)
        return choice, line

    def keep(self, decision, choice, line):
        """decision's choice and line, and every timing, into self.path beside what other processes kept there."""
        self.measured[decision] = (choice, line)
        try:
            on_disk, _ = read_kept(self.path, self.key)
        except store.UNREADABLE:  # said when read; replaced now
            on_disk = {}
        timings = [[*key, seconds] for key, seconds in self.timings.items()]
        kept = {"key": self.key, "choices": on_disk | self.measured, "timings": timings}
        try:
            with store.atomically(self.path) as temporary, open(temporary, "w") as f:
                json.dump(kept, f, indent=1)
        except OSError as error:
            self.say_once("not kept", f"weights auto: cannot keep the choices in {self.path} ({error}); the next run "
                          "measures again")

    def timed_calls(self, shape, fmt, rows, wide=0):
        """-> {rows: seconds of one call of the CPU backend's linear on a weight of shape [out, in] in format fmt
        (wide: as it holds a file's wider blocks of that many bits)}: the best of two passes over copies of it, back to
        back, that fill 1.5 times the CPU's last-level cache, so that each pass reads every copy from memory (at most
        256 copies: matrices that small are a tiny model's, whose forward hits the cache too)."""
        if fmt == "int4" and wide:  # int4 holds them in int8: its timings
            return self.timed_calls(shape, "int8", rows)
        key = (*shape, fmt, wide, torch.get_num_threads())
        todo = [r for r in rows if key + (r,) not in self.timings]
        if todo:
            values = torch.linspace(-0.05, 0.05, shape[1], dtype=formats.FORMATS[fmt])  # they alter no timing
            w = values.repeat(shape[0], 1)
            first = cpu_formats.converted(w, fmt, wide=wide)
            copies = min(255, int(1.5 * cache_bytes() // cpu_formats.matmul_bytes(fmt, *shape, wide)))
            linear = cpu_backend.Backend().linear
            ws = [first]
            for _ in range(copies):  # oneDNN's packed tensors cannot be copied: packed again
                ws.append(copy.deepcopy(first) if isinstance(first, torch.nn.Module) else cpu_formats.converted(w, fmt))
            for r in todo:
                x = torch.randn(r, shape[1], dtype=formats.FORMATS[fmt])
                passes = timeit.repeat(lambda: [linear(x, w) for w in ws], repeat=2, number=1)
                self.timings[key + (r,)] = min(passes) / len(ws)
        return {r: self.timings[key + (r,)] for r in rows}

    def measure_formats(self, c, rows, fmts=("bf16", "float32", "int8", "int4"), threads=None, held=None, wide=8):
        """-> {format: {rows: ms}}: one forward's matmuls on this CPU at each row count (1 for ar and draft steps,
        R x N x (K + 1) for a verify), in each of fmts that can hold c's shapes.
        Each of a layer's matrices (q/k/v, o, gate/up, down) and an eighth of the head's rows is timed (timed_calls)
        and counted as often as a forward runs it: whole matrices streamed from memory, as a forward's are (a small
        sample read alone costs more a weight). held {matrix: how many}: those int4 holds in int8 and w4a8 in codes of
        `wide` bits (a GGUF file's wider blocks: held_wide), priced so."""
        q = c.n_heads * c.head_dim
        kv = c.n_kv_heads * c.head_dim
        head = -(-c.vocab_size // 128) * 16
        sizes = [(q + 2 * kv, c.dim), (c.dim, q), (2 * c.ffn_dim, c.dim), (c.dim, c.ffn_dim), (head, c.dim)]
        shapes = dict(zip(formats.MATMULS, sizes))
        counts = {m: c.n_layers for m in formats.MATMULS[:4]} | {"lm_head": c.vocab_size / head}
        threads_before = torch.get_num_threads()
        per_call = {}
        wide_call = {}
        torch.set_num_threads(threads or threads_before)
        try:
            for fmt in fmts:
                try:
                    per_call[fmt] = {m: self.timed_calls(shape, fmt, rows) for m, shape in shapes.items()}
                    if held and fmt in FOUR_BITS:
                        wide_call[fmt] = {m: self.timed_calls(shapes[m], fmt, rows, wide=wide) for m in held}
                except errors.LoadError:  # int4 on sizes it cannot pack
                    continue
        finally:
            torch.set_num_threads(threads_before)
        costs = {fmt: {r: 1e3 * sum(counts[m] * t[m][r] for m in t) for r in rows} for fmt, t in per_call.items()}
        for fmt, wide in wide_call.items():  # its held share of each matrix at the wide cost
            for r in rows:
                extra = sum(counts[m] * n / (1 if m == "lm_head" else c.n_layers) *
                            (wide[m][r] - per_call[fmt][m][r]) for m, n in held.items())
                costs[fmt][r] += 1e3 * extra
        return costs

    def fits(self, fmt):
        """Whether both models' weights in format fmt fit the memory free, each weight at its format's bytes."""
        return self.price((fmt, fmt)) <= self.free_bytes

    def left_out(self, fmt):
        """One line on why auto does not time fmt (a 4-bit file's), where it does not: the memory, w4a8's kernel."""
        if fmt == "w4a8" and native.library()[0] is None:
            self.say_once(fmt, f"weights auto: w4a8 not timed: {native.library()[1]}")
        elif not self.fits(fmt):
            self.say_once(fmt, f"weights auto: {fmt} not timed: its weights need {self.price((fmt, fmt)) / 2**30:.2f} "
                          f"GiB, {self.free_bytes / 2**30:.2f} GiB is free")

    def candidates(self):
        """-> (the formats auto times for the target: bf16, float32 and int8 where they fit, and int4 and w4a8 for a
        4-bit file (each holds its blocks as they are; elsewhere they change the model more: on request only, as
        fp8, whose rounded activations change it as much); for the draft, those and int4 and w4a8, since its format
        changes only the proposals). w4a8 where its kernel builds here."""
        four = tuple(f for f in FOUR_BITS if f != "w4a8" or native.library()[0] is not None)
        tried = ("bf16", "float32", "int8")
        if self.home in FOUR_BITS:
            tried += four
            for fmt in FOUR_BITS:
                self.left_out(fmt)
        fits = [f for f in tried if self.fits(f)]
        drafts = fits + [f for f in four if f not in fits]
        return fits, drafts

    def cycle_costs(self, shapes, formats, draft_formats):
        """-> ({format: {(N, K): ms}} of a target forward of N x (K + 1) rows (K = 0: N rows), the same of K draft
        steps of N rows): the matmuls of an (N, K) cycle, each model's timed on its own shapes (measure_formats), in
        bf16 where none of its formats can hold them."""
        def timed(c, rows, fmts, held=None):
            costs = self.measure_formats(c, rows, tuple(fmts), held=held, wide=self.wide)
            return costs or self.measure_formats(c, rows, ("bf16",))
        target_rows = sorted({n * (k + 1) for n, k in shapes})
        target = timed(self.config, target_rows, formats, self.held)
        steps = {}
        if self.draft_config and any(k for _, k in shapes):
            steps = timed(self.draft_config, sorted({n for n, k in shapes if k}), draft_formats)
        target_costs = {f: {(n, k): ms[n * (k + 1)] for n, k in shapes} for f, ms in target.items()}
        step_costs = {f: {(n, k): k * ms.get(n, 0) for n, k in shapes} for f, ms in steps.items()}
        return target_costs, step_costs

    def per_token(self, method, cells, formats):
        """-> {(N, K): ms per token of method's cycle}: the cycle's matmuls (cycle_costs), each model in its cheapest of
        formats (a pair of lists: the target's, the draft's), over the tokens the cycle emits (method.emits; ar's cell
        (1, 0): one)."""
        target, steps = self.cycle_costs(cells, *formats)
        costs = {}
        for n, k in cells:
            cycle = min(ms[n, k] for ms in target.values()) + min((ms[n, k] for ms in steps.values()), default=0)
            costs[n, k] = cycle / method.emits(k)
        return costs

    def cheapest(self, method, formats):
        """-> (smc's or sd's cell, {cell: ms per token}): of method.auto_cells, the cycle that costs least per token
        (per_token), if clearly (clear_winner) below the method's default (auto_home)."""
        costs = self.per_token(method, method.auto_cells, formats)
        return clear_winner(costs, method.auto_home), costs

    def choose_weights(self, shape):
        """-> ((the target's format, the draft's), the line that says so): for each model the format (FORMATS) whose
        part of shape's cycle (cycle_costs; the method's verify rows, no draft where no draft model drafts) costs least
        on this machine, if clearly (clear_winner), else its file's own (file_format). The draft may also be int4: its
        format changes only the proposals, which sd and mdsd correct exactly and smc's weights account for (and it is
        int4 throughout, where the target keeps a Q4_K_M file's wider blocks wide, priced so: self.held). Kept
        (recall), unless the formats kept no longer fit the memory free."""
        rows = shape.method.rows(shape)
        drafted = self.draft_home is not None and shape.method.draft_model
        cell = (shape.particles, shape.draft_len) if drafted else (rows, 0)
        decision = f"weights {shape.method.name} {cell[0]}x{cell[1]}"

        def usable(choice):
            return all(self.fits(f) for f in choice)
        return self.recall(decision, lambda: self.measure_weights(shape.method.name, rows, cell, drafted), usable)

    def measure_weights(self, name, rows, cell, drafted):
        """choose_weights, measured: the named method's cycle of cell (N, K) (K = 0: `rows` rows, no draft)."""
        target, steps = self.cycle_costs([cell], *self.candidates())
        home = self.home if self.home in target else "bf16"
        chosen = clear_winner({f: ms[cell] for f, ms in target.items()}, home)
        draft = chosen
        if drafted:
            draft = clear_winner({f: ms[cell] for f, ms in steps.items()}, self.draft_home)

        def listed(costs):
            return ", ".join(f"{f} {ms[cell]:.0f}" for f, ms in costs.items())
        draft_part = f", draft {draft}" if drafted else ""
        steps_part = f"; its {cell[1]} draft steps at {cell[0]} rows: {listed(steps)}" if drafted else ""
        line = (f"weights: {chosen}{draft_part} (measured ms per {name} cycle at {rows} rows: "
                f"{listed(target)}{steps_part})")
        return (chosen, draft), line

    def formats_of(self, weights, draft_weights):
        """The formats a cycle's cost is taken in: auto's candidates, or the loaded weights' and draft_weights'."""
        if weights == "auto":
            return self.candidates()
        return [weights], [draft_weights]

    def choose_shape(self, method, weights="auto", draft_weights="auto"):
        """smc without --particles or --draft-len, sd without --draft-len -> ((N, K), the line that says so): the
        cheapest cell per token (cheapest), each model in its cheapest format (weights "auto": of candidates; else the
        loaded weights' and draft_weights'); kept (recall). The matmuls alone: the glue outside them grows with the
        rows too, so a wider cycle gains less than predicted; and each forward has its own, so sd's K = 1, twice the
        forwards a token, is left out."""
        decision = f"shape {method.name} {weights} {draft_weights}"
        return self.recall(decision, lambda: self.measure_shape(method, weights, draft_weights))

    def measure_shape(self, method, weights, draft_weights):
        """choose_shape, measured."""
        chosen, per_token = self.cheapest(method, self.formats_of(weights, draft_weights))
        prior = f", {methods.ACCEPTANCE} of draft tokens accepted"
        if method.weighted:  # smc rejects nothing
            prior = ""
        costs = ", ".join(f"{method.cell_name(c)} {ms:.0f}" for c, ms in per_token.items())
        return chosen, (f"{method.name} shape: {method.cell_name(chosen)} (measured ms per token, a cycle's matmuls in "
                        f"its cheapest formats{prior}: {costs})")

    def speed_note(self, method, cell, weights="auto", draft_weights="auto"):
        """smc's or sd's chosen cell -> (its predicted speed as a multiple of ar's, a note line where ar, or for smc sd
        at its own K, is predicted faster on this machine, else ""): ms per token of each (per_token), ar's and sd's
        in auto's formats; kept (recall)."""
        decision = f"speed {method.name} {cell[0]}x{cell[1]} {weights} {draft_weights}"
        return self.recall(decision, lambda: self.measure_speed(method, cell, weights, draft_weights))

    def measure_speed(self, method, cell, weights, draft_weights):
        """speed_note, measured."""
        auto = self.candidates()
        ar = self.per_token(methods.AR, [(1, 0)], (auto[0], []))[1, 0]
        ratio = ar / self.per_token(method, [cell], self.formats_of(weights, draft_weights))[cell]
        faster = {methods.AR: 1.0}
        if method.weighted:  # smc against sd too
            sd_cell, sd_costs = self.cheapest(methods.SD, auto)
            faster[methods.SD] = ar / sd_costs[sd_cell]
        best = max(faster, key=faster.get)
        if faster[best] <= ratio:
            return round(ratio, 2), ""
        option = f"--method {best.name}"
        if best is not methods.AR:
            option += f" ({faster[best]:.2f}x)"
        return round(ratio, 2), (f"note: {method.name} {method.cell_name(cell)} is predicted to run at {ratio:.2f}x "
                                 f"ar here (measured matmul costs); {option} is faster on this machine")
