#!/usr/bin/env bash
# cmake --install BUILD into a temporary prefix, then configure, build and run
# tests/consumer (find_package(fusedmoe) + fusedmoe::fusedmoe, as the README
# says) against it. Usage: consumer.sh BUILD_DIR CONSUMER_SOURCE_DIR CMAKE
set -euo pipefail
build=$1 src=$2 cmake=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$cmake" --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log"; exit 1; }
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
"$cmake" -S "$src" -B "$tmp/b" "${gen[@]}" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; exit 1; }
"$cmake" --build "$tmp/b" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"$tmp/b/consumer" "$tmp/prefix/share/fusedmoe/models/tiny-deepseek-v3"
