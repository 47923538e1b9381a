#!/usr/bin/env bash
# Prepares, on a Debian machine with its archive, the few Debian packages the model-only build
# (-DSKYREELS_MODEL_ONLY=ON) needs besides LibTorch, for a GPU machine that has CMake, a compiler, CUDA and a
# PyTorch wheel but no spdlog, fmt or nlohmann-json and no network: `apt-get download` puts the .deb files in
# gpu-deps/debs/ (ignored by git; about 1 MiB, far below the 64 MiB that travels with the working tree), and
# scripts/gpu-check.sh unpacks them there with `dpkg -x` (or `ar` + `tar` where dpkg is missing) into
# gpu-deps/root/ and puts gpu-deps/root/usr on CMAKE_PREFIX_PATH.
#   scripts/gpu-deps.sh            # download (idempotent) and list what is there
#   scripts/gpu-deps.sh --extract  # unpack into gpu-deps/root (what gpu-check.sh does on the GPU machine)
# Debian 12's packages: built with GCC 12 against glibc 2.36, so they load on any newer glibc/libstdc++.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${GPU_DEPS_DIR:-$PWD/gpu-deps}
PACKAGES=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 nlohmann-json3-dev)

extract() {
  mkdir -p "$DIR/root"
  local deb
  for deb in "$DIR"/debs/*.deb; do
    if command -v dpkg >/dev/null; then
      dpkg -x "$deb" "$DIR/root"
    else  # a .deb is an ar archive holding data.tar.*
      local tmp
      tmp=$(mktemp -d)
      (cd "$tmp" && ar x "$deb" && tar -xf data.tar.* -C "$DIR/root")
      rm -rf "$tmp"
    fi
  done
  echo "gpu-deps: unpacked $(ls "$DIR"/debs/*.deb | wc -l) packages into $DIR/root"
}

if [ "${1:-}" = --extract ]; then
  extract
  exit 0
fi

mkdir -p "$DIR/debs"
missing=()
for p in "${PACKAGES[@]}"; do
  ls "$DIR/debs/${p}_"*.deb >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  (cd "$DIR/debs" && apt-get download -q "${missing[@]}")
fi
# `apt-get download` runs as the unprivileged _apt user where it can; keep the files readable for the copy. An
# epoch in a file name is written "1%3a": plain names travel everywhere.
for f in "$DIR"/debs/*%3a*.deb; do
  [ -e "$f" ] && mv "$f" "${f//%3a/-}"
done
chmod a+r "$DIR"/debs/*.deb
ls -l "$DIR/debs"
echo "gpu-deps: ${#PACKAGES[@]} packages, $(du -sk "$DIR/debs" | cut -f1) KiB in $DIR/debs"
