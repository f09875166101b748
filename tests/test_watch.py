"""The watch page (server.py's / and POST /watch, watch.html): the records a watched request sends, on tiny random
models in this process; the page's HTTP side on a server over them; and the page itself in headless Chromium,
driven over the DevTools protocol against a server on the SmolLM2-135M pair. The README's screenshot, on the default
pair: python tests/test_watch.py docs/watch.png --weights w4a8 (after the PNG, server.py's flags)."""
import asyncio
import contextlib
import http.client
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script too
import cli  # noqa: E402
import engine  # noqa: E402
import roofline  # noqa: E402
import server  # noqa: E402
import test_engine  # noqa: E402
from test_engine import DRAFT, PROMPT, TARGET, save  # noqa: E402
from test_server import DIRECT, free_port, serve, word_model  # noqa: E402

CHROMIUM = shutil.which("chromium")
WIDTH = 1400  # the browser's window, in pixels
NO_CHROMIUM = "chromium not found: apt-get install chromium"
reference_kernels = test_engine.reference_kernels  # autouse, as there: the interpreted Triton kernels are slow
random_trees = test_engine.random_trees


# ---------------------------------------------------------------- the records, in this process


def watched(e, **options):
    """-> (Result, the records a Watch sent) of a request run with a Watch as its on_cycle."""
    records = []
    req = e.request(PROMPT, on_cycle=server.Watch(e.tokenizer, records.append), **options)
    return engine.run(e, [req])[0], records


@pytest.mark.parametrize("method", ["smc", "sd", "mdsd"])
def test_watching_changes_no_token(method):
    """One path: a Watch reads every cycle's State and the tokens are those of the same seed unwatched."""
    options = dict(method=method, particles=4, draft_len=2, max_new_tokens=20, temperature=1.0, seed=5,
                   ess_threshold=0.9)
    e = engine.Engine.of_models(TARGET, DRAFT)
    plain = e.generate(PROMPT, **options)
    result, records = watched(e, **options)
    assert result.tokens == plain.tokens and len(records) == result.stats["cycles"]
    particles = 1 if method == "sd" else 4
    assert all(r["ms"] > 0 and r["seconds"] > 0 and len(r["texts"]) == particles for r in records)
    if method == "smc":
        assert sum(r["resampled"] for r in records) == result.stats["resamples"] >= 1
        assert all(r["drafts"] is None for r in records)
    else:
        assert sum(r["drafts"]["accepted"] for r in records) == result.stats["accepted"]
        assert all(len(r["drafts"]["rows"]) == (4 if method == "mdsd" else 1) for r in records)


def test_a_racer_tree_is_marked_along_its_paths(random_trees):
    """racer's trees (random ones, test_engine.py's) arrive as their root-to-leaf paths, the accepted tokens marked on
    the path the target took; no draft model's bytes are read."""
    e = engine.Engine.of_models(TARGET, "racer")
    options = dict(method="sd", max_new_tokens=20, temperature=1.0, seed=1, draft_len=3, tree=8)
    plain = e.generate(PROMPT, **options)
    result, records = watched(e, **options)
    assert result.tokens == plain.tokens and sum(r["drafts"]["accepted"] for r in records) == result.stats["accepted"]
    for r in records:
        path = [row for row in r["drafts"]["rows"] if [m for _, m in row][:r["drafts"]["accepted"]] ==
                ["accepted"] * r["drafts"]["accepted"]]
        assert path and r["bytes"]["weights"] == e.target.weight_bytes()


def test_a_cycle_reads_each_weight_once_a_forward():
    e = engine.Engine.of_models(TARGET, DRAFT).load()
    ar = roofline.cycle_reads(e.target, e.draft, 0, 1, prompt_len=3, suffix_len=5)
    assert ar == {"weights": e.target.weight_bytes(), "kv": roofline.kv_bytes_per_token(e.target) * 8}
    smc = roofline.cycle_reads(e.target, e.draft, 2, 4, prompt_len=3, suffix_len=5)
    assert smc["weights"] == ar["weights"] + 2 * e.draft.weight_bytes()
    assert smc["kv"] == (roofline.kv_bytes_per_token(e.target) + 2 * roofline.kv_bytes_per_token(e.draft)) * 23


