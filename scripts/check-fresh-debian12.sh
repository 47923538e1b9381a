#!/usr/bin/env bash
# Proves the README's two commands on a bare Debian 12: debootstraps bookworm (Debian's archive only, the mirror this
# machine's apt uses) into a folder outside the repository, copies a fresh `git clone` of this repository's HEAD
# (committed work only) into it as /root/skyreels-cpp, and runs, as root in the chroot, `./scripts/demo.sh` and then
# `./scripts/test.sh`, timing each. Exits non-zero when either fails. Needs root and network access to Debian's
# archive and the npm registry. Rerunnable: the chroot is reused (its packages then already installed, so a rerun
# times the build and the tests only), the clone is made afresh every time.
#   scripts/check-fresh-debian12.sh             # debootstrap once into /var/tmp/skyreels-bookworm, then both commands
#   scripts/check-fresh-debian12.sh --fresh     # delete that chroot first: the honest "fresh Debian 12" numbers
#   scripts/check-fresh-debian12.sh --ccache    # opt-in: bind-mount this machine's ccache into the chroot (a warm
#                                               # cache: faster, NOT the numbers of a fresh machine)
#   BOOKWORM_ROOT=/path DEBIAN_MIRROR=http://... DEBIAN_SECURITY_MIRROR=http://... scripts/check-fresh-debian12.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ROOT=${BOOKWORM_ROOT:-/var/tmp/skyreels-bookworm}
FRESH=0
CCACHE=0
for arg in "$@"; do
  case "$arg" in
    --fresh) FRESH=1 ;;
    --ccache) CCACHE=1 ;;
    *) echo "usage: $0 [--fresh] [--ccache]" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "check-fresh-debian12: needs root (debootstrap, chroot, mounts)" >&2; exit 2; }
case "$ROOT" in /|/var|/var/tmp|/tmp|"$REPO"*) echo "check-fresh-debian12: refusing BOOKWORM_ROOT=$ROOT" >&2; exit 2 ;; esac

# The mirrors this machine's apt uses for bookworm and bookworm-security (deb822 .sources or one-line lists).
apt_uri() {  # $1: suite
  local uri
  uri=$(awk -v suite="$1" '
    BEGIN { RS = ""; FS = "\n" }
    { u = ""; s = "" ; for (i = 1; i <= NF; i++) {
        if ($i ~ /^URIs:/) { u = $i; sub(/^URIs:[ \t]*/, "", u); sub(/[ \t].*/, "", u) }
        if ($i ~ /^Suites:/) s = " " substr($i, 8) " " }
      if (u != "" && index(s, " " suite " ")) { print u; exit } }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$uri" ] || uri=$(awk -v suite="$1" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ ) { if ($(i+1) == suite) { print $i; exit } else break } }' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
  echo "$uri"
}
MIRROR=${DEBIAN_MIRROR:-$(apt_uri bookworm)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-$(apt_uri bookworm-security)}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}

