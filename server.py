"""An OpenAI-compatible HTTP server on the engine's batched serving loop.

    python server.py --target weights/qwen2.5-coder-1.5b-instruct.gguf --draft weights/qwen2.5-coder-0.5b-instruct.gguf
    curl localhost:8000/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 64, "stream": true}'
    openai.OpenAI(base_url="http://localhost:8000/v1", api_key="x").chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Hi"}], extra_body={"method": "sd"})

Endpoints: POST /v1/completions and /v1/chat/completions ("stream": true for server-sent events), GET /v1/models,
GET /health. Fields: prompt (a string or token ids) / messages, max_tokens (default 16 for completions, as OpenAI;
256 for chat), temperature (default: the engine's 0.7), top_p, seed (default: a random one), stop, n (1 only),
stream, stream_options.include_usage; model is not checked (one model here). Extensions, top-level keys: method,
particles, draft_len, lag, top_k. A request naming no method that smc cannot honour (temperature 0, top_p < 1, top_k)
runs sd, which is exact there. Unknown fields are ignored; fields whose meaning cannot be honoured (logprobs,
echo, n > 1, tools...) are a 400, as is every request the engine refuses.

One worker thread runs Engine.serve: `--slots` requests decode together, later ones wait in its inbox. When
`--max-waiting` already wait, a new request is refused at once with 503 rather than queued without bound. A client
that goes away cancels its request: the engine frees its slot at the next cycle."""
import argparse
import asyncio
import collections
import contextlib
import json
import os
import queue
import random
import sys
import threading
import time
import traceback
import uuid
from types import SimpleNamespace

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import engine
import formats
import model

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # "degenerate" (smc) passes as it is
# Fields that change what a client gets back, with the values that change nothing; any other value is a 400.
UNSUPPORTED = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
               "suffix": ("",), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
               "function_call": ("none",), "response_format": ({"type": "text"},), "presence_penalty": (0,),
               "frequency_penalty": (0,)}
KINDS = {int: "an integer", (int, float): "a number", str: "a string", bool: "true or false", list: "a list",
         dict: "an object"}