class Words:
    """A tokenizer whose token t reads "wt "."""
    decode = staticmethod(lambda ids: "".join(f"w{t} " for t in ids))


def test_drafts_are_marked_along_the_path_taken():
    watch = server.Watch(Words(), None)
    record = {"tokens": [[1, 2, 9]]}  # two accepted, then the target's own token
    marked = watch.drafts([[1, 2, 3, 4], [1, 5, 6, 7], [1, 2]], record)
    assert [[mark for _, mark in row] for row in marked["rows"]] == [
        ["accepted", "accepted", "rejected", "unseen"], ["accepted", "rejected", "unseen", "unseen"],
        ["accepted", "accepted"]]
    assert marked["rows"][0][0] == ["w1 ", "accepted"] and marked["emitted"] == "w9 " and marked["accepted"] == 2
    assert watch.drafts(None, record) is None


def test_a_tree_is_drafted_as_its_paths():
    # node 1 (token 10) under the root, nodes 2, 3 (11, 12) under node 1, node 4 (13) under the root, node 5 unused
    assert server.tree_paths([10, 11, 12, 13, -1], [0, 1, 1, 0, 0]) == [[10, 11], [10, 12], [13]]


def test_the_methods_a_page_offers():
    assert server.served_methods("model") == ["smc", "sd", "mdsd", "easd", "ar"]
    assert server.served_methods("racer") == ["sd", "ar"]
    assert server.served_methods(None) == ["ar"]


# ---------------------------------------------------------------- the page's HTTP side, on tiny random models


@pytest.fixture(scope="module")
def words_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("watch")
    return save(word_model(0), str(root / "target")), save(word_model(1), str(root / "draft"))


@pytest.fixture(scope="module")
def words_server(words_pair):
    with serve(words_pair, "--slots", "2") as s:
        yield s


def post(s, path, body, timeout=30):
    """(the response, its connection) of a POST whose body is read as it comes."""
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return c.getresponse(), c


def events(response):
    """The JSON of each server-sent event of a response, as they arrive."""
    for line in response:
        if line.startswith(b"data: "):
            yield json.loads(line[6:])


BAD_BODIES = [  # the page's request is checked as the API's: the same 400, before any event
    ({"temperature": 0}, "smc needs temperatures > 0"),
    ({"stream": "yes"}, "stream must be true or false"),
    ({"prompt": [[1, 2], [3]]}, "prompt must be a string or a list of token ids (one prompt)"),
    ({"stop": [1]}, "stop must be a string or a list of non-empty strings"),
    ({"particles": 1000000}, "GiB"),  # its batch could never fit the memory
]


