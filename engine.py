"""Generation: autoregressive decoding (ar), speculative sampling (sd, mdsd, easd, racer drafts) and sequential
Monte Carlo speculative decoding (smc), for one prompt or many, from the command line or from Python.

Top to bottom: Settings and their one check; Request; Engine, the API; the CLI. Batches and their rounds are
scheduler.py's, each method's own parts methods.py's."""
import argparse
import contextlib
import functools
import json
import math
import os
import queue
import sys
import time
import typing
from dataclasses import dataclass, field, fields, replace

import torch

import decode
import formats
import loading
import model
import platforms
import racer
import scheduler
from errors import DeviceFailed, LoadError, UsageError, require
from methods import METHODS

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPT = "def quicksort(xs):\n"
EASD = (1.0, 5, 0.6)  # easd's rule: entropy (nats) both models must reach, top-m, share of the top-m they share
WEIGHTS = ("auto", *formats.FORMATS)
SLOTS = 4  # requests decoded together by a server, or by the CLI from a .jsonl file
BATCH = 8  # the most prompts of one generate call decoded together, by default
CONTEXT = 2048  # the tokens a server's slot holds, by default
PROGRESS_S = 5.0  # the CLI's prefill says how far it has come once it takes this long, and then this often
KINDS = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
         tuple: "three numbers ENTROPY,TOP,SHARE (TOP an integer)"}


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class Shape:
    """What the requests of one batch share, and so its key: the cycle's shape."""
    method: object  # methods.py's object
    particles: int
    draft_len: int
    ess_threshold: float
    power: float
    easd: tuple | None
    restrict: bool  # some request has top-k or top-p: the cycle restricts the target
    tree: int  # racer: the draft tokens verified per cycle (a chain of draft_len, or a tree)
    cuda_graphs: bool
    overlap: bool


def easd_rule(text):
    """--easd's ENTROPY,TOP,SHARE -> (float, int, float)."""
    try:
        entropy, top, share = text.split(",")
        return float(entropy), int(top), float(share)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ENTROPY,TOP,SHARE like 1.0,5,0.6, got {text!r}") from None


def option(default, help, **keywords):
    """A Settings field: its default, its --help and argparse's other keywords for it (choices, type, metavar);
    api_only=True keeps it off the command line."""
    return field(default=default, metadata={"help": help, **keywords})


def defaults_on(name, index):
    """The named method's default N (index 0) or K (1) on a CPU and on a GPU, in words."""
    shapes = METHODS[name].shapes
    return f"{shapes['cpu'][index]} on a CPU, {shapes['gpu'][index]} on a GPU"


