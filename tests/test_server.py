"""server.py in a subprocess on a tiny random model pair, driven with the official openai client over loopback:
completions and chat (streamed and not), concurrent streams equal to the same requests alone, bad requests
refused while others stream on, disconnects freeing their slot, a bounded load run, stop strings, and 503."""
import concurrent.futures
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from unittest.mock import ANY

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import engine

from test_engine import save, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 96  # words w0 .. w95
TEMPLATE = ("{% for m in messages %}{{ {'system': 'w1', 'user': 'w2'}.get(m['role'], 'w3') }} {{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}w3{% endif %}")


def word_model(seed):
    """A tiny random model over V words with a long context and no EOS, so that every request runs to
    max_tokens or a stop string (the tests rely on their lengths, not on where a random model would stop)."""
    m = tiny(seed, 0.8, vocab=V)
    m.config.max_seq_len = 4096  # only the saved config: nothing is built from it until the server loads it
    return m


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    paths = save(word_model(0), str(root / "target")), save(word_model(1), str(root / "draft"))
    for path in paths:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": TEMPLATE}, f)
    return paths


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, whatever the proxy settings


class Server:
    def __init__(self, port, proc):
        self.port, self.proc = port, proc
        self.client = self.openai(timeout=60)

    def openai(self, timeout):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=timeout,
                             http_client=openai.DefaultHttpx2Client(trust_env=False))

    def get(self, path):
        with DIRECT.open(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())

    def metrics(self):
        """/metrics, parsed by prometheus_client's own parser -> {(sample name, sorted labels): value}, after checking
        that every series carries its HELP and TYPE lines."""
        with DIRECT.open(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=")
            text = r.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            exposed = family.name + "_total" if family.type == "counter" else family.name  # as the text names it
            assert family.name.startswith("smcsd_") and family.documentation
            assert f"# HELP {exposed} " in text and f"# TYPE {exposed} {family.type}" in text, family.name
            for s in family.samples:
                samples[s.name, tuple(sorted(s.labels.items()))] = s.value
        return samples

    def post_raw(self, path, body):
        """(status, parsed JSON) for a body the openai client would not send."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            c.request("POST", path, body, {"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read())
        finally:
            c.close()

    def idle(self, seconds=10):
        """Wait until the engine holds no request (every one finished or cancelled); False after `seconds`."""
        end = time.monotonic() + seconds
        while self.get("/health")[1]["requests"] and time.monotonic() < end:
            time.sleep(0.05)
        return self.get("/health")[1]["requests"] == 0


@contextlib.contextmanager
def serve(pair, *args, stop=signal.SIGTERM):
    """server.py on the reference kernels (conftest.py set TRITON_INTERPRET for the kernel tests), float32;
    yields once /health answers, stops it with `stop` (SIGTERM, or SIGINT: Ctrl-C) and checks that it shut down
    cleanly, without a traceback, in bounded time."""
    port, env = free_port(), {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--target", pair[0], "--draft",
                                 pair[1], "--device", "cpu", "--weights", "float32", "--host", "127.0.0.1", "--port",
                                 str(port), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        server = Server(port, proc)
        try:
            for _ in range(600):  # 60 s
                with contextlib.suppress(OSError):
                    if server.get("/health")[0] == 200:
                        break
                assert proc.poll() is None, "server exited"
                time.sleep(0.1)
            else:
                raise AssertionError("server did not answer /health in 60 s")
            yield server
            proc.send_signal(stop)  # uvicorn shuts down, then re-raises the signal
            assert proc.wait(20) in (0, -signal.SIGTERM, 130)
            log.seek(0)
            said = log.read()
            assert "Application shutdown complete" in said, "the server did not shut down cleanly"
            assert "Traceback" not in said
        except BaseException:
            log.seek(0)
            print(log.read()[-5000:])
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def server(pair):
    with serve(pair, "--slots", "4") as s:
        yield s


@pytest.fixture(scope="module")
def single(pair):
    """One slot, one waiting request at most."""
    with serve(pair, "--slots", "1", "--max-waiting", "1") as s:
        yield s


def stream_text(stream, chat=False):
    """(text, finish_reason, usage or None) of a streamed response."""
    text, finish, usage = "", None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += (c.delta.content or "") if chat else c.text
            finish = c.finish_reason or finish
    return text, finish, usage


def words(text):
    return all(w.startswith("w") and 0 <= int(w[1:]) < V for w in text.split())


# ---------------------------------------------------------------- the API


def test_completions_streamed_and_not(server):
    c = server.client
    r = c.completions.create(model="target", prompt="w5 w6 w7", max_tokens=6, seed=3)
    text, choice = r.choices[0].text, r.choices[0]
    assert choice.finish_reason == "length" and len(text.split()) == 6 and words(text)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 6, 9)
    assert r.object == "text_completion" and r.model == "target"
    stream = c.completions.create(model="target", prompt=["w5 w6 w7"], max_tokens=6, seed=3, stream=True,
                                  stream_options={"include_usage": True})
    streamed, finish, usage = stream_text(stream)
    assert (streamed, finish) == (text, "length") and usage.completion_tokens == 6
    ids = c.completions.create(model="target", prompt=[5, 6, 7], max_tokens=6, seed=3)  # token ids
    assert ids.choices[0].text == text
    assert c.completions.create(model="target", prompt="w5 w6 w7", seed=3).usage.completion_tokens == 16  # default


def test_chat_streamed_and_not(server):
    c, messages = server.client, [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w11"}]
    r = c.chat.completions.create(model="target", messages=messages, max_tokens=5, seed=4)
    m = r.choices[0].message
    assert m.role == "assistant" and len(m.content.split()) == 5 and words(m.content)
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 5)  # "w1 w9 w10 w2 w11 w3"
    stream = c.chat.completions.create(model="target", messages=messages, max_tokens=5, seed=4, stream=True)
    assert stream_text(stream, chat=True)[:2] == (m.content, "length")


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == ["target"]
    assert server.get("/health") == (200, {"status": "ok", "requests": 0})


def test_stats_in_responses_and_metrics(server):
    """Each response carries the engine's stats (an extension: vLLM's acceptance figures for the drafting methods),
    and /metrics, typed and documented, counts what finished exactly: requests, tokens, drafted and accepted tokens,
    at each position, and the latency histograms' observations."""
    before = server.metrics()
    r = server.client.completions.create(model="target", prompt="w3 w4", max_tokens=9, seed=2,
                                         extra_body={"method": "mdsd", "particles": 2, "draft_len": 2})
    stats = r.model_extra["stats"]
    assert stats["method"] == "mdsd" and stats["particles"] == 2 and len(stats["acceptance_by_position"]) == 2
    after = server.metrics()
    grew = {k: after[k] - before.get(k, 0) for k in after}
    assert grew["smcsd_requests_total", (("stop", "length"),)] == 1
    assert grew["smcsd_generation_tokens_total", ()] == 9 and grew["smcsd_prompt_tokens_total", ()] == 2
    assert grew["smcsd_spec_accepted_tokens_total", ()] == stats["accepted"]
    assert grew["smcsd_spec_draft_tokens_total", ()] == 2 * stats["cycles"]
    for position, count in enumerate(stats["accepted_by_position"]):
        assert grew["smcsd_spec_accepted_tokens_per_position_total", (("position", str(position)),)] == count
    assert sum(stats["accepted_by_position"]) == stats["accepted"]
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert grew[f"smcsd_{histogram}_count", ()] == 1  # a non-streaming request's first text is timed too
    assert after["smcsd_requests_running", ()] == 0 and after["smcsd_requests_waiting", ()] == 0
    assert after["smcsd_slots", ()] == 4
    stream = server.client.completions.create(model="target", prompt="w3 w4", max_tokens=9, seed=2, stream=True,
                                              extra_body={"method": "mdsd", "particles": 2, "draft_len": 2})
    assert [c.model_extra.get("stats") for c in stream][-1] == stats | {"seconds": ANY, "prefill_seconds": ANY,
                                                                         "tokens_per_s": ANY}


