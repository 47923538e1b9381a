# Sourced by the scripts: process defaults that must be set before a binary starts.
# OpenBLAS 0.3.21 misdetects recent CPUs and reads OPENBLAS_CORETYPE at load time (the binaries also re-exec
# themselves to set it; exporting it here spares every test process that second start).
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then export OPENBLAS_CORETYPE=SkylakeX
  elif grep -qw avx2 /proc/cpuinfo 2>/dev/null; then export OPENBLAS_CORETYPE=Haswell
  fi
fi