@dataclass(frozen=True)
class Settings:
    """A request's options, the one source of their defaults, types and choices (the CLI's and the server's flags
    derive from these fields); `resolve` fills the defaults that depend on the device, `check` is the one check."""
    method: str = option("smc", "; ".join(f"{name}: {m.when}" for name, m in METHODS.items()), choices=tuple(METHODS))
    max_new_tokens: int = option(64, "the most tokens to generate")
    temperature: float = option(0.7, "draft and target temperature; 0 = greedy")
    draft_temperature: float | None = option(None, "the draft's temperature (default: --temperature)")
    target_temperature: float | None = option(None, "the target's temperature (default: --temperature)")
    particles: int | None = option(None, f"smc: particles N; mdsd: drafts N (default: {defaults_on('smc', 0)})")
    draft_len: int | None = option(None, f"draft tokens K per cycle (default: sd {METHODS['sd'].shapes['cpu'][1]}; "
                                         f"smc, mdsd {defaults_on('smc', 1)})")
    ess_threshold: float = option(0.5, "smc: resample when ESS < this * N")
    # A lag streams smc's text even where its weights never degenerate and so never resample.
    lag: int = option(16, "smc: collapse onto one particle past this many unsettled tokens (0: never)")
    top_k: int = option(0, "keep the k likeliest target tokens (0 = all)")
    top_p: float = option(1.0, "keep the target's top-p nucleus")
    seed: int = option(0, "the seed of every random draw")
    select: str = option("sample", "smc's returned particle: drawn in proportion to its weight, or the heaviest",
                         choices=("sample", "argmax"), api_only=True)
    cuda_graphs: bool = option(True, "run every cycle eagerly, not as a CUDA graph's replay")
    power: float = option(1.0, "smc: sample whole sequences from p ** power (normalised; > 1 sharper than the "
                               "target)")
    easd: tuple = option(EASD, "easd: reject the draft token where both models' entropies reach ENTROPY nats and their "
                               "top-TOP tokens share SHARE x TOP, the token among them",
                         type=easd_rule, metavar="ENTROPY,TOP,SHARE")
    tree: int = option(0, "--draft racer: draft a tree of up to NODES tokens, at most --draft-len deep, verified in "
                          "one forward (0: a chain)", metavar="NODES")
    overlap: bool = option(False, "MineDraft: one half of the slots drafts while the other verifies")

    @classmethod
    def of(cls, options):
        """Settings from a dict of options; an option that does not exist is a UsageError."""
        try:
            return cls(**options)
        except TypeError as error:
            raise UsageError(str(error).replace("Settings.__init__() ", "")) from None

    @property
    def kind(self):
        """The method's object (methods.py): its name looked up here, once."""
        return METHODS[self.method]

    def resolve(self, device, chosen=None):
        """Every default filled; chosen {method: (N, K)} (auto's measured shapes) before the method's defaults."""
        kind = self.kind
        home = "cpu" if torch.device(device).type == "cpu" else "gpu"
        particles, draft_len = (chosen or {}).get(self.method) or kind.shapes[home]
        if kind.particles and self.particles is not None:
            particles = self.particles
        if kind.drafts and self.draft_len is not None:
            draft_len = self.draft_len
        draft_temperature = self.temperature if self.draft_temperature is None else self.draft_temperature
        target_temperature = self.temperature if self.target_temperature is None else self.target_temperature
        return replace(self, particles=particles, draft_len=draft_len, draft_temperature=draft_temperature,
                       target_temperature=target_temperature)

    def check(self, vocab=None, draft="model"):
        """-> self, or a UsageError; draft: "model", "racer" or None; vocab: None while unknown."""
        self.check_types()
        self.resolve("cpu").check_values(vocab or math.inf, draft)
        return self

    def check_types(self):
        """Each option's type and choices, first, so that a JSON "hot" is named, not compared."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            kind = kind_of(f)
            require(has_kind(value, kind), f"{option_name(f.name)} must be {KINDS[kind]}, got {value!r}", f.name)
            if "choices" in f.metadata:
                choices = f.metadata["choices"]
                require(value in choices, f"unknown {f.name} {value!r} (choose from {', '.join(choices)})", f.name)

    def check_values(self, vocab, draft):
        """The ranges, and the options that go together, of these resolved settings; then the method's own."""
        kind = self.kind
        entropy, top, share = self.easd
        require(not kind.drafts or draft, f"method {self.method} needs a draft model (--draft)", "method")
        require(min(self.draft_temperature, self.target_temperature) >= 0, "temperatures must be >= 0", "temperature")
        require(self.particles >= 1, f"particles must be at least 1, got {self.particles}", "particles")
        require(self.draft_len >= 1, f"draft-len must be at least 1, got {self.draft_len}", "draft_len")
        require(0 <= self.ess_threshold <= 1, f"ess-threshold must lie in [0, 1], got {self.ess_threshold}",
                "ess_threshold")
        require(self.max_new_tokens >= 1, f"max-new-tokens must be at least 1, got {self.max_new_tokens}",
                "max_new_tokens")
        require(self.lag >= 0, f"lag must be at least 0 tokens (0: no bound), got {self.lag}", "lag")
        require(0 <= self.top_k <= vocab, f"top-k must lie in [0, {vocab}] (the vocabulary), got {self.top_k}", "top_k")
        require(0 < self.top_p <= 1, f"top-p must lie in (0, 1], got {self.top_p}", "top_p")
        require(0 <= self.seed < 2 ** 63, f"seed must lie in [0, 2**63), got {self.seed}", "seed")
        require(self.power > 0, f"power must be > 0 and is smc's (sd and ar sample the target itself), got "
                f"{self.power}", "power")
        kind.check(self)
        require(0 <= self.tree <= 64, f"tree must lie in [0, 64] draft tokens, got {self.tree}", "tree")
        require(entropy >= 0 and 1 <= top <= vocab and 0 <= share <= 1, f"easd takes ENTROPY >= 0, TOP in [1, {vocab}] "
                f"(the vocabulary) and SHARE in [0, 1], got {entropy},{top},{share}", "easd")
        require(draft != "racer" or kind.on_racer(), f"{self.method} needs a draft model's distribution, and racer "
                "drafts are deterministic tokens; use --method sd with --draft racer", "method")
        require(not self.tree or draft == "racer", "tree drafts come from racer: use --tree with --draft racer", "tree")
        require(not self.overlap or draft == "model" and kind.drafts, "overlap runs a draft model's drafting beside "
                "the target's verifying: use it with a draft model and any method but ar", "overlap")

    def restricts(self):
        """Whether top-k or top-p restricts the target."""
        return bool(self.top_k or self.top_p < 1)

    def shape(self, racer_drafts=False):
        """The batch key of these resolved settings: racer_drafts, the method that runs on racer's drafts."""
        kind = self.kind
        if racer_drafts:
            kind = kind.on_racer()
        return Shape(method=kind, particles=self.particles, draft_len=self.draft_len, power=self.power,
                     restrict=self.restricts(), cuda_graphs=self.cuda_graphs, overlap=self.overlap,
                     **kind.shape_fields(self))


