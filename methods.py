"""The decoding methods, one object each: its defaults and checks, what it keeps in a batch's State beside every
method's, the rows its verify reads, the tokens a cycle emits, and its statistics; its cycle is decode.py's (CYCLES,
by the method's name). METHODS is where a method's name is looked up, once, by the Settings; racer's drafts are a
draft kind: sd on them is a method of its own (`on_racer`)."""
import math

import torch

import racer
from errors import require

ACCEPTANCE = 0.7  # a prior for sd's cost: the chance that the target accepts a draft token


class Ar:
    """The target alone, a token a cycle: the baseline."""
    name = "ar"
    when = "the target alone, the baseline"
    # (N, K) when not given: on a CPU every verify row costs compute, a GPU reads the weights once for all.
    shapes = {"cpu": (1, 1), "gpu": (1, 1)}
    drafts = False  # needs drafts (a draft model's or racer's)
    draft_model = False  # a draft model drafts K tokens a cycle on the device
    particles = False  # takes --particles
    weighted = False  # particles part at once, weighted and resampled
    auto_cells = ()  # the (N, K) --weights auto prices for a shape left open, and its default among them
    auto_home = None
    summary = ""  # the CLI's closing line's part of this method's (str.format of its statistics)

    def check(self, settings):
        """This method's own checks of resolved settings."""
        require(settings.power == 1, f"power is smc's alone ({self.name} samples the target itself), got "
                f"{settings.power}: drop --power or use --method smc", "power")

    def on_racer(self):
        """The method that runs on racer's drafts; None where it needs a draft model's distribution."""
        return self

    def shape_fields(self, settings):
        """The Shape's fields this method takes from its settings (the others': zero)."""
        return {"ess_threshold": 0.0, "easd": None, "tree": 0}

    def state(self, new, R, N, K, V, shape):
        """The State's tensors of this method's own, beside every method's (new(*size, dtype=...))."""
        return {}

    def rows(self, shape):
        """The target rows a slot's cycle verifies."""
        return 1

    def emits(self, K):
        """The tokens a cycle of K drafts emits: with ACCEPTANCE a draft token, (1 - a^(K+1)) / (1 - a) on average."""
        return (1 - ACCEPTANCE ** (K + 1)) / (1 - ACCEPTANCE)

    def stats(self, st, r, req):
        """Slot r's statistics of this method."""
        return {}


class Sd(Ar):
    """Speculative sampling: the target accepts a prefix of K drafts and draws the next token, exactly."""
    name = "sd"
    when = "exact and usually fastest on a CPU"
    shapes = {"cpu": (1, 4), "gpu": (1, 4)}
    drafts = True
    draft_model = True
    auto_cells = tuple((1, k) for k in range(2, 7))
    auto_home = (1, 4)
    summary = ", {cycles} cycles, acceptance {acceptance:.2f}"

    def on_racer(self):
        return RACER_SD

    def state(self, new, R, N, K, V, shape):
        return {"q_logits": new(R, N, K, V)}  # the draft's logits: the residual a rejection draws from

    def rows(self, shape):
        return shape.particles * (shape.draft_len + 1)

    def cell_name(self, cell):
        return f"K={cell[1]}"

    def stats(self, st, r, req):
        """sd's acceptance (vLLM's figures)."""
        settings = req.settings
        cycles = max(req.cycles, 1)
        accepted = int(st.accepted[r])
        return {"draft_len": settings.draft_len, "accepted": accepted,
                "acceptance": round(accepted / (cycles * settings.draft_len), 4),  # per drafted token
                "mean_acceptance_length": round(1 + accepted / cycles, 4),  # tokens a cycle emits
                "acceptance_by_position": [round(a / cycles, 4) for a in st.accepted_at[r].tolist()],
                "accepted_by_position": st.accepted_at[r].tolist()}


