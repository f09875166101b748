"""A cycle of every method reads nothing back to the host, as a CUDA graph needs: cycles run under a dispatch mode
that fails on each op that brings a device value to the host, with the Triton kernels interpreted (the GPU's
path), over every slot of a batch (a graph's shape: busy and empty slots)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import decode
import engine
import kernels
from test_engine import DRAFT, PROMPT, TARGET

SYNCS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal")  # .item(), bool(), masks to indices, torch.equal


class NoSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNCS:
            raise AssertionError(f"a host sync in a cycle: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_the_guard_catches_a_sync(monkeypatch):
    """A cycle with one .item() in it fails the test below."""
    publish = decode.publish
    monkeypatch.setattr(decode, "publish", lambda st: int(st.gen_len[0]) and publish(st))
    with pytest.raises(AssertionError, match="_local_scalar_dense"):
        test_a_cycle_syncs_nothing_with_the_host(monkeypatch, "ar", DRAFT, {})


@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's log2(0) = -inf for an empty slot
@pytest.mark.parametrize("method, draft, options", [
    ("ar", DRAFT, {}), ("sd", DRAFT, {"top_p": 0.9}), ("easd", DRAFT, {}), ("smc", DRAFT, {"ess_threshold": 1.0}), ("mdsd", DRAFT, {}),
    ("sd", "racer", {"tree": 4}), ("smc", DRAFT, {"overlap": True})])
def test_a_cycle_syncs_nothing_with_the_host(monkeypatch, method, draft, options):
    monkeypatch.setattr(kernels, "INTERPRET", True)
    if not kernels.use_triton(torch.empty(0)):
        pytest.skip("no triton")
    e = engine.Engine(TARGET, draft).load()
    with torch.no_grad():  # not inference_mode, under which no dispatch mode sees the ops on its tensors
        req = e.request(PROMPT, method=method, max_new_tokens=12, temperature=1.0, draft_len=2, particles=3, **options)
        b = engine.Batch(e, req.shape, 2, len(PROMPT), req.capacity)
        b.admit(req)
        for _ in range(2):
            if b.shape.tree:  # racer's tree, host work before the cycle (as Batch.cycle does)
                decode.plant(b.st, [r and r.drafter.draft(b.shape.draft_len, b.shape.tree) for r in b.requests])
            with NoSync():
                if options.get("overlap"):  # MineDraft's halves run the two phases apart
                    decode.draft_block(e, b.st, b.shape)
                    decode.verify_cycle(e, b.st, b.shape)
                else:
                    decode.cycle(e, b.st, b.shape)
            b.cycled()
            b.collect()
    assert req.result is None and int(b.st.gen_len[0]) > 1  # it decoded, and is still running