SETTINGS = {f.name for f in fields(Settings)}  # a request's options that are Settings'


def option_name(name):
    """A Settings field's name as its command-line option says it: draft-len."""
    return name.replace("_", "-")


def kind_of(f):
    """The type of Settings field f's values (int for `int | None`)."""
    kinds = [kind for kind in typing.get_args(f.type) if kind is not type(None)]
    if kinds:
        return kinds[0]
    return f.type


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def has_kind(value, kind):
    """Whether value is of kind: JSON's true is no number, and easd's rule is three numbers, TOP an integer."""
    if kind is float:
        return is_number(value)
    if kind is tuple:
        numbers = isinstance(value, (tuple, list)) and len(value) == 3 and all(map(is_number, value))
        return numbers and isinstance(value[1], int)
    if kind is bool:
        return isinstance(value, bool)
    return isinstance(value, kind) and not isinstance(value, bool)


# ---------------------------------------------------------------- requests


class Request:
    """A checked prompt (ids) with its resolved Settings and Shape on its way through a batch, and its progress.
    Callbacks, called on the decoding thread: on_tokens(settled ids) as more settle (True stops the request),
    on_text(piece) with new settled text (whole characters; what may begin a stop string is held back),
    on_done(Result) at the end, on_cycle(batch, slot) after each cycle (traces). A stop string ends the text."""

    def __init__(self, ids, settings, shape, capacity, stop=(), tokenizer=None, ends=(), drafter=None, on_tokens=None,
                 on_text=None, on_done=None, on_cycle=None):
        self.ids = ids
        self.settings = settings
        self.shape = shape
        self.capacity = capacity  # the suffix a slot needs: the new tokens and a draft block
        self.stop_strings = list(stop)
        self.tokenizer = tokenizer
        self.ends = ends  # the EOS ids and the pad
        self.drafter = drafter  # racer's Retrieval, or None
        self.on_tokens = on_tokens
        self.on_text = on_text
        self.on_done = on_done
        self.on_cycle = on_cycle
        self.on_prefill = None  # on_prefill(layers done, layers) during the target's prefill of ids: progress
        self.settled = []  # the tokens that can no longer change
        self.shown = 0  # the characters of text passed to on_text
        self.streamed = 0  # the settled tokens passed on before the last cycle
        self.cycles = 0
        self.start = 0.0
        self.prefill_seconds = 0.0
        self.particle = 0  # the returned particle
        self.cancelled = False
        self.result = None

    def cancel(self):
        """Thread-safe: the request ends at its batch's next round, with stats["stop"] = "cancelled"."""
        self.cancelled = True

    def stats(self, tokens, why):
        """The statistics every request has (its method's own: `decode.method_stats`)."""
        new = len(until_eos(tokens, self.ends))
        seconds = 0.0
        if self.start:
            seconds = time.perf_counter() - self.start
        tokens_per_s = 0.0
        if seconds > 0:
            tokens_per_s = round(new / seconds, 2)
        if not why:
            why = "eos" if new < len(tokens) else "length"
        return {"method": self.settings.method, "prompt_tokens": len(self.ids), "new_tokens": new,
                "seconds": round(seconds, 4), "prefill_seconds": round(self.prefill_seconds, 4),
                "streamed": min(self.streamed, new), "tokens_per_s": tokens_per_s, "cycles": self.cycles, "stop": why}

    def release(self, tokens):
        """More settled tokens -> "stopped" or "stop" when on_tokens or a stop string ends the request, else None."""
        self.settled += tokens
        tokens = until_eos(self.settled, self.ends)
        if self.on_tokens and self.on_tokens(tokens):
            self.streamed = len(self.settled)
            return "stopped"
        if self.tokenizer and (self.on_text or self.stop_strings):
            text, cut = self.cut(self.tokenizer.decode(tokens))
            self.show(text, final=cut)
            if cut:
                return "stop"
        return None

    def cut(self, text):
        """-> (text before the first stop string, whether there was one)."""
        found = [text.find(string) for string in self.stop_strings if string]
        found = [at for at in found if at >= 0]
        if not found:
            return text, False
        return text[:min(found)], True

    def holds_stop(self, tokens):
        """Whether the text of tokens holds a stop string."""
        return self.cut(self.tokenizer.decode(until_eos(tokens, self.ends)))[1]

    def show(self, text, final):
        """Pass on the text not shown yet, holding back (until final) a half-decoded character and a tail that
        may begin a stop string."""
        end = len(text)
        if not final:
            end = len(text.rstrip("\ufffd"))
            end -= self.stop_prefix(text[:end])
        if self.on_text and end > self.shown:
            self.on_text(text[self.shown:end])
        self.shown = max(self.shown, end)

    def stop_prefix(self, text):
        """The length of text's longest tail that begins a stop string."""
        tails = [k for string in self.stop_strings for k in range(1, len(string)) if text.endswith(string[:k])]
        return max(tails, default=0)

    def finish(self, tokens, stats):
        """The Result from the returned particle's tokens; on_done."""
        tokens = until_eos(tokens, self.ends)
        text = None
        if self.tokenizer:
            text, cut = self.cut(self.tokenizer.decode(tokens))
            if cut:
                stats["stop"] = "stop"
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


