"""The engine: generation by autoregressive decoding (ar), speculative sampling (sd, mdsd, easd, racer drafts) and
sequential Monte Carlo speculative decoding (smc), for one prompt or many, from Python. `python engine.py` runs the
command line (cli.py).

Top to bottom: Request and Result; Engine, the API (generate, stream, serve); the functions beneath it. A request's
options are settings.py's, batches and their rounds scheduler.py's, each method's own parts methods.py's."""
import contextlib
import functools
import os
import queue
import runpy
import sys

import torch

import decode
import formats
import loading
import model
import platforms
import racer
import scheduler
from errors import DeviceFailed, UsageError, require
from methods import METHODS
from request import Request, capacity
from settings import SETTINGS, Settings

ROOT = os.path.dirname(os.path.abspath(__file__))
SLOTS = 4  # requests decoded together by a server, or by the CLI from a .jsonl file
BATCH = 8  # the most prompts of one generate call decoded together, by default
CONTEXT = 2048  # the tokens a server's slot holds, by default


# ---------------------------------------------------------------- engine


def on_disk(path):
    """The bytes of a .gguf file, or of a model directory's weights."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def reading(paths):
    """'PATH (1.1 GB) and the draft PATH (0.4 GB)': the files of [target, draft] (None: none) that load() reads."""
    parts = []
    for path, what in zip(paths, ("", "the draft ")):
        if not path:
            continue
        size = on_disk(path)
        if size >= 1e9:
            parts.append(f"{what}{path} ({size / 1e9:.1f} GB)")
        else:
            parts.append(f"{what}{path} ({size / 1e6:.1f} MB)")
    return " and ".join(parts)



class Engine:
    """A target and an optional draft, each a path (Hugging Face directory or .gguf file), or both models already built
    (`of_models`: prompts are ids, results have no text); draft "racer" drafts without a model. Paths open at once: a
    bad request is refused before `load()` reads a weight. weights: formats.FORMATS' (both models) or "auto" (paths
    on a CPU: each model's measured once on this machine and kept; remeasure: measured again). Under torchrun each
    rank holds its target shard and decodes alike (same logits and rng). observers: each told (batch, phase, seconds)
    of every phase the batches run (scheduler.Batch; also `watching`), which runs as it would unwatched.
    on_line(text): each line the engine reports (auto's measuring and choices, the files it reads); None: none.
    A user's calls: generate, stream, serve (with request, which makes what serve takes)."""

    def __init__(self, target, draft=None, device=None, weights=None, remeasure=False, observers=(), on_line=None,
                 draft_weights=None):
        """An engine on model files: paths or Hub ids (draft also "racer" or None); draft_weights: the draft's format
        where it differs from weights'."""
        self.begin(observers, on_line)
        self.open(target, draft, device)
        self.choose_formats(weights, remeasure, draft_weights)

    @classmethod
    def of_models(cls, target, draft=None, weights=None, observers=(), on_line=None, draft_weights=None):
        """An engine on models already built (model.Transformer; draft also "racer" or None): no tokenizer (prompts
        are ids), the models' own device and formats (weights, draft_weights: the names of theirs, for reports;
        default bf16, and the draft's the target's)."""
        e = cls.__new__(cls)
        e.begin(observers, on_line)
        e.hold(target, draft)
        e.choose_formats(weights, False, draft_weights)
        return e

    # ------------------------------------------------ what a user calls

    def generate(self, prompt, on_tokens=None, slots=None, **options):
        """prompt: text, ids or {"prompt": ..., **its options} -> Result(text, tokens, stats); a list of prompts ->
        [Result], decoded together, `slots` at a time (default: up to BATCH), each with its own randomness. options:
        Settings' fields, and stop. on_tokens(settled tokens), called as more settle, stops the request by returning
        True. stats["stop"]: "eos", "length", "stop", "stopped", "interrupted", or "degenerate" (smc: no weight);
        serving also "refused" (too large for a slot or the memory free), "error" and "cancelled"."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, dict, list, tuple)):
            return run(self, prepared(self, items_of(prompt, options)), slots)
        one = items_of([prompt], options | {"on_tokens": on_tokens})
        return run(self, prepared(self, one, numbered=False), 1)[0]

    def stream(self, prompts, slots=None, **options):
        """generate's list form as it goes: yields (i, text, None) as the i-th prompt's text settles, then
        (i, "", Result) when it ends (models without a tokenizer: the Results only)."""
        events = []
        requests = prepared(self, items_of(prompts, options))
        for i, req in enumerate(requests):
            req.on_text = functools.partial(on_event, events, i, done=False)
            req.on_done = functools.partial(on_event, events, i, done=True)
        for _ in serving(self, requests, slots):
            yield from events
            events.clear()
        yield from events

    def serve(self, inbox, slots=SLOTS, context=CONTEXT, idle_s=scheduler.IDLE_S):
        """Decode the Requests put in inbox (a queue.Queue; `request` makes them) until None arrives (what still runs
        ends "cancelled"). context: the tokens a slot holds (a pair (prompt, rest) for each apart; check requests with
        request(context=)). A failing batch ends its requests "error" and serving goes on; a failed device ends them
        all: DeviceFailed."""
        caps = context if isinstance(context, tuple) else (context, context)
        for _ in serving(self, inbox, slots, caps, idle_s):
            pass

    def request(self, prompt, stop=(), on_tokens=None, on_text=None, on_done=None, on_cycle=None, context=None,
                **options):
        """A prompt (text or ids) and options (Settings' fields) -> a checked Request, before any weight is read;
        or a UsageError. stop: strings that end the text. context: the most tokens (prompt, new ones and a draft
        block) a slot of the serving batch holds, where that is below the models' context. N and K left open are
        auto's choice (`choose_shapes`, which `prepared` runs) or the defaults: a request measures nothing."""
        s = Settings.of(options).check(self.vocab, self.drafts())
        if isinstance(stop, str):
            stop = [stop]
        strings = isinstance(stop, (list, tuple)) and all(isinstance(x, str) and x for x in stop)
        require(strings, "stop must be a string or a list of non-empty strings", "stop")
        require(not stop or self.tokenizer is not None, "stop strings need a tokenizer: this engine's models have "
                "none", "stop")
        ids = self.encode(prompt)
        settings = s.resolve(self.device, self.chosen)
        shape = settings.shape(self.racer)
        drafter = None
        if shape.tree:
            drafter = racer.Retrieval(ids, chain=not settings.tree)
        return Request(ids, settings, shape, capacity(self, len(ids), settings, shape, context), stop, self.tokenizer,
                       self.ends, drafter, on_tokens, on_text, on_done, on_cycle)

    # ------------------------------------------------ the models: opened, formats chosen, read

    def begin(self, observers, on_line):
        self.on_line = on_line
        self.failure = None
        # each called (batch, phase, seconds) after every phase a batch runs (scheduler.Batch): traces, bench.py
        self.observers = list(observers)

    def open(self, target, draft, device):
        """The models' files opened (their configs and tokenizer read, no weight yet); under torchrun, this rank's
        place."""
        if isinstance(target, model.Transformer) or isinstance(draft, model.Transformer):
            raise UsageError("Engine(...) takes model files; give models already built to Engine.of_models(...)")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError("CUDA is not available here; use --device cpu")
        self.racer = draft == "racer"
        if self.racer:
            draft = None
        self.target = None
        self.draft = None
        self.paths = loading.local_paths([target, draft])  # the files (a Hub id's in the Hugging Face cache)
        # a path's loading.Opened until load() reads its weights
        self.opened = [loading.open_weights(path) if path else None for path in self.paths]
        target_file = self.opened[0]
        draft_file = self.opened[1]
        self.rank, self.world = model.init_distributed(device)
        self.config = model.shard_config(target_file.config, self.world)  # this rank's
        self.tokenizer = target_file.tokenizer
        files = [f for f in self.opened if f]
        vocab = loading.shared_vocabulary([f.config for f in files], [f.tokenizer for f in files], self.paths)
        self.place(device, None if draft_file is None else draft_file.config, vocab)

    def hold(self, target, draft):
        """The models given, on their device."""
        self.racer = draft == "racer"
        if self.racer:
            draft = None
        self.target = target
        self.draft = draft
        self.paths = [None, None]
        self.opened = [None, None]
        self.rank = 0
        self.world = 1
        self.config = target.config
        self.tokenizer = None
        configs = [m.config for m in (target, draft) if m is not None]
        self.place(target.device, None if draft is None else draft.config, loading.shared_vocabulary(configs, [], []))

    def place(self, device, draft_config, vocab):
        """The device's platform (platforms.py: its backend, formats and builds); the ids every method samples from
        (vocab: loading.shared_vocabulary's), the pad the next one; the table of the tokens that end a text."""
        self.device = device
        self.platform = platforms.for_device(device)
        self.draft_config = draft_config
        self.vocab = vocab
        self.pad = vocab
        eos = [i for i in self.config.eos_ids if i < vocab]
        self.is_eos = torch.zeros(self.pad + 1, dtype=torch.bool, device=self.device)
        self.is_eos[eos + [self.pad]] = True
        self.ends = set(eos) | {self.pad}

    def choose_formats(self, weights, remeasure, draft_weights=None):
        """The models' weight formats: weights as given (the draft's draft_weights where given), or "auto"'s (a CPU's
        measuring, when load() reads them), and the memory they take checked before any weight is read."""
        one_process = self.world == 1 and bool(self.opened[0])  # model files read by one process
        self.auto = weights in (None, "auto") and self.platform.name == "cpu" and one_process
        if self.auto:
            self.weights = "auto"
        elif weights in (None, "auto"):
            self.weights = "bf16"
        else:
            self.weights = self.platform.usable(weights)
        self.draft_weights = self.weights
        if draft_weights is not None:
            require(not self.auto, "--draft-weights with --weights auto: auto chooses both; name a target format with "
                    "--weights, or drop --draft-weights", "draft_weights")
            self.draft_weights = self.platform.usable(draft_weights)
        self.chosen = {}  # method -> the (N, K) auto measured for it
        self.dtype = torch.bfloat16 if self.auto else formats.FORMATS[self.weights]
        if self.target:
            self.dtype = self.target.embed.dtype
        unread = scheduler.unread_bytes(self)
        scheduler.check_fits(unread, self.device, "the weights", "try a smaller model or another --device")
        self.measurement = None  # weights auto's: asked by load() and by request() for smc's and sd's shapes
        if self.auto:
            price = functools.partial(scheduler.unread_bytes, self)  # of (the target's format, the draft's)
            self.measurement = self.platform.measurement(self.opened, self.draft_config, price,
                                                         scheduler.free_bytes(self.device), self.paths, remeasure,
                                                         self.say)

    def load(self, shape=None):
        """Read the weights (once) -> self; with weights "auto", first measure which format suits shape's cycles."""
        if self.weights == "auto" and self.target is None:
            shape = shape or Settings().resolve(self.device).shape(self.racer)
            (self.weights, self.draft_weights), line = self.measurement.choose_weights(shape)
            self.dtype = formats.FORMATS[self.weights]
            self.say(line)
        target_file = self.opened[0]
        draft_file = self.opened[1]
        files = [path if opened else None for path, opened in zip(self.paths, self.opened)]  # those not yet read
        if any(files) and self.rank == 0:
            self.say(f"loading {reading(files)} ...")
        if self.target is None and target_file:
            self.target = self.built(0, self.weights, wider=True)
        if self.draft is None and draft_file:
            self.draft = self.built(1, self.draft_weights, wider=False)
        self.opened = [None, None]
        return self

    def built(self, i, fmt, wider):
        """-> the Transformer of self.paths[i] (0 the target, its rank's shard; 1 the draft) in weight format fmt, as
        the platform builds it."""
        tp = (self.rank, self.world) if i == 0 else (0, 1)
        return self.platform.build(self.paths[i], self.opened[i], ("target", "draft")[i], fmt, wider, tp, self.say)

    # ------------------------------------------------ what the cycles and the checks read

    def drafts(self):
        """What drafts for this engine: "model", "racer", or None (no draft: ar only)."""
        if self.racer:
            return "racer"
        if self.draft_config:
            return "model"
        return None

    def say(self, line):
        if self.on_line:
            self.on_line(line)

    @property
    def models(self):
        """What decode's cycles read of this engine (after load())."""
        return decode.Models(self.target, self.draft, self.is_eos, self.pad, self.target.backend)

    @contextlib.contextmanager
    def watching(self, observer):
        """observer(batch, phase, seconds) told of every phase the batches run in the block (scheduler.Batch)."""
        self.observers.append(observer)
        try:
            yield
        finally:
            self.observers.remove(observer)

    def encode(self, prompt):
        """A prompt (text, or ids) -> its checked ids."""
        if isinstance(prompt, str):
            require(self.tokenizer is not None, "this engine has no tokenizer: give the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = prompt
        is_ids = isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        require(is_ids, "a prompt is text or a list of token ids")
        blank = isinstance(prompt, str) and not prompt.strip()
        require(ids and not blank, "the prompt is empty or only whitespace")
        require(all(0 <= i < self.vocab for i in ids), f"prompt token ids must lie in [0, {self.vocab})")
        return list(ids)

    def device_ok(self):
        """Whether the device still runs work (a CUDA error is sticky: every later call fails)."""
        try:
            return self.device.type != "cuda" or torch.cuda.synchronize(self.device) is None
        except RuntimeError:
            return False


# ---------------------------------------------------------------- beneath the API


def items_of(prompts, options):
    """[{"prompt": ..., **options}] of prompts, each text, ids, or {"prompt": ..., **options of its own}."""
    items = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            items.append(options | prompt)
        else:
            items.append(options | {"prompt": prompt})
    return items


def prepared(e, items, numbered=True):
    """Checked Requests of items ({"prompt": text or ids, **options}); under weights auto the (N, K) they leave
    open measured first (`choose_shapes`), once every item fits the least shape auto may choose. numbered: an error
    names its prompt's number."""
    if unchosen(e, items):
        each(items, functools.partial(check_least_shape, e), numbered)
        choose_shapes(e, items)
    return each(items, lambda item: e.request(**item), numbered)


def each(items, fn, numbered):
    """[fn(item)] for items; numbered: a UsageError (or a wrong keyword) names the item's number."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(fn(item))
        except (UsageError, TypeError) as error:
            if not numbered:
                raise
            raise UsageError(f"prompt {i + 1}: {error}", getattr(error, "param", None)) from None
    return out


def unchosen(e, items):
    """The names of the methods of items ({"prompt", options...}) whose (N, K) weights auto is still to choose (smc's
    and sd's: those with auto_cells), where an item leaves them open."""
    names = set()
    if not (e.auto and e.draft_config):
        return names
    for item in items:
        spec = METHODS.get(item.get("method", Settings.method))
        if spec is None or not spec.auto_cells:  # an unknown method is the check's to name
            continue
        given = item.get("draft_len") is not None and (item.get("particles") is not None or not spec.particles)
        if not given and spec.name not in e.chosen:
            names.add(spec.name)
    return names


def choose_shapes(e, items):
    """weights auto: the (N, K) of each method (smc, sd) that items leave open, measured once on this machine (kept;
    each said, with a note where ar or sd is predicted faster)."""
    for name in sorted(unchosen(e, items)):
        spec = METHODS[name]
        e.chosen[name], line = e.measurement.choose_shape(spec, e.weights, e.draft_weights)
        e.say(line)
        _, note = e.measurement.speed_note(spec, e.chosen[name], e.weights, e.draft_weights)
        if note:
            e.say(note)


def check_least_shape(e, item):
    """The context and memory item's request needs in the least shape auto may choose (a draft block of one, one
    particle unless given): a request that fails there fails in every shape, so it is refused before measuring."""
    options = {name: value for name, value in item.items() if name in SETTINGS}
    least = Settings.of(options).check(e.vocab, e.drafts())
    least = least.resolve(e.device, {method: (1, 1) for method in METHODS})
    shape = least.shape(e.racer)
    ids = e.encode(item.get("prompt"))
    needs = capacity(e, len(ids), least, shape, item.get("context"))
    scheduler.check_memory(e, [Request(ids, least, shape, needs)], 1)


def run(e, requests, slots=None):
    """Decode checked Requests to the end -> their Results."""
    for _ in serving(e, requests, slots):
        pass
    return [req.result for req in requests]


def serving(e, inbox, slots=None, caps=None, idle_s=scheduler.IDLE_S):
    """The Scheduler's loop, yielding after every round, over a list of Requests (checked to fit, `slots` at a
    time, default up to BATCH, until all end) or a queue.Queue (slots of caps tokens, until None arrives)."""
    until_idle = isinstance(inbox, list)
    if until_idle:
        requests = inbox
        slots = slots or min(len(requests), BATCH)
        caps = scheduler.check_memory(e, requests, slots)
        e.load(requests[0].shape)
        inbox = queue.Queue()
        for req in requests:
            inbox.put(req)
    sched = scheduler.Scheduler(e.load(), slots, caps, until_idle, idle_s)
    with torch.inference_mode():
        try:
            yield from sched.rounds(inbox, until_idle)
        except KeyboardInterrupt:
            sched.end_all("interrupted")
        except DeviceFailed as error:
            e.failure = str(error)
            sched.end_all("error", error)
            raise
        finally:  # what an error left (until_idle raises): the overlap's threads
            for b in sched.batches.values():
                b.close()


def on_event(events, i, value, done):
    """Engine.stream's callbacks: the i-th prompt's text piece, or its Result (done), as an event."""
    if done:
        events.append((i, "", value))
    else:
        events.append((i, value, None))


def apply_chat(tokenizer, messages):
    """messages (a list of {"role", "content"}, or one text: a user message) in the tokenizer's chat template,
    ending where the reply begins; the texts joined by newlines when there is no template."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not tokenizer or not tokenizer.chat_template:
        return "\n".join(m["content"] for m in messages)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def fail(message):
        raise UsageError(f"chat template: {message}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = fail
    return env.from_string(tokenizer.chat_template).render(messages=messages, add_generation_prompt=True,
                                                           bos_token="", eos_token="")


def say(line):
    """The CLI's engine lines, on stderr."""
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":  # python engine.py: cli.py is the program, which imports this module as `engine`
    runpy.run_module("cli", run_name="__main__")