@pytest.mark.slow
def test_the_page_and_its_events(words_server):
    """GET / serves the page, its script and styles its own; /watch/info the methods, defaults and the copy
    bandwidth; POST /watch streams start, a record per cycle, the settled text and an end whose text is the API's
    for the same seed, beside another page's request; bad options get the API's one-line 400; a page that goes away
    cancels its request."""
    with DIRECT.open(f"http://127.0.0.1:{words_server.port}/", timeout=10) as r:
        page = r.read().decode()
        assert "default-src 'none'" in r.headers["Content-Security-Policy"] and "<script>" in page
    status, info = words_server.get("/watch/info")
    assert status == 200 and info["methods"] == server.served_methods("model") and info["copy_bandwidth_gbs"] > 0
    options = {"prompt": "w5 w6 w7", "max_tokens": 12, "seed": 3, "method": "smc", "particles": 3, "draft_len": 2}
    other, other_c = post(words_server, "/watch", options | {"max_tokens": 2000, "method": "sd"})
    assert next(e for e in events(other) if e["kind"] == "cycle")["cycle"] == 1  # another page's, decoding on
    response, c = post(words_server, "/watch", options)
    with contextlib.closing(c):
        got = list(events(response))
    kinds = [e["kind"] for e in got]
    assert kinds[0] == "start" and kinds[-1] == "end" and "cycle" in kinds and "text" in kinds
    text = "".join(e["text"] for e in got if e["kind"] == "text")
    api = words_server.client.completions.create(model="target", prompt=options["prompt"], max_tokens=12, seed=3,
                                                 extra_body={"method": "smc", "particles": 3, "draft_len": 2})
    assert got[-1]["text"] == text == api.choices[0].text
    assert sum(e["kind"] == "cycle" for e in got) == got[-1]["stats"]["cycles"]
    for bad, message in BAD_BODIES:
        status, reply = words_server.post_raw("/watch", json.dumps(options | bad))
        api_status, api_reply = words_server.post_raw("/v1/completions", json.dumps(options | bad))
        assert status == api_status == 400 and reply == api_reply and message in str(reply), bad
    assert words_server.get("/health")[1]["requests"] == 1
    other.close()  # the other page goes away
    other_c.close()
    assert words_server.idle(5), "the page went away, its request still holds its slot"


def test_a_missing_page_is_a_404_that_says_where_it_should_be(monkeypatch, tmp_path):
    """A page found nowhere is a one-line 404 naming where it was looked for, rather than a failure inside."""
    places = (str(tmp_path / "a" / "watch.html"), str(tmp_path / "b" / "watch.html"))
    monkeypatch.setattr(server, "PAGES", places)
    with pytest.raises(server.ApiError) as error:
        asyncio.run(server.page(None))
    assert error.value.status == 404 and str(error.value) == (f"watch.html is missing from {places[0]} and "
                                                              f"{places[1]}: reinstall (pip install .) or serve from "
                                                              "the repository's checkout")


def test_engine_watch_needs_no_prompt():
    with pytest.raises(SystemExit) as e:
        cli.main(["--watch", "--prompt", "hello"])
    assert "--watch: prompts are typed in the page" in str(e.value)


@pytest.mark.slow
def test_engine_watch_serves_the_page_and_says_where(words_pair):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, os.path.join(test_engine.ROOT, "engine.py"), "--watch", str(port), "--target",
               words_pair[0], "--draft", words_pair[1], "--device", "cpu", "--weights", "float32"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, bufsize=0)
    try:
        said = until(lambda: said_where(proc), 60)
        assert said == f"watch it decode: open http://127.0.0.1:{port}/ in a browser\n"
        with DIRECT.open(f"http://127.0.0.1:{port}/", timeout=10) as r:
            assert r.status == 200 and "watch it decode" in r.read().decode()
    finally:
        proc.terminate()
        proc.wait(20)


def said_where(proc):
    """The server's line with the page's address, once it has said it (other lines are passed over); its stderr is
    unbuffered, so that what select sees waiting is all there is."""
    while select.select([proc.stderr], [], [], 0.1)[0]:
        line = proc.stderr.readline().decode()
        assert line, "the server exited"
        if line.startswith("watch it decode"):
            return line
    return None


# ---------------------------------------------------------------- the page, in a browser