def capacity(e, prompt_len, settings, shape, context=None):
    """The context's checks -> the suffix a request needs: its budget and a draft block of lookahead."""
    lookahead = 0  # what a cycle writes past the new tokens
    configs = [e.config]
    if settings.kind.drafts:
        lookahead = max(shape.tree, settings.draft_len)
        configs.append(e.draft_config)
    context = min([c.max_seq_len for c in configs if c is not None] + [context or math.inf])
    require(prompt_len < context, f"the prompt is {prompt_len} tokens, longer than the context of {context}")
    what = "tree" if shape.tree > settings.draft_len else "draft-len"
    require(prompt_len + lookahead + 1 <= context, f"{what} {lookahead} does not fit the context of {context} after a "
            f"{prompt_len}-token prompt; use at most {context - prompt_len - 1}", "draft_len")
    require(prompt_len + settings.max_new_tokens + lookahead <= context, f"max-new-tokens {settings.max_new_tokens} "
            f"does not fit the context of {context} after a {prompt_len}-token prompt; use at most "
            f"{context - prompt_len - lookahead}", "max_new_tokens")
    return settings.max_new_tokens + lookahead


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
    on_line(text): each line the engine reports (auto's measuring and choices, the files it reads); None: none."""

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
        self.place(device, None if draft_file is None else draft_file.config, draft)

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
        self.place(target.device, None if draft is None else draft.config, draft)

    def place(self, device, draft_config, draft):
        """The device's platform (platforms.py: its backend, formats and builds); the draft's vocabulary checked; the
        table of the tokens that end a text."""
        self.device = device
        self.platform = platforms.for_device(device)
        self.draft_config = draft_config
        if draft_config and draft_config.vocab_size != self.config.vocab_size:
            raise UsageError(f"{draft}: vocabulary size {draft_config.vocab_size} differs from the target's "
                             f"{self.config.vocab_size}")
        self.pad = self.config.vocab_size
        self.is_eos = torch.zeros(self.pad + 1, dtype=torch.bool, device=self.device)
        self.is_eos[self.config.eos_ids + [self.pad]] = True
        self.ends = set(self.config.eos_ids) | {self.pad}

    def choose_formats(self, weights, remeasure, draft_weights=None):
        """The models' weight formats: weights as given (the draft's draft_weights where given), or "auto"'s (a CPU's
        measuring, when load() reads them), and the memory they take checked before any weight is read."""
        one_process = self.world == 1 and bool(self.opened[0])  # model files read by one process
        self.auto = weights in (None, "auto") and self.platform.kind == "cpu" and one_process
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

    def choose(self, names):
        """weights auto: the (N, K) of each named method (smc, sd) that requests resolve to where they leave it open,
        measured once on this machine (kept; each said, with a note where ar or sd is predicted faster)."""
        for name in names:
            kind = METHODS[name]
            self.chosen[name], line = self.measurement.choose_shape(kind, self.weights, self.draft_weights)
            self.say(line)
            _, note = self.measurement.speed_note(kind, self.chosen[name], self.weights, self.draft_weights)
            if note:
                self.say(note)

    def unchosen(self, items):
        """The names of the methods of items ({"prompt", options...}) whose (N, K) auto is still to choose (smc's and
        sd's: those with auto_cells), where an item leaves them open."""
        names = set()
        if not (self.auto and self.draft_config):
            return names
        for item in items:
            kind = METHODS.get(item.get("method", Settings.method))
            if kind is None or not kind.auto_cells:  # an unknown method is the check's to name
                continue
            given = item.get("draft_len") is not None and (item.get("particles") is not None or not kind.particles)
            if not given and kind.name not in self.chosen:
                names.add(kind.name)
        return names

    @property
    def models(self):
        """What decode's cycles read of this engine (after load())."""
        return decode.Models(self.target, self.draft, self.is_eos, self.pad)

    @property
    def backend(self):
        """What runs the models' kernels (after load()): the target's, chosen when it was built."""
        return self.target.backend

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
        vocab = self.config.vocab_size
        require(all(0 <= i < vocab for i in ids), f"prompt token ids must lie in [0, {vocab})")
        return list(ids)

    def request(self, prompt, stop=(), on_tokens=None, on_text=None, on_done=None, on_cycle=None, context=None,
                **options):
        """A prompt (text or ids) and options (Settings' fields) -> a checked Request, before any weight is read;
        or a UsageError. stop: strings that end the text. context: the most tokens (prompt, new ones and a draft
        block) a slot of the serving batch holds, where that is below the models' context. N and K left open are
        auto's choice (`choose`, which `prepared` runs) or the defaults: a request measures nothing."""
        s = Settings.of(options).check(self.config.vocab_size, self.drafts())
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

    def check_least_shape(self, item):
        """The context and memory item's request needs in the least shape auto may choose (a draft block of one, one
        particle unless given): a request that fails there fails in every shape, so it is refused before measuring."""
        options = {name: value for name, value in item.items() if name in SETTINGS}
        least = Settings.of(options).check(self.config.vocab_size, self.drafts())
        least = least.resolve(self.device, {method: (1, 1) for method in METHODS})
        shape = least.shape(self.racer)
        ids = self.encode(item.get("prompt"))
        needs = capacity(self, len(ids), least, shape, item.get("context"))
        scheduler.check_memory(self, [Request(ids, least, shape, needs)], 1)

    def prepared(self, items, numbered=True):
        """Checked Requests of items ({"prompt": text or ids, **options}); under weights auto the (N, K) they leave
        open measured first (`choose`), once every item fits the least shape auto may choose. numbered: an error
        names its prompt's number."""
        methods = self.unchosen(items)
        if methods:
            self.each(items, self.check_least_shape, numbered)
            self.choose(sorted(methods))
        return self.each(items, lambda item: self.request(**item), numbered)

    def each(self, items, fn, numbered):
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

    def requests(self, prompts, **options):
        """Checked Requests for a list of prompts, each text, ids, or {"prompt": ..., **options of its own}."""
        items = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                items.append(options | prompt)
            else:
                items.append(options | {"prompt": prompt})
        return self.prepared(items)

    def generate(self, prompt, on_tokens=None, slots=None, **options):
        """prompt: text, ids or {"prompt": ..., **its options} -> Result(text, tokens, stats); a list of prompts ->
        [Result], decoded together, `slots` at a time (default: up to BATCH), each with its own randomness. options:
        Settings' fields, and stop. on_tokens(settled tokens), called as more settle, stops the request by returning
        True. stats["stop"]: "eos", "length", "stop", "stopped", "interrupted", or "degenerate" (smc: no weight);
        serving also "refused" (too large for a slot or the memory free), "error" and "cancelled"."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, dict, list, tuple)):
            return self.run(self.requests(prompt, **options), slots)
        if isinstance(prompt, dict):
            one = options | prompt
        else:
            one = options | {"prompt": prompt}
        return self.run(self.prepared([one | {"on_tokens": on_tokens}], numbered=False), 1)[0]

    def run(self, requests, slots=None):
        """Decode checked Requests to the end -> their Results."""
        for _ in self.serving(requests, slots):
            pass
        return [req.result for req in requests]

    def stream(self, prompts, slots=None, **options):
        """generate's list form as it goes: yields (i, text, None) as the i-th prompt's text settles, then
        (i, "", Result) when it ends (models without a tokenizer: the Results only)."""
        events = []
        requests = self.requests(prompts, **options)
        for i, req in enumerate(requests):
            req.on_text = functools.partial(on_event, events, i, done=False)
            req.on_done = functools.partial(on_event, events, i, done=True)
        for _ in self.serving(requests, slots):
            yield from events
            events.clear()
        yield from events

    def serve(self, inbox, slots=SLOTS, context=CONTEXT, idle_s=scheduler.IDLE_S):
        """Decode the Requests put in inbox (a queue.Queue) until None arrives (what still runs ends "cancelled").
        context: the tokens a slot holds (a pair (prompt, rest) for each apart; check requests with request(context=)).
        A failing batch ends its requests "error" and serving goes on; a failed device ends them all: DeviceFailed."""
        caps = context if isinstance(context, tuple) else (context, context)
        for _ in self.serving(inbox, slots, caps, idle_s):
            pass

    def serving(self, inbox, slots=None, caps=None, idle_s=scheduler.IDLE_S):
        """The Scheduler's loop, yielding after every round, over a list of Requests (checked to fit, `slots` at a
        time, default up to BATCH, until all end) or a queue.Queue (slots of caps tokens, until None arrives)."""
        until_idle = isinstance(inbox, list)
        if until_idle:
            requests = inbox
            slots = slots or min(len(requests), BATCH)
            caps = scheduler.check_memory(self, requests, slots)
            self.load(requests[0].shape)
            inbox = queue.Queue()
            for req in requests:
                inbox.put(req)
        sched = scheduler.Scheduler(self.load(), slots, caps, until_idle, idle_s)
        with torch.inference_mode():
            try:
                yield from sched.rounds(inbox, until_idle)
            except KeyboardInterrupt:
                sched.end_all("interrupted")
            except DeviceFailed as error:
                self.failure = str(error)
                sched.end_all("error", error)
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


def on_event(events, i, value, done):
    """Engine.stream's callbacks: the i-th prompt's text piece, or its Result (done), as an event."""
    if done:
        events.append((i, "", value))
    else:
        events.append((i, value, None))


# ---------------------------------------------------------------- command line


def default_pair():
    """(draft, target) GGUF files of the default Qwen2.5-Coder pair, fetched into weights/ if missing."""
    from weights import fetch
    return tuple(fetch.fetch_gguf(name) for name in fetch.DEFAULT_PAIR)


def model_paths(target, draft):
    """(target, draft) as a command line gives them: without --target, the default pair's (racer drafts stay)."""
    require(draft in (None, "racer") or target, "--draft needs --target")
    if target:
        return target, draft
    pair_draft, pair_target = default_pair()
    if draft == "racer":
        return pair_target, draft
    return pair_target, pair_draft


