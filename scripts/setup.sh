#!/usr/bin/env bash
# mtrace-live's one set-up, used by the README, by CI (through make) and by
# vagrant/. It installs the distro packages, makes kernel headers reachable
# by bcc, mounts tracefs if needed, and creates .venv. Idempotent: a second
# run checks and returns in seconds. It changes nothing it does not report.
#
# Exit codes: 20 not root, 21 unknown distro, 22 package repositories
# unreachable or a package missing, 23 Python package index unreachable,
# 24 no usable kernel headers, 25 tracefs cannot be mounted.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$REPO/.venv"
STAMP="$VENV/.mtrace-live-setup"

say() { printf 'setup: %s\n' "$*"; }
fail() { printf 'setup: error: %s\n' "$2" >&2; exit "$1"; }

[ "$(id -u)" = 0 ] || fail 20 "must run as root: it installs distro packages and links kernel headers (try: sudo $0)"

[ -r /etc/os-release ] || fail 21 "cannot identify the distro (/etc/os-release is missing); Debian and Ubuntu are supported"
# shellcheck disable=SC1091
. /etc/os-release
case " ${ID:-} ${ID_LIKE:-} " in
  *" debian "* | *" ubuntu "*) ;;
  *) fail 21 "unsupported distro '${ID:-unknown}': only Debian and Ubuntu (apt) are supported" ;;
esac
command -v apt-get >/dev/null || fail 21 "apt-get not found on this ${ID} system"

KERNEL=$(uname -r)
ARCH=$(dpkg --print-architecture)

# ---- distro packages ------------------------------------------------------
# prometheus (server and promtool) and openssl are for the exporter's tests;
# golang-go for go tool pprof, which reads the pprof output in the tests;
# bpftool reads BTF for the tests, independently of the project's reader;
# heaptrack is a peer in make bench and the stacks tests; g++ builds their C++ workload; sqlite3 is the bench's real program; libc6-dbg names the frames inside the libc;
# python3-dev's headers build the compiled parts at install (report's pass, the ring copier, the CFI reader);
# libdw-dev (elfutils' libdw) is what the reader of DWARF line tables is built on; llvm's llvm-symbolizer is
# the tests' second opinion on the lines it reads;
# mariadb-server and redis-server (with their clients and load generators) are the real servers the
# tests trace under load (tests/privileged/test_servers.py): both link libsystemd, hence libgcrypt.
# clang and its sanitizer and libFuzzer runtimes fuzz the kmemtrace walker's C code natively (make fuzz,
# tests/unit/test_native_fuzz.py).
# The allocators other than glibc's are traced where a process calls them (tests/privileged/test_allocators.py).
# postgresql-15 (pgbench is in its contrib part of the server package) forks a backend per connection
# (tests/privileged/test_forking_server.py); libllvm15 is the largest library a process maps.
SERVERS=(mariadb-server mariadb-client redis-server redis-tools postgresql-15 libllvm15)
ALLOCATORS=(libjemalloc2 libtcmalloc-minimal4 libgoogle-perftools4 libmimalloc2.0)
packages=(python3-bpfcc libbpfcc bpfcc-tools bpftool bpftrace gcc g++ make libc6-dev libc6-dbg golang-go heaptrack
          systemtap-sdt-dev python3-venv python3-dev libdw-dev llvm binutils prometheus openssl sqlite3 clang
          libclang-rt-dev
          "${SERVERS[@]}" "${ALLOCATORS[@]}")
if [ "${ID}" = ubuntu ]; then
  packages+=(linux-tools-common "linux-tools-$KERNEL")
else
  packages+=(linux-perf)
fi

missing() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || echo "$p"
  done
}

apt_updated=0
apt_update() {
  [ "$apt_updated" = 1 ] && return 0
  say "refreshing the package lists (apt-get update)"
  if ! apt-get update -qq >/tmp/mtrace-live-apt-update.log 2>&1 \
     || grep -qE '^(W|E): (Failed to fetch|Some index files failed)' /tmp/mtrace-live-apt-update.log; then
    fail 22 "cannot reach the distro's package repositories (see /tmp/mtrace-live-apt-update.log)"
  fi
  apt_updated=1
}

