#!/usr/bin/env bash
# One command for a lent GPU machine (one H200: under 8 minutes): builds the model-only tree against the machine's
# PyTorch LibTorch (torch.utils.cmake_prefix_path; scripts/gpu-deps.sh's packages when carried; architecture 9.0,
# every core), then checks on cuda:0 that every checkpoint layout loads straight onto the device and runs, parity
# with diffusers' golden fixtures (transformer, DF/I2V/V2V pipelines, VAE decode; bf16 against fp32), the speed of
# DF-1.3B / DF-14B-width passes and the VAE decode at 540P with MFU, and host-device syncs per transformer call.
# Writes OUTDIR/report.md, OUTDIR/report.json and OUTDIR/commands.log; exits 1 when a check fails.
#   scripts/gpu-check.sh OUTDIR                 # on the GPU machine
#   scripts/gpu-check.sh OUTDIR --cpu           # the same steps on the CPU at tiny sizes (any machine)
#   scripts/gpu-check.sh OUTDIR --cpu --bin build/bin   # reuse built binaries instead of building (the ctest test)
# Everything is in scripts/gpu_check.py (Python standard library only).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
PY=$(command -v python3)
exec "$PY" scripts/gpu_check.py "$@"
