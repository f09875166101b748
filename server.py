"""An OpenAI-compatible HTTP server on the engine's batched serving loop: /v1/completions, /v1/chat/completions
(streamed or not), /v1/models, /health and Prometheus' /metrics; and at / the watch page (watch.html), whose
requests stream every cycle of their own slot from POST /watch. One worker thread runs Engine.serve; a request's
options are Settings' fields, checked by Settings.check; a client that goes away cancels its request."""
import argparse
import asyncio
import contextlib
import functools
import json
import os
import queue
import random
import signal
import sys
import threading
import time
import traceback
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import engine
import errors
import methods
import metrics
import plot
import roofline
import scheduler
import settings
from request import Result, until_eos

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # "degenerate" (smc) passes as it is
# Fields that change what a client gets back, with the values that change nothing; any other value is a 400.
UNSUPPORTED = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
               "suffix": ("",), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
               "function_call": ("none",), "response_format": ({"type": "text"},), "presence_penalty": (0,),
               "frequency_penalty": (0,)}
TYPES = settings.TYPES | {list: "a list", dict: "an object"}
# The Settings a request body may set (top-level keys, beside OpenAI's), and those the server's flags set.
FIELDS = ("temperature", "top_p", "top_k", "seed", "method", "particles", "draft_len", "lag")
SERVED = ("method", "particles", "draft_len", "lag", "tree", "overlap")
API_NAMES = {"max_new_tokens": "max_tokens", "draft_temperature": "temperature", "target_temperature": "temperature"}
MAX_TOKENS = {"completion": 16, "chat": 256}  # when a request gives none: OpenAI's for completions
STOPPED = "the serving loop stopped"
PAGES = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "watch.html"),  # a checkout's
         os.path.join(sys.prefix, "share", "smcsd-mini", "watch.html"))  # pip install .'s (pyproject's data-files)
# The page's own script and styles, and requests back to this server only: nothing from the network.
PAGE_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"


