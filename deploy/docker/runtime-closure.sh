#!/usr/bin/env bash
# Collects what a runtime image needs from a finished build, so no Dockerfile keeps a hand-written package list:
#
#   deploy/docker/runtime-closure.sh BUILD_DIR OUT_DIR
#
# Writes
#   OUT_DIR/bin/                      skyreels-server and skyreels
#   OUT_DIR/lib/                      the shared libraries the project itself built (none today; kept for modules)
#   OUT_DIR/runtime-packages.txt      the Debian packages owning every shared library those files load (ldd + dpkg -S),
#                                     one per line: runtime packages only, never -dev
#   OUT_DIR/unpackaged-libraries.txt  loaded libraries no package owns, e.g. a LibTorch zip under /opt/libtorch
#
# Fails when a library cannot be found at all (except the NVIDIA driver's, which the container runtime injects), or
# when an unpackaged library lies outside UNPACKAGED_OK_PREFIXES (space-separated; the Dockerfile copies those trees).
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 BUILD_DIR OUT_DIR" >&2
  exit 2
fi
build_dir=$1
out_dir=$2
unpackaged_ok=${UNPACKAGED_OK_PREFIXES:-}
# Driver libraries come from the host through the NVIDIA container toolkit, never from the image.
driver_libs='^(libcuda\.so|libnvidia-)'

mkdir -p "$out_dir/bin" "$out_dir/lib"
for exe in skyreels-server skyreels; do
  [ -x "$build_dir/bin/$exe" ] || { echo "runtime-closure: $build_dir/bin/$exe was not built" >&2; exit 1; }
  cp "$build_dir/bin/$exe" "$out_dir/bin/"
done
if [ -d "$build_dir/lib" ]; then
  find "$build_dir/lib" -maxdepth 1 -name '*.so*' -exec cp -a {} "$out_dir/lib/" \;
fi

mapfile -t objects < <(find "$out_dir/bin" "$out_dir/lib" -type f | sort)
ldd_output=$(LD_LIBRARY_PATH="$out_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "${objects[@]}")

missing=$(printf '%s\n' "$ldd_output" | awk '/=> not found/ {print $1}' | sort -u | grep -Ev "$driver_libs" || true)
if [ -n "$missing" ]; then
  echo "runtime-closure: libraries not found (install them in the build stage): $missing" >&2
  exit 1
fi

# "libx.so.1 => /path (0x...)" and the loader's own "/lib64/ld-linux-x86-64.so.2 (0x...)".
mapfile -t libraries < <(printf '%s\n' "$ldd_output" |
  awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(0x/ {print $1}' | sort -u)

# dpkg records a file under the path its package shipped it at, so /lib vs /usr/lib (usrmerge) and alternatives
# symlinks (libblas.so.3 -> openblas) need other spellings. Bash builtins and one batched dpkg -S call: a process per
# library takes minutes on a busy machine.
mapfile -t real_paths < <(readlink -f "${libraries[@]}")
spellings=()  # five per library, in order of preference
for i in "${!libraries[@]}"; do
  path=${libraries[$i]} real=${real_paths[$i]}
  spellings+=("$path" "$real" "${path/#\/usr\/lib\//\/lib\/}" "${path/#\/lib\//\/usr\/lib\/}"
              "${real/#\/usr\/lib\//\/lib\/}")
done
declare -A owner=()
# Output lines: "libfoo1:amd64: /path" or "pkg-a, pkg-b: /path"; keep the first package, without its architecture.
while IFS= read -r line; do
  path=${line##*: }
  pkg=${line%%: /*}
  pkg=${pkg%%,*}
  owner[$path]=${pkg%%:*}
done < <(printf '%s\n' "${spellings[@]}" | sort -u | xargs dpkg -S 2>/dev/null || true)

# Installer packages own what their post-install script wrote: Debian's nvidia-cudnn downloads cuDNN and records each
# file in its filelist (scripts/setup-cuda.sh --cudnn=stub records its stub there the same way).
while IFS= read -r path; do
  [ -n "$path" ] && owner[$path]=nvidia-cudnn
done < <(cat /var/lib/nvidia-cudnn/filelist.txt 2>/dev/null || true)

packages=()
unpackaged=()
for i in "${!libraries[@]}"; do
  lib=${libraries[$i]}
  case "$lib" in "$out_dir"/*) continue ;; esac
  pkg=""
  for candidate in "${spellings[@]:$((i * 5)):5}"; do
    if [ -n "${owner[$candidate]:-}" ]; then pkg=${owner[$candidate]}; break; fi
  done
  if [ -n "$pkg" ]; then
    packages+=("$pkg")
    continue
  fi
  allowed=0
  for prefix in $unpackaged_ok; do
    case "$lib" in "$prefix"*) allowed=1 ;; esac
  done
  if [ "$allowed" = 0 ]; then
    echo "runtime-closure: no Debian package owns $lib and it is not under UNPACKAGED_OK_PREFIXES" >&2
    exit 1
  fi
  unpackaged+=("$lib")
done

printf '%s\n' "${packages[@]}" | sort -u > "$out_dir/runtime-packages.txt"
printf '%s\n' "${unpackaged[@]+"${unpackaged[@]}"}" | sed '/^$/d' | sort -u > "$out_dir/unpackaged-libraries.txt"
echo "runtime-closure: $(wc -l < "$out_dir/runtime-packages.txt") packages, $(wc -l < "$out_dir/unpackaged-libraries.txt") unpackaged libraries, ${#objects[@]} files in $out_dir"
