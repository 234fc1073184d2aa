#!/usr/bin/env bash
# cmake --install BUILD into a temporary prefix, then configure, build and run
# tests/consumer (find_package(fusedmoe) + fusedmoe::fusedmoe, as the README
# says) against it, with the README's C++ example (its "## C++ API" code block)
# built beside it. Usage: consumer.sh BUILD_DIR CONSUMER_SOURCE_DIR CMAKE README
set -euo pipefail
build=$1 consumer=$2 cmake=$3 readme=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The consumer's sources, and the README's example as readme_example.cpp.
src="$tmp/src"
cp -r "$consumer" "$src"
awk '/^## C\+\+ API/ { api = 1 } api && /^```cpp$/ { code = 1; next }
     code && /^```$/ { exit } code { print }' "$readme" >"$src/readme_example.cpp"
grep -q "int main" "$src/readme_example.cpp" ||
  { echo "FAIL: no C++ example under '## C++ API' in $readme"; exit 1; }
"$cmake" --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log"; exit 1; }
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
"$cmake" -S "$src" -B "$tmp/b" "${gen[@]}" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; exit 1; }
"$cmake" --build "$tmp/b" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
model="$tmp/prefix/share/fusedmoe/models/tiny-deepseek-v3"
"$tmp/b/consumer" "$model"
# The README's example: the model given, the bundled one from the repository's
# root (its default), and a folder that is not there: the error printed, exit 1.
"$tmp/b/readme_example" "$model" >"$tmp/out" && grep -q "^layer 1: token 0 -> expert " "$tmp/out" ||
  { echo "FAIL: README example with $model"; cat "$tmp/out"; exit 1; }
(cd "$(dirname "$readme")" && "$tmp/b/readme_example") >"$tmp/out" &&
  grep -q "^layer 1: token 0 -> expert " "$tmp/out" ||
  { echo "FAIL: README example from the repository's root"; cat "$tmp/out"; exit 1; }
rc=0
(cd "$tmp" && "$tmp/b/readme_example") >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 1 ] && grep -q "^error: models/tiny-deepseek-v3" "$tmp/err" ||
  { echo "FAIL: README example without a model (exit $rc)"; cat "$tmp/out" "$tmp/err"; exit 1; }
echo "readme_example: ok"