MOUNTS=(proc sys dev root/.cache/ccache)
unmount_all() {
  local m
  for m in "${MOUNTS[@]}"; do
    if mountpoint -q "$ROOT/$m" 2>/dev/null; then umount -R "$ROOT/$m" 2>/dev/null || umount -R -l "$ROOT/$m"; fi
  done
}
# Every process still running inside the chroot (a server a failed test left, a daemon a package started) is ended
# by its id: only processes whose root is this chroot.
stop_chroot_processes() {
  local proc pid root left=()
  for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    root=$(readlink "$proc/root" 2>/dev/null) || continue
    [ "$root" = "$ROOT" ] && left+=("$pid")
  done
  [ ${#left[@]} -eq 0 ] && return 0
  echo "check-fresh-debian12: ending ${#left[@]} process(es) left in the chroot: ${left[*]}"
  kill -TERM "${left[@]}" 2>/dev/null || true
  sleep 2
  kill -KILL "${left[@]}" 2>/dev/null || true
}
# The host's /dev/shm as it was: a tmpfs stacked on it during a run (seen once here, origin not found) breaks
# Debian's chromium launcher (its dev-shm check reads two sizes) and the suite after it; take such a leftover off.
HOST_SHM_MOUNTS=$(findmnt -nr -o target /dev/shm | wc -l)
restore_host_shm() {
  while [ "$(findmnt -nr -o target /dev/shm | wc -l)" -gt "$HOST_SHM_MOUNTS" ]; do
    echo "check-fresh-debian12: a mount was left stacked on the host's /dev/shm: unmounting it"
    umount /dev/shm || break
  done
}
cleanup() {
  stop_chroot_processes
  unmount_all
  restore_host_shm
}

ROOT=$(realpath -m "$ROOT")
if [ "$FRESH" = 1 ] && [ -e "$ROOT" ]; then
  echo "check-fresh-debian12: --fresh: deleting $ROOT"
  stop_chroot_processes
  unmount_all
  rm -rf --one-file-system "$ROOT"
fi
trap cleanup EXIT

SECONDS_DEBOOTSTRAP=-
if [ ! -x "$ROOT/usr/bin/apt-get" ]; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
  echo "check-fresh-debian12: debootstrap bookworm from $MIRROR into $ROOT"
  start=$(date +%s)
  rm -rf --one-file-system "$ROOT"
  # The default variant (required + important priorities): what a minimal Debian 12 install has, not less.
  debootstrap bookworm "$ROOT" "$MIRROR"
  SECONDS_DEBOOTSTRAP=$(($(date +%s) - start))
fi

# A bare Debian 12's apt sources: the release, its updates and its security archive.
cat >"$ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY_MIRROR bookworm-security main
EOF
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# Certificate authorities this machine added locally (a network that intercepts TLS, as npm's registry is reached
# here, needs them; elsewhere there are none): Debian's Node.js trusts the system store, which the ca-certificates
# package (a dependency of nodejs) builds from /usr/local/share/ca-certificates too.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  mkdir -p "$ROOT/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
  [ ! -x "$ROOT/usr/sbin/update-ca-certificates" ] || chroot "$ROOT" /usr/sbin/update-ca-certificates >/dev/null
fi
# No init system runs in a chroot: packages must not start daemons (PostgreSQL's cluster, Prometheus) that would
# outlive this script; the tests start their own PostgreSQL.
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
chmod 755 "$ROOT/usr/sbin/policy-rc.d"

mount -t proc proc "$ROOT/proc"
mount --rbind /sys "$ROOT/sys" && mount --make-rslave "$ROOT/sys"
mount --rbind /dev "$ROOT/dev" && mount --make-rslave "$ROOT/dev"
if [ "$CCACHE" = 1 ]; then
  host_cache=$(ccache -k cache_dir 2>/dev/null || echo "$HOME/.cache/ccache")
  mkdir -p "$host_cache" "$ROOT/root/.cache/ccache"
  mount --bind "$host_cache" "$ROOT/root/.cache/ccache"
  echo "check-fresh-debian12: --ccache: $host_cache is the chroot's ccache (warm cache, not fresh-machine numbers)"
fi

# A fresh clone of HEAD, as a user would make it.
rm -rf --one-file-system "$ROOT/root/skyreels-cpp"
git clone -q --no-hardlinks "$REPO" "$ROOT/root/skyreels-cpp"
git -C "$ROOT/root/skyreels-cpp" checkout -q --detach "$(git rev-parse HEAD)"
echo "check-fresh-debian12: cloned $(git rev-parse --short HEAD) into $ROOT/root/skyreels-cpp"

in_chroot() {  # a login-like environment: root's, nothing from this machine's
  chroot "$ROOT" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root USER=root \
    LOGNAME=root LANG=C.UTF-8 TERM=dumb bash -c "cd /root/skyreels-cpp && $1"
}
run_timed() {  # $1: name, $2: command; sets SECONDS_<name>, RC_<name>
  local start rc=0
  echo "check-fresh-debian12: ===== $2 ====="
  start=$(date +%s)
  in_chroot "$2" || rc=$?
  printf -v "SECONDS_$1" '%s' $(($(date +%s) - start))
  printf -v "RC_$1" '%s' "$rc"
  stop_chroot_processes
}
mmss() { [ "$1" = - ] && echo "-" || printf '%d min %02d s' $(($1 / 60)) $(($1 % 60)); }

NODE_VERSION=
run_timed DEMO ./scripts/demo.sh
[ "$RC_DEMO" = 0 ] && ls -l "$ROOT/root/skyreels-cpp/out" || true
run_timed TEST ./scripts/test.sh
NODE_VERSION=$(in_chroot 'node --version; npm --version' 2>/dev/null | tr '\n' ' ' || true)

echo "check-fresh-debian12: ===== results (chroot $ROOT, $(nproc) cores, ccache $([ "$CCACHE" = 1 ] && echo "host's, warm" || echo "the chroot's own")) ====="
echo "  debootstrap:        $(mmss "$SECONDS_DEBOOTSTRAP")"
echo "  ./scripts/demo.sh:  $(mmss "$SECONDS_DEMO") (exit $RC_DEMO)"
echo "  ./scripts/test.sh:  $(mmss "$SECONDS_TEST") (exit $RC_TEST)"
echo "  node, npm in the chroot: $NODE_VERSION"
[ "$RC_DEMO" = 0 ] && [ "$RC_TEST" = 0 ]
