"""A request on its way through a batch: its ids, resolved settings and shape, its settled text streamed as it
settles (stop strings held back), its end; the context a request needs."""
import math
import time
from dataclasses import dataclass

from errors import require


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
    if settings.spec.drafts:
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