def device_of(name):
    """torch.device(name), or a UsageError naming the choices."""
    try:
        return torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use cpu or cuda") from None


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


def summary(stats):
    """The CLI's closing line: new tokens, speed and the method's statistics."""
    line = "[{method}: {new_tokens} new tokens, {tokens_per_s:.1f} tok/s" + METHODS[stats["method"]].summary
    if stats["stop"] == "interrupted":
        line += ", interrupted"
    return line.format(**stats) + "]"


def read_prompt(path):
    """The text of a prompt file, UTF-8; a missing, unreadable or non-UTF-8 file is a one-line UsageError."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise UsageError(f"{path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
                         "save it as UTF-8") from None


def read_jsonl(path):
    """The prompts of a JSONL file: one {"prompt": text, ...its own options} per line."""
    items = []
    for n, line in enumerate(read_prompt(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path}:{n}: not JSON ({error.msg})") from None
        require(isinstance(item, dict) and isinstance(item.get("prompt"), str),
                f'{path}:{n}: expected an object with a "prompt" string')
        items.append(item)
    require(items, f"{path}: no prompts")
    return items


def add_models(parser):
    """The options engine.py and server.py share: the models, their device and their weights' format."""
    parser.add_argument("--target", help="target model: Hugging Face directory, .gguf file or Hub id (org/name, "
                        "@revision, :FILE.gguf or :QUANT; from the Hugging Face cache, else downloaded) (default: the "
                        "weights/ pair's)")
    parser.add_argument("--draft", help="draft model, as --target, of the target's vocabulary (default: the weights/ "
                        "pair's); racer: drafts from retrieval and the target's own logits, no draft model (sd)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default %(default)s)")
    parser.add_argument("--weights", choices=WEIGHTS, default=WEIGHTS[0], help="matmul weights' format (activations "
                        "in the dtype its kernels want); auto: each model's fastest, smc's N x K, sd's K, measured "
                        "(CPU) (default %(default)s)")
    parser.add_argument("--draft-weights", choices=formats.FORMATS, help="the draft's matmul weights' format (fp8 on "
                        "CUDA sm_89+, int4: a draft in fewer bytes; smc's weights and sd's acceptance stay exact for "
                        "any draft) (default: --weights')")
    parser.add_argument("--remeasure", action="store_true", help="--weights auto: measure this machine again, not "
                        "read back the choices kept in its cache (default off)")


