#!/usr/bin/env bash
# Builds the library and installs it for C and C++ builds:
#   scripts/install.sh [PREFIX]        (default: $PREFIX, else /usr/local)
# puts under PREFIX
#   lib/libep.so, lib/libep.a, include/ep.h,
#   lib/pkgconfig/ep.pc                (pkg-config ep: -lep; --static adds the system libraries)
#   lib/cmake/ep/epConfig.cmake, epConfigVersion.cmake   (find_package(ep): ep::ep, ep::ep_static)
# LIBDIR (default lib) names the library directory under PREFIX; DESTDIR, if
# set, is put in front of every path (staged installs). The pkg-config and
# CMake files find the prefix from their own location, so an installed tree
# can be moved. libep.so has no SONAME: programs record "libep.so" and find
# it through their rpath or LD_LIBRARY_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${1:-${PREFIX:-/usr/local}}"
libdir="${LIBDIR:-lib}"
case "$prefix" in /*) ;; *) prefix="$PWD/$prefix" ;; esac
case "$libdir" in /*|*..*) echo "install.sh: LIBDIR must be a relative path without '..'" >&2; exit 2 ;; esac
dest="${DESTDIR:-}$prefix"

if [ -z "${NVCC:-}${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null; then
  scripts/install-cuda-tools.sh >/dev/null
fi
cargo build --release --lib
target="$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/release"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)"

# What a program linking libep.a statically also needs (the Rust standard
# library's native libraries on Linux; rustc --print native-static-libs).
static_libs="-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc"
cmake_static_libs="$(echo "$static_libs" | sed 's/-l//g; s/ /;/g')"

# "../" once per directory level between a file's directory and the prefix.
up() { echo "$1" | awk -F/ '{ s = ""; for (i = 1; i <= NF; i++) if ($i != "") s = s "../"; print s }'; }
pc_to_prefix="$(up "$libdir/pkgconfig")"
cmake_to_prefix="$(up "$libdir/cmake/ep")"

install -d "$dest/$libdir/pkgconfig" "$dest/$libdir/cmake/ep" "$dest/include"
install -m 755 "$target/libep.so" "$dest/$libdir/libep.so"
install -m 644 "$target/libep.a" "$dest/$libdir/libep.a"
install -m 644 include/ep.h "$dest/include/ep.h"

fill() {
  sed -e "s|@VERSION@|$version|g" -e "s|@LIBDIR@|$libdir|g" \
      -e "s|@PC_TO_PREFIX@|${pc_to_prefix%/}|g" -e "s|@CMAKE_TO_PREFIX@|${cmake_to_prefix%/}|g" \
      -e "s|@STATIC_LIBS@|$static_libs|g" -e "s|@CMAKE_STATIC_LIBS@|$cmake_static_libs|g" "$1"
}
fill packaging/ep.pc.in > "$dest/$libdir/pkgconfig/ep.pc"
fill packaging/epConfig.cmake.in > "$dest/$libdir/cmake/ep/epConfig.cmake"
fill packaging/epConfigVersion.cmake.in > "$dest/$libdir/cmake/ep/epConfigVersion.cmake"
chmod 644 "$dest/$libdir/pkgconfig/ep.pc" "$dest/$libdir/cmake/ep/"*.cmake

echo "installed ep $version under $dest:"
(cd "$dest" && find "$libdir/libep.so" "$libdir/libep.a" include/ep.h "$libdir/pkgconfig/ep.pc" \
  "$libdir/cmake/ep" -type f | sort | sed 's/^/  /')