apt_install() {
  apt_update
  say "installing: $*"
  # The servers' packages start their daemons where they can; the tests start
  # their own. A policy-rc.d (Debian's invoke-rc.d policy) that denies every
  # start is put in place for the install, unless one is there already.
  local policy=/usr/sbin/policy-rc.d placed=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && placed=1
  fi
  local status=0
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
    >/tmp/mtrace-live-apt-install.log 2>&1 || status=$?
  [ "$placed" = 0 ] || rm -f "$policy"
  [ "$status" = 0 ] || fail 22 "apt-get install failed for: $* (see /tmp/mtrace-live-apt-install.log)"
}

# ---- kernel headers -------------------------------------------------------
# bcc compiles against /lib/modules/$(uname -r)/build. Debian splits each
# headers tree in two (an -ARCH tree that includes a -common tree), so a
# kernel without its own headers package needs both links: build and source.
headers_ok() { [ -e "/lib/modules/$KERNEL/build/include/generated/autoconf.h" ] \
                 || [ -e "/lib/modules/$KERNEL/build/include/linux/kconfig.h" ]; }

candidate() { apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}'; }

headers_package=""
if ! headers_ok; then
  apt_update
  if [ -n "$(candidate "linux-headers-$KERNEL")" ] && [ "$(candidate "linux-headers-$KERNEL")" != "(none)" ]; then
    headers_package="linux-headers-$KERNEL"
  else
    # No package for this kernel (a custom or cloud kernel): take the newest
    # headers of the distro's standard flavour (bcc needs only the headers'
    # own consistency; tracepoint layouts come from the running kernel).
    flavour=$ARCH; [ "${ID}" = ubuntu ] && flavour=generic
    headers_package=$(apt-cache search --names-only "^linux-headers-[0-9].*[0-9]-$flavour\$" \
                      | awk '{print $1}' | sort -V | tail -n1)
    [ -n "$headers_package" ] || fail 24 "no headers package for $KERNEL and no linux-headers-*-$flavour at all"
  fi
  packages+=("$headers_package")
fi