def add_settings(parser, names, unset=()):
    """Settings' fields `names` as parser's options, each with its type, choices, help and default (None for those
    in `unset`, which the caller fills) -> {name: its argparse action}."""
    actions = {}
    for f in fields(Settings):
        if f.name in names:
            flag, keywords = argument(f, f.name in unset)
            actions[f.name] = parser.add_argument(flag, **keywords)
    return actions


def argument(f, unset):
    """(flag, argparse's keywords) of Settings' field f: a True switch is turned off by --no-NAME."""
    keywords = {key: value for key, value in f.metadata.items() if key != "api_only"}
    flag = "--" + option_name(f.name)
    if kind_of(f) is bool:
        keywords["help"] += " (default off)"  # a switch's: not given
    if kind_of(f) is bool and f.default:
        return "--no-" + option_name(f.name), keywords | {"dest": f.name, "action": "store_false"}
    if kind_of(f) is bool:
        return flag, keywords | {"action": "store_true"}
    keywords.setdefault("type", kind_of(f))
    if unset:
        return flag, keywords | {"default": None}
    if f.default is not None:
        keywords["help"] += " (default %(default)s)"
    return flag, keywords | {"default": f.default}


def command_line_settings():
    """The names of the Settings fields the command line sets."""
    return [f.name for f in fields(Settings) if not f.metadata.get("api_only")]


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the docstring's first paragraph
    add_models(p)
    p.add_argument("--prompt", help=f"the prompt (default {DEFAULT_PROMPT!r})")  # None: --prompt-file may be given
    p.add_argument("--prompt-file", help='read the prompt from this file instead of --prompt; a .jsonl file holds one '
                   '{"prompt": ...} per line (with options of its own) and gives one JSON result per line (default: '
                   "none)")
    p.add_argument("--slots", type=int, default=SLOTS, help="prompts of a .jsonl file decoded together (default "
                   "%(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template (default "
                   "off)")
    add_settings(p, command_line_settings())
    p.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats (default off: the "
                   "text as it settles, then a summary)")
    p.add_argument("--trace", metavar="PATH", help="one JSON line per cycle to PATH: tokens, weights, ancestors, "
                   "phase times (default: none)")
    p.add_argument("--watch", metavar="PORT", type=int, nargs="?", const=8000, help="serve the watch page instead, "
                   "on 127.0.0.1:PORT (8000 if not given): type prompts there and watch each cycle (default off)")
    return p