class ApiError(Exception):
    def __init__(self, status, message, param=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind


def error_body(message, param=None, kind="invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ---------------------------------------------------------------- request fields

def float_constant(name):
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity, JSON has neither


def get(body, name, expected, default=None):
    """body[name], default when absent or null; a 400 when not of type `expected`."""
    value = body.get(name)
    if value is None:
        return default
    engine.require(isinstance(value, expected), f"{name} must be {TYPES[expected]}", name)
    return value


def prompt_of(body, chat, tokenizer):
    """A completion's prompt (text or token ids), or the chat messages in the tokenizer's chat template."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        engine.require(isinstance(prompt, str) or ids, "prompt must be a string or a list of token ids (one prompt)",
                       "prompt")
        return prompt
    messages = get(body, "messages", list)
    texts = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages or [])
    engine.require(messages and texts, "messages must be a list of {role, content} with text content", "messages")
    return engine.apply_chat(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])


def options_of(body, chat, defaults):
    """The engine's options (Settings' fields) of a request body, their types checked."""
    for name, harmless in UNSUPPORTED.items():
        if body.get(name) not in (None, *harmless):
            raise ApiError(400, f"{name}={json.dumps(body[name])[:40]} is not supported", name)
    options = dict(defaults)
    options["max_new_tokens"] = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:  # the newer name
        options["max_new_tokens"] = body["max_completion_tokens"]
    if options["max_new_tokens"] is None:
        options["max_new_tokens"] = MAX_TOKENS["chat" if chat else "completion"]
    for name in FIELDS:
        if body.get(name) is not None:
            options[name] = body[name]
    if "seed" not in options:
        options["seed"] = random.randrange(2 ** 31)  # no seed given: a fresh sample, as OpenAI's
    asked = settings.Settings.of(options)
    asked.check_types()
    if "method" not in body and asked.spec.weighted and (asked.temperature == 0 or asked.restricts()):
        options["method"] = methods.SD.name  # smc has no greedy or truncated form; sd samples the target exactly
    spec = settings.Settings.of(options).spec
    if not spec.drafts:  # the server's overlap and racer trees are for the methods that draft
        options.pop("overlap", None)
    if spec.on_racer() is not methods.RACER_SD:  # racer's trees are sd's
        options.pop("tree", None)
    return options


def default_method(draft):
    """The method of a request that names none: smc with a draft model, sd with racer's drafts, else ar."""
    if draft == "racer":
        return "sd"
    if draft:
        return "smc"
    return "ar"


# ---------------------------------------------------------------- the serving loop, bridged to asyncio

class Worker:
    """Engine.serve on one thread. A request's text pieces (str), then its result, come back through
    loop.call_soon_threadsafe into an asyncio.Queue of its own. `live` maps the queues of the requests the engine
    has not finished, running or waiting, to their Clocks: its size bounds the waiting ones."""

    def __init__(self, eng, slots, context, max_waiting):
        self.eng = eng
        self.slots = slots
        self.context = context
        self.max_waiting = max_waiting
        self.inbox = queue.Queue()
        self.live = {}  # queue -> Clock
        self.loop = None
        self.thread = None
        self.failure = None  # why the loop serves no more, once it has stopped
        self.metrics = metrics.Metrics(slots, functools.partial(len, self.live))

    def start(self):
        self.loop = asyncio.get_running_loop()
        self.thread = threading.Thread(target=self.work, daemon=True)
        self.thread.start()

    def work(self):
        try:
            self.eng.serve(self.inbox, self.slots, self.context)
        except errors.DeviceFailed as error:  # the engine ended every request; later ones are refused with this
            self.failure = str(error)
            print(f"error: {error}", file=sys.stderr)
        except BaseException as error:
            self.failure = f"{STOPPED}: {error!r}"
            traceback.print_exc()
        finally:  # what is still live will never finish: tell its clients
            if self.failure is None:
                self.failure = STOPPED
            gone = Result("", [], {"stop": "error", "error": self.failure})
            self.post(self.deliver_all, gone)

    def post(self, call, *args):
        with contextlib.suppress(AttributeError, RuntimeError):  # no event loop (yet, or any more): nobody waits
            self.loop.call_soon_threadsafe(call, *args)

    def deliver(self, events, result):
        clock = self.live.pop(events, None)
        if clock:
            latency = time.monotonic() - clock.arrival
            self.metrics.finished(result.stats, latency, clock.first_text)
            events.put_nowait(result)

    def deliver_all(self, result):
        for events in list(self.live):
            self.deliver(events, result)

    def submit(self, prompt, stop, options, stream, watched=False):
        """-> (engine.Request, its queue); errors.UsageError for a bad request; a 503 when too many wait. watched:
        each cycle's record (a Watch's) goes in the queue too, between the text pieces."""
        if self.failure:
            raise ApiError(503, self.failure, kind="server_error")
        if len(self.live) >= self.slots + self.max_waiting:
            raise ApiError(503, f"server busy: {len(self.live)} requests running or waiting", kind="server_error")
        events = asyncio.Queue()
        forward = None
        if stream:
            forward = functools.partial(self.post, events.put_nowait)
        clock = Clock(forward)
        on_done = functools.partial(self.post, self.deliver, events)
        on_cycle = None
        if watched:
            on_cycle = Watch(self.eng.tokenizer, forward)
        req = self.eng.request(prompt, stop=stop, context=self.context, on_text=clock.text, on_done=on_done,
                               on_cycle=on_cycle, **options)
        self.check_fits_at_all(req)
        self.live[events] = clock
        self.inbox.put(req)
        return req, events

    def check_fits_at_all(self, req):
        """A 400 before any answer where req's batch alone outgrows the device's whole memory: it could never run
        (one that outgrows only the memory free now is the scheduler's to refuse or run once others end)."""
        caps = self.context
        if not isinstance(caps, tuple):
            caps = (caps, caps)
        need = scheduler.batch_bytes(self.eng, req.shape, self.slots, caps)
        whole = scheduler.total_bytes(self.eng.device)
        engine.require(need <= whole, f"{self.slots} slots' KV caches and logits need {need / 2**30:.2f} GiB, more "
                       f"than the {whole / 2**30:.2f} GiB of {self.eng.device}: lower particles, draft_len or "
                       "max_tokens")

    def stop(self):
        self.post(self.inbox.put, None)  # via the loop: safe from a signal handler, which may interrupt a put


class Clock:
    """A request's arrival and the seconds to its first text piece (None: none yet), for /metrics; its text pieces go
    on to forward (a streaming client's queue) where there is one. `text` runs on the decoding thread."""

    def __init__(self, forward=None):
        self.arrival = time.monotonic()
        self.first_text = None
        self.forward = forward

    def text(self, piece):
        if self.first_text is None:
            self.first_text = time.monotonic() - self.arrival
        if self.forward:
            self.forward(piece)


def error_of(result):
    """(status, message, kind) of a request that ended without an answer, else None: a request the scheduler refused
    (too large for a slot, or for the memory free) is the client's error."""
    if result.stats["stop"] == "refused":
        return 400, result.stats["error"], "invalid_request_error"
    if result.stats["stop"] == "error":
        return 500, result.stats["error"], "server_error"
    if result.stats["stop"] == "cancelled":  # with its client still there: only at shutdown
        return 503, "the server is shutting down", "server_error"
    return None


# ---------------------------------------------------------------- HTTP

async def body_of(request):
    """A request's JSON object."""
    try:
        body = json.loads(await request.body(), parse_constant=float_constant)
    except ValueError as error:
        raise ApiError(400, f"malformed JSON body: {error}") from None
    engine.require(isinstance(body, dict), "the body must be a JSON object")
    return body


def checked(body, chat, state):
    """A completion's body, every field checked -> (prompt, stop, options, stream, include_usage): the API's and the
    watch page's one check."""
    stream = get(body, "stream", bool, False)
    include_usage = get(get(body, "stream_options", dict, {}), "include_usage", bool, False)
    prompt = prompt_of(body, chat, state.worker.eng.tokenizer)
    options = options_of(body, chat, state.defaults)
    return prompt, body.get("stop") or [], options, stream, include_usage


async def completions(request):
    state = request.app.state
    chat = request.url.path.endswith("/chat/completions")
    prompt, stop, options, stream, include_usage = checked(await body_of(request), chat, state)
    req, events = state.worker.submit(prompt, stop, options, stream)
    kind = "chat.completion" if chat else "text_completion"
    if chat and stream:
        kind = "chat.completion.chunk"
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": state.model_name, "object": kind}
    if stream:
        return StreamingResponse(sse(req, events, head, chat, include_usage), media_type="text/event-stream")
    result = await until_done(request, req, events)
    if result is None:
        return Response(status_code=499)  # the client has gone: nobody reads this
    failure = error_of(result)
    if failure:
        status, message, kind = failure
        raise ApiError(status, message, kind=kind)
    if chat:
        part = {"message": {"role": "assistant", "content": result.text}}
    else:
        part = {"text": result.text}
    choice = {"index": 0, **part, "logprobs": None, "finish_reason": finish_reason(result)}
    return JSONResponse({**head, "choices": [choice], "usage": usage(req, result),
                         "stats": result.stats})  # stats: the engine's, an extension


async def until_done(request, req, events):
    """The request's result, or None when the client disconnects first (then the request is cancelled)."""
    async def disconnected():  # the body has been read: uvicorn's receive() now waits for a disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass
    done = asyncio.ensure_future(events.get())
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([done, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            done.cancel()
            req.cancel()
    if done.done():
        return done.result()
    return None


async def sse(req, events, head, chat, include_usage):
    """Server-sent events in OpenAI's chunk format. Starlette cancels this generator when the client goes away;
    `finally` then cancels the request."""
    def chunk(piece, finish=None, **extra):
        part = {"delta": piece} if chat else {"text": piece}
        return data({**head, "choices": [{"index": 0, **part, "logprobs": None, "finish_reason": finish}], **extra})
    result = None
    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        while isinstance(result := await events.get(), str):
            yield chunk({"content": result} if chat else result)
        failure = error_of(result)
        if failure:
            yield data(error_body(failure[1], kind=failure[2]))
        else:
            yield chunk({} if chat else "", finish_reason(result), stats=result.stats)
            if include_usage:
                yield data({**head, "choices": [], "usage": usage(req, result)})
        yield "data: [DONE]\n\n"
    finally:
        if not hasattr(result, "stats"):  # not finished: the client went away
            req.cancel()


def data(obj):
    return f"data: {json.dumps(obj)}\n\n"


def finish_reason(result):
    return FINISH.get(result.stats["stop"], result.stats["stop"])


def usage(req, result):
    prompt = result.stats.get("prompt_tokens", len(req.ids))
    new = result.stats["new_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


# ---------------------------------------------------------------- the watch page


class Watch:
    """A watched request's on_cycle, on the decoding thread: plot.Cycles' record of its slot after each cycle (what a
    trace holds), and beside it what the page draws: each particle's text past the settled tokens, the drafts this
    cycle verified with their tokens marked, the bytes the cycle read and its time; sent on by `forward`. It reads
    the State and changes nothing."""

    def __init__(self, tokenizer, forward):
        self.records = plot.Cycles(tokenizer)
        self.forward = forward
        self.last = None  # perf_counter() at the previous cycle's end

    def __call__(self, batch, r):
        req = batch.requests[r]
        before = self.records.length
        record = self.records.record(batch, r)
        now = time.perf_counter()
        if self.last is None:
            self.last = req.start + req.prefill_seconds
        record |= {"ms": 1e3 * (now - self.last), "seconds": now - req.start,
                   "texts": self.unsettled(batch.st, r, req, record, before),
                   "drafts": self.drafts(drafts_of(batch, r, record), record), "bytes": bytes_read(batch, req, before)}
        self.last = now
        self.forward(record)

    def unsettled(self, st, r, req, record, before):
        """Each particle's text past its settled tokens, after resampling: [the part before this cycle, this cycle's],
        up to its EOS (record: the cycle's, whose lengths are read once)."""
        texts = []
        settled = record["settled"]
        cut = max(settled, before)
        for row in st.hist[r, :, 1:1 + record["length"]].tolist():
            row = until_eos(row, req.ends)
            texts.append([self.records.decode(row[settled:cut]), self.records.decode(row[cut:])])
        return texts

    def drafts(self, rows, record):
        """The drafts as rows of [token's text, "accepted", "rejected" (the first off the path taken) or "unseen"],
        and the token the target emitted after the accepted ones; None for a method that drafts nothing to reject."""
        if rows is None:
            return None
        appended = record["tokens"][0]  # every particle's: the winner's
        accepted = max(len(appended) - 1, 0)
        marked = []
        for row in rows:
            on_path = 0
            while on_path < min(accepted, len(row)) and row[on_path] == appended[on_path]:
                on_path += 1
            marks = ["accepted"] * on_path + ["rejected"] + ["unseen"] * len(row)
            marked.append([[self.records.decode([token]), mark] for token, mark in zip(row, marks)])
        return {"rows": marked, "accepted": accepted, "emitted": self.records.decode(appended[accepted:])}

    def start_record(self, req):
        return plot.start_record(req, self.records.decode) | {"racer": bool(req.shape.tree)}


def drafts_of(batch, r, record):
    """The token ids of each draft slot r's last cycle verified: sd's one, mdsd's N, racer's tree as its paths from
    the root to each leaf; None for ar and smc (smc keeps every drafted token, weighed)."""
    method = batch.shape.method
    if batch.shape.tree:
        return tree_paths(record["tree"], record["parents"])
    if not method.draft_model or method.weighted:
        return None
    return batch.st.drafted[r].tolist()


def tree_paths(tokens, parents):
    """A racer tree's nodes 1..T (tokens, -1 none; parents, node 0 the root) -> each leaf's tokens from the root."""
    inner = set(parents)
    paths = []
    for leaf in range(1, len(tokens) + 1):
        if tokens[leaf - 1] < 0 or leaf in inner:
            continue
        path = []
        node = leaf
        while node:
            path.insert(0, tokens[node - 1])
            node = parents[node - 1]
        paths.append(path)
    return paths


def bytes_read(batch, req, before):
    """The bytes req's cycle read (roofline.cycle_reads) at its suffix before the cycle, as if alone in its batch."""
    shape = batch.shape
    draft_steps = shape.draft_len if shape.method.draft_model else 0
    suffix = before - 1  # the pending token is in no cache yet
    return roofline.cycle_reads(batch.models.target, batch.models.draft, draft_steps, shape.particles, len(req.ids),
                                suffix)


def served_methods(drafts):
    """The methods this engine's drafts ("model", "racer" or None) let a request name."""
    names = []
    for name, kind in methods.METHODS.items():
        if not kind.drafts or drafts == "model" or drafts == "racer" and kind.on_racer():
            names.append(name)
    return names


async def page(request):
    """The watch page: a checkout's, else an install's."""
    found = [path for path in PAGES if os.path.exists(path)]
    if not found:
        raise ApiError(404, f"watch.html is missing from {' and '.join(PAGES)}: reinstall (pip install .) or serve "
                            "from the repository's checkout")
    with open(found[0], encoding="utf-8") as f:
        return HTMLResponse(f.read(), headers={"Content-Security-Policy": PAGE_POLICY})


async def watch_info(request):
    """What the page shows before a request: the model, the methods served, the defaults, and the machine's copy
    bandwidth, measured on the first call (in a thread: the loop serves on)."""
    state = request.app.state
    eng = state.worker.eng
    async with state.measuring:
        if state.bandwidth is None:
            state.bandwidth = await asyncio.to_thread(roofline.copy_bandwidth, eng.device)
    return JSONResponse({"model": state.model_name, "device": str(eng.device), "weights": eng.weights,
                         "drafts": eng.drafts(), "methods": served_methods(eng.drafts()), "defaults": state.defaults,
                         "copy_bandwidth_gbs": state.bandwidth})


async def watch(request):
    """The page's request: a completion's options (chat: true for the chat template), checked as the API checks
    them; its events streamed: start, a record per cycle, text pieces as they settle, and end (or error)."""
    state = request.app.state
    body = await body_of(request)
    chat = get(body, "chat", bool, False)
    prompt, stop, options, _, _ = checked(body, chat, state)
    req, events = state.worker.submit(prompt, stop, options, True, watched=True)
    return StreamingResponse(watch_events(req, events), media_type="text/event-stream")


async def watch_events(req, events):
    """Server-sent events of the records req's Watch makes, its text pieces and its end. Starlette cancels this
    generator when the page goes away; `finally` then cancels the request."""
    event = None
    try:
        yield data(req.on_cycle.start_record(req))
        while not isinstance(event := await events.get(), Result):
            if isinstance(event, str):
                yield data({"kind": "text", "text": event})
            else:
                yield data(event)
        failure = error_of(event)
        if failure:
            yield data({"kind": "error", "message": failure[1]})
        else:
            yield data(plot.end_record(event))
    finally:
        if not isinstance(event, Result):
            req.cancel()


async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": request.app.state.model_name, "object": "model",
                                                     "created": 0, "owned_by": "smcsd-mini"}]})