class Easd(Sd):
    """sd that draws from the target where both models are unsure (decode.easd_trigger)."""
    name = "easd"
    when = "sd that draws from the target where both models are unsure"
    auto_cells = ()
    summary = Sd.summary + ", {triggers} easd rejections"

    def on_racer(self):
        return None

    def shape_fields(self, settings):
        return super().shape_fields(settings) | {"easd": tuple(settings.easd)}

    def stats(self, st, r, req):
        triggers = int(st.triggers[r])
        rate = round(triggers / max(req.cycles, 1), 4)
        return super().stats(st, r, req) | {"triggers": triggers, "trigger_rate": rate}


class Mdsd(Sd):
    """Exact multi-draft sd: N drafts a cycle, the target accepting one's prefix."""
    name = "mdsd"
    when = "exact, N drafts a cycle, for a GPU"
    shapes = {"cpu": (3, 2), "gpu": (4, 4)}
    particles = True
    auto_cells = ()
    summary = Sd.summary + ", {particles} drafts a cycle"

    def on_racer(self):
        return None

    def stats(self, st, r, req):
        return {"particles": req.settings.particles} | super().stats(st, r, req)


class Smc(Ar):
    """Sequential Monte Carlo: N particles of K drafts weighed by target over draft, resampled when they degenerate."""
    name = "smc"
    when = "approximate, for a GPU, where its particles come almost free"
    shapes = {"cpu": (3, 2), "gpu": (4, 4)}
    drafts = True
    draft_model = True
    particles = True
    weighted = True
    auto_cells = ((3, 2), (3, 4), (4, 2), (4, 4))  # the bench grid's cells that resample (N >= 3)
    auto_home = (3, 2)
    summary = ", {cycles} cycles, {resamples} resamples, mean ESS {mean_ess:.2f}/{particles}, log Z {log_z:.3f}"

    def check(self, settings):
        require(0 not in (settings.draft_temperature, settings.target_temperature), "smc needs temperatures > 0 "
                "(greedy has no importance weights); use --method sd or --method ar", "temperature")
        require(not settings.restricts(), "smc cannot honour top-k/top-p (its draft proposes tokens the restricted "
                "target forbids); use --method sd or --method ar with them", "top_k")

    def on_racer(self):
        return None

    def shape_fields(self, settings):
        return super().shape_fields(settings) | {"ess_threshold": settings.ess_threshold}

    def rows(self, shape):
        return shape.particles * (shape.draft_len + 1)

    def emits(self, K):
        return K + 1  # no rejection

    def cell_name(self, cell):
        return f"{cell[0]}x{cell[1]}"

    def stats(self, st, r, req):
        """smc's resampling, and its log-normaliser's estimate."""
        settings = req.settings
        final = st.logw[r].logsumexp(-1) - math.log(settings.particles)  # the weights since the last resampling
        return {"particles": settings.particles, "particle": req.particle, "draft_len": settings.draft_len,
                "resamples": int(st.resamples[r]), "collapses": int(st.collapses[r]),
                "mean_ess": round(float(st.ess_sum[r]) / max(req.cycles, 1), 3),
                "log_z": round(float(st.log_z[r] + final), 4)}


class RacerSd(Sd):
    """sd on racer's draft tree (or chain) from the host, verified in one target forward: no draft model."""
    name = "racer"  # its key in decode.CYCLES (a user asks for --method sd with --draft racer)
    draft_model = False

    def shape_fields(self, settings):
        return super().shape_fields(settings) | {"tree": settings.tree or settings.draft_len}

    def state(self, new, R, N, K, V, shape):
        T = shape.tree + 1
        i64 = torch.int64
        return dict(nodes=new(R, T, dtype=i64), parent=new(R, T, dtype=i64), depth=new(R, T, dtype=i64),
                    mask=new(R, T, T, dtype=torch.bool), cues=new(R, T, racer.CUES, dtype=i64),
                    cue_p=new(R, T, racer.CUES))

    def rows(self, shape):
        return shape.tree + 1


AR = Ar()
SD = Sd()
SMC = Smc()
RACER_SD = RacerSd()
METHODS = {method.name: method for method in (SMC, SD, Mdsd(), Easd(), AR)}  # --method's choices, in order
