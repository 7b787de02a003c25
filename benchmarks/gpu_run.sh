#!/usr/bin/env bash
# The GPU measurements of issue 24 in one run of at most 8 minutes on one H200:
# gpu_compile_fp8.py (eager, --compile, --compile --precision fp8 for the 169M built-in and the
# 1.1B Llama-style model under hpc-hsdp run; the same models unwrapped, eager and compiled; the
# hand-written FSDP2 + per-block compile script at 1.1B; tokens/s, MFU, peak memory, compile
# time, the loss at the end; $OUT/compile_fp8.json and .md). The fp8 rows need torchao
# (pip install torchao==0.18.0, or hpc-hsdp[fp8]); without it they say why.
# FULL=1 also runs the earlier GPU checks of issues 10, 11 and 15 (about 15 more minutes):
# the CUDA tests (pytest -m gpu), then gpu_hsdp_step.py (bf16 vs fp32 tokens/s, data wait
# with the pinned prefetch, the loop vs the unwrapped model) with and without accumulation,
# then gpu_llama_1b.py (a 1.1B Llama-style transformers model under hpc-hsdp run vs unwrapped:
# tokens/s, MFU, peak memory; about 2 minutes), then gpu_profile_loop.py (where the 169M step's
# host time goes; the optimizer over local shards, multi-tensor vs fused, against torch's over DTensors).
# TP=1 runs gpu_tp_step.py alone (the built-in model at tp 1/2/4/8 on one node's GPUs, shard =
# GPUs / tp; tokens/s per GPU, peak memory and the TP group's bytes against tp 1; a tp needing more
# GPUs than the node has is listed as skipped: one H200 runs tp 1 only); FULL=1 runs it last.
# Run from the repository root; OUT (default ./gpu-out) collects the logs. The machine's own
# python3 with CUDA torch is used; hpc-hsdp comes from the checkout (PYTHONPATH), so only its
# pure-Python dependencies must be importable (click, jinja2, numpy, python-hostlist). A machine
# image without python-hostlist (a one-file module): copy it beside the checkout first, e.g.
#   mkdir -p .gpu-deps && cp .venv/lib/python3*/site-packages/hostlist.py .gpu-deps/
# (.gpu-deps is put on PYTHONPATH when present).
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ -d .gpu-deps ] && export PYTHONPATH="$PWD/.gpu-deps:$PYTHONPATH"
python="${PYTHON:-python3}"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; "$python" -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } 2>&1 | tee "$out/machine.txt"
if [ "${TP:-0}" = 1 ]; then
  timeout 470 "$python" benchmarks/gpu_tp_step.py 2>&1 | tee "$out/gpu_tp_step.txt"
  exit 0
fi
timeout 470 "$python" benchmarks/gpu_compile_fp8.py --budget-s 400 --out "$out/compile_fp8" 2>&1 | tee "$out/compile_fp8.txt"
[ "${FULL:-0}" = 1 ] || exit 0
timeout 240 "$python" -m pytest -m gpu tests/processes/test_runtime.py -q -p no:cacheprovider 2>&1 | tee "$out/pytest-gpu.txt"
timeout 240 "$python" benchmarks/gpu_hsdp_step.py --steps 20 --warmup 3 2>&1 | tee "$out/gpu_hsdp_step.txt"
timeout 240 "$python" benchmarks/gpu_hsdp_step.py --steps 10 --warmup 3 --grad-accum 4 2>&1 | tee "$out/gpu_hsdp_step-accum4.txt"
timeout 300 "$python" benchmarks/gpu_llama_1b.py --out "$out/gpu_llama_1b.json" 2>&1 | tee "$out/gpu_llama_1b.txt"
timeout 240 "$python" benchmarks/gpu_profile_loop.py 2>&1 | tee "$out/gpu_profile_loop.txt"
timeout 470 "$python" benchmarks/gpu_tp_step.py 2>&1 | tee "$out/gpu_tp_step.txt"