class Browser:
    """Headless Chromium over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages that end in a
    NUL byte, read from its fd 3 and answered on its fd 4), attached to one page of width x height pixels."""

    def __init__(self, folder, width=WIDTH, height=1000):
        to_browser = os.pipe()
        from_browser = os.pipe()

        def on_3_and_4():  # in the child: no pipe end can be fd 3 but the one put there
            os.dup2(to_browser[0], 3)
            os.dup2(from_browser[1], 4)
            for fd in (3, 4):  # dup2 onto itself leaves a pipe end as it was made: closed at exec
                os.set_inheritable(fd, True)
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--no-default-browser-check", "--no-proxy-server", "--disable-extensions", "--mute-audio",
                 "--remote-debugging-pipe", f"--user-data-dir={folder}", "about:blank"]
        self.proc = subprocess.Popen([CHROMIUM, *flags], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, close_fds=False, preexec_fn=on_3_and_4)
        for end in (to_browser[0], from_browser[1]):
            os.close(end)
        self.commands = to_browser[1]
        self.replies = from_browser[0]
        self.buffer = b""
        self.calls = 0
        self.session = None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.resize(width, height)

    def resize(self, width, height):
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method, timeout=30, **params):
        """A DevTools command's result (an error fails the test); the events between are passed over."""
        self.calls += 1
        message = {"id": self.calls, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self.receive(deadline)
            if reply.get("id") == self.calls:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]

    def receive(self, deadline):
        while b"\0" not in self.buffer:
            ready = select.select([self.replies], [], [], max(deadline - time.monotonic(), 0))[0]
            assert ready, "Chromium did not answer in time"
            chunk = os.read(self.replies, 1 << 20)
            assert chunk, "Chromium closed its pipe"
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def evaluate(self, expression):
        """The value of a JavaScript expression in the page (a promise awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def open(self, url):
        """Load url and wait until the page has read /watch/info (its methods offered)."""
        self.call("Page.navigate", url=url)
        until(self.ready, 30)

    def ready(self):
        """Whether the page offers its methods (an evaluation while it loads may find no document: not yet)."""
        with contextlib.suppress(AssertionError):
            return self.evaluate("document.getElementById('method')?.options.length > 0")
        return False

    def screenshot(self, path):
        """The whole page, as tall as it is, to a PNG file."""
        import base64
        self.resize(WIDTH, self.evaluate("document.documentElement.scrollHeight"))
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self):
        with contextlib.suppress(AssertionError, OSError):
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.commands)
        os.close(self.replies)


def until(check, seconds, every=0.05):
    """check()'s first true value, tried every `every` seconds for at most `seconds`; fails after that."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not seen in {seconds} s: {check.__doc__ or check}")


def set_form(browser, method, **fields):
    """Fill the page's form, the method first: it enables the fields it takes."""
    sets = [f"document.getElementById({json.dumps(k)}).value = {json.dumps(str(v))};" for k, v in fields.items()]
    browser.evaluate(f"""(() => {{
        const method = document.getElementById("method");
        method.value = {json.dumps(method)};
        method.dispatchEvent(new Event("change"));
        {" ".join(sets)}
    }})()""")


def start_run(browser, method, **fields):
    """Fill the page's form and press Start."""
    set_form(browser, method, **fields)
    browser.evaluate('document.getElementById("start").click()')


SNAPSHOT = """(() => ({
    rows: [...document.querySelectorAll("#particle-rows .particle .tail")].map((t) => t.textContent),
    moved: document.querySelectorAll("#genealogy line.moved").length,
    accepted: document.querySelectorAll("#drafts .chip.accepted").length,
    rejected: document.querySelectorAll("#drafts .chip.rejected").length,
    settled: document.getElementById("settled").textContent,
    done: document.getElementById("status").dataset.done === "true",
    cycle: Number(document.getElementById("status").dataset.cycle || 0),
    error: document.getElementById("error").textContent,
    ar: document.getElementById("ar-line").textContent,
}))()"""


def watch_to_the_end(browser, seconds=60):
    """The page's snapshots from Start to the run's end (or its error), polled."""
    snapshots = []
    end = time.monotonic() + seconds
    while not (snapshots and (snapshots[-1]["done"] or snapshots[-1]["error"])):
        assert time.monotonic() < end, f"the run did not end in {seconds} s: {snapshots[-1:]}"
        snapshots.append(browser.evaluate(SNAPSHOT))
        time.sleep(0.05)
    return snapshots