class ApiError(Exception):
    def __init__(self, status, message, param=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


def error_body(message, param=None, kind="invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ---------------------------------------------------------------- request fields

def float_constant(name):
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity, JSON has neither


def check(ok, message, param=None):
    if not ok:
        raise ApiError(400, message, param)


def get(body, name, kind, default=None):
    """body[name], default when absent or null; a 400 when not of `kind` (JSON true is no number here)."""
    value = body.get(name)
    if value is None:
        return default
    check(isinstance(value, kind) and (kind is bool or not isinstance(value, bool)), f"{name} must be {KINDS[kind]}",
          name)
    return value


def prompt_of(body, chat, tokenizer):
    """A completion's prompt (text or token ids), or the chat messages in the tokenizer's chat template."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        check(isinstance(prompt, str) or ids, "prompt must be a string or a list of token ids (one prompt)", "prompt")
        return prompt
    messages = get(body, "messages", list)
    check(messages and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in messages), "messages must be a list of {role, content} with text content",
          "messages")
    return engine.apply_chat(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])


def options_of(body, chat, defaults):
    """-> (stop strings, the engine's options) of a request body."""
    for name, harmless in UNSUPPORTED.items():
        if body.get(name) not in (None, *harmless):
            raise ApiError(400, f"{name}={json.dumps(body[name])[:40]} is not supported", name)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    check(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
          "stop must be a string or a list of non-empty strings", "stop")
    o = dict(defaults, max_new_tokens=get(body, "max_tokens", int, 256 if chat else 16))
    if chat and body.get("max_completion_tokens") is not None:  # the newer name
        o["max_new_tokens"] = get(body, "max_completion_tokens", int)
    check(o["max_new_tokens"] >= 1, "max_tokens must be at least 1", "max_tokens")  # the API's name for it
    for name, kind in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int), ("seed", int),
                       ("method", str), ("particles", int), ("draft_len", int), ("lag", int)):
        if body.get(name) is not None:
            o[name] = get(body, name, kind)
    o.setdefault("seed", random.randrange(2 ** 31))  # no seed given: a fresh sample, as OpenAI's
    if "method" not in body and o["method"] == "smc" and (o.get("temperature", 1) == 0 or o.get("top_p", 1) < 1
                                                          or o.get("top_k", 0) > 0):
        o["method"] = "sd"  # smc has no greedy or truncated form; sd samples the target exactly
    if o["method"] == "ar":  # the server's racer trees and overlap are for the methods that draft
        o.pop("overlap", None)
    if o["method"] != "sd":
        o.pop("tree", None)
    return stop, o


# ---------------------------------------------------------------- the serving loop, bridged to asyncio

class Worker:
    """Engine.serve on one thread. A request's text pieces (str), then its result, come back through
    loop.call_soon_threadsafe into an asyncio.Queue of its own. `live` holds the queues of the requests the engine
    has not finished, running or waiting: its size bounds the waiting ones."""

    def __init__(self, eng, slots, context, max_waiting):
        self.eng, self.slots, self.context, self.max_waiting = eng, slots, context, max_waiting
        self.inbox, self.live, self.loop, self.failure = queue.Queue(), set(), None, None
        self.totals, self.by_position = collections.Counter(), collections.Counter()  # /metrics

    def start(self):
        self.loop = asyncio.get_running_loop()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        try:
            self.eng.serve(self.inbox, self.slots, self.context)
        except engine.DeviceFailed as e:  # the engine ended every request; later ones are refused with this
            self.failure = str(e)
            print(f"error: {e}", file=sys.stderr)
        except BaseException as e:
            self.failure = f"the serving loop stopped: {e!r}"
            traceback.print_exc()
        finally:  # what is still live will never finish: tell its clients
            gone = SimpleNamespace(text="", tokens=[], stats={"stop": "error", "error": self.failure or
                                                              "the serving loop stopped"})
            self.post(lambda: [self.finish(events, gone) for events in list(self.live)])

    def post(self, call, *args):
        with contextlib.suppress(AttributeError, RuntimeError):  # no event loop (yet, or any more): nobody waits
            self.loop.call_soon_threadsafe(call, *args)

    def finish(self, events, result):
        if events in self.live:
            self.live.discard(events)
            self.count(result.stats)
            events.put_nowait(result)

    def count(self, stats):
        """A finished request's figures into the counters /metrics shows (on the event loop's thread)."""
        cycles, t = stats.get("cycles", 0), self.totals
        t[f'requests_total{{stop="{stats["stop"]}"}}'] += 1
        for name, key in (("prompt_tokens_total", "prompt_tokens"), ("generation_tokens_total", "new_tokens"),
                          ("request_seconds_sum", "seconds"), ("prefill_seconds_sum", "prefill_seconds"),
                          ("cycles_total", "cycles"), ("spec_accepted_tokens_total", "accepted"),
                          ("smc_resamples_total", "resamples"), ("smc_collapses_total", "collapses")):
            t[name] += stats.get(key, 0)
        t["request_seconds_count"] += 1
        if "acceptance" in stats:  # vLLM's spec-decode counters: drafted, accepted, accepted at each position
            t["spec_draft_tokens_total"] += cycles * stats["draft_len"]
            t["spec_cycles_total"] += cycles
            for k, rate in enumerate(stats["acceptance_by_position"]):
                self.by_position[k] += round(rate * cycles)

    def metrics(self):
        """Prometheus' text format: the counters, then the requests running or waiting now."""
        lines = [f"smcsd_{name} {value:g}" for name, value in sorted(self.totals.items())]
        lines += [f'smcsd_spec_accepted_tokens_per_position_total{{position="{k}"}} {n}'
                  for k, n in sorted(self.by_position.items())]
        lines += [f"smcsd_requests_live {len(self.live)}", f"smcsd_slots {self.slots}",
                  f"smcsd_requests_waiting {max(0, len(self.live) - self.slots)}"]
        return "\n".join(lines) + "\n"

    def submit(self, prompt, stop, options, stream):
        """-> (engine.Request, its queue); engine.UsageError for a bad request; a 503 when too many wait."""
        if self.failure or not self.thread.is_alive():
            raise ApiError(503, self.failure or "the serving loop has stopped", kind="server_error")
        if len(self.live) >= self.slots + self.max_waiting:
            raise ApiError(503, f"server busy: {len(self.live)} requests running or waiting", kind="server_error")
        events = asyncio.Queue()
        req = self.eng.request(prompt, stop=stop, context=self.context, **options,
                               on_text=(lambda text: self.post(events.put_nowait, text)) if stream else None,
                               on_done=lambda result: self.post(self.finish, events, result))
        self.live.add(events)
        self.inbox.put(req)
        return req, events

    def stop(self):
        self.post(self.inbox.put, None)  # via the loop: safe from a signal handler, which may interrupt a put


def failure(result):
    """(status, message) of a request that ended without an answer, else None."""
    if result.stats["stop"] == "error":
        return 500, result.stats["error"]
    if result.stats["stop"] == "cancelled":  # with its client still there: only at shutdown
        return 503, "the server is shutting down"


# ---------------------------------------------------------------- HTTP

async def completions(request):
    state, chat = request.app.state, request.url.path.endswith("/chat/completions")
    try:
        body = json.loads(await request.body(), parse_constant=float_constant)
    except ValueError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    check(isinstance(body, dict), "the body must be a JSON object")
    stream = get(body, "stream", bool, False)
    include_usage = get(get(body, "stream_options", dict, {}), "include_usage", bool, False)
    prompt = prompt_of(body, chat, state.worker.eng.tokenizer)
    req, events = state.worker.submit(prompt, *options_of(body, chat, state.defaults), stream)
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": state.model_name, "object": "chat.completion" if chat else "text_completion"}
    if stream:
        head["object"] += ".chunk" if chat else ""
        return StreamingResponse(sse(req, events, head, chat, include_usage), media_type="text/event-stream")
    result = await until_done(request, req, events)
    if result is None:
        return Response(status_code=499)  # the client has gone: nobody reads this
    if failure(result):
        raise ApiError(*failure(result), kind="server_error")
    part = {"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text}
    return JSONResponse({**head, "choices": [{"index": 0, **part, "logprobs": None, "finish_reason": finish(result)}],
                         "usage": usage(req, result), "stats": result.stats})  # stats: the engine's, an extension


async def until_done(request, req, events):
    """The request's result, or None when the client disconnects first (then the request is cancelled)."""
    async def disconnected():  # the body has been read: uvicorn's receive() now waits for a disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass
    done, gone = asyncio.ensure_future(events.get()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([done, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            done.cancel()
            req.cancel()
    return done.result() if done.done() else None


async def sse(req, events, head, chat, include_usage):
    """Server-sent events in OpenAI's chunk format. Starlette cancels this generator when the client goes away;
    `finally` then cancels the request."""
    def chunk(piece, finish_reason=None, **extra):
        part = {"delta": piece} if chat else {"text": piece}
        return data({**head, "choices": [{"index": 0, **part, "logprobs": None, "finish_reason": finish_reason}],
                     **extra})
    result = None
    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        while isinstance(result := await events.get(), str):
            yield chunk({"content": result} if chat else result)
        if failure(result):
            yield data(error_body(failure(result)[1], kind="server_error"))
        else:
            yield chunk({} if chat else "", finish(result), stats=result.stats)
            if include_usage:
                yield data({**head, "choices": [], "usage": usage(req, result)})
        yield "data: [DONE]\n\n"
    finally:
        if not hasattr(result, "stats"):  # not finished: the client went away
            req.cancel()


def data(obj):
    return f"data: {json.dumps(obj)}\n\n"


def finish(result):
    return FINISH.get(result.stats["stop"], result.stats["stop"])


def usage(req, result):
    prompt, new = result.stats.get("prompt_tokens", len(req.ids)), result.stats["new_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": request.app.state.model_name, "object": "model",
                                                     "created": 0, "owned_by": "smcsd-mini"}]})


async def health(request):
    """200 while the engine serves; 503, with the reason, once it cannot (its device failed, its loop stopped)."""
    worker = request.app.state.worker
    ok = worker.thread.is_alive() and not worker.failure
    return JSONResponse({"status": "ok" if ok else worker.failure or "the serving loop stopped",
                         "requests": len(worker.live)}, 200 if ok else 503)


async def metrics(request):
    return Response(request.app.state.worker.metrics(), media_type="text/plain; version=0.0.4")


async def api_error(request, e):
    """OpenAI's error object for an ApiError, an engine.UsageError (400) or Starlette's 404 and 405."""
    if isinstance(e, HTTPException):
        e = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
    elif not isinstance(e, ApiError):  # the engine's one check names the option: the API's name for it
        e = ApiError(400, str(e), {"max_new_tokens": "max_tokens", "draft_temperature": "temperature",
                                   "target_temperature": "temperature"}.get(e.param, e.param))
    return JSONResponse(error_body(str(e), e.param, e.kind), e.status)


def serve_http(worker, model_name, defaults, host, port):
    """uvicorn on the app. At a signal the running requests end at once (their clients get an error) rather than
    hold the shutdown; uvicorn then waits for the connections to close."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()
        await asyncio.to_thread(worker.thread.join)  # the loop stays open for the cancelled requests' results

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            worker.stop()
            super().handle_exit(sig, frame)
    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", completions, methods=["POST"]),
                            Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics)],
                    exception_handlers={ApiError: api_error, engine.UsageError: api_error, HTTPException: api_error},
                    lifespan=lifespan)
    app.state.worker, app.state.model_name, app.state.defaults = worker, model_name, defaults
    Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5)).run()


# ---------------------------------------------------------------- command line

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model: Hugging Face directory or .gguf file (default: weights/ pair)")
    p.add_argument("--draft", help="draft model, same vocabulary as the target; racer: drafts from retrieval and the "
                   "target's logits, no draft model (sd)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=4, help="requests decoded together")
    p.add_argument("--context", type=int, help="tokens per slot: prompt + max_tokens + draft lookahead "
                   "(default 2048, or the model's context if smaller)")
    p.add_argument("--max-waiting", type=int, default=64, help="requests queued beyond the slots before 503")
    p.add_argument("--method", choices=engine.METHODS,
                   help="default method (smc with a draft model, sd with racer, else ar)")
    p.add_argument("--particles", type=int, help="default smc particles N")
    p.add_argument("--draft-len", type=int, help="default draft tokens K per cycle")
    p.add_argument("--lag", type=int, help="default smc lag (16): collapse onto one particle past this many unsettled "
                   "tokens")
    p.add_argument("--tree", type=int, metavar="NODES", help="--draft racer: tree drafts of up to NODES tokens")
    p.add_argument("--overlap", action="store_true", help="MineDraft: half the slots draft while the other half "
                   "verifies")
    p.add_argument("--device")
    p.add_argument("--weights", choices=["auto", *formats.FORMATS], help="matmul weights' format "
                   "(default auto: each model's measured at load on a CPU, bf16 elsewhere)")
    p.add_argument("--model-name", help="the model id clients see (default: the target's base name)")
    args = p.parse_args(argv)
    try:
        if args.slots < 1 or args.max_waiting < 0 or args.context is not None and args.context < 1:
            raise engine.UsageError("--slots and --context must be at least 1, --max-waiting at least 0")
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise engine.UsageError("server.py serves from one process: tensor parallelism (torchrun) is for "
                                    "engine.py; run the server without torchrun")
        if args.overlap and args.slots < 2:
            raise engine.UsageError("--overlap needs at least 2 slots, one for each half")
        if args.draft and not args.target:
            raise engine.UsageError("--draft needs --target")
        draft, target = (args.draft, args.target) if args.target else engine.default_pair()
        try:
            device = args.device and torch.device(args.device)
        except RuntimeError:
            raise engine.UsageError(f"unknown device {args.device!r}; use cpu or cuda") from None
        eng = engine.Engine(target, draft, device, args.weights)  # opens the files; reads no weights yet
        context = args.context or min(2048, eng.config.max_seq_len)
        if context > eng.config.max_seq_len:
            raise engine.UsageError(f"--context {context} exceeds the model's {eng.config.max_seq_len} tokens")
        method = args.method or ("sd" if draft == "racer" else "smc" if draft else "ar")
        defaults = {k: v for k, v in (("method", method), ("particles", args.particles), ("draft_len", args.draft_len),
                                      ("lag", args.lag), ("tree", args.tree), ("overlap", args.overlap or None))
                    if v is not None}
        probe = eng.request([0], context=context, max_new_tokens=1, **defaults)  # checked before the weights
        print(f"loading {target}" + (f" with draft {draft}" if draft else ""), file=sys.stderr)
        eng.load(probe.shape)  # weights auto: the format fastest for the default method's cycle
    except (model.LoadError, engine.UsageError) as e:
        sys.exit(f"error: {e}")
    name = args.model_name or os.path.basename(os.path.normpath(target)).removesuffix(".gguf")
    serve_http(Worker(eng, args.slots, context, args.max_waiting), name, defaults, args.host, args.port)


if __name__ == "__main__":
    main()