async def health(request):
    """200 while the engine serves; 503, with the reason, once it cannot (its device failed, its loop stopped)."""
    worker = request.app.state.worker
    if worker.failure:
        return JSONResponse({"status": worker.failure, "requests": len(worker.live)}, 503)
    return JSONResponse({"status": "ok", "requests": len(worker.live)})


async def prometheus(request):
    body, content_type = request.app.state.worker.metrics.render()
    return Response(body, headers={"Content-Type": content_type})


async def api_error(request, error):
    """OpenAI's error object for an ApiError, an errors.UsageError (400) or Starlette's 404 and 405."""
    if isinstance(error, HTTPException):
        error = ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}")
    elif not isinstance(error, ApiError):  # the engine's one check names the option: here the API's name for it
        error = ApiError(400, api_message(error), API_NAMES.get(error.param, error.param))
    return JSONResponse(error_body(str(error), error.param, error.kind), error.status)


def api_message(error):
    """A UsageError's message with the option at fault called by the API's name (max_tokens)."""
    if error.param not in API_NAMES:
        return str(error)
    return str(error).replace(settings.option_name(error.param), API_NAMES[error.param])


def serve_http(worker, model_name, defaults, host, port):
    """uvicorn on the app -> the signals that stopped it. At a signal the running requests end at once (their
    clients get an error) rather than hold the shutdown; uvicorn then waits for the connections to close."""
    signals = []
    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()
        await asyncio.to_thread(worker.thread.join)  # the loop stays open for the cancelled requests' results

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            signals.append(sig)
            worker.stop()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                engine.say(f"watch it decode: open http://{host}:{port}/ in a browser")
    routes = [Route("/", page), Route("/watch", watch, methods=["POST"]), Route("/watch/info", watch_info),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", completions, methods=["POST"]),
              Route("/v1/models", models), Route("/health", health), Route("/metrics", prometheus)]
    handlers = {ApiError: api_error, errors.UsageError: api_error, HTTPException: api_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.worker = worker
    app.state.model_name = model_name
    app.state.defaults = defaults
    app.state.bandwidth = None  # GB/s, measured once the page first asks
    app.state.measuring = asyncio.Lock()
    Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5)).run()
    return signals


