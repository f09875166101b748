"""Traces and pictures: each cycle's record (`Cycles`, from the request's on_cycle), which the Tracer behind
engine.py --trace writes as a JSON line and server.py's watch page draws live; and pictures of what the particles
do (from a trace) and of where the bytes go (from bench.py's JSON). The pictures need matplotlib, an optional
requirement of this file alone (pip install matplotlib)."""
import atexit
import importlib.util
import json
import math
import os
import re
import sys


# ---------------------------------------------------------------- traces (engine.py --trace)


def start_record(request, decode):
    """The first line of a trace (the first event of a watched request): its settings and prompt."""
    s = request.settings
    return {"kind": "start", "method": s.method, "particles": s.particles, "draft_len": s.draft_len,
            "ess_threshold": s.ess_threshold, "draft_temperature": s.draft_temperature,
            "target_temperature": s.target_temperature, "seed": s.seed, "max_new_tokens": s.max_new_tokens,
            "prompt_tokens": len(request.ids), "prompt": decode(request.ids)}


def end_record(result):
    return {"kind": "end", "tokens": result.tokens, "text": result.text, "stats": result.stats}


class Cycles:
    """The record of each cycle of one request, read from its slot after the cycle (the trace's lines, the watch
    page's events): the tokens each particle appended (before resampling; null for a particle no survivor descends
    from) and their text, its log weight before and after resampling, the ESS, whether the request resampled and
    each particle's ancestor, the settled and generated lengths; for sd the drafted tokens (racer: the tree's
    tokens and parents) and how many were accepted. It reads the State and changes nothing."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cycles = 0
        self.length = 1  # a prefilled slot holds x0, the prefill's token
        self.ess_sum = 0.0
        self.resamples = 0

    def decode(self, ids):
        if ids is None or self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids)

    def appended(self, st, r, length, method):
        """-> [N] the tokens each particle appended in the last cycle, in the numbering before resampling: a
        particle's new tokens are its ancestor's (None for a particle that left no descendant)."""
        after = st.hist[r, :, 1 + self.length:1 + length].tolist()  # [N, kept]
        if not method.weighted:  # only smc's particles resample
            return after
        tokens = [None] * len(after)
        for particle, ancestor in enumerate(st.ancestors[r].tolist()):
            tokens[ancestor] = after[particle]
        return tokens

    def record(self, batch, r):
        """Slot r of batch after a cycle -> the cycle's record."""
        st = batch.st
        method = batch.shape.method
        self.cycles += 1
        length = int(st.gen_len[r])
        tokens = self.appended(st, r, length, method)
        record = {"kind": "cycle", "cycle": self.cycles, "tokens": tokens, "text": [self.decode(t) for t in tokens],
                  "settled": int(st.flags[r, 1]), "length": length}
        kept = length - self.length
        self.length = length
        if method.weighted:
            ess_sum = float(st.ess_sum[r])
            resamples = int(st.resamples[r])
            record |= {"logw_before": st.logw_before[r].tolist(), "logw_after": st.logw[r].tolist(),
                       "ess": ess_sum - self.ess_sum, "resampled": resamples > self.resamples,
                       "ancestors": st.ancestors[r].tolist()}
            self.ess_sum = ess_sum
            self.resamples = resamples
        if batch.shape.tree:  # racer: the tree's node tokens (-1: none) and their parents, node 0 the root
            record |= {"tree": st.nodes[r, 1:].tolist(), "parents": st.parent[r, 1:].tolist(), "accepted": kept - 1}
        elif method.draft_model and not method.particles:  # sd and easd: one draft a cycle
            record |= {"drafted": st.drafted[r, 0].tolist(), "accepted": kept - 1}
        return record


