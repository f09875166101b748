import os
import sys

import torch

# Without a GPU the Triton kernels run under the interpreter, which must be chosen before any @triton.jit
# function is defined, i.e. before anything imports kernels.py. On a GPU they run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