def watch(args):
    """--watch: server.py on these models, at 127.0.0.1; it prints the page's address once it serves."""
    import server
    require(args.prompt is None and not args.prompt_file and not args.trace, "--watch: prompts are typed in the "
            "page; drop --prompt, --prompt-file and --trace")
    flags = ["--device", args.device, "--weights", args.weights, "--host", "127.0.0.1", "--port", str(args.watch)]
    for name in ("target", "draft", "draft_weights"):
        if getattr(args, name):
            flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    if args.remeasure:
        flags.append("--remeasure")
    server.main(flags)


def prepare(args, batch, world):
    """-> (engine, requests, prompt), every check done before a weight is read, a format or shape measured, or the
    prompt echoed."""
    options = {name: getattr(args, name) for name in command_line_settings()}
    drafts = "model"
    if args.draft == "racer":
        drafts = "racer"
    Settings.of(options).check(None, drafts)  # before the pair is fetched
    require(world == 1 or args.target, "under torchrun give --target (and --draft): fetch the default pair first "
            "with python weights/fetch.py, so that the ranks do not fetch it at once")
    scheduler.check_slots(args.slots, args.overlap)
    require(args.prompt is None or not args.prompt_file, "give --prompt or --prompt-file, not both")
    require(not (args.trace and batch), "--trace follows one prompt; give --prompt or a text --prompt-file")
    if args.trace:
        check_writable(args.trace, "--trace")
    prompt = args.prompt
    if prompt is None:
        prompt = DEFAULT_PROMPT
    if args.prompt_file and batch:
        prompt = read_jsonl(args.prompt_file)
    elif args.prompt_file:
        prompt = read_prompt(args.prompt_file)
    if not batch:
        require(prompt.strip(), f"{args.prompt_file or '--prompt'}: the prompt is empty or only whitespace")
    target, draft = model_paths(args.target, args.draft)
    e = Engine(target, draft, args.device, args.weights, args.remeasure, on_line=say, draft_weights=args.draft_weights)
    if args.chat:
        require(e.tokenizer and e.tokenizer.chat_template, f"--chat: {target} has no chat template; give the prompt "
                "as the model should read it")

    def as_read(text):
        """The prompt as the model reads it: in its chat template under --chat."""
        if args.chat:
            return apply_chat(e.tokenizer, text)
        return text
    if batch:
        items = [item | {"prompt": as_read(item["prompt"])} for item in prompt]
    else:
        items = [{"prompt": as_read(prompt)}]
    if not args.overlap:
        args.slots = min(args.slots, len(items))  # no caches for absent prompts
    if batch:
        requests = e.requests(items, **options)
    else:
        requests = e.prepared([options | items[0]], numbered=False)
    scheduler.check_memory(e, requests, args.slots)
    return e, requests, prompt