def test_stop_strings(server):
    c = server.client
    full = c.completions.create(model="target", prompt="w8 w9", max_tokens=12, seed=5).choices[0].text
    stop = " " + " ".join(full.split()[4:6])  # two words in the middle
    expected = full[:full.index(stop)]
    r = c.completions.create(model="target", prompt="w8 w9", max_tokens=12, seed=5, stop=[stop, "w999"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    stream = c.completions.create(model="target", prompt="w8 w9", max_tokens=12, seed=5, stop=stop, stream=True)
    assert stream_text(stream)[:2] == (expected, "stop")


# ---------------------------------------------------------------- concurrency


def test_concurrent_streams_equal_the_same_requests_alone(server):
    methods = ["smc", "sd", "ar"]
    requests = [dict(prompt=f"w{10 + i} w{20 + i}", max_tokens=10, seed=i, extra_body={"method": methods[i % 3]})
                for i in range(8)]

    def run(r):
        return stream_text(server.client.completions.create(model="target", stream=True, **r))
    alone = [run(r) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, requests))
    assert together == alone, (together, alone)
    assert all(finish == "length" for _, finish, _ in alone), alone


@pytest.mark.slow
def test_overlap_and_racer_servers(pair, server):
    """--overlap (MineDraft halves) gives each request the plain server's text; --draft racer --tree serves
    tree drafts, greedy equal to ar."""
    requests = [dict(prompt=f"w{30 + i} w{40 + i}", max_tokens=10, seed=i, extra_body={"method": m})
                for i, m in enumerate(["smc", "sd", "ar", "sd", "smc"])]

    def run(s, r):
        return stream_text(s.client.completions.create(model="target", stream=True, **r))
    plain = [run(server, r) for r in requests]
    with serve(pair, "--slots", "4", "--overlap") as s, concurrent.futures.ThreadPoolExecutor(5) as pool:
        assert list(pool.map(lambda r: run(s, r), requests)) == plain
    greedy = dict(prompt="w5 w6 w5 w6 w5", max_tokens=12, temperature=0)
    with serve(pair, "--draft", "racer", "--tree", "6") as s:
        assert run(s, greedy) == run(server, greedy | {"extra_body": {"method": "ar"}})


@pytest.mark.slow
def test_a_qwen3_gguf_file_and_directory_serve_every_method(tmp_path):
    """transformers' Qwen3 as a GGUF file (the target, whose byte-level vocabulary reads the prompt) and as its
    directory (the draft): every method completes a prompt; greedy, each the same text."""
    from test_model import qwen3_files
    _, directory, gguf = qwen3_files(str(tmp_path))
    greedy = set()
    with serve((gguf, directory), "--slots", "2") as s:
        for method in engine.METHODS:
            temperature = 0.7 if method == "smc" else 0  # smc weighs draws: it has no greedy form
            r = s.client.completions.create(model="target", prompt="Hello world", max_tokens=8, seed=1,
                                            temperature=temperature, extra_body={"method": method})
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8, method
            if temperature == 0:
                greedy.add(r.choices[0].text)
    assert len(greedy) == 1, greedy


BAD = [  # (body, param or None, words of the message)
    ({"temperature": -1}, "temperature", "temperature"),
    ({"n": 2}, "n", "n=2 is not supported"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"logprobs": 2}, "logprobs", "logprobs"),
    ({"echo": True}, "echo", "echo"),
    ({"particles": "three"}, "particles", "particles"),
    ({"stop": [1]}, "stop", "stop"),
    ({"prompt": "w1 " * 5000}, None, "context"),  # longer than the context: the engine's UsageError
    ({"prompt": " "}, None, "empty"),
    ({"method": "beam"}, "method", "beam"),
    ({"method": "smc", "temperature": 0}, "temperature", "smc"),
    ({"method": "sd", "top_k": V + 1}, "top_k", f"top-k must lie in [0, {V}]"),  # a crash, then a CUDA poison
    ({"seed": 2 ** 63}, "seed", "seed must lie in [0, 2**63)"),
    ({"max_tokens": "x"}, "max_tokens", "max_tokens must be an integer, got 'x'"),  # Settings' check, the API's name
    ({"temperature": "hot"}, "temperature", "temperature must be a finite number, got 'hot'"),
    ({"stream": 1}, "stream", "stream must be true or false"),
    ({"method": "smc", "particles": 1000000}, None, "GiB"),  # its batch cannot fit the memory: refused, not a 500
    ({"method": "smc", "particles": 1000000, "stream": True}, None, "GiB"),  # refused before the stream starts
]


