#!/usr/bin/env bash
# Builds the distro's own glibc version from its source package with
# --enable-systemtap, so that its libc carries SDT probes, into a cache
# outside the repository. A finished build is reused: the first run takes
# about five minutes on two cores, later runs seconds.
#
# Cache: $MTRACE_SDT_GLIBC_DIR, default /var/cache/mtrace-live/sdt-glibc.
# The file "current" there names the build directory to use, or "/" when the
# system libc already has probes (Ubuntu, Fedora), in which case nothing is
# built. scripts/with-sdt-glibc and `mtrace-live --sdt-glibc` read it.
#
# With --malloc-tests (make glibc-malloc-tests), glibc's own malloc tests
# are built in that build tree too (not run): the privileged tests run them
# under the trace (tests/privileged/test_glibc_malloc_tests.py). Minutes
# once, on two cores; then a stamp.
#
# Exit codes: 20 not root (when a build is needed), 22 packages or sources
# unavailable, 26 the build failed, 2 an unknown argument.
set -euo pipefail

malloc_tests=no
[ $# -le 1 ] || { printf 'sdt-glibc: error: one argument at most (--malloc-tests)\n' >&2; exit 2; }
case "${1:-}" in
  "") ;;
  --malloc-tests) malloc_tests=yes ;;
  *) printf 'sdt-glibc: error: unknown argument %s (only --malloc-tests)\n' "$1" >&2; exit 2 ;;
esac

CACHE=${MTRACE_SDT_GLIBC_DIR:-/var/cache/mtrace-live/sdt-glibc}
say() { printf 'sdt-glibc: %s\n' "$*"; }
fail() { printf 'sdt-glibc: error: %s\n' "$2" >&2; exit "$1"; }

# grep -c reads all of readelf's output: with pipefail, grep -q could stop
# early and fail the pipeline through readelf's SIGPIPE.
has_libc_probes() { [ "$(readelf -n "$1" 2>/dev/null | grep -c 'Provider: libc')" -gt 0 ]; }

system_libc=$(/usr/bin/python3 - <<'PY'
import re
for line in open("/proc/self/maps"):
    path = line.split(maxsplit=5)[-1].strip()
    if re.search(r"/libc(\.so\.6|-[0-9.]+\.so)$", path):
        print(path)
        break
PY
)
if has_libc_probes "$system_libc"; then
  mkdir -p "$CACHE"
  echo / >"$CACHE/current"
  say "the system libc ($system_libc) already carries SDT probes; using it"
  [ "$malloc_tests" = no ] || say "no glibc build tree here: its malloc tests are not built"
  exit 0
fi

version=$(dpkg-query -W -f='${Version}' libc6 2>/dev/null) \
  || fail 22 "libc6 is not a dpkg package here; build an SDT glibc by hand and use --lib"
# Characters such as the "+" of Debian versions break bpftrace's parser when
# they appear in a probe path, so the directory name keeps only plain ones.
top="$CACHE/${version//[^A-Za-z0-9._-]/_}"
build="$top/build"
# glibc's own malloc tests (--malloc-tests), built in the build tree.
build_malloc_tests() {
  [ "$malloc_tests" = yes ] || return 0
  [ -f "$build/.mtrace-live-malloc-tests" ] && return 0
  [ "$(id -u)" = 0 ] || fail 20 "building glibc's malloc tests needs root; try: sudo make glibc-malloc-tests"
  say "building glibc's malloc tests (log in $build/malloc-tests.log)"
  (cd "$build" && make -j"$(( $(nproc) + 1 ))" subdirs=malloc check run-built-tests=no \
     >"$build/malloc-tests.log" 2>&1) || fail 26 "building glibc's malloc tests failed (see $build/malloc-tests.log)"
  touch "$build/.mtrace-live-malloc-tests"
}

if [ -f "$build/.mtrace-live-built" ] && [ -x "$build/testrun.sh" ]; then
  build_malloc_tests
  echo "$build" >"$CACHE/current"
  say "using the cached build of glibc $version in $build"
  exit 0
fi

[ "$(id -u)" = 0 ] || fail 20 "building glibc $version needs root (apt-get source and build dependencies); try: sudo make sdt-glibc"
mkdir -p "$top"

# apt-get source needs deb-src entries. Add them, beside the existing deb
# entries, in one file of our own: the only change made to apt's setup.
# (Captured first: under pipefail, grep -q closing the pipe early would fail it.)
showsrc=$(apt-cache showsrc glibc 2>/dev/null || true)
if ! grep -q '^Package: glibc' <<<"$showsrc"; then
  src_list=/etc/apt/sources.list.d/mtrace-live-deb-src.sources
  {
    for f in /etc/apt/sources.list.d/*.sources; do
      [ -e "$f" ] && [ "$f" != "$src_list" ] && sed 's/^Types: deb$/Types: deb-src/' "$f" && echo
    done
  } >"$src_list.tmp"
  if [ -f /etc/apt/sources.list ]; then
    grep -E '^deb ' /etc/apt/sources.list | sed 's/^deb /deb-src /' >/etc/apt/sources.list.d/mtrace-live-deb-src.list || true
  fi
  if grep -q 'deb-src' "$src_list.tmp"; then mv "$src_list.tmp" "$src_list"; else rm -f "$src_list.tmp"; fi
  say "added deb-src entries ($src_list) so that apt-get source works"
  apt-get update -qq >/tmp/mtrace-live-apt-update.log 2>&1 \
    || fail 22 "apt-get update failed (see /tmp/mtrace-live-apt-update.log)"
fi

say "installing glibc's build tools"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  dpkg-dev gawk bison gettext perl python3 make gcc systemtap-sdt-dev xz-utils \
  >/tmp/mtrace-live-apt-install.log 2>&1 \
  || fail 22 "cannot install glibc's build tools (see /tmp/mtrace-live-apt-install.log)"

src=$(find "$top" -maxdepth 1 -type d -name 'glibc-*' | head -n1)
if [ -z "$src" ]; then
  say "fetching the source of glibc $version"
  (cd "$top" && apt-get source -qq "glibc=$version" >/tmp/mtrace-live-apt-source.log 2>&1) \
    || fail 22 "apt-get source glibc=$version failed (see /tmp/mtrace-live-apt-source.log)"
  src=$(find "$top" -maxdepth 1 -type d -name 'glibc-*' | head -n1)
fi
# Debian's source package has no manual/ directory; the build must not ask for it.
sed -i 's/\(wctype\) manual /\1 /' "$src/Makeconfig"

mkdir -p "$build"
if [ ! -f "$build/config.make" ]; then
  say "configuring with --enable-systemtap"
  (cd "$build" && "$src/configure" --prefix=/usr --enable-systemtap --disable-werror \
     >"$build/configure.log" 2>&1) || fail 26 "configure failed (see $build/configure.log)"
fi
jobs=$(( $(nproc) + 1 ))
say "building with make -j$jobs (about five minutes on two cores; log in $build/make.log)"
(cd "$build" && make -j"$jobs" >"$build/make.log" 2>&1) || fail 26 "the glibc build failed (see $build/make.log)"
has_libc_probes "$build/libc.so.6" || fail 26 "the built libc has no SDT probes"
touch "$build/.mtrace-live-built"
build_malloc_tests
echo "$build" >"$CACHE/current"
say "built glibc $version with SDT probes in $build"
