#!/usr/bin/env bash
# The GPU checks of issues 10 and 15 in one script, for a machine with one CUDA GPU:
# the CUDA tests (pytest -m gpu), then gpu_hsdp_step.py (bf16 vs fp32 tokens/s, data wait
# with the pinned prefetch, the loop vs the unwrapped model) with and without accumulation.
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
timeout 240 "$python" -m pytest -m gpu tests/test_runtime.py -q -p no:cacheprovider 2>&1 | tee "$out/pytest-gpu.txt"
timeout 240 "$python" benchmarks/gpu_hsdp_step.py --steps 20 --warmup 3 2>&1 | tee "$out/gpu_hsdp_step.txt"
timeout 240 "$python" benchmarks/gpu_hsdp_step.py --steps 10 --warmup 3 --grad-accum 4 2>&1 | tee "$out/gpu_hsdp_step-accum4.txt"
