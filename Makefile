# make gpu-check: on a machine with a CUDA GPU, the GPU's tests and benchmarks in one command.
# Each step runs even if one before it failed (the "-" prefix), so one call reports everything.
# First the compile test (every Triton kernel compiled for sm_80, sm_90 and gfx942 at the engine's launches: shared
# memory and spills); then kernels against their references, a model through Triton attention and CUDA-graph
# replay, all on CUDA; the kernel micro-benchmark; then bench.py's subcommands on random-weight models shaped like
# Llama-3.2-1B (draft) and Llama-3.1-8B (target) in bf16: `batch`, ar, sd and smc (its GPU default, 4x4) at 1, 4
# and 8 concurrent requests (total tokens/s, per-request latency), sd and smc with MineDraft's overlap beside them
# at 4 and 8 (and the draft and verify phases of a cycle at 8: plain, half the slots alone, and overlapped);
# `speed`, ar, mdsd and smc (8x8, 4x4) one request at a time (random weights accept no draft, so mdsd's row is its
# cycle cost): tokens/s, cycle phase split, achieved against measured copy bandwidth; `lengths` and `requests`,
# the same methods over prompt lengths and short requests; then `speed` for ar and smc 4x4 again with both models'
# matmul weights in int4 (the Triton matmul), the same prompt and tokens, to set against the bf16 rows. (No racer
# rows: they need real text.) With two GPUs or more, the same ar and smc at tensor-parallel 2 (torchrun, nccl), to
# set against the TP=1 line. `profile`, the first benchmark, takes one cycle of ar and smc apart: phase replays,
# device time by kernel class, the host's gap, a GEMM sweep (cuBLAS, cuBLASLt) and the copy against the roofline.
# roofline.py's prediction for these shapes is in docs/results.md.
# make gpu-roof: the GPU roof's measurements in one short call (a few minutes on an H100): the new kernels against
# their references and CUDA-graph replay on the card; `profile` of ar and smc 4x4, 8x8, 8x1 (bf16 1B -> 8B, 256 +
# 256 tokens); `speed` of ar and smc 8x8, 4x4 with the draft in bf16, in fp8 (sm_89+) and in int4 (the Triton
# matmul), ESS and resampling rate beside each, against the target's ar in the same run.
ROOF = --random llama-1b:llama-8b --prompt-len 256 --new-tokens 256
.PHONY: gpu-roof
gpu-roof:
	-python -m pytest -q tests/test_kernels.py tests/test_engine.py tests/test_model.py \
		-k "cuda_graphs or through_triton or glue or rms_norm or rope or silu or merge or quantized or fp8"
	-python bench.py profile $(ROOF) --out gpu-roof-profile.json
	-python bench.py speed $(ROOF) --methods ar,smc --grid 8x8,4x4 --repeats 3 --out gpu-roof-speed.json
	-python bench.py speed $(ROOF) --methods ar,smc --grid 8x8,4x4 --repeats 3 --draft-weights fp8 \
		--out gpu-roof-fp8.json
	-python bench.py speed $(ROOF) --methods smc --grid 8x8,4x4 --repeats 3 --draft-weights int4 \
		--out gpu-roof-int4.json

.PHONY: gpu-check
gpu-check:
	-python -m pytest -q tests/test_compile.py
	-python -m pytest -q tests/test_kernels.py
	-python -m pytest -q tests/test_engine.py -k cuda_graphs
	-python -m pytest -q tests/test_model.py -k through_triton
	-python bench.py profile --random llama-1b:llama-8b --prompt-len 256 --new-tokens 256 --out gpu-check-profile.json
	-python tests/bench_kernels.py
	-python bench.py batch --random llama-1b:llama-8b --methods ar,sd,smc,sd+overlap,smc+overlap \
		--concurrency 1,4,8 --prompt-len 256 --new-tokens 128 --repeats 2 --out gpu-check-batch.json
	-python bench.py speed --random llama-1b:llama-8b --methods ar,mdsd,smc --grid 8x8,4x4 --prompt-len 256 \
		--new-tokens 256 --repeats 3 --out gpu-check.json
	-python bench.py lengths --random llama-1b:llama-8b --methods ar,mdsd,smc --new-tokens 256 --repeats 3 \
		--out gpu-check-lengths.json
	-python bench.py requests --random llama-1b:llama-8b --methods ar,mdsd,smc --new-tokens 256 \
		--out gpu-check-requests.json
	-python bench.py speed --random llama-1b:llama-8b --weights int4 --methods ar,smc --grid 4x4 --prompt-len 256 \
		--new-tokens 256 --repeats 3 --out gpu-check-int4.json
	if [ "$$(nvidia-smi -L | wc -l)" -ge 2 ]; then torchrun --nproc-per-node 2 bench.py speed \
		--random llama-1b:llama-8b --methods ar,smc --grid 4x4 --prompt-len 256 --new-tokens 128 --repeats 2 \
		--out gpu-check-tp2.json; fi