@contextlib.contextmanager
def browser_on(url):
    with tempfile.TemporaryDirectory() as folder:
        browser = Browser(folder)
        try:
            browser.open(url)
            yield browser
        finally:
            browser.close()


SMOLLM = dict(prompt="Once upon a time, in a small village,", temperature=1.0, max_tokens=16)
SMC = dict(particles=4, draft_len=3, seed=2)  # its particles part, and the server's lag collapses them


@pytest.mark.slow
def test_the_page_in_a_browser():
    """Headless Chromium on the page of a server over SmolLM2-135M (draft and target alike): an smc run started from
    the form shows its N particle rows growing, draws a resampling and ends with the API's text for its seed, and
    the ar button sets ar's speed beside it; an sd run (top-k 2: the target refuses what the draft proposes outside
    its top two) marks accepted and rejected drafts."""
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    from test_model import smollm_gguf
    gguf = smollm_gguf()
    lag = ("--lag", "5")  # a draft that is its target never resamples by weight: by the lag it does
    with serve((gguf, gguf), "--slots", "2", *lag) as s, browser_on(f"http://127.0.0.1:{s.port}/") as browser:
        start_run(browser, "smc", **SMOLLM, **SMC)
        snapshots = watch_to_the_end(browser)
        last = snapshots[-1]
        assert not last["error"], last["error"]
        growing = [snap["rows"] for snap in snapshots if len(snap["rows"]) == SMC["particles"]]
        assert len({json.dumps(rows) for rows in growing}) >= 2, "the particle rows did not grow"
        assert max(snap["moved"] for snap in snapshots) > 0, "no resampling drawn"
        api = s.client.completions.create(model="smollm", prompt=SMOLLM["prompt"], max_tokens=SMOLLM["max_tokens"],
                                          temperature=1.0, seed=SMC["seed"],
                                          extra_body={"method": "smc", "particles": 4, "draft_len": 3})
        assert last["settled"] == api.choices[0].text
        browser.evaluate('document.getElementById("ar").click()')
        until(lambda: "x ar" in browser.evaluate(SNAPSHOT)["ar"], 30)
        start_run(browser, "sd", **SMOLLM, draft_len=4, top_k=2, seed=1)
        last = watch_to_the_end(browser)[-1]
        assert not last["error"] and last["accepted"] > 0 and last["rejected"] > 0, last


# ---------------------------------------------------------------- a screenshot of the page mid-decode


def screenshot(path, flags):
    """docs/watch.png: the page mid-decode, smc on the default pair (server flags: `flags`)."""
    port = str(free_port())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, os.path.join(root, "server.py"), "--port", port, *flags])
    try:
        until(lambda: health(port), 600, every=1)
        with browser_on(f"http://127.0.0.1:{port}/") as browser:
            form = dict(prompt="def quicksort(xs):\n", particles=4, draft_len=3, seed=1, max_tokens=128,
                        temperature=0.7)
            set_form(browser, "smc", **form)
            browser.evaluate('document.getElementById("ar").click()')  # ar first: its speed stays beside smc's
            until(lambda: "tok/s" in browser.evaluate(SNAPSHOT)["ar"], 300, every=0.5)
            start_run(browser, "smc", **form)
            until(lambda: apart(browser), 300, every=0.02)
            browser.screenshot(path)
    finally:
        proc.terminate()
        proc.wait(30)


def apart(browser):
    """Mid-decode with the particles apart: ten cycles in, three different texts past the settled one."""
    snapshot = browser.evaluate(SNAPSHOT)
    assert not snapshot["done"], "the run ended before its particles parted"
    return snapshot["cycle"] >= 10 and len({row for row in snapshot["rows"] if row.strip()}) >= 3


def health(port):
    with contextlib.suppress(OSError):
        with DIRECT.open(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    return False


if __name__ == "__main__":
    screenshot(sys.argv[1], sys.argv[2:])
