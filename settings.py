"""The options: a request's Settings (the one source of their defaults, types, choices and checks) and the models'
(files, device, weight formats), and the command-line flags of both, which engine.py's command line (cli.py) and
server.py derive from them."""
import argparse
import math
import typing
from dataclasses import dataclass, field, fields, replace

import torch

import formats
from errors import UsageError, require
from methods import METHODS

EASD = (1.0, 5, 0.6)  # easd's rule: entropy (nats) both models must reach, top-m, share of the top-m they share
WEIGHTS = ("auto", *formats.FORMATS)
TYPES = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
         tuple: "three numbers ENTROPY,TOP,SHARE (TOP an integer)"}

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
    def spec(self):
        """The method's object (methods.py: its defaults, checks, State tensors and costs), by its name."""
        return METHODS[self.method]

    def resolve(self, device, chosen=None):
        """Every default filled; chosen {method: (N, K)} (auto's measured shapes) before the method's defaults."""
        spec = self.spec
        home = "cpu" if torch.device(device).type == "cpu" else "gpu"
        particles, draft_len = (chosen or {}).get(self.method) or spec.shapes[home]
        if spec.particles and self.particles is not None:
            particles = self.particles
        if spec.drafts and self.draft_len is not None:
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
            expected = type_of(f)
            require(has_type(value, expected), f"{option_name(f.name)} must be {TYPES[expected]}, got {value!r}",
                    f.name)
            if "choices" in f.metadata:
                choices = f.metadata["choices"]
                require(value in choices, f"unknown {f.name} {value!r} (choose from {', '.join(choices)})", f.name)

    def check_values(self, vocab, draft):
        """The ranges, and the options that go together, of these resolved settings; then the method's own."""
        spec = self.spec
        entropy, top, share = self.easd
        require(not spec.drafts or draft, f"method {self.method} needs a draft model (--draft)", "method")
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
        require(self.power > 0, f"power must be > 0, got {self.power}", "power")
        spec.check(self)
        require(0 <= self.tree <= 64, f"tree must lie in [0, 64] draft tokens, got {self.tree}", "tree")
        require(entropy >= 0 and 1 <= top <= vocab and 0 <= share <= 1, f"easd takes ENTROPY >= 0, TOP in [1, {vocab}] "
                f"(the vocabulary) and SHARE in [0, 1], got {entropy},{top},{share}", "easd")
        require(draft != "racer" or spec.on_racer(), f"{self.method} needs a draft model's distribution, and racer "
                "drafts are deterministic tokens; use --method sd with --draft racer", "method")
        require(not self.tree or draft == "racer", "tree drafts come from racer: use --tree with --draft racer", "tree")
        require(not self.overlap or draft == "model" and spec.drafts, "overlap runs a draft model's drafting beside "
                "the target's verifying: use it with a draft model and any method but ar", "overlap")

    def restricts(self):
        """Whether top-k or top-p restricts the target."""
        return bool(self.top_k or self.top_p < 1)

    def shape(self, racer_drafts=False):
        """The batch key of these resolved settings: racer_drafts, the method that runs on racer's drafts."""
        spec = self.spec
        if racer_drafts:
            spec = spec.on_racer()
        return Shape(method=spec, particles=self.particles, draft_len=self.draft_len, power=self.power,
                     restrict=self.restricts(), cuda_graphs=self.cuda_graphs, overlap=self.overlap,
                     **spec.shape_fields(self))


SETTINGS = {f.name for f in fields(Settings)}  # a request's options that are Settings'


def option_name(name):
    """A Settings field's name as its command-line option says it: draft-len."""
    return name.replace("_", "-")


def type_of(f):
    """The type of Settings field f's values (int for `int | None`)."""
    types = [t for t in typing.get_args(f.type) if t is not type(None)]
    if types:
        return types[0]
    return f.type


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def has_type(value, expected):
    """Whether value is of type expected: JSON's true is no number, and easd's rule is three numbers, TOP an
    integer."""
    if expected is float:
        return is_number(value)
    if expected is tuple:
        numbers = isinstance(value, (tuple, list)) and len(value) == 3 and all(map(is_number, value))
        return numbers and isinstance(value[1], int)
    if expected is bool:
        return isinstance(value, bool)
    return isinstance(value, expected) and not isinstance(value, bool)


# ---------------------------------------------------------------- the models' options


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



# ---------------------------------------------------------------- flags


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
    if type_of(f) is bool:
        keywords["help"] += " (default off)"  # a switch's: not given
    if type_of(f) is bool and f.default:
        return "--no-" + option_name(f.name), keywords | {"dest": f.name, "action": "store_false"}
    if type_of(f) is bool:
        return flag, keywords | {"action": "store_true"}
    keywords.setdefault("type", type_of(f))
    if unset:
        return flag, keywords | {"default": None}
    if f.default is not None:
        keywords["help"] += " (default %(default)s)"
    return flag, keywords | {"default": f.default}


def command_line_settings():
    """The names of the Settings fields the command line sets."""
    return [f.name for f in fields(Settings) if not f.metadata.get("api_only")]