# ---------------------------------------------------------------- command line

def parser():
    p = argparse.ArgumentParser(description=__doc__.split(":", 1)[0])  # the docstring's first words
    settings.add_models(p)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (default %(default)s)")
    p.add_argument("--slots", type=int, default=engine.SLOTS, help="requests decoded together (default %(default)s)")
    p.add_argument("--context", type=int, help="tokens per slot: prompt + max_tokens + draft lookahead (default "
                   f"{engine.CONTEXT}, or the model's context if smaller)")
    p.add_argument("--max-waiting", type=int, default=64, help="requests queued beyond the slots before a 503 "
                   "(default %(default)s)")
    p.add_argument("--model-name", help="the model id clients see (default: the target's base name)")
    actions = settings.add_settings(p, SERVED, unset=("method",))
    actions["method"].help += " (default: smc with a draft model, sd with --draft racer, else ar)"
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        scheduler.check_slots(args.slots, args.overlap)
        engine.require(args.max_waiting >= 0, f"--max-waiting must be at least 0, got {args.max_waiting}")
        engine.require(args.context is None or args.context >= 1, f"--context must be at least 1, got {args.context}")
        engine.require(int(os.environ.get("WORLD_SIZE", 1)) == 1, "server.py serves from one process: tensor "
                       "parallelism (torchrun) is for engine.py; run the server without torchrun")
        target, draft = settings.model_paths(args.target, args.draft)
        eng = engine.Engine(target, draft, settings.device_of(args.device), args.weights, args.remeasure,
                            on_line=engine.say, draft_weights=args.draft_weights)  # opens only
        longest = eng.config.max_seq_len
        context = args.context or min(engine.CONTEXT, longest)
        engine.require(context <= longest, f"--context {context} exceeds the model's {longest} tokens")
        defaults = {name: getattr(args, name) for name in SERVED}
        if defaults["method"] is None:
            defaults["method"] = default_method(draft)
        probe = {"prompt": [0], "context": context, "max_new_tokens": 1} | defaults
        probe = engine.prepared(eng, [probe], numbered=False)[0]  # checked before the weights; auto's shape measured
        engine.choose_shapes(eng, [{"method": name} for name in methods.METHODS])  # the others' that clients ask
        eng.load(probe.shape)  # weights auto: the format fastest for the default method's cycle
    except (errors.LoadError, errors.UsageError) as error:
        sys.exit(f"error: {error}")
    except KeyboardInterrupt:
        stopped(" while loading")
    name = args.model_name or os.path.basename(os.path.normpath(target)).removesuffix(".gguf")
    try:
        signals = serve_http(Worker(eng, args.slots, context, args.max_waiting), name, defaults, args.host, args.port)
    except KeyboardInterrupt:  # uvicorn shut down at the first Ctrl-C, then raised it again
        signals = [signal.SIGINT]
    if signal.SIGINT in signals:  # uvicorn's raising it again does not always come out of asyncio as an exception
        stopped("")


def stopped(when):
    """One line for a Ctrl-C, and the shell's status for it."""
    print(f"server stopped by Ctrl-C{when}", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
    main()