@pytest.mark.slow
def test_bad_requests_are_400_while_streams_continue(server):
    c = server.client
    streams = [c.completions.create(model="target", prompt="w3 w4", max_tokens=500, seed=i, stream=True,
                                    extra_body={"method": "ar"}) for i in range(3)]  # about 2 s each here
    for body, param, message in BAD:
        status, reply = server.post_raw("/v1/completions", json.dumps({"prompt": "w1 w2", **body}))
        assert status == 400, (body, reply)
        e = reply["error"]
        assert e["type"] == "invalid_request_error" and message in e["message"] and e["param"] == param, body
    with pytest.raises(openai.BadRequestError) as e:  # the same through the client
        c.completions.create(model="target", prompt="w1", max_tokens=4, n=2)
    assert e.value.param == "n"
    assert server.post_raw("/v1/completions", "{not json")[0] == 400
    assert server.post_raw("/v1/completions", "[1, 2]")[0] == 400
    assert server.post_raw("/v1/nowhere", "{}")[0] == 404
    assert server.get("/health") == (200, {"status": "ok", "requests": 3})  # the streams still run
    for s in streams:
        text, finish, _ = stream_text(s)
        assert finish == "length" and len(text.split()) == 500


LONG = {"method": "sd"}  # 2000 tokens of sd take 30 s here (the random draft is rarely accepted): far past the bounds