class Tracer:
    """One JSON line per cycle of one request, written from its on_cycle callback: `Cycles`' record, and the phase
    times, `phase` being one of the engine's observers (draft, verify with the method's rule, cycle; a CUDA graph's
    replay: the cycle alone). A first line holds the settings, a last one the result. Lines go to PATH.tmp, renamed
    to PATH at the end, so no half-written trace is left."""

    def __init__(self, path, engine, request):
        self.path = path
        self.request = request
        self.records = Cycles(engine.tokenizer)
        self.ms = {}
        self.file = open(path + ".tmp", "w")
        atexit.register(self.discard)
        self.write(start_record(request, self.records.decode))

    def phase(self, batch, name, seconds):
        """An engine observer: the phase times of the traced request's batch, until its next cycle line."""
        if self.request in batch.requests:
            self.ms[name] = self.ms.get(name, 0.0) + 1e3 * seconds

    def cycle(self, batch, r):
        """Request.on_cycle: slot r of batch after a cycle."""
        record = self.records.record(batch, r)
        if "verify_cycle" in self.ms:  # an eager cycle, phase by phase
            draft = self.ms.get("draft_block", 0.0)
            verify = self.ms["verify_cycle"]
            record["ms"] = {"draft": draft, "verify": verify, "cycle": draft + verify}
        elif "cycle" in self.ms:  # a CUDA graph's replay of the whole cycle
            record["ms"] = {"cycle": self.ms["cycle"]}
        self.ms = {}
        self.write(record)

    def done(self, result):
        """Request.on_done: the result line; the trace is complete."""
        self.write(end_record(result))
        self.file.close()
        os.replace(self.path + ".tmp", self.path)

    def discard(self):
        if not self.file.closed:
            self.file.close()
            os.remove(self.path + ".tmp")

    def write(self, record):
        self.file.write(json.dumps(record) + "\n")


