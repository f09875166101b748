"""The command line, which `python engine.py` runs: generation (ar, sd, mdsd, easd, racer drafts, smc) for one
prompt or a .jsonl file of many, or the watch page.

Every check runs before a weight is read; the text is printed as it settles, then a summary (or one JSON object a
prompt)."""
import argparse
import json
import os
import sys
import time

import torch

import model
import scheduler
from engine import SLOTS, Engine, apply_chat, prepared, run, say
from errors import LoadError, UsageError, require
from methods import METHODS
from settings import Settings, add_models, add_settings, command_line_settings, device_of, model_paths

DEFAULT_PROMPT = "def quicksort(xs):\n"
PROGRESS_S = 5.0  # the prefill says how far it has come once it takes this long, and then this often


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
    requests = prepared(e, [options | item for item in items], numbered=batch)
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
        results = run(e, requests, args.slots)
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