@pytest.mark.slow
def test_disconnect_frees_the_slot(single):
    c = single.client
    stream = c.completions.create(model="target", prompt="w1 w2", max_tokens=2000, stream=True, extra_body=LONG)
    for _, _ in zip(stream, range(3)):
        pass
    assert single.get("/health")[1]["requests"] == 1
    stream.close()  # the client goes away mid-stream
    assert single.idle(3), "the abandoned stream still holds its slot"
    with pytest.raises(openai.APITimeoutError):  # a non-streaming client that gives up
        single.openai(timeout=0.5).completions.create(model="target", prompt="w1 w2", max_tokens=2000, extra_body=LONG)
    assert single.idle(3), "the abandoned request still holds its slot"
    start = time.monotonic()
    assert c.completions.create(model="target", prompt="w1 w2", max_tokens=4).choices[0].finish_reason == "length"
    assert time.monotonic() - start < 5


def test_503_when_the_queue_is_full(single):
    c = single.client
    assert single.idle()
    running = c.completions.create(model="target", prompt="w1", max_tokens=2000, stream=True, extra_body=LONG)
    waiting = c.completions.create(model="target", prompt="w2", max_tokens=2000, stream=True, extra_body=LONG)
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="target", prompt="w3", max_tokens=4)
    assert e.value.status_code == 503 and "busy" in e.value.message
    running.close()
    waiting.close()
    assert single.idle()
    assert c.completions.create(model="target", prompt="w3", max_tokens=4).choices[0].finish_reason == "length"


def test_load(server):
    """200 short requests at concurrency 16, streamed and not: every one completes, none lost."""
    def run(i):
        r = dict(model="target", prompt=f"w{1 + i % 90} w{2 + i % 90}", max_tokens=3, seed=i)
        if i % 2:
            return stream_text(server.client.completions.create(stream=True, **r))[1]
        return server.client.completions.create(**r).choices[0].finish_reason
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        finishes = list(pool.map(run, range(200), timeout=120))
    assert finishes == ["length"] * 200
    assert server.get("/health") == (200, {"status": "ok", "requests": 0})


@pytest.mark.slow
def test_ctrl_c_stops_the_server_in_one_line(pair):
    """Ctrl-C (SIGINT) while a request streams: the server ends it, shuts down and says so in one line, with no
    KeyboardInterrupt traceback."""
    with serve(pair, "--slots", "1", stop=signal.SIGINT) as s:
        stream = s.client.completions.create(model="target", prompt="w1 w2", max_tokens=2000, stream=True,
                                             extra_body=LONG)
        next(iter(stream))
        assert s.get("/health")[1]["requests"] == 1
    assert s.proc.returncode == 130


def test_flags_derive_from_settings():
    """The server's flags for request defaults are Settings' fields, with their types, choices and defaults; a
    request that names no method gets the one that suits the models."""
    import settings
    import server
    args = server.parser().parse_args([])
    assert {name: getattr(args, name) for name in server.SERVED} == \
        {name: getattr(settings.Settings(), name) for name in server.SERVED} | {"method": None}
    assert [server.default_method(d) for d in ("racer", "draft.gguf", None)] == ["sd", "smc", "ar"]
    with pytest.raises(SystemExit):
        server.parser().parse_args(["--method", "beam"])


def test_health_and_new_requests_say_why_once_the_device_failed(monkeypatch):
    """A device error after which nothing runs (a CUDA error is sticky) ends the running requests with it; then
    /health answers 503 with the reason and new requests are refused with it, rather than failing one by one."""
    import asyncio
    from types import SimpleNamespace

    import decode
    import engine
    import server
    from test_engine import DRAFT, PROMPT, TARGET
    e = engine.Engine.of_models(TARGET, DRAFT)
    monkeypatch.setattr(decode, "target_logits",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("device-side assert")))
    monkeypatch.setattr(e, "device_ok", lambda: False)

    async def scenario():
        worker = server.Worker(e, 2, 32, 4)
        worker.start()
        _, events = worker.submit(PROMPT, [], {"method": "smc", "max_new_tokens": 8}, False)
        result = await asyncio.wait_for(events.get(), 60)
        await asyncio.to_thread(worker.thread.join, 30)
        health = await server.health(SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(worker=worker))))
        with pytest.raises(server.ApiError) as refused:
            worker.submit(PROMPT, [], {"method": "ar", "max_new_tokens": 8}, False)
        return result, health, refused.value
    result, health, refused = asyncio.run(scenario())
    assert result.stats["stop"] == "error" and "device-side assert" in result.stats["error"]
    assert health.status_code == 503 and b"the device failed" in health.body
    assert refused.status == 503 and "the device failed" in str(refused)