def read_trace(path):
    """-> (start, [cycle records], end) of a trace file."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records[0], [r for r in records if r["kind"] == "cycle"], records[-1]


# ---------------------------------------------------------------- reading: a trace or bench.py's JSON


class PlotError(Exception):
    """A one-line problem with the input; main prints it without a traceback."""


def load(path):
    """-> ("trace", (start, cycles, end)) or ("bench", report), decided by the content."""
    try:
        with open(path) as f:
            text = f.read()
        head = json.loads(text.split("\n", 1)[0])  # a trace's start line; a compact JSON file whole
    except (OSError, UnicodeDecodeError) as e:
        raise PlotError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}")
    except json.JSONDecodeError:
        head = None
    try:
        if isinstance(head, dict) and head.get("kind") == "start":
            start, cycles, end = read_trace(path)
            if end["kind"] == "end" and cycles:
                return "trace", (start, cycles, end)
        else:
            report = json.loads(text)
            if isinstance(report, dict) and (report.get("speed") or report.get("quality")):
                return "bench", report
    except (json.JSONDecodeError, KeyError, TypeError):
        pass
    raise PlotError(f"{path} is neither a whole trace (engine.py --trace) nor bench.py JSON with speed or quality rows")


def normalised(logw):
    """Softmax of one cycle's log weights: the particles' normalised weights."""
    top = max((x for x in logw if math.isfinite(x)), default=0.0)
    w = [math.exp(x - top) if math.isfinite(x) else 0.0 for x in logw]
    return [x / sum(w) for x in w] if sum(w) > 0 else [1.0 / len(w)] * len(w)


def lineage(cycles, particle):
    """The row of the returned particle's ancestor at each cycle, following ancestors backward from its final
    index (in the last cycle's numbering after resampling)."""
    rows = []
    for c in reversed(cycles):
        particle = c["ancestors"][particle]
        rows.append(particle)
    return rows[::-1]


def shown(text, ids, width=16):
    """A token run as a one-line label, escaped as in Python (a newline reads \\n), runs of spaces shown as one,
    cut at `width`; its ids when the trace has no text (a model without a tokenizer)."""
    text = " ".join(map(str, ids)) if text is None else re.sub(" {2,}", " ", repr(text)[1:-1])
    return text if len(text) <= width else text[:width - 1] + "…"


def text_axis(ax, labels, every=1):
    """Label the cycles along the bottom with text (rotated, monospace), every `every`-th when crowded."""
    ticks = range(1, len(labels) + 1, every)
    ax.set_xticks(list(ticks), [labels[c - 1] for c in ticks], rotation=90, fontfamily="DejaVu Sans Mono",
                  fontsize=9)


# ---------------------------------------------------------------- pictures of a trace


SIZES = {"genealogy.png": (12, 6), "weights.png": (10, 6), "acceptance.png": (12, 5), "roofline.png": (12, 5),
         "grid.png": (10, 4.5), "frontier.png": (12, 5)}  # inches, at DPI dots per inch
DPI = 100


def figure(name, *args, **kw):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(*args, figsize=SIZES[name], dpi=DPI, **kw)


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt
    plt.close(fig)
    print(path)
    return path


def genealogy(start, cycles, end, out):
    """Particles (rows) across cycles (columns), each dot coloured by its normalised weight before resampling.
    Straight grey lines: a particle kept its own history; crossing lines (in the shaded gaps): resampling, each
    particle taking the history of the one its line comes from. Red: the returned particle's lineage, its text
    along the bottom (\\n: a newline). Green +k above a cycle: k more tokens settled (shared by all
    particles, so printed) after it."""
    from matplotlib.colors import PowerNorm
    N = start["particles"]
    C = len(cycles)
    fig, ax = figure("genealogy.png")
    for c in range(1, C):
        if cycles[c - 1]["resampled"]:
            ax.axvspan(c + 0.08, c + 0.92, color="orange", alpha=0.15, lw=0)
        for i, a in enumerate(cycles[c - 1]["ancestors"]):
            ax.plot([c, c + 1], [a, i], color="0.6", lw=1, zorder=1)
    rows = lineage(cycles, end["stats"]["particle"])
    ax.plot(range(1, C + 1), rows, color="red", lw=2.5, zorder=2)
    xs = [c for c in range(1, C + 1) for _ in range(N)]
    ys = [i for _ in range(C) for i in range(N)]
    weights = [w for c in cycles for w in normalised(c["logw_before"])]
    dots = ax.scatter(xs, ys, c=weights, cmap="viridis", norm=PowerNorm(0.5, 0, 1), s=60, zorder=3, edgecolors="k",
                      lw=0.5)
    settled = 0
    for c, rec in enumerate(cycles, 1):
        if rec["settled"] > settled:
            ax.text(c, -0.75, f"+{rec['settled'] - settled}", color="green", ha="center", va="center", fontsize=9,
                    fontweight="bold")
        settled = rec["settled"]
    ax.set_ylim(N - 0.5, -1.0)
    ax.set_xlim(0.5, C + 0.5)
    ax.set_yticks(range(N))
    ax.set_ylabel("particle")
    text_axis(ax, [shown(c["text"][r], c["tokens"][r]) for c, r in zip(cycles, rows)], max(1, -(-C // 60)))
    top = ax.secondary_xaxis("top")
    top.set_xticks(range(1, C + 1, max(1, -(-C // 30))))
    top.set_xlabel("cycle   (red: the returned particle's lineage; shaded: resampling; green +k: k tokens settled)",
                   fontsize=9)
    fig.colorbar(dots, ax=ax, pad=0.01, label="normalised weight before resampling")
    s = end["stats"]
    ax.set_title(f"smc genealogy: N={N}, K={start['draft_len']}, ESS threshold {start['ess_threshold']} x N, "
                 f"{s.get('resamples', 0)} resamplings in {C} cycles, particle {s['particle']} returned",
                 fontsize=10, loc="left")
    fig.subplots_adjust(left=0.05, right=1.0, bottom=0.24, top=0.86)
    return save(fig, out, "genealogy.png")


def weights(start, cycles, end, out):
    """Top: the effective sample size (1 / sum of squared normalised weights; N when all weigh the same, 1 when
    one holds everything) each cycle, red where it fell below the threshold and the population was resampled.
    Bottom: each particle's log weight before resampling; after a resampling all restart from 0."""
    N = start["particles"]
    C = len(cycles)
    fig, (top, bottom) = figure("weights.png", 2, 1, sharex=True)
    x = range(1, C + 1)
    top.plot(x, [c["ess"] for c in cycles], "o-", color="C0", ms=4, label="ESS")
    top.axhline(start["ess_threshold"] * N, color="k", ls="--", lw=1, label=f"threshold {start['ess_threshold']} x N")
    hit = [c["cycle"] for c in cycles if c["resampled"]]
    top.plot(hit, [cycles[c - 1]["ess"] for c in hit], "o", color="red", ms=7, label="resampled")
    for c in hit:
        for ax in (top, bottom):
            ax.axvline(c, color="red", alpha=0.2, lw=3)
    top.set_ylim(0, N * 1.05)
    top.set_ylabel("effective sample size")
    top.legend(loc="lower left", fontsize=8, ncol=3)
    for i in range(N):
        bottom.plot(x, [c["logw_before"][i] for c in cycles], ".-", lw=1, label=f"{i}")
    bottom.set_ylabel("log weight before resampling")
    bottom.set_xlabel("cycle")
    if N <= 12:
        bottom.legend(title="particle", fontsize=7, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    s = end["stats"]
    top.set_title(f"smc weights: N={N}, K={start['draft_len']}, {s.get('resamples', 0)} resamplings, "
                  f"mean ESS {s.get('mean_ess', 0):.2f}, log Z {s.get('log_z', 0):.2f}", fontsize=10, loc="left")
    fig.tight_layout()
    return save(fig, out, "weights.png")


def acceptance(start, cycles, end, out):
    """sd: the draft tokens the target accepted each cycle, out of K; the text the cycle added along the
    bottom (the accepted tokens, then the target's correction or bonus token)."""
    K = start["draft_len"]
    C = len(cycles)
    fig, ax = figure("acceptance.png")
    ax.bar(range(1, C + 1), [c["accepted"] for c in cycles], color="C0")
    ax.axhline(K, color="k", ls="--", lw=1)
    ax.set_ylim(0, K + 0.5)
    ax.set_xlim(0.5, C + 0.5)
    ax.set_ylabel(f"draft tokens accepted (of K={K})")
    text_axis(ax, [shown(c["text"][0], c["tokens"][0]) for c in cycles], max(1, -(-C // 60)))
    ax.set_title(f"sd: {sum(c['accepted'] for c in cycles)} of {C * K} draft tokens accepted in {C} cycles",
                 fontsize=10, loc="left")
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.25, top=0.92)
    return save(fig, out, "acceptance.png")


def trace_pictures(start, cycles, end, out):
    if start["method"] == "smc":
        return [genealogy(start, cycles, end, out), weights(start, cycles, end, out)]
    if start["method"] in ("sd", "easd"):
        return [acceptance(start, cycles, end, out)]
    raise PlotError(f"an {start['method']} trace has no particles or drafts to draw: trace an smc or sd run")


# ---------------------------------------------------------------- pictures of bench.py's JSON


def config(r):
    return {"ar": "ar", "sd": f"sd K={r['K']}"}.get(r["method"], f"{r['method']} {r['N']}x{r['K']}")


def roofline(report, out):
    """Left: the weight and KV bytes a cycle reads / the cycle's time, against the copy bandwidth measured in the
    same run (the dashed line: a memory-bound decoder cannot beat it). Right: tokens/s (filled) against the
    tokens/s that bandwidth would give at this configuration's bytes per token (outline). The percentages say
    how close each configuration comes to its limit."""
    rows = [r for r in report["speed"] if r.get("achieved_gbs") is not None]
    names = list(dict.fromkeys(config(r) for r in rows))
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    bandwidth = report["copy_bandwidth_gbs"]
    width = 0.8 / len(prompts)
    fig, (gbs, tps) = figure("roofline.png", 1, 2)
    for j, p in enumerate(prompts):
        mine = [r for r in rows if r["prompt"] == p]
        x = [names.index(config(r)) + (j - (len(prompts) - 1) / 2) * width for r in mine]
        bars = gbs.bar(x, [r["achieved_gbs"] for r in mine], width, color=f"C{j}", label=p)
        gbs.bar_label(bars, [f"{r['achieved_gbs'] / bandwidth:.0%}" for r in mine], fontsize=7)
        tps.bar(x, [r["ideal_tokens_per_s"] for r in mine], width, fill=False, edgecolor=f"C{j}", lw=1)
        bars = tps.bar(x, [r["tokens_per_s"] for r in mine], width, color=f"C{j}")
        tps.bar_label(bars, [f"{r['tokens_per_s'] / r['ideal_tokens_per_s']:.0%}" for r in mine], fontsize=7)
    gbs.axhline(bandwidth, color="k", ls="--", lw=1)
    gbs.text(-0.5, bandwidth, f" copy bandwidth {bandwidth:.1f} GB/s", va="bottom", fontsize=8)
    gbs.set_ylim(0, bandwidth * 1.3)
    gbs.set_ylabel("achieved GB/s (bytes read per cycle / cycle time)")
    gbs.set_title("where the bytes go: % of the copy bandwidth", fontsize=10, loc="left")
    tps.set_ylabel("tokens/s (outline: ideal at the copy bandwidth)")
    tps.set_title("tokens/s (filled) against the ideal (outline): % of the ideal", fontsize=10, loc="left")
    for ax in (gbs, tps):
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_xlabel("method (smc: N particles x K draft tokens)", fontsize=9)
    gbs.legend(title="prompt", fontsize=8, title_fontsize=8, loc="upper right", ncol=len(prompts))
    fig.tight_layout()
    return save(fig, out, "roofline.png")


def grid(report, out):
    """The smc N x K grid, one panel per prompt: the colour and the number in each cell are tokens/s over ar's
    on the same prompt (green faster, red slower), the smaller number the tokens/s; grey: not measured."""
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm
    rows = [r for r in report["speed"] if r["method"] == "smc" and r.get("speedup") is not None]
    if not rows:
        return None
    prompts = list(dict.fromkeys(r["prompt"] for r in report["speed"]))
    Ns = sorted({r["N"] for r in rows})
    Ks = sorted({r["K"] for r in rows})
    lo = min(r["speedup"] for r in rows)
    hi = max(r["speedup"] for r in rows)
    norm = TwoSlopeNorm(1.0, min(lo, 1 / hi, 0.9), max(hi, 1 / lo, 1.1))  # as far below 1 as above
    fig, axes = figure("grid.png", 1, len(prompts), squeeze=False, layout="constrained")
    for ax, p in zip(axes[0], prompts):
        cells = {(r["N"], r["K"]): r for r in rows if r["prompt"] == p}
        values = [[cells[n, k]["speedup"] if (n, k) in cells else math.nan for k in Ks] for n in Ns]
        image = ax.imshow(values, cmap=colormaps["RdYlGn"].with_extremes(bad="0.85"), norm=norm, aspect="auto")
        for n in Ns:
            for k in Ks:
                r = cells.get((n, k))
                label = f"{r['speedup']:.2f}x\n{r['tokens_per_s']:.1f} tok/s" if r else "not run"
                dark = r and abs(norm(r["speedup"]) - 0.5) > 0.35
                ax.text(Ks.index(k), Ns.index(n), label, ha="center", va="center", fontsize=10,
                        color="white" if dark else "black")
        ax.set_xticks(range(len(Ks)), Ks)
        ax.set_yticks(range(len(Ns)), Ns)
        ax.set_xlabel("K (draft tokens per cycle)")
        ax.set_ylabel("N (particles)")
        sd = [f"sd K={r['K']} {r['speedup']:.2f}x" for r in report["speed"] if r["prompt"] == p
              and r["method"] == "sd" and r.get("speedup") is not None]
        ax.set_title(f"{p} prompt: smc speed-up over ar" + (f" ({sd[0]})" if sd else ""), fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label="tokens/s over ar's (1: as fast)")
    return save(fig, out, "grid.png")


def frontier(report, out):
    """The accuracy-speed frontier of the quality run: HumanEval pass@1 (left) and the target's mean log-probability
    per generated token minus ar's, paired per problem (right: an exact method sits at 0, the draft alone lower),
    against tokens/s over the same run, one point per method with its standard error."""
    q = report["quality"]
    fig, (acc, fid) = figure("frontier.png", 1, 2)
    for i, (label, r) in enumerate(q.items()):
        style = dict(fmt="o", color=f"C{i % 10}", capsize=3, label=label)
        acc.errorbar(r["tokens_per_s"], r["pass_at_1"], yerr=r["pass_at_1_stderr"], **style)
        shift, err = (0.0, 0.0) if label == "ar" else (r.get("logprob_vs_ar"), r.get("logprob_vs_ar_stderr"))
        if shift is not None:
            fid.errorbar(r["tokens_per_s"], shift, yerr=err, **style)
    some = next(iter(q.values()))
    acc.set_ylabel("pass@1")
    acc.set_title(f"pass@1 on {some['problems']} problems, {some['samples']} sample(s) each", fontsize=10, loc="left")
    fid.axhline(0.0, color="k", ls="--", lw=1)
    fid.set_ylabel("target log-prob per token, minus ar's (paired)")
    fid.set_title("fidelity to the target (0: exact)", fontsize=10, loc="left")
    for ax in (acc, fid):
        ax.set_xlabel("tokens/s (the same run)")
        ax.grid(alpha=0.3)
    fid.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return save(fig, out, "frontier.png")


# ---------------------------------------------------------------- command line


EPILOG = """examples:
  python engine.py --prompt "def quicksort(xs):" --trace run.jsonl   # one JSON line per cycle
  python plot.py run.jsonl                                            # genealogy.png, weights.png
  python bench.py speed --out bench.json && python plot.py bench.json  # roofline.png, grid.png"""


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Pictures from an engine.py --trace file (genealogy.png, weights.png; "
                                "acceptance.png for sd) or bench.py's JSON (roofline.png, grid.png; frontier.png "
                                "from a quality run).", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="a trace (JSON lines) or bench.py's --out JSON")
    p.add_argument("--out", help="folder for the PNG files (default: the file's folder)")
    args = p.parse_args(argv)
    out = args.out or os.path.dirname(os.path.abspath(args.file))
    try:
        kind, data = load(args.file)
        if importlib.util.find_spec("matplotlib") is None:
            raise PlotError("the pictures need matplotlib: pip install matplotlib")
        os.makedirs(out, exist_ok=True)
        if kind == "trace":
            trace_pictures(*data, out)
        else:
            if data.get("speed"):
                roofline(data, out)
                grid(data, out)
            if data.get("quality"):
                frontier(data, out)
    except PlotError as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
