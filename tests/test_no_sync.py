"""The CUDA-graph path by construction, on a CPU: every phase a batch records (the cycle, MineDraft's draft and verify)
reads nothing back to the host, under a dispatch mode that fails on each op that would, with the Triton kernels
interpreted, over every slot of a batch; each graph is captured on a stream of its own; the memory check counts them."""
import contextlib
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import decode
import engine
import kernels
import scheduler
from test_engine import DRAFT, PROMPT, TARGET

# .item() (as inference mode dispatches it, and below it), bool(), masks to indices, torch.equal
SYNCS = ("item", "_local_scalar_dense", "nonzero", "is_nonzero", "equal")


class NoSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNCS:
            raise AssertionError(f"a host sync in a recorded phase: {func}")
        return func(*args, **(kwargs or {}))


def guarded(phases):
    """decode.record as a CPU can run it: the phase (its warm-up, each replay) under NoSync, its name into phases."""
    def record(fn):
        phases.append(fn.func.__name__)  # the decode function the engine records

        def replay():
            with NoSync():
                fn()
        replay()
        return replay
    return record


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_the_guard_catches_a_sync(monkeypatch):
    """A cycle with one .item() in it fails the test below."""
    publish = decode.publish
    monkeypatch.setattr(decode, "publish", lambda st: int(st.gen_len[0]) and publish(st))
    with pytest.raises(AssertionError, match="a host sync"):
        test_a_recorded_phase_syncs_nothing_with_the_host(monkeypatch, "ar", DRAFT, {})


@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's log2(0) = -inf for an empty slot
@pytest.mark.parametrize("method, draft, options", [
    ("ar", DRAFT, {}), ("sd", DRAFT, {"top_p": 0.9}), ("easd", DRAFT, {}), ("smc", DRAFT, {"ess_threshold": 1.0}),
    ("mdsd", DRAFT, {}), ("sd", "racer", {"tree": 4}), ("sd", "racer", {}), ("smc", DRAFT, {"overlap": True}),
    ("sd", DRAFT, {"overlap": True, "top_k": 3})])
@pytest.mark.slow
def test_a_recorded_phase_syncs_nothing_with_the_host(monkeypatch, method, draft, options):
    """The engine's own graph path (decode.graphs on), each phase it records run and replayed under NoSync."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    if not kernels.use_triton(torch.empty(0)):
        pytest.skip("no triton")
    phases = []
    monkeypatch.setattr(decode, "graphs", lambda shape, device: True)
    monkeypatch.setattr(decode, "record", guarded(phases))
    e = engine.Engine.of_models(TARGET, draft).load()
    with torch.no_grad():  # the recorded phases run as the engine runs them (a pair's halves: inference mode)
        req = e.request(PROMPT, method=method, max_new_tokens=12, temperature=1.0, draft_len=2, particles=3, **options)
        kind = scheduler.Pair if req.shape.overlap else scheduler.Batch
        b = kind(e.models, req.shape, 2, len(PROMPT), req.capacity)
        b.admit(req)
        for _ in range(3):
            b.cycle()
            b.collect()
        if options.get("overlap"):
            b.close()
    expected = ["draft_block", "verify_cycle"] * 2 if options.get("overlap") else ["cycle"]
    assert phases == expected  # recorded once, when the batch was made
    assert req.result is None and req.cycles > 0  # it decoded, and is still running


def fake_cuda(monkeypatch, captures):
    """torch.cuda's streams and graphs as a CPU can run them: each capture's keyword arguments into captures."""
    class Stream:
        def wait_stream(self, other):
            pass

    def graph(cuda_graph, **options):
        captures.append(options)
        return contextlib.nullcontext()
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph", graph)


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_each_graph_is_captured_on_a_stream_of_its_own(monkeypatch):
    """MineDraft's pair records four graphs (a draft and a verify graph for each half), which replay two at once on
    two streams: each capture names a stream of its own, so no two share cuBLAS's workspace (one per stream)."""
    monkeypatch.setattr(kernels, "INTERPRET", False)  # the reference kernels: the capture is the point here
    captures = []
    fake_cuda(monkeypatch, captures)
    monkeypatch.setattr(decode, "graphs", lambda shape, device: True)
    e = engine.Engine.of_models(TARGET, DRAFT).load()
    req = e.request(PROMPT, method="smc", max_new_tokens=8, draft_len=2, particles=3, overlap=True)
    with torch.no_grad():
        scheduler.Pair(e.models, req.shape, 2, len(PROMPT), req.capacity).close()
        scheduler.Batch(e.models, replace(req.shape, overlap=False), 2, len(PROMPT), req.capacity)
    streams = [c.get("stream") for c in captures]
    assert len(streams) == 5 and None not in streams and len({id(s) for s in streams}) == 5


def test_the_memory_check_counts_every_graphs_pool_and_the_sort(monkeypatch):
    """On CUDA graphs each graph holds a cycle's working memory in a private pool (a pair: four), and a request with
    top-k or top-p adds what `restrict` sorts: float32 values and int64 indices of [R, N, K+1, V]."""
    e = engine.Engine.of_models(TARGET, DRAFT).load()
    s = e.request(PROMPT, method="smc", max_new_tokens=8, draft_len=2, particles=3).shape
    R = 4
    caps = (len(PROMPT), 16)
    V = e.config.vocab_size
    need = lambda shape: scheduler.batch_bytes(e, shape, R, caps)  # noqa: E731
    eager, eager_pair = need(s), need(replace(s, overlap=True))
    monkeypatch.setattr(decode, "graphs", lambda shape, device: True)
    assert need(s) == eager  # one graph's pool: what an eager cycle allocates
    assert need(replace(s, overlap=True)) - eager_pair == scheduler.cycle_bytes(e, s, R)  # four halves' pools: two
    sort = (4 + 8) * R * s.particles * (s.draft_len + 1) * V
    assert need(replace(s, restrict=True)) - need(s) >= sort
    assert need(replace(s, restrict=True, overlap=True)) - need(replace(s, overlap=True)) >= 2 * sort