# shellcheck disable=SC2207
todo=($(missing "${packages[@]}"))
if [ ${#todo[@]} -gt 0 ]; then
  apt_install "${todo[@]}"
  # Debian's prometheus, mariadb-server and redis-server packages enable and
  # start a server of their own where systemd runs; the tests start theirs on
  # loopback or a socket, so a server we caused to be installed is stopped
  # and disabled again.
  for pair in prometheus:prometheus mariadb-server:mariadb redis-server:redis-server; do
    package=${pair%%:*} service=${pair#*:}
    printf '%s\n' "${todo[@]}" | grep -qx "$package" || continue  # installed before: left as it is
    if command -v systemctl >/dev/null && systemctl is-enabled --quiet "$service" 2>/dev/null; then
      systemctl disable --now "$service" >/dev/null 2>&1 || true
      say "disabled the $service service its package enabled (the tests run their own)"
    fi
  done
else
  say "distro packages already installed"
fi

if ! headers_ok; then
  # Link the chosen tree, and the common tree it depends on.
  tree=$headers_package
  [ -d "/usr/src/$tree" ] || fail 24 "no kernel headers for $KERNEL: $tree did not install /usr/src/$tree"
  common=$(dpkg-query -W -f='${Depends}' "$tree" 2>/dev/null | tr ',' '\n' \
           | awk '{print $1}' | grep -E '^linux-headers-.*-common' | head -n1)
  mkdir -p "/lib/modules/$KERNEL"
  ln -sfn "/usr/src/$tree" "/lib/modules/$KERNEL/build"
  say "linked /lib/modules/$KERNEL/build -> /usr/src/$tree (no headers package exists for $KERNEL)"
  if [ -n "$common" ] && [ -d "/usr/src/$common" ]; then
    ln -sfn "/usr/src/$common" "/lib/modules/$KERNEL/source"
    say "linked /lib/modules/$KERNEL/source -> /usr/src/$common"
  fi
  headers_ok || fail 24 "the linked headers in /usr/src/$tree are incomplete"
else
  say "kernel headers for $KERNEL are reachable"
fi

# ---- tracefs ----------------------------------------------------------------
# bcc and bpftrace read tracepoint formats from tracefs.
if [ ! -d /sys/kernel/tracing/events ] && [ ! -d /sys/kernel/debug/tracing/events ]; then
  mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null \
    || fail 25 "tracefs is not mounted and cannot be mounted at /sys/kernel/tracing"
  say "mounted tracefs at /sys/kernel/tracing (not persistent across reboots)"
fi
if ! mountpoint -q /sys/kernel/debug 2>/dev/null; then
  # bcc 0.26 looks up some tracepoint data under debugfs.
  if mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null; then
    say "mounted debugfs at /sys/kernel/debug (not persistent across reboots)"
  fi
fi

# ---- the virtual environment -----------------------------------------------
# Made from the distro's python3 with --system-site-packages, so that it sees
# python3-bpfcc. A .venv left half-made by an interrupted run is rebuilt.
# The stamp covers the C that pip compiles (the kmemtrace walker, the ring copier),
# so a change to it rebuilds the extensions.
want_stamp=$(cat "$REPO/pyproject.toml" "$REPO"/tracer/bpf/*.c "$REPO"/probes/elf/*.c "$REPO"/exporters/kmemtrace/*.c | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] && [ -x "$VENV/bin/pip" ] \
   && "$VENV/bin/python" -c 'import bcc, mtrace_live.tracer.cli' 2>/dev/null; then
  say ".venv is up to date"
else
  if [ ! -x "$VENV/bin/pip" ] || ! "$VENV/bin/python" -c 'import bcc' 2>/dev/null; then
    rm -rf "$VENV"
    say "creating .venv from /usr/bin/python3 with the distro's site packages"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
  fi
  rm -f "$STAMP"
  say "installing mtrace-live (editable) and its development tools into .venv"
  if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$REPO[dev]" \
       >/tmp/mtrace-live-pip.log 2>&1; then
    fail 23 "pip could not install the Python dependencies (is the package index reachable? see /tmp/mtrace-live-pip.log)"
  fi
  "$VENV/bin/python" -c 'import bcc' 2>/dev/null \
    || fail 22 "the venv cannot import bcc: python3-bpfcc does not match /usr/bin/python3"
  echo "$want_stamp" >"$STAMP"
fi
# Byte-code for mtrace-live's own modules, as a non-editable install has it:
# an environment with PYTHONDONTWRITEBYTECODE would otherwise compile them
# from source at every start (about 40 ms). Only stale files are rewritten.
"$VENV/bin/python" -m compileall -q "$REPO/probes" "$REPO/tracer" "$REPO/exporters" >/dev/null \
  || say "could not byte-compile mtrace-live's modules (start-up is slower, nothing else changes)"
# ---- the caches a first trace reads ------------------------------------------
# The BPF programs and the libc's facts of the traces a new user starts
# first, so that the first one is warm (MTRACE_LIVE_SETUP_WARM=0 skips it).
if [ "$(id -u)" = 0 ] && [ "${MTRACE_LIVE_SETUP_WARM:-1}" = 1 ]; then
  say "compiling the BPF program of a first trace (about 10 s, once)"
  bash "$REPO/scripts/warm-caches.sh" "$VENV/bin/mtrace-live" \
    || say "$? of 6 first traces could not be compiled now (see /tmp/mtrace-live-warm.log): each compiles at its first start instead"
fi
say "ready: $("$VENV/bin/mtrace-live" --version)"
