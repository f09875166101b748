import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which must be chosen before any @triton.jit
# function is defined, i.e. before anything imports kernels.py. On a GPU they run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Nothing in the suite asks the Hugging Face Hub: a Hub id is read from a cache a test lays out (test_hub.py).
os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the tests build or keep (native's compiled kernel at collection, auto's choices) never goes to the user's
# cache directory; each test gets a folder of its own below (measurement_cache)
os.environ["SMCSD_MINI_CACHE"] = tempfile.mkdtemp(prefix="smcsd-tests-")
atexit.register(shutil.rmtree, os.environ["SMCSD_MINI_CACHE"], ignore_errors=True)  # gone with the run
sys.path.insert(0, ROOT)
# Under pytest-xdist (-n) the workers share the cores: each worker, and what it starts, gets its share of threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    torch.set_num_threads(THREADS)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test the edit loop skips (python -m pytest -m 'not slow' tests)")


@pytest.fixture(autouse=True)
def measurement_cache(tmp_path_factory, monkeypatch):
    """--weights auto keeps its choices in a folder of each test's own, never in the user's cache directory."""
    monkeypatch.setenv("SMCSD_MINI_CACHE", str(tmp_path_factory.mktemp("auto-cache")))