def check_writable(path, option):
    """path's folder exists and takes a new file, or a one-line UsageError naming option."""
    folder = os.path.dirname(os.path.abspath(path))
    require(os.path.isdir(folder), f"{option} {path}: no such directory {folder}")
    require(os.access(folder, os.W_OK), f"{option} {path}: {folder} is not writable")
    require(not os.path.isdir(path), f"{option} {path}: a directory, not a file")


class PrefillProgress:
    """A CLI request's on_prefill: on a prefill past PROGRESS_S seconds, the target's layers done so far, on stderr,
    at most every PROGRESS_S seconds."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.start = 0.0
        self.said = 0.0

    def __call__(self, done, layers):
        now = time.monotonic()
        if done == 0:
            self.start = now
            self.said = now
        elif now - self.said >= PROGRESS_S:
            print(f"prefill of {self.tokens} prompt tokens: {done} of {layers} layers, {now - self.start:.0f} s",
                  file=sys.stderr, flush=True)
            self.said = now


def say(line):
    """The CLI's engine lines, on stderr."""
    print(line, file=sys.stderr, flush=True)


def print_piece(piece):
    print(piece, end="", flush=True)


def fail(rank, message):
    """Exit with status 1, saying why on rank 0 (the other ranks' output goes nowhere)."""
    if rank:
        sys.exit(1)
    sys.exit(f"error: {message}")


def main(argv=None):
    args = parser().parse_args(argv)
    if args.watch is not None:
        try:
            return watch(args)
        except UsageError as error:
            fail(0, error)
    batch = bool(args.prompt_file and args.prompt_file.endswith(".jsonl"))
    rank = 0
    try:
        args.device = device_of(args.device)
        rank, world = model.init_distributed(args.device)  # under torchrun; only rank 0 speaks
        if rank:
            sys.stdout = open(os.devnull, "w")
        e, requests, prompt = prepare(args, batch, world)
        if rank == 0:
            for req in requests:
                req.on_prefill = PrefillProgress(len(req.ids))
        if not (batch or args.json):
            requests[0].on_text = print_piece
            if not args.chat:
                print(prompt, end="", flush=True)
        if args.trace and rank == 0:
            import plot
            tracer = plot.Tracer(args.trace, e, requests[0])
            requests[0].on_cycle = tracer.cycle
            requests[0].on_done = tracer.done
            e.observers.append(tracer.phase)
        results = e.run(requests, args.slots)
    except (LoadError, UsageError) as error:
        fail(rank, error)
    except KeyboardInterrupt:
        sys.exit(130)
    if world > 1:
        torch.distributed.destroy_process_group()
    if batch or args.json:
        for result in results:
            print(json.dumps({"text": result.text, "tokens": result.tokens, "stats": result.stats}), flush=True)
    else:
        print()
        if not rank:
            print(summary(results[0].stats), file=sys.stderr)
    ending = results[0].stats["stop"]
    if ending == "interrupted":
        sys.exit(130)
    if ending == "degenerate" and not batch:  # a batch reports it in its JSON lines
        fail(rank, "smc stopped: no particle kept a positive weight, or one is NaN (the models' log-probabilities "
             "are not finite); the text above is what had settled")


if __name__ == "__main__":
    main()
