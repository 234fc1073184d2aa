#!/usr/bin/env bash
# `fusedmoe run` on bad inputs: each gives exit code != 0 (and no crash), exactly
# one line "fusedmoe: error: ..." on stderr naming the problem, and no output
# file (not even a temporary one).
# Usage: bash errors.sh FUSEDMOE_BIN TEST_DATA_DIR MODELS_DIR
set -euo pipefail
BIN=$1 DATA=$2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ST="$HERE/st_util.py"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
FIX="$DATA/hf/deepseek_v3"   # MoE layers 1 and 2, H = 128
REF="$FIX/reference.safetensors"
OUTDIR="$TMP/outdir"
mkdir -p "$OUTDIR"
failures=0

# A case's outcome: "ok" with its stderr, or "FAIL" with `problem` and its
# stderr (counted). verdict NAME PROBLEM ("" when the case passed).
verdict() {
  if [ -n "$2" ]; then
    echo "FAIL $1: $2"
    sed 's/^/  stderr: /' "$TMP/stderr"
    failures=$((failures + 1))
  else
    echo "ok   $1: $(cat "$TMP/stderr")"
  fi
}

# expect_error NAME PATTERN -- ARGS...: the run fails cleanly with PATTERN in its message.
expect_error() {
  local name=$1 pattern=$2
  shift 3
  local rc=0 out=(--output "$OUTDIR/out.safetensors")
  case " $* " in *" --output "*) out=() ;; esac
  [ "${1:-}" = run ] || out=()  # only `run` takes --output
  "$BIN" "$@" "${out[@]}" >"$TMP/stdout" 2>"$TMP/stderr" || rc=$?
  last_rc=$rc
  local lines
  lines=$(wc -l <"$TMP/stderr")
  local problem=""
  if [ "$rc" -eq 0 ]; then problem="exit code 0"
  elif [ "$rc" -ge 128 ]; then problem="crashed (exit $rc)"
  elif [ "$lines" -ne 1 ]; then problem="$lines lines on stderr"
  elif ! grep -q "^fusedmoe: error: " "$TMP/stderr"; then problem="no 'fusedmoe: error:' prefix"
  elif ! grep -qF -- "$pattern" "$TMP/stderr"; then problem="message does not name '$pattern'"
  elif [ -n "$(ls -A "$OUTDIR")" ]; then problem="left files: $(ls -A "$OUTDIR")"
  fi
  verdict "$name" "$problem"
  rm -rf "${OUTDIR:?}"/* "$OUTDIR"/.[!.]* 2>/dev/null || true
}

# expect_usage NAME PATTERN -- ARGS...: as expect_error, with exit code 2 (README: a usage error).
expect_usage() {
  expect_error "$@"
  if [ "$last_rc" -ne 2 ]; then
    echo "FAIL $1: exit $last_rc, expected 2"
    failures=$((failures + 1))
  fi
}

# A copy of the fixture whose model.safetensors is damaged by st_util.py MODE.
corrupt_model() {  # corrupt_model DIR MODE -> prints the tensor it damaged (if any)
  local dir=$1 mode=$2
  mkdir -p "$dir"
  cp "$FIX/config.json" "$dir/"
  python3 "$ST" corrupt "$mode" "$FIX/model.safetensors" "$dir/model.safetensors"
}

run_args=(--layer 1 --input "$REF" --input-key layers.1.T5.input)

# --- damaged checkpoints ---
corrupt_model "$TMP/truncated" truncate >/dev/null
# Errors of --model's files name the option first, as other options' errors do
# (they began with the path).
expect_error "truncated model.safetensors" "error: --model: $TMP/truncated" -- run --model "$TMP/truncated" "${run_args[@]}"

corrupt_model "$TMP/header" header-past-eof >/dev/null
expect_error "header length past EOF" "model.safetensors" -- run --model "$TMP/header" "${run_args[@]}"

corrupt_model "$TMP/badjson" bad-json >/dev/null
expect_error "header not JSON" "model.safetensors" -- run --model "$TMP/badjson" "${run_args[@]}"
# A header whose first bytes are no UTF-8 (\xff\xfe): the parser's message quotes them,
# written as \xNN, never as raw bytes on the terminal.
mkdir -p "$TMP/nonutf8"
cp "$FIX/config.json" "$FIX/model.safetensors" "$TMP/nonutf8/"
printf '\xff\xfe' | dd of="$TMP/nonutf8/model.safetensors" bs=1 seek=8 conv=notrunc status=none
expect_error "header bytes not UTF-8" 'header is not valid JSON' -- run --model "$TMP/nonutf8" --tokens 2
if LC_ALL=C grep -q $'[\x80-\xff]' "$TMP/stderr" || ! grep -qF "'\xff'" "$TMP/stderr"; then
  echo "FAIL header bytes not UTF-8: raw bytes on stderr, or no \\xff"; failures=$((failures + 1))
fi

t=$(corrupt_model "$TMP/offsets" offsets-outside)
expect_error "data_offsets outside the file" "$t" -- run --model "$TMP/offsets" "${run_args[@]}"

t=$(corrupt_model "$TMP/shape" transpose-shape)
expect_error "expert tensor shape mismatch" "$t" -- run --model "$TMP/shape" "${run_args[@]}"

t=$(corrupt_model "$TMP/dtype" dtype-f32)
expect_error "expert tensor dtype/shape mismatch" "$t" -- run --model "$TMP/dtype" "${run_args[@]}"

t=$(corrupt_model "$TMP/missing" rename)
expect_error "missing expert tensor" "$t" -- run --model "$TMP/missing" "${run_args[@]}"

t=$(corrupt_model "$TMP/nan" nan-weight)
expect_error "NaN in an expert weight" "error: --model: $TMP/nan: tensor '$t': expected finite values, got NaN at [0, 3] (a corrupt checkpoint)" -- \
  run --model "$TMP/nan" "${run_args[@]}"
# (The library's LoadOptions::check_finite, no option of the CLI's, is not named.)

mkdir -p "$TMP/noweights" && cp "$FIX/config.json" "$TMP/noweights/"
expect_error "no model.safetensors" "error: --model: $TMP/noweights: checkpoint directory has neither model.safetensors" -- run --model "$TMP/noweights" "${run_args[@]}"

# --- bad config.json ---
mkdir -p "$TMP/unknown"
cp "$FIX/model.safetensors" "$TMP/unknown/"
sed 's/"model_type": "deepseek_v3"/"model_type": "frobnicator_moe"/' "$FIX/config.json" >"$TMP/unknown/config.json"
expect_error "unknown model_type" "error: --model: $TMP/unknown/config.json: model_type 'frobnicator_moe'" -- run --model "$TMP/unknown" "${run_args[@]}"

# --model (and inspect) naming a file that is no model (a .npy): the same message, not
# "not valid JSON".
python3 -c "import sys; h = b\"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }\".ljust(118) + b'\\n'; open(sys.argv[1], 'wb').write(b'\\x93NUMPY\\x01\\x00v\\x00' + h + bytes(8))" "$TMP/notmodel.npy"
for cmd in "run --tokens 2 --model" "inspect"; do
  expect_error "$cmd a .npy" "$TMP/notmodel.npy: expected a model directory, its config.json, its *.safetensors.index.json or a .safetensors file" -- \
    $cmd "$TMP/notmodel.npy"
done

# A config string with a newline: quoted as \x0a, not as the "; " that joins a
# message's own lines (run and inspect alike).
mkdir -p "$TMP/newline-act" && cp "$FIX/model.safetensors" "$TMP/newline-act/"
python3 - "$FIX/config.json" "$TMP/newline-act/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["hidden_act"] = "si\nlu"
json.dump(c, open(sys.argv[2], "w"))
PY
expect_error "hidden_act with a newline" "hidden_act 'si\x0alu' is not supported" -- \
  run --model "$TMP/newline-act" "${run_args[@]}"
expect_error "inspect: hidden_act with a newline" "hidden_act 'si\x0alu' is not supported" -- \
  inspect "$TMP/newline-act"

# Paths with control characters: quoted as printable() writes them (a newline
# as \x0a, not as the "; " that joins a message's own lines; ESC as \x1b).
expect_error "--model with a newline and ESC" "error: --model: $TMP/bad\x0aname\x1b: cannot open" -- \
  run --model "$TMP/bad"$'\n'"name"$'\x1b' "${run_args[@]}"
expect_error "--model=PATH with a newline" "$TMP/bad\x0aname: cannot open" -- \
  run --model="$TMP/bad"$'\n'"name" "${run_args[@]}"
expect_error "inspect: path with a newline" "$TMP/x\x0ay: no such model directory or file" -- \
  inspect "$TMP/x"$'\n'"y"
# A symbolic-link loop or a path through a file: why, as run --model says it
# (it was "no such model directory or file").
ln -sfn "$TMP/loop_b" "$TMP/loop_a" && ln -sfn "$TMP/loop_a" "$TMP/loop_b"
expect_error "inspect: symbolic-link loop" "$TMP/loop_a: cannot open: Too many levels of symbolic links" -- \
  inspect "$TMP/loop_a"
expect_error "run --model: symbolic-link loop" "--model: $TMP/loop_a: cannot open: Too many levels of symbolic links" -- \
  run --model "$TMP/loop_a" "${run_args[@]}"
expect_error "--output in a missing folder with a newline" \
  "$TMP/no\x0adir/o.safetensors: cannot create a temporary file in $TMP/no\x0adir: " -- \
  run --model "$FIX" "${run_args[@]}" --output "$TMP/no"$'\n'"dir/o.safetensors"

mkdir -p "$TMP/notjson" && cp "$FIX/model.safetensors" "$TMP/notjson/"
echo '{"model_type": "deepseek_v3",' >"$TMP/notjson/config.json"
expect_error "config.json not JSON" "error: --model: $TMP/notjson/config.json: not valid JSON" -- run --model "$TMP/notjson" "${run_args[@]}"

expect_error "nonexistent model dir" "error: --model: $TMP/does-not-exist: cannot open" -- run --model "$TMP/does-not-exist" "${run_args[@]}"

# --- bad inputs / arguments ---
python3 "$ST" write-f32 "$TMP/small.safetensors" x 5 64
expect_error "wrong hidden size" "--input 'x' in $TMP/small.safetensors: expected [T, 128], got [5, 64]" -- \
  run --model "$FIX" --layer 1 --input "$TMP/small.safetensors" --input-key x
# An FP8 tensor as --input: refused, as the README and the message list f32, bf16, f16, f64.
python3 - "$TMP/f8.safetensors" <<'PY'
import json, struct, sys
data = bytes([0x38]) * (2 * 128)  # e4m3 1.0
h = json.dumps({"x": {"dtype": "F8_E4M3", "shape": [2, 128], "data_offsets": [0, len(data)]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + data)
PY
expect_error "--input an F8_E4M3 tensor" "--input 'x' in $TMP/f8.safetensors: expected dtype f32, bf16, f16 or f64, got f8_e4m3fn" -- \
  run --model "$FIX" --layer 1 --input "$TMP/f8.safetensors" --input-key x
expect_error "--reference an F8_E4M3 tensor" "--reference 'x' in $TMP/f8.safetensors: expected dtype f32, bf16, f16 or f64, got f8_e4m3fn" -- \
  run --model "$FIX" --layer 1 --tokens 2 --reference "$TMP/f8.safetensors" --reference-key x
expect_error "--layer not an MoE layer" "run --layer: layer 0 is not an MoE layer" -- run --model "$FIX" --layer 0 --input "$REF" --input-key layers.1.T5.input
expect_error "--layer out of range" "run --layer: layer 7: out of range, the model has 3 layers (0..2); MoE layers: 1, 2" -- run --model "$FIX" --layer 7 --input "$REF" --input-key layers.1.T5.input
expect_error "--layer just past the last" "layer 3: out of range, the model has 3 layers (0..2); MoE layers: 1, 2" -- run --model "$FIX" --layer 3 --tokens 2
# A key the file lacks: the option, the file, and (a few of) its tensors.
expect_error "missing input key" "--input-key 'no-such-key': $REF has no tensor of that name; it has " -- run --model "$FIX" --layer 1 --input "$REF" --input-key no-such-key
grep -qF -- ", ... (\`fusedmoe inspect $REF\` lists them)" "$TMP/stderr" ||
  { echo "FAIL missing input key: no '...' and inspect hint"; cat "$TMP/stderr"; failures=$((failures + 1)); }
expect_error "missing input key, one tensor" "--input-key 'y': $TMP/small.safetensors has no tensor of that name; it has 1 tensor: 'x' (\`fusedmoe inspect $TMP/small.safetensors\` lists them)" -- \
  run --model "$FIX" --layer 1 --input "$TMP/small.safetensors" --input-key y
expect_error "missing reference key" "--reference-key 'y': $TMP/small.safetensors has no tensor of that name; it has 1 tensor: 'x'" -- \
  run --model "$FIX" --layer 1 --tokens 2 --reference "$TMP/small.safetensors" --reference-key y
expect_usage "--input-key missing, one tensor" "--input-key is required with a .safetensors file ($TMP/small.safetensors has 1 tensor: 'x'; " -- \
  run --model "$FIX" --layer 1 --input "$TMP/small.safetensors"
expect_error "nonexistent input file" "$TMP/nope.safetensors" -- run --model "$FIX" --layer 1 --input "$TMP/nope.safetensors" --input-key x
expect_error "no input" "no input" -- run --model "$FIX" --layer 1
expect_error "reference shape mismatch" "layers.1.T64.output_f64" -- run --model "$FIX" "${run_args[@]}" \
  --reference "$REF" --reference-key layers.1.T64.output_f64
expect_error "bad --compute-dtype" "compute-dtype" -- run --model "$FIX" "${run_args[@]}" --compute-dtype f8
expect_error "unknown option" "--frobnicate" -- run --model "$FIX" "${run_args[@]}" --frobnicate
# CLI11's own parse errors in the command line's style (they read "The following
# argument was not expected: --frobnicate", "--tokens: 1 required INT:INTEGER >= 0
# missing", "--dtype: f64 not in {f32,bf16}", ...): the command, the option or
# argument, what was expected; exit code 2.
see_run="(see fusedmoe run --help)"
expect_usage "CLI11: unknown option" "error: run: unknown option --frobnicate $see_run" -- \
  run --model "$FIX" --tokens 2 --frobnicate
expect_usage "CLI11: unknown option, near one" "error: run: unknown option --token; did you mean --tokens? $see_run" -- \
  run --model "$FIX" --token 2
expect_usage "CLI11: unexpected argument" "error: run: unexpected arguments '4', '5': expected options only, each with its value $see_run" -- \
  run --model "$FIX" --tokens 3 4 5
expect_usage "CLI11: inspect, a second PATH" "error: inspect: unexpected argument 'b': expected one PATH (see fusedmoe inspect --help)" -- \
  inspect "$FIX" b
expect_usage "CLI11: inspect without PATH" "error: inspect: expected PATH, got none (PATH: " -- inspect
expect_usage "CLI11: an option without its value" "error: run --tokens: expected a value (INTEGER >= 0), got none $see_run" -- \
  run --model "$FIX" --output "$OUTDIR/o.safetensors" --tokens
expect_usage "CLI11: bench --tokens without its value" "error: bench --tokens: expected a value (T1,T2,...), got none (see fusedmoe bench --help)" -- \
  bench --tokens
expect_usage "CLI11: an option given twice" "error: run --tokens: expected once, given 2 times $see_run" -- \
  run --model "$FIX" --tokens 1 --tokens=2
# A flag given twice, as any option given twice (--quiet --quiet was taken).
expect_usage "CLI11: a flag given twice" "error: run --quiet: expected once, given 2 times $see_run" -- \
  run --model "$FIX" --tokens 1 --quiet --quiet=true
expect_usage "CLI11: inspect --json given twice" "error: inspect --json: expected once, given 2 times (see fusedmoe inspect --help)" -- \
  inspect --json --json "$FIX"
# Arguments after "--" are named (they read "unexpected argument : ..."); --output
# given before "--" (expect_usage adds it at the end otherwise).
expect_usage "CLI11: an argument after --" "error: run: unexpected argument 'foo': expected options only, each with its value $see_run" -- \
  run --model "$FIX" --output "$OUTDIR/o.safetensors" --tokens 5 -- foo
expect_usage "CLI11: arguments after --" "error: run: unexpected arguments 'foo', '--bar': expected options only, each with its value $see_run" -- \
  run --model "$FIX" --output "$OUTDIR/o.safetensors" --tokens 5 -- foo --bar
expect_usage "CLI11: a value not in the list" "error: bench --dtype: expected f32 or bf16, got \"f64\"" -- \
  bench --dtype f64
expect_usage "CLI11: run --backend not in the list" "error: run --backend: expected cpu or cuda, got \"tpu\"" -- \
  run --model "$FIX" --tokens 1 --backend tpu
# --help / --version end CLI11's checks where they stand: what follows them, and a
# value given to them, are still checked (they exited 0, the help printed).
for c in "--help=3:--help: a flag, expected no value, got \"3\" (see fusedmoe --help)" \
  "run --help=3:run --help: a flag, expected no value, got \"3\" (see fusedmoe run --help)" \
  "run -h3:run -h: a flag, expected no value, got \"3\"" \
  "--version=1:--version: a flag, expected no value, got \"1\"" \
  "run --help --bogus:run: unknown option --bogus (see fusedmoe run --help)" \
  "bench --bogus --help:bench: unknown option --bogus" \
  "inspect --help --bogus:inspect: unknown option --bogus" \
  "run --help --quiet=3:run --quiet: a flag, expected no value (or true / false), got \"3\"" \
  "--help --bogus:unknown option --bogus before the command" "--version --bogus:unknown option --bogus before the command" \
  "--version=false:--version: a flag, expected no value, got \"false\" (see fusedmoe --help)" \
  "--version=false inspect $FIX:--version: a flag, expected no value, got \"false\"" \
  "inspect --help=false $FIX:inspect --help: a flag, expected no value, got \"false\"" \
  "--help=0 run --model $FIX --tokens 1:--help: a flag, expected no value, got \"0\"" \
  "--version --version:--version: expected once, given 2 times (see fusedmoe --help)" \
  "run --help -h:run -h: expected once, given 2 times (see fusedmoe run --help)" \
  "--help --version:--version: prints the version only, got --version with --help (fusedmoe --version for the version; fusedmoe --help for the help)" \
  "--version -h:--version: prints the version only, got --version with -h"; do
  # shellcheck disable=SC2086
  expect_usage "with --help: ${c%%:*}" "error: ${c#*:}" -- ${c%%:*}
  [ -s "$TMP/stdout" ] && { echo "FAIL with --help: ${c%%:*}: printed the help"; failures=$((failures + 1)); }
done
# --version beside a command printed the version and exited 0 without running
# it: a usage error naming both, nothing on stdout (after the command too, where
# --version is an unknown option of the command).
for c in "--version run --model $FIX --layer 1 --tokens 2:run" "--version inspect $FIX:inspect" \
  "--version inspect:inspect" "--version bench --shapes qwen3-cpu --tokens 1:bench"; do
  # shellcheck disable=SC2086
  expect_usage "--version with a command: ${c%%:*}" "error: --version: prints the version only and takes no command, got --version with ${c##*:} (fusedmoe --version alone; fusedmoe ${c##*:} ... without --version to run the command)" -- ${c%%:*}
  [ -s "$TMP/stdout" ] && { echo "FAIL --version with a command: ${c%%:*}: printed to stdout"; failures=$((failures + 1)); }
done
expect_usage "--version after the command" "error: run: unknown option --version (see fusedmoe run --help)" -- \
  run --model "$FIX" --layer 1 --tokens 2 --version
# The help alone still needs no input, PATH or command (exit 0, the help on stdout).
for c in "--help" "-h" "run --help" "run -h" "inspect --help" "bench --help" "--help run" \
  "run --tokens 2 --help" "--version"; do
  # shellcheck disable=SC2086
  if "$BIN" $c >"$TMP/stdout" 2>"$TMP/stderr" && [ -s "$TMP/stdout" ] && [ ! -s "$TMP/stderr" ]; then
    echo "ok   $c: exit 0"
  else
    echo "FAIL $c: not exit 0 with the help alone"; cat "$TMP/stderr"; failures=$((failures + 1))
  fi
done
expect_usage "CLI11: a flag given a value" "error: bench --no-baseline: a flag, expected no value (or true / false), got \"maybe\" (see fusedmoe bench --help)" -- \
  bench --no-baseline=maybe
# A number, yes / no, on / off: CLI11 alone read "--quiet=3" as true, "--quiet=0" as false;
# an empty value ("--quiet=") as true. Every flag of every command takes no value, or
# true / false only.
for flag in "run --quiet=3" "run --quiet=0" "run --quiet=yes" "bench --no-baseline=1" \
  "bench --nccl=on" "bench --sweep=2" "inspect --json=7" "run --quiet=" "inspect --json=" \
  "bench --no-baseline="; do
  cmd=${flag%% *} f=${flag#* }
  extra=()
  case $cmd in run) extra=(--model "$FIX" --tokens 1) ;; inspect) extra=("$FIX") ;; esac
  expect_usage "CLI11: $flag" "error: $cmd ${f%%=*}: a flag, expected no value (or true / false), got \"${f#*=}\" (see fusedmoe $cmd --help)" -- \
    $cmd "${extra[@]}" "$f"
done
# An option that takes a value, given "--name=" (nothing after '='): CLI11 read it as
# "--name" and took the next argument as the value ("--output= --quiet" wrote a file
# named --quiet and printed the report; trial). Now the empty value is refused, and
# the next argument stays an option: no file named --quiet in the folder run in.
pushd "$OUTDIR" >/dev/null
expect_usage "run --output= --quiet" "error: run --output: expected a path, got an empty string" -- \
  run --model "$FIX" --tokens 1 --output= --quiet
[ ! -e "$OUTDIR/--quiet" ] || { echo "FAIL run --output= --quiet: wrote a file named --quiet"; failures=$((failures + 1)); }
popd >/dev/null
expect_usage "run --model= 2" "error: run --model: expected a path, got an empty string" -- \
  run --model= --tokens 2
expect_usage "run --tokens= --quiet" "error: run --tokens: expected a decimal integer >= 0, got \"\"" -- \
  run --model "$FIX" --tokens= --quiet
expect_usage "bench --csv= --shapes" "error: bench --csv: expected a path, got an empty string" -- \
  bench --csv= --shapes qwen3-cpu
# A path option whose value was left out takes the next option as its path ("run --model
# --tokens 1" read as "unexpected argument '1'"; trial): named as an option, nothing
# written; "--" too. ./--x names such a file.
pushd "$OUTDIR" >/dev/null
for c in "run --model|--model --tokens 1" "run --input|--input --tokens 1" \
  "run --reference|--tokens 1 --reference --quiet" "run --output|--tokens 1 --output --quiet" \
  "bench --csv|--csv --shapes qwen3-cpu"; do
  IFS='|' read -r opt args <<<"$c"
  read -r -a argv <<<"$args"
  value=$(sed -E 's/.*'"${opt#* }"' (--[a-z-]+).*/\1/' <<<"$args")
  expect_usage "$opt $value" "error: $opt: expected a path, got \"$value\", which is an option (was the value left out? ./$value names a file of that name)" -- \
    ${opt% *} "${argv[@]}"
done
expect_usage "run --output --" "error: run --output: expected a path, got \"--\", the end of the options" -- \
  run --tokens 1 --output --
[ -z "$(ls -A "$OUTDIR")" ] || { echo "FAIL: a path option given an option's name wrote $(ls -A "$OUTDIR")"; failures=$((failures + 1)); }
popd >/dev/null
"$BIN" run --model "$FIX" --tokens 1 --quiet --output "$OUTDIR/--x.safetensors" >/dev/null && [ -f "$OUTDIR/--x.safetensors" ] ||
  { echo "FAIL: --output DIR/--x.safetensors refused"; failures=$((failures + 1)); }
rm -f -- "$OUTDIR/--x.safetensors"
"$BIN" run --model "$FIX" --tokens 1 --quiet=true >/dev/null && "$BIN" run --model "$FIX" --tokens 1 --quiet=false >/dev/null ||
  { echo "FAIL run --quiet=true / --quiet=false: refused"; failures=$((failures + 1)); }
# "-" is no file name here, nor the standard output (which carries the report): refused, and no
# file named "-" is left in the working folder (expect_error checks $OUTDIR, the folder run in).
pushd "$OUTDIR" >/dev/null
expect_usage "run --output -" "error: run --output: expected a file path, got \"-\" (not the standard output" -- \
  run --model "$FIX" --tokens 1 --output -
expect_usage "bench --csv -" "error: bench --csv: expected a file path, got \"-\" (not the standard output" -- \
  bench --csv - --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline
popd >/dev/null
expect_error "output into a missing folder" "$TMP/no/such/dir" -- run --model "$FIX" "${run_args[@]}" \
  --output "$TMP/no/such/dir/out.safetensors"
# A directory: refused before the work, naming --output and the path (as bench --csv).
mkdir -p "$TMP/outdir-as-file"
expect_error "run --output a directory" \
  "--output: $TMP/outdir-as-file: exists and is not a regular file (a directory" -- \
  run --model "$FIX" "${run_args[@]}" --output "$TMP/outdir-as-file"
rmdir "$TMP/outdir-as-file"

{
  python3 "$ST" npy "$TMP/x.npy" f 3 128 0.5
  # The command line's mistakes: usage errors (exit 2), as the README says.
  expect_usage "--input-key with a .npy input" "--input-key 'x': $TMP/x.npy is a .npy file" -- \
    run --model "$FIX" --layer 1 --input "$TMP/x.npy" --input-key x
  expect_usage "--input .safetensors without --input-key" "--input-key is required with a .safetensors file ($REF has " -- \
    run --model "$FIX" --layer 1 --input "$REF"
  # A config.json whose hidden_size does not fit its checkpoint: the model's error (the
  # checkpoint checked from its headers first), not the input's, which fits the checkpoint.
  mkdir -p "$TMP/h96"
  python3 -c 'import json,sys; c = json.load(open(sys.argv[1])); c["hidden_size"] = 96; json.dump(c, open(sys.argv[2], "w"))' "$FIX/config.json" "$TMP/h96/config.json"
  ln -sf "$FIX/model.safetensors" "$TMP/h96/model.safetensors"
  expect_error "config.json's hidden_size against its checkpoint" "--model: $TMP/h96: tensor 'model.layers.1.mlp.gate.weight': expected shape [16, 96], got bf16 [16, 128]" -- \
    run --model "$TMP/h96" --layer 1 --input "$TMP/x.npy"
}
cp "$REF" "$TMP/in.safetensors"
expect_usage "--output is the --input file" "is the same file as --input" -- run --model "$FIX" \
  --layer 1 --input "$TMP/in.safetensors" --input-key layers.1.T5.input --output "$TMP/in.safetensors"
cmp -s "$REF" "$TMP/in.safetensors" || { echo "FAIL: the input was changed"; failures=$((failures + 1)); }
rm -f "$TMP/in.safetensors"
# ... or the --reference file, named by another path to it.
cp "$REF" "$TMP/ref.safetensors"
expect_usage "--output is the --reference file" "is the same file as --reference $TMP/ref.safetensors" -- \
  run --model "$FIX" --layer 1 --input "$REF" --input-key layers.1.T5.input \
  --reference "$TMP/ref.safetensors" --reference-key layers.1.T5.output_f64 \
  --output "$TMP/./ref.safetensors"
cmp -s "$REF" "$TMP/ref.safetensors" || { echo "FAIL: the reference was changed"; failures=$((failures + 1)); }
rm -f "$TMP/ref.safetensors"
# ... or a file of the bundled model, when --model is not given (--layer 99 would
# stop the run before it wrote anything, were the output not refused first).
BUNDLED=$3/tiny-deepseek-v3
expect_usage "--output is the bundled model's checkpoint" \
  "(the checkpoint of the bundled model " -- \
  run --layer 99 --tokens 2 --output "$BUNDLED/model.safetensors"
expect_usage "--output is the bundled model's config.json" "(the config.json of the bundled model" -- \
  run --layer 99 --tokens 2 --output "$BUNDLED/./config.json"
# bench --csv neither (a trial's --csv $BUNDLED/model.safetensors replaced the checkpoint with
# the CSV, exit 0), nor under a name of the formats the tool reads.
sum_before=$(cksum <"$BUNDLED/model.safetensors")
expect_usage "bench --csv over the bundled checkpoint" \
  "error: --csv $BUNDLED/model.safetensors: is inside " -- \
  bench --csv "$BUNDLED/model.safetensors" --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline
expect_usage "bench --csv in the bundled model's folder" "the folder of the bundled model" -- \
  bench --csv "$BUNDLED/results.csv" --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline
[ "$(cksum <"$BUNDLED/model.safetensors")" = "$sum_before" ] && [ ! -e "$BUNDLED/results.csv" ] ||
  { echo "FAIL bench --csv in the bundled model's folder: a file there written"; failures=$((failures + 1)); }
# A link to a file not there yet, in the model's folder (dangling: the writer
# would create its target): the same usage error, exit 2 (it exited 1, "symbolic
# link to a missing file", session 28's focused trial), nothing created there.
ln -s "$BUNDLED/new-results.csv" "$TMP/dangling.csv"
ln -s "$TMP/dangling.csv" "$TMP/dangling2.csv"
for link in dangling dangling2; do
  expect_usage "bench --csv, a dangling link ($link) into the bundled model's folder" \
    "error: --csv $TMP/$link.csv ($BUNDLED/new-results.csv): is inside " -- \
    bench --csv "$TMP/$link.csv" --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline
done
[ ! -e "$BUNDLED/new-results.csv" ] ||
  { echo "FAIL bench --csv through a dangling link: the target was created"; failures=$((failures + 1)); }
expect_usage "bench --csv *.SafeTensors" \
  "error: --csv $TMP/r.SafeTensors: the results are CSV text, not .safetensors" -- \
  bench --csv "$TMP/r.SafeTensors" --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline
# --output is never a file of the model (its config.json, checkpoint, index or a
# shard): a usage error naming --model, the file left as it was (compared as files:
# through a symbolic link too).
mkdir -p "$TMP/own" "$TMP/own-sharded"
cp "$FIX/config.json" "$FIX/model.safetensors" "$TMP/own/"
cp "$FIX/config.json" "$TMP/own-sharded/"
cp "$FIX/model.safetensors" "$TMP/own-sharded/model-00001-of-00001.safetensors"
python3 - "$TMP/own-sharded" <<'PY'
import json, struct, sys
d = sys.argv[1]
raw = open(f"{d}/model-00001-of-00001.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
names = [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]
json.dump({"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in names}},
          open(f"{d}/model.safetensors.index.json", "w"))
PY
ln -s "$TMP/own/model.safetensors" "$TMP/own-link.safetensors"
for c in "$TMP/own:$TMP/own/model.safetensors:the checkpoint" \
  "$TMP/own/model.safetensors:$TMP/own/model.safetensors:the checkpoint" \
  "$TMP/own:$TMP/own/config.json:the config.json" \
  "$TMP/own:$TMP/own-link.safetensors:the checkpoint" \
  "$TMP/own-sharded:$TMP/own-sharded/model.safetensors.index.json:the index" \
  "$TMP/own-sharded:$TMP/own-sharded/model-00001-of-00001.safetensors:the shard" \
  "$TMP/own-sharded/model.safetensors.index.json:$TMP/own-sharded/config.json:the config.json" \
  "$TMP/own-sharded/model.safetensors.index.json:$TMP/own-sharded/model.safetensors.index.json:the index"; do
  IFS=: read -r m o what <<<"$c"
  expect_usage "--output $o of --model $m" "--output $o: is the same file as" -- \
    run --model "$m" --layer 1 --tokens 2 --output "$o"
  grep -qF "($what of --model $m; it would be overwritten)" "$TMP/stderr" ||
    { echo "FAIL --output $o: does not name $what of --model"; failures=$((failures + 1)); }
done
cmp -s "$FIX/model.safetensors" "$TMP/own/model.safetensors" && cmp -s "$FIX/config.json" "$TMP/own/config.json" &&
  cmp -s "$FIX/model.safetensors" "$TMP/own-sharded/model-00001-of-00001.safetensors" ||
  { echo "FAIL: a model file was changed"; failures=$((failures + 1)); }
# ... nor any other path in the model's folder (the bundled model's reference.safetensors,
# a new file, a file in a subfolder, a path through a link to the folder or a link to a
# file in it): a usage error naming the path and the folder, nothing written.
mkdir -p "$TMP/own/sub"
ln -s "$TMP/own" "$TMP/own-dirlink"
ln -s "$TMP/own/notes.txt" "$TMP/to-notes.safetensors"
echo notes >"$TMP/own/notes.txt"
cp -r "$BUNDLED" "$TMP/bundled-copy"
RT=$(cd "$TMP" && pwd -P) RB=$(cd "$BUNDLED" && pwd -P)  # resolved
# MODEL|OUTPUT|RESOLVED OUTPUT (shown when it differs)|WHOSE FOLDER|FOLDER
for c in "$TMP/own|$TMP/own/out.safetensors|$RT/own/out.safetensors|--model $TMP/own|$RT/own" \
  "$TMP/own/model.safetensors|$TMP/own/sub/out.safetensors|$RT/own/sub/out.safetensors|--model $TMP/own/model.safetensors|$RT/own" \
  "$TMP/own|$TMP/own-dirlink/out.safetensors|$RT/own/out.safetensors|--model $TMP/own|$RT/own" \
  "$TMP/own-dirlink|$TMP/own/sub/../out.safetensors|$RT/own/out.safetensors|--model $TMP/own-dirlink|$RT/own" \
  "$TMP/own|$TMP/to-notes.safetensors|$RT/own/notes.txt|--model $TMP/own|$RT/own" \
  "$TMP/own-sharded/model.safetensors.index.json|$TMP/own-sharded/out.safetensors|$RT/own-sharded/out.safetensors|--model $TMP/own-sharded/model.safetensors.index.json|$RT/own-sharded" \
  "|$BUNDLED/reference.safetensors|$RB/reference.safetensors|the bundled model |$RB" \
  "$TMP/own|$BUNDLED/reference.safetensors|$RB/reference.safetensors|the bundled model |$RB" \
  "$TMP/own|$BUNDLED/new.safetensors|$RB/new.safetensors|the bundled model |$RB"; do
  IFS='|' read -r m o resolved whose folder <<<"$c"
  # The bundled model's folder is the source tree's: --layer 99 stops a run that
  # did not refuse the output before it writes there (with another --model too:
  # that folder was not protected then).
  model=(--layer 99)
  [ -z "$m" ] || model=(--model "$m" --layer 1)
  case "$o" in "$BUNDLED"/*) [ -z "$m" ] || model=(--model "$m" --layer 99) ;; esac
  expect_usage "--output $o in the folder of ${m:-the bundled model}" "--output $o" -- \
    run "${model[@]}" --tokens 2 --output "$o"
  [ "$resolved" = "$o" ] && shown="" || shown=" ($resolved)"
  grep -qF -- "--output $o$shown: is inside $folder, the folder of $whose" "$TMP/stderr" &&
    grep -qF -- "; the output is never written among the model's files, give a path outside that folder" "$TMP/stderr" ||
    { echo "FAIL --output $o: does not name the model's folder $folder"; failures=$((failures + 1)); }
done
[ "$(cat "$TMP/own/notes.txt")" = notes ] && [ -z "$(ls -A "$TMP/own/sub")" ] &&
  [ ! -e "$TMP/own/out.safetensors" ] && [ ! -e "$TMP/own-sharded/out.safetensors" ] &&
  diff -r "$BUNDLED" "$TMP/bundled-copy" >/dev/null ||
  { echo "FAIL: a file was written in a model's folder"; failures=$((failures + 1)); }
rm -rf "$TMP/bundled-copy" "$TMP/own-dirlink" "$TMP/to-notes.safetensors" "$TMP/own/sub" "$TMP/own/notes.txt"
# ... nor in a folder the model's files are links into: a Hugging Face cache keeps a
# snapshot's config.json and checkpoint in blobs/, the snapshot folder holds links.
mkdir -p "$TMP/hf-cache/blobs" "$TMP/hf-cache/snapshots/rev1"
cp "$FIX/config.json" "$TMP/hf-cache/blobs/aaa" && cp "$FIX/model.safetensors" "$TMP/hf-cache/blobs/bbb"
ln -s ../../blobs/aaa "$TMP/hf-cache/snapshots/rev1/config.json"
ln -s ../../blobs/bbb "$TMP/hf-cache/snapshots/rev1/model.safetensors"
snap="$TMP/hf-cache/snapshots/rev1" blobs="$(cd "$TMP/hf-cache/blobs" && pwd -P)"
expect_usage "--output in the blobs/ folder of a Hugging Face cache snapshot" \
  "--output $TMP/hf-cache/blobs/out.safetensors" -- \
  run --model "$snap" --layer 1 --tokens 2 --output "$TMP/hf-cache/blobs/out.safetensors"
grep -qF -- "is inside $blobs, the folder of the config.json of --model $snap ($snap/config.json)" "$TMP/stderr" ||
  { echo "FAIL --output in blobs/: does not name the folder the config.json links into"; failures=$((failures + 1)); }
[ "$(ls "$TMP/hf-cache/blobs")" = "$(printf 'aaa\nbbb')" ] ||
  { echo "FAIL: --output in blobs/ wrote a file"; failures=$((failures + 1)); }
"$BIN" run --model "$snap" --layer 1 --tokens 2 --quiet --output "$TMP/hf-cache/out.safetensors" >/dev/null ||
  { echo "FAIL: --output beside a Hugging Face cache's blobs/"; failures=$((failures + 1)); }
rm -rf "$TMP/hf-cache"
# ... while a folder beside it, whose name begins as the model folder's, may be written.
mkdir -p "$TMP/own-out"
"$BIN" run --model "$TMP/own" --layer 1 --tokens 2 --quiet --output "$TMP/own-out/out.safetensors" >/dev/null ||
  { echo "FAIL: --output beside the model's folder"; failures=$((failures + 1)); }
rm -rf "$TMP/own-out"
# --model may name a sharded checkpoint's index (the config.json beside it; the index
# was read as the config: "required field 'model_type' is missing"): the same output.
"$BIN" run --model "$TMP/own-sharded/model.safetensors.index.json" --layer 1 --tokens 2 --seed 5 --quiet \
  --output "$TMP/by-index.safetensors" >/dev/null &&
  "$BIN" run --model "$TMP/own-sharded" --layer 1 --tokens 2 --seed 5 --quiet \
    --output "$TMP/by-dir.safetensors" >/dev/null &&
  python3 - "$TMP/by-index.safetensors" "$TMP/by-dir.safetensors" <<'PY' ||
import json, struct, sys
def tensors(path):  # the header without its metadata (which names --model), and the data
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    h.pop("__metadata__")
    return h, raw[8 + n:]
sys.exit(tensors(sys.argv[1]) != tensors(sys.argv[2]))
PY
  { echo "FAIL: --model an index"; failures=$((failures + 1)); }
mkdir -p "$TMP/index-only"
cp "$TMP/own-sharded/model.safetensors.index.json" "$TMP/index-only/"
expect_error "--model an index without config.json" "$TMP/index-only/model.safetensors.index.json: a safetensors index, whose folder has no config.json ($TMP/index-only/config.json)" -- \
  run --model "$TMP/index-only/model.safetensors.index.json" --tokens 2
rm -rf "$TMP/own" "$TMP/own-sharded" "$TMP/own-link.safetensors" "$TMP/index-only" \
  "$TMP/by-index.safetensors" "$TMP/by-dir.safetensors"

# A FIFO where a file is expected: a clear error, not a reader blocked forever.
mkfifo "$TMP/fifo.safetensors"
rc=0
timeout 20 "$BIN" run --model "$FIX" --layer 1 --input "$TMP/fifo.safetensors" --input-key x \
  >"$TMP/stdout" 2>"$TMP/stderr" || rc=$?
if [ "$rc" -eq 124 ] || ! grep -qF "not a regular file (a FIFO)" "$TMP/stderr"; then
  echo "FAIL FIFO as --input (exit $rc)"; cat "$TMP/stderr"; failures=$((failures + 1))
else
  echo "ok   FIFO as --input: $(cat "$TMP/stderr")"
fi

# A finite input that overflows f32 inside the experts: an error, no output file.
{
  python3 "$ST" npy "$TMP/huge.npy" f 2 128 1e37
  expect_error "input overflowing f32" "error: --input $TMP/huge.npy: the layer's output has a non-finite value at token 0" -- \
    run --model "$FIX" --layer 1 --input "$TMP/huge.npy"
  # ... already in the router's product: named by the input too, not by the library's
  # argument names (hidden_states, gate_weight, check_finite; session 31's trial).
  python3 "$ST" npy "$TMP/huger.npy" f 2 128 3e38
  expect_error "input overflowing f32 in the router" "error: --input $TMP/huger.npy: the router logits computed from it and the model's gate weights: expected no NaN, got NaN at token 0" -- \
    run --model "$FIX" --layer 1 --input "$TMP/huger.npy"
}

# More tokens than memory: the error names --tokens (it named Tensor::empty alone).
expect_error "--tokens beyond memory" "--tokens: expected at most " -- \
  run --model "$FIX" --layer 1 --tokens 10000000000000
# So does an --input with more tokens than the run's buffers fit beside it (a sparse
# f16 .npy file of phys / 4096 tokens, refused from its header before its data is read,
# its f32 copy and the experts' buffers, which need ~7 KiB a token).
# sparse_npy PATH DESCR ITEMSIZE DIVISOR: a sparse [T, 128] .npy of dtype DESCR
# (ITEMSIZE bytes) with T = physical memory / DIVISOR rows: no data written.
sparse_npy() {
  python3 - "$@" <<'PY'
import os, sys
path, descr, itemsize, divisor = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
T = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // divisor
header = "{'descr': '%s', 'fortran_order': False, 'shape': (%d, 128), }" % (descr, T)
header += " " * (63 - (len(header) + 10) % 64) + "\n"
with open(path, "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
    f.truncate(f.tell() + T * 128 * itemsize)
PY
}
sparse_npy "$TMP/many.npy" "<f2" 2 4096
expect_error "--input beyond memory" "error: --input $TMP/many.npy: expected at most " -- \
  run --model "$FIX" --layer 1 --input "$TMP/many.npy" --quiet
rm -f "$TMP/many.npy"
# A sparse f32 .npy file twice the physical memory, as --input and as --reference: the
# header's shape is checked before anything is allocated for, or read of, its data
# (the data was read first: an out-of-memory error naming neither, or the OOM killer).
sparse_npy "$TMP/twice.npy" "<f4" 4 256  # twice the memory: T * 512 bytes = 2 x phys
expect_error "--input .npy twice the memory" "error: --input $TMP/twice.npy: expected at most " -- \
  run --model "$FIX" --layer 1 --input "$TMP/twice.npy" --quiet
python3 "$ST" npy "$TMP/two.npy" f 2 128 1
expect_error "--reference .npy twice the memory" "error: --reference $TMP/twice.npy: expected [2, 128], got [" -- \
  run --model "$FIX" --layer 1 --input "$TMP/two.npy" --reference "$TMP/twice.npy" --quiet
rm -f "$TMP/twice.npy"
# Values the f32 input cannot hold: an f64 one beyond its range (it became Inf, named as
# "hidden_states: ... got Inf"), an f16 Inf: each named in the input file, with its place.
python3 "$ST" npy "$TMP/f64big.npy" d 2 128 1 1,7=1e300
python3 "$ST" npy "$TMP/f16inf.npy" e 2 128 1 1,3=inf
expect_error "f64 --input beyond the f32 range" "error: --input $TMP/f64big.npy: element [1, 7] is beyond the f32 range once converted from f64 (its value 1e+300)" -- \
  run --model "$FIX" --layer 1 --input "$TMP/f64big.npy" --quiet
expect_error "f16 --input with an Inf" "error: --input $TMP/f16inf.npy: expected finite values, got Inf at token 1, column 3" -- \
  run --model "$FIX" --layer 1 --input "$TMP/f16inf.npy" --quiet
expect_error "--tokens beyond 64 bits" "--tokens: expected a decimal integer >= 0, got \"99999999999999999999\" (beyond 64 bits)" -- \
  run --model "$FIX" --layer 1 --tokens 99999999999999999999
expect_error "negative --seed" "--seed: expected a decimal integer in [0, 2^64), got \"-1\"" -- \
  run --model "$FIX" --layer 1 --tokens 3 --seed -1
expect_error "--seed beyond 64 bits" "--seed: expected a decimal integer in [0, 2^64), got \"18446744073709551616\" (beyond 64 bits)" -- \
  run --model "$FIX" --layer 1 --tokens 3 --seed 18446744073709551616
expect_error "bench --seed not an integer" "--seed: expected a decimal integer in [0, 2^64), got \"1.5\"" -- \
  bench --shapes qwen3-cpu --tokens 1 --seed 1.5
expect_usage "--dispatch-dtype without expert parallelism" "--dispatch-dtype fp8" -- \
  run --model "$FIX" --layer 1 --tokens 3 --dispatch-dtype fp8
expect_usage "--output with a .npy name" "not .npy" -- \
  run --model "$FIX" --layer 1 --tokens 3 --output "$OUTDIR/out.npy"
# ... in any case, and .npz (both were written as safetensors under the NumPy name).
for name in out.NPY out.npz; do
  expect_usage "--output with a $name name" "not .npy / .npz" -- \
    run --model "$FIX" --layer 1 --tokens 3 --output "$OUTDIR/$name"
  [ -e "$OUTDIR/$name" ] && { echo "FAIL: $name written"; failures=$((failures + 1)); }
done
expect_error "--threads beyond the pool's limit" "--threads: expected a decimal integer in [0, 1024] (0: all cores), got \"5000\"" -- \
  run --model "$FIX" --layer 1 --tokens 3 --threads 5000
# int options beyond int: the range, not CLI11's "Could not convert".
expect_error "--repeat beyond int" "--repeat: expected a decimal integer in [1, 2147483647], got \"99999999999999\"" -- \
  run --model "$FIX" --layer 1 --tokens 3 --repeat 99999999999999
expect_error "--threads beyond int" "--threads: expected a decimal integer in [0, 1024] (0: all cores), got \"99999999999999\"" -- \
  run --model "$FIX" --layer 1 --tokens 3 --threads 99999999999999
expect_error "bench --threads 1025" "--threads: expected a decimal integer in [0, 1024] (0: all cores), got \"1025\"" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --threads 1025
expect_error "bench --threads -1" "--threads: expected a decimal integer in [0, 1024] (0: all cores), got \"-1\"" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --threads -1
expect_error "--ep-size 1.5" "--ep-size: expected a decimal integer in [1, 2147483647], got \"1.5\"" -- \
  run --model "$FIX" --layer 1 --tokens 3 --ep-size 1.5

# Numbers are plain decimal only, on the command line and in FUSEDMOE_* variables:
# no hexadecimal, no spaces, no inf / nan; a usage error naming the option, the
# form expected and the text given (CLI11 alone read 0x10 as 16 and 010 as 8).
int_ge0="expected a decimal integer >= 0, got"
expect_usage "run --tokens 0x10" "--tokens: $int_ge0 \"0x10\"" -- run --model "$FIX" --layer 1 --tokens 0x10
expect_usage "run --tokens ' 16'" "--tokens: $int_ge0 \" 16\"" -- run --model "$FIX" --layer 1 --tokens " 16"
expect_usage "run --tokens '16 '" "--tokens: $int_ge0 \"16 \"" -- run --model "$FIX" --layer 1 --tokens "16 "
expect_usage "run --tokens 1e3" "--tokens: $int_ge0 \"1e3\"" -- run --model "$FIX" --layer 1 --tokens 1e3
expect_usage "run --layer 0x1" "--layer: $int_ge0 \"0x1\"" -- run --model "$FIX" --layer 0x1 --tokens 2
expect_usage "run --seed 0x10" "--seed: expected a decimal integer in [0, 2^64), got \"0x10\"" -- \
  run --model "$FIX" --layer 1 --tokens 2 --seed 0x10
expect_usage "run --repeat ' 2'" "--repeat: expected a decimal integer in [1, 2147483647], got \" 2\"" -- \
  run --model "$FIX" --layer 1 --tokens 2 --repeat " 2"
expect_usage "run --threads 0x2" "--threads: expected a decimal integer in [0, 1024] (0: all cores), got \"0x2\"" -- \
  run --model "$FIX" --layer 1 --tokens 2 --threads 0x2
expect_usage "run --ep-size 0x2" "--ep-size: expected a decimal integer in [1, 2147483647], got \"0x2\"" -- \
  run --model "$FIX" --layer 1 --tokens 2 --ep-size 0x2
for v in inf nan 0x1p-3 " 0.1" 1e999; do
  expect_usage "run --tolerance '$v'" "--tolerance: expected a decimal number >= 0, got \"$v\"" -- \
    run --model "$FIX" --layer 1 --tokens 2 --reference "$REF" --reference-key layers.1.T1.input --tolerance "$v"
done
expect_usage "bench --max-experts 0x10" "--max-experts: expected a decimal integer >= 1, got \"0x10\"" -- \
  bench --shapes qwen3-cpu --tokens 1 --max-experts 0x10
expect_usage "bench --memory-fraction 0x0.4p0" "--memory-fraction: expected a decimal number in [0.01, 0.95], got \"0x0.4p0\"" -- \
  bench --shapes qwen3-cpu --tokens 1 --memory-fraction 0x0.4p0
for v in " 16" 0x10 "1, 16" "1,+0x2" "16 "; do
  expect_usage "bench --tokens '$v'" "--tokens: expected a comma-separated list of decimal integers >= 0, got \"$v\"" -- \
    bench --shapes qwen3-cpu --max-experts 8 --min-time 0 --tokens "$v"
done
# FUSEDMOE_COMM_TIMEOUT_S (read by a parallel run): the same rule, checked before MPI waits on it.
for v in " 16" 0x10 inf; do
  FUSEDMOE_COMM_TIMEOUT_S=$v expect_usage "FUSEDMOE_COMM_TIMEOUT_S='$v'" \
    "FUSEDMOE_COMM_TIMEOUT_S: expected a decimal number of seconds in (0, 1e+09], got \"$v\"" -- \
    run --model "$FIX" --layer 1 --tokens 2 --ep-size 2
done
# ... on one rank without expert parallelism too, for run and bench (README: a usage error).
FUSEDMOE_COMM_TIMEOUT_S=abc expect_usage "FUSEDMOE_COMM_TIMEOUT_S=abc, run on one rank" \
  "FUSEDMOE_COMM_TIMEOUT_S: expected a decimal number of seconds in (0, 1e+09], got \"abc\"" -- \
  run --model "$FIX" --layer 1 --tokens 4
FUSEDMOE_COMM_TIMEOUT_S=0 expect_usage "FUSEDMOE_COMM_TIMEOUT_S=0, bench on one rank" \
  "FUSEDMOE_COMM_TIMEOUT_S: expected a decimal number of seconds in (0, 1e+09], got \"0\"" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0
# The CPU GEMM's FUSEDMOE_CPU_ISA and FUSEDMOE_CPU_AMX: usage errors before anything runs
# (bench printed its header and measured the ceilings first, exit 1).
FUSEDMOE_CPU_ISA=bogus expect_usage "FUSEDMOE_CPU_ISA=bogus, bench" \
  "FUSEDMOE_CPU_ISA: expected one of auto, avx512, avx2, scalar, got 'bogus'" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0
if [ -s "$TMP/stdout" ]; then
  echo "FAIL FUSEDMOE_CPU_ISA=bogus, bench: printed before the error"; failures=$((failures + 1))
fi
FUSEDMOE_CPU_AMX=yes expect_usage "FUSEDMOE_CPU_AMX=yes, run" \
  "FUSEDMOE_CPU_AMX: expected 0, 1 or auto, got 'yes'" -- run --model "$FIX" --layer 1 --tokens 4
# =1 beside another instruction set: an error (where the CPU has AMX: the two
# conflict; elsewhere: AMX is missing), not silently the AVX2 path.
FUSEDMOE_CPU_ISA=scalar FUSEDMOE_CPU_AMX=1 expect_usage "FUSEDMOE_CPU_AMX=1 with FUSEDMOE_CPU_ISA=scalar" \
  "FUSEDMOE_CPU_AMX=1: " -- run --model "$FIX" --layer 1 --tokens 4
expect_usage "run --warmup -1" 'run --warmup: expected a decimal integer in [0, 1000000], got "-1"' -- \
  run --model "$FIX" --layer 1 --tokens 4 --warmup -1
# More threads than CPUs: a warning on stderr, the run goes on.
cpus=$(nproc)
if ! "$BIN" run --model "$FIX" --layer 1 --tokens 4 --threads $((cpus + 1)) --quiet >"$TMP/stdout" 2>"$TMP/stderr" ||
  ! grep -q "^fusedmoe: warning: --threads $((cpus + 1)) is more than the $cpus CPU" "$TMP/stderr" ||
  ! grep -q "after 1 untimed" "$TMP/stdout"; then
  echo "FAIL run --threads above the CPUs"; cat "$TMP/stderr"; failures=$((failures + 1))
else
  echo "ok   run --threads above the CPUs: $(cat "$TMP/stderr")"
fi
# FUSEDMOE_EP_TRANSPORT (read by the GPUs' expert parallelism): a bad value is a usage
# error of run and bench on every backend, one rank too, checked where
# FUSEDMOE_COMM_TIMEOUT_S is (it used to pass unnoticed on the CPU, exit 0).
transport_msg="FUSEDMOE_EP_TRANSPORT: expected auto, nccl or peer, got"
FUSEDMOE_EP_TRANSPORT=bogus expect_usage "FUSEDMOE_EP_TRANSPORT=bogus, run" "$transport_msg 'bogus'" -- \
  run --model "$FIX" --layer 1 --tokens 2
FUSEDMOE_EP_TRANSPORT=Peer expect_usage "FUSEDMOE_EP_TRANSPORT=Peer, run --ep-size 2" "$transport_msg 'Peer'" -- \
  run --model "$FIX" --layer 1 --tokens 2 --ep-size 2
FUSEDMOE_EP_TRANSPORT=nvshmem expect_usage "FUSEDMOE_EP_TRANSPORT=nvshmem, bench" "$transport_msg 'nvshmem'" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0
# The CUDA backend's switches (FUSEDMOE_CUDA_*): a bad value is a usage error of run and
# bench on every backend too (it used to pass unnoticed without a GPU, exit 0).
FUSEDMOE_CUDA_SM90_CONTIG=maybe expect_usage "FUSEDMOE_CUDA_SM90_CONTIG=maybe, run" \
  "FUSEDMOE_CUDA_SM90_CONTIG: expected on or off, got 'maybe'" -- run --model "$FIX" --layer 1 --tokens 2
FUSEDMOE_CUDA_PDL=7 expect_usage "FUSEDMOE_CUDA_PDL=7, bench" \
  "FUSEDMOE_CUDA_PDL: expected 0 or 1, got '7'" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0
FUSEDMOE_CUDA_ALIGN=blocks expect_usage "FUSEDMOE_CUDA_ALIGN=blocks, run" \
  "FUSEDMOE_CUDA_ALIGN: expected fused, chunks or grid, got 'blocks'" -- \
  run --model "$FIX" --layer 1 --tokens 2
if FUSEDMOE_CUDA_SM90_CONTIG=off FUSEDMOE_CUDA_SM90_TILE=m128 FUSEDMOE_CUDA_PDL= "$BIN" run --model "$FIX" --layer 1 --tokens 2 --quiet >"$TMP/stdout" 2>"$TMP/stderr"; then
  echo "ok   FUSEDMOE_CUDA_* valid values: run"
else
  echo "FAIL FUSEDMOE_CUDA_* valid values: refused"; cat "$TMP/stderr"; failures=$((failures + 1))
fi
# ... while FUSEDMOE_EP_TRANSPORT's values (and empty: unset) run.
for v in "" auto nccl peer; do
  if FUSEDMOE_EP_TRANSPORT=$v "$BIN" run --model "$FIX" --layer 1 --tokens 2 --quiet >"$TMP/stdout" 2>"$TMP/stderr"; then
    echo "ok   FUSEDMOE_EP_TRANSPORT='$v': runs"
  else
    echo "FAIL FUSEDMOE_EP_TRANSPORT='$v': refused"; cat "$TMP/stderr"; failures=$((failures + 1))
  fi
done
# A leading zero is decimal, not octal: 010 tokens are 10.
"$BIN" run --model "$FIX" --layer 1 --tokens 010 --quiet >"$TMP/stdout" 2>"$TMP/stderr" || true
if ! grep -q "T = 10$" "$TMP/stdout"; then
  echo "FAIL run --tokens 010: not 10 tokens"; cat "$TMP/stdout" "$TMP/stderr"; failures=$((failures + 1))
else
  echo "ok   run --tokens 010: 10 tokens"
fi
{
  python3 "$ST" npy "$TMP/x.npy" f 2 128 1
  python3 "$ST" npy "$TMP/zero.npy" f 2 128 0
  # Without --tolerance the default is named as such (it said "1e-05 given").
  expect_error "all-zero --reference" "relative L2 error inf (fails under any tolerance, 1e-05 (the default))" -- \
    run --model "$FIX" --layer 1 --input "$TMP/x.npy" --reference "$TMP/zero.npy" --output "$TMP/zref.safetensors"
  expect_error "all-zero --reference, --tolerance 1e308" "relative L2 error inf (fails under any tolerance, 1e+308 given)" -- \
    run --model "$FIX" --layer 1 --input "$TMP/x.npy" --reference "$TMP/zero.npy" --tolerance 1e308 \
    --output "$TMP/zref.safetensors"
  # A reference holding NaN / Inf: refused, named, whatever the tolerance.
  python3 "$ST" npy "$TMP/nanref.npy" d 2 128 nan
  python3 "$ST" npy "$TMP/infref.npy" d 2 128 1 1,5=inf
  expect_error "all-NaN --reference" "--reference $TMP/nanref.npy: expected finite values, got NaN at row 0, column 0" -- \
    run --model "$FIX" --layer 1 --input "$TMP/x.npy" --reference "$TMP/nanref.npy" --tolerance 1e308
  expect_error "--reference with an Inf" "--reference $TMP/infref.npy: expected finite values, got Inf at row 1, column 5" -- \
    run --model "$FIX" --layer 1 --input "$TMP/x.npy" --reference "$TMP/infref.npy"
}

# --max-experts below a shape's top_k: an error naming the minimum, not E = k silently.
expect_usage "bench --max-experts below top_k" "--max-experts: expected at least 8 (top_k of shape 'qwen3-cpu'), got 1" -- \
  bench --shapes qwen3-cpu --max-experts 1 --tokens 1 --min-time 0
# Options of the CUDA bench on the CPU bench (single or parallel): errors, not ignored.
expect_usage "bench --nccl without --backend cuda" "error: --nccl: options of --backend cuda, given without it" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --nccl
expect_usage "bench --sweep, --dump-dir with --ep-size" "error: --dump-dir, --sweep: options of --backend cuda" -- \
  bench --shapes qwen3-cpu --tokens 1 --ep-size 2 --sweep --dump-dir "$TMP"

# Exit codes (README): 2 for a command line that does not parse, the same for run
# and bench; 1 for other errors.
expect_rc() {  # expect_rc NAME CODE ARGS...
  local name=$1 code=$2 rc=0
  shift 2
  "$BIN" "$@" >"$TMP/stdout" 2>"$TMP/stderr" || rc=$?
  if [ "$rc" -ne "$code" ]; then
    echo "FAIL $name: exit $rc, expected $code"; sed 's/^/  stderr: /' "$TMP/stderr"
    failures=$((failures + 1))
  else
    echo "ok   $name: exit $rc: $(cat "$TMP/stderr")"
  fi
}
expect_rc "run --tokens -1" 2 run --model "$FIX" --layer 1 --tokens -1
expect_rc "bench --tokens -1" 2 bench --shapes qwen3-cpu --max-experts 8 --tokens -1 --min-time 0
expect_rc "bench --tokens 1,,2" 2 bench --shapes qwen3-cpu --max-experts 8 --tokens 1,,2 --min-time 0
expect_rc "run without --input or --tokens" 2 run --model "$FIX" --layer 1
expect_rc "run --threads 5000" 2 run --model "$FIX" --layer 1 --tokens 3 --threads 5000
expect_rc "run --layer 0 (not MoE)" 1 run --model "$FIX" --layer 0 --tokens 3

# Usage errors found after parsing (options that do not go together, a value a
# command does not take) exit with 2 as well; the README says so.
expect_usage "bench --shapes foo" "--shapes: expected one of mixtral, qwen3, deepseek, qwen3-cpu, got \"foo\"" -- \
  bench --shapes foo --tokens 1
for v in ,qwen3-cpu qwen3-cpu,,mixtral qwen3-cpu, "qwen3-cpu, ,mixtral"; do
  expect_usage "bench --shapes '$v'" "--shapes: expected a comma-separated list of shape names, got \"$v\" (an empty item)" -- \
    bench --shapes "$v" --max-experts 8 --tokens 1 --min-time 0
done
expect_usage "bench --shapes ," "--shapes: expected at least one shape, got \",\"" -- bench --shapes , --tokens 1
# A shape or token count listed twice would be measured twice: a usage error naming it
# (for the parallel bench too), as an option given twice is.
for v in "qwen3-cpu,qwen3-cpu:qwen3-cpu" "qwen3-cpu, mixtral,qwen3-cpu:qwen3-cpu"; do
  IFS=: read -r list dup <<<"$v"
  expect_usage "bench --shapes '$list'" "error: bench --shapes: expected distinct shape names, got \"$dup\" twice in \"$list\" (each shape is measured once; list it once)" -- \
    bench --shapes "$list" --max-experts 8 --tokens 1 --min-time 0
done
for v in "1,1,16:1" "1,16,016:16" "0,2,0:0"; do
  IFS=: read -r list dup <<<"$v"
  expect_usage "bench --tokens '$list'" "error: bench --tokens: expected distinct token counts, got $dup twice in \"$list\" (each count is measured once; list it once)" -- \
    bench --shapes qwen3-cpu --max-experts 8 --min-time 0 --tokens "$list"
done
expect_usage "bench --tokens 1,1 --ep-size 2" "error: bench --tokens: expected distinct token counts, got 1 twice in \"1,1\"" -- \
  bench --shapes qwen3-cpu --max-experts 8 --min-time 0 --tokens 1,1 --ep-size 2
expect_usage "bench --sweep on the CPU" "--sweep: options of --backend cuda, given without it" -- \
  bench --shapes qwen3-cpu --tokens 1 --sweep
expect_usage "bench --dispatch-dtype without expert parallelism" "--dispatch-dtype bf16: the expert-parallel dispatch payload, needs --ep-size > 1" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --dispatch-dtype bf16
expect_usage "run --compute-dtype f16 on the CPU" "--compute-dtype f16: needs --backend cuda" -- \
  run --model "$FIX" --layer 1 --tokens 2 --compute-dtype f16
expect_usage "run --backend cuda --compute-dtype f32" "--backend cuda computes in bf16 or f16" -- \
  run --model "$FIX" --layer 1 --tokens 2 --backend cuda --compute-dtype f32
expect_usage "run --backend cuda --tp-size 2" "--backend cuda: --ep-size only" -- \
  run --model "$FIX" --layer 1 --tokens 2 --backend cuda --tp-size 2
expect_usage "bench --backend cuda --tp-size 2" "--backend cuda: --ep-size only" -- \
  bench --backend cuda --shapes qwen3 --tokens 1 --tp-size 2
for cmd in run bench; do
  case $cmd in run) a=(run --model "$FIX" --layer 1 --tokens 2) ;; *) a=(bench --shapes qwen3 --tokens 1) ;; esac
  expect_usage "$cmd --backend cuda --dispatch-dtype f32" "--dispatch-dtype f32: with --backend cuda the experts take bf16 (or f16) inputs" -- \
    "${a[@]}" --backend cuda --ep-size 2 --dispatch-dtype f32
  # The combine payload: GPU expert parallelism only.
  expect_usage "$cmd --combine-dtype bf16 on the CPU" "--combine-dtype bf16: the combine payload of GPU expert parallelism" -- \
    "${a[@]}" --ep-size 2 --combine-dtype bf16
  expect_usage "$cmd --backend cuda --combine-dtype bf16 without --ep-size" "needs --backend cuda and --ep-size > 1" -- \
    "${a[@]}" --backend cuda --combine-dtype bf16
done
# Options the CUDA benches do not take: named with their values.
expect_usage "bench --backend cuda --seed 5" "--seed 5: not taken by the single-GPU CUDA bench" -- \
  bench --backend cuda --shapes qwen3 --tokens 1 --seed 5
expect_usage "bench --backend cuda --nccl --sweep" "--sweep: an option of the single-GPU CUDA bench" -- \
  bench --backend cuda --shapes qwen3 --tokens 1 --nccl --sweep
# GPU-only misuses that the command line alone decides: the usage error on any machine
# (with a GPU or not, a build with CUDA or not), never "no CUDA device found" or "this
# build has no CUDA backend" first. The f16 experts take no bf16 records (the runner
# refused them after setting up the device).
expect_usage "run --backend cuda --compute-dtype f16 --dispatch-dtype bf16" "--dispatch-dtype bf16 with --compute-dtype f16: with --backend cuda the experts take f16 inputs; expected --dispatch-dtype auto (f16 records) or fp8, or --compute-dtype bf16" -- \
  run --model "$FIX" --layer 1 --tokens 2 --backend cuda --compute-dtype f16 --dispatch-dtype bf16 --ep-size 2
# The single-GPU CUDA bench has mixtral, qwen3 and deepseek only (qwen3-cpu silently
# ran qwen3 on a GPU); the default --shapes list runs those three.
for shapes in qwen3-cpu mixtral,qwen3-cpu; do
  expect_usage "bench --backend cuda --shapes $shapes" "--shapes $shapes: the single-GPU CUDA bench (--backend cuda without --ep-size or --nccl) times mixtral, qwen3 or deepseek, got \"qwen3-cpu\"" -- \
    bench --backend cuda --shapes $shapes --tokens 1
done
# --dispatch-dtype, --combine-dtype and --expert-placement at the default --help shows
# (auto, f32, contiguous), given explicitly, change nothing: taken in any layout, for
# run and bench (they were usage errors when given at all). A value other than the
# default where it has no effect is a usage error naming the option, its value and
# what it needs.
# expect_ok NAME -- ARGS...: exit 0, nothing on stderr.
expect_ok() {
  local name=$1 rc=0
  shift 2
  "$BIN" "$@" >"$TMP/stdout" 2>"$TMP/stderr" || rc=$?
  if [ "$rc" -ne 0 ] || [ -s "$TMP/stderr" ]; then
    echo "FAIL $name: exit $rc"
    sed 's/^/  stderr: /' "$TMP/stderr"
    failures=$((failures + 1))
  else
    echo "ok   $name: exit 0"
  fi
}
defaults=(--dispatch-dtype auto --combine-dtype f32 --expert-placement contiguous)
expect_ok "run with the EP options' defaults, no expert parallelism" -- \
  run --model "$FIX" --layer 1 --tokens 1 --quiet "${defaults[@]}"
expect_ok "run with the EP options' defaults, --ep-size 1" -- \
  run --model "$FIX" --layer 1 --tokens 1 --quiet --ep-size 1 "${defaults[@]}"
expect_ok "bench with the EP options' defaults, no expert parallelism" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline "${defaults[@]}"
# With --dp-size 2 the default dispatch payload is taken too (here: the rank-count
# error of a run without mpirun, not a --dispatch-dtype one).
expect_usage "run --dispatch-dtype auto --dp-size 2" "--ep-size 1 --tp-size 1 --dp-size 2: expected 2 ranks" -- \
  run --model "$FIX" --layer 1 --tokens 4 --dp-size 2 --dispatch-dtype auto
for v in f32 bf16; do
  expect_usage "run --dispatch-dtype $v without expert parallelism" "--dispatch-dtype $v: the expert-parallel dispatch payload, needs --ep-size > 1, got --ep-size 1 (without expert parallelism only the default, auto, is taken)" -- \
    run --model "$FIX" --layer 1 --tokens 1 --dispatch-dtype $v
  expect_usage "bench --dispatch-dtype $v without expert parallelism" "--dispatch-dtype $v: the expert-parallel dispatch payload, needs --ep-size > 1, got --ep-size 1" -- \
    bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --dispatch-dtype $v --tp-size 1
done
expect_usage "run --combine-dtype bf16 without expert parallelism" "--combine-dtype bf16: the combine payload of GPU expert parallelism, needs --backend cuda and --ep-size > 1 (the peer transport), got --backend cpu --ep-size 1 (elsewhere only the default, f32, is taken)" -- \
  run --model "$FIX" --layer 1 --tokens 1 --combine-dtype bf16
# --dispatch-dtype with --dp-size > 1: the data-parallel layout gathers f32 rows, so
# the payload would change nothing but loosen run --reference's default tolerance (and
# bench printed "dispatch payload fp8"): a usage error naming both options.
dp_msg="with --dp-size 2: the expert-parallel dispatch payload, taken with --ep-size > 1 and --dp-size 1 only"
expect_usage "run --dispatch-dtype fp8 --dp-size 2" "--dispatch-dtype fp8 $dp_msg" -- \
  run --model "$FIX" --layer 1 --tokens 4 --dp-size 2 --dispatch-dtype fp8
expect_usage "run --dispatch-dtype bf16 --dp-size 2 --ep-size 2" "--dispatch-dtype bf16 $dp_msg" -- \
  run --model "$FIX" --layer 1 --tokens 4 --dp-size 2 --ep-size 2 --dispatch-dtype bf16
expect_usage "bench --dispatch-dtype fp8 --dp-size 2 --ep-size 2" "--dispatch-dtype fp8 $dp_msg" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --dp-size 2 --ep-size 2 --dispatch-dtype fp8
# --expert-placement without expert parallelism (--ep-size 1, also beside --tp-size or
# --dp-size): it has no meaning there, a usage error rather than ignored.
placement_msg="needs --ep-size > 1"
expect_usage "run --expert-placement round-robin" "--expert-placement round-robin: which experts each expert-parallel rank holds, $placement_msg" -- \
  run --model "$FIX" --layer 1 --tokens 2 --expert-placement round-robin
expect_usage "run --expert-placement round-robin --ep-size 1" "--expert-placement round-robin: which experts each expert-parallel rank holds, $placement_msg, got --ep-size 1 (one rank holds them all; only the default, contiguous, is taken)" -- \
  run --model "$FIX" --layer 1 --tokens 2 --expert-placement round-robin --ep-size 1
expect_usage "run --expert-placement with --tp-size 2" "--expert-placement round-robin: which experts each expert-parallel rank holds, $placement_msg" -- \
  run --model "$FIX" --layer 1 --tokens 2 --expert-placement round-robin --tp-size 2
expect_usage "bench --expert-placement round-robin" "--expert-placement round-robin: which experts each expert-parallel rank holds, $placement_msg" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --expert-placement round-robin
# ... while with --ep-size 2 it is taken (here: the rank-count error of a run without mpirun).
expect_usage "run --expert-placement with --ep-size 2" "--ep-size 2 --tp-size 1 --dp-size 1: expected 2 ranks" -- \
  run --model "$FIX" --layer 1 --tokens 2 --expert-placement round-robin --ep-size 2

# --ep-size other than 1 or --dp-size with --dp-size > 1: a usage error naming both
# options, before any rank builds its groups (under mpirun -np 3 it passed the
# rank-count check and failed on each rank with "ExpertMap: rank: expected in [0, 2)").
expect_usage "run --dp-size 3 --ep-size 2" "--ep-size 2 with --dp-size 3: expected --ep-size 1 (each data-parallel rank holds every expert) or 3" -- \
  run --model "$FIX" --layer 1 --tokens 8 --dp-size 3 --ep-size 2
expect_usage "bench --dp-size 4 --ep-size 2" "--ep-size 2 with --dp-size 4: expected --ep-size 1" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --dp-size 4 --ep-size 2

# A shape that does not fit --memory-fraction even at E = top_k: an error naming the
# option, the bytes needed and the budget, before anything runs (not a claim that it
# was scaled to fit). Mixtral at E = 2 needs 1409286144 bytes in f32: over 0.01 of
# any machine with less than 140 GB.
if python3 -c 'import os, sys; sys.exit(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 100 >= 1409286144)'; then
  expect_error "bench --memory-fraction too small for a shape" "--memory-fraction 0.01 (of " -- \
    bench --memory-fraction 0.01 --shapes mixtral --tokens 1 --min-time 0
  grep -qF "shape 'mixtral' needs 1409286144 bytes even at its fewest experts (E = top_k = 2, the least --max-experts takes), over the budget of" "$TMP/stderr" &&
    ! grep -q "^## mixtral" "$TMP/stdout" ||
    { echo "FAIL bench --memory-fraction too small: message or output"; cat "$TMP/stderr"; failures=$((failures + 1)); }
fi

# bench: a NaN --memory-fraction is refused (CLI::Range lets NaN through).
rc=0
"$BIN" bench --memory-fraction nan --shapes qwen3-cpu --tokens 1 >"$TMP/stdout" 2>"$TMP/stderr" || rc=$?
if [ "$rc" -eq 0 ] || ! grep -qF -- "--memory-fraction" "$TMP/stderr"; then
  echo "FAIL bench --memory-fraction nan (exit $rc)"; cat "$TMP/stderr"; failures=$((failures + 1))
else
  echo "ok   bench --memory-fraction nan: $(cat "$TMP/stderr")"
fi

# bench --backend cuda: CPU-only options are refused before any device is used.
for args in "--dtype f32:--dtype" "--csv $TMP/b.csv:--csv" "--threads 2:--threads" \
  "--no-baseline:--no-baseline" "--seed 7:--seed"; do
  rc=0
  # shellcheck disable=SC2086
  "$BIN" bench --backend cuda --shapes qwen3 --tokens 1 ${args%%:*} >"$TMP/stdout" 2>"$TMP/stderr" || rc=$?
  if [ "$rc" -ne 2 ] || ! grep -qF -- "${args##*:}" "$TMP/stderr" || [ -e "$TMP/b.csv" ]; then
    echo "FAIL bench --backend cuda ${args%%:*} (exit $rc)"; cat "$TMP/stderr"; failures=$((failures + 1))
  else
    echo "ok   bench --backend cuda ${args%%:*}: $(cat "$TMP/stderr")"
  fi
done

# --tokens beyond the memory budget: an error naming --tokens, the most that fit
# and the count given, before anything is allocated or measured (200000 tokens
# were killed by the out-of-memory killer with no message; the budget counted
# the weights alone, not the tokens' activations, intermediates and outputs).
# The largest T counts, in any position; no CSV, no temporary file. (200000
# tokens of qwen3-cpu need ~43 GiB: over --memory-fraction 0.25 below ~170 GiB.)
counts=(1,1000000000000000,16)
python3 -c 'import os, sys; sys.exit(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >= 160 << 30)' &&
  counts+=(200000)
for t in "${counts[@]}"; do
  expect_error "bench --tokens $t beyond the memory budget" "--tokens: expected at most " -- \
    bench --tokens "$t" --shapes qwen3-cpu --max-experts 8 --min-time 0 --no-baseline \
    --csv "$OUTDIR/c.csv"
  big=${t#1,}; big=${big%,16}
  grep -qE -- "--tokens: expected at most [0-9]+ for this machine's memory, got $big \(shape 'qwen3-cpu' takes [0-9.]+ KiB a token .* give fewer --tokens or a larger --memory-fraction$" "$TMP/stderr" &&
    [ ! -s "$TMP/stdout" ] ||
    { echo "FAIL bench --tokens $t: message or output"; cat "$TMP/stdout" "$TMP/stderr"; failures=$((failures + 1)); }
done
# run --tokens T beyond the machine's memory: an error naming --tokens, the most that
# fit and T, before anything is allocated for them (as bench). A count whose input
# alone fits (a quarter of the memory; the experts' routed rows need ~8x more) was
# allocated, filled, and killed by the out-of-memory killer with no message.
quarter=$(python3 -c 'import os; print(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (4 * 4 * 128))')
for t in "$quarter" 1000000000000000 9223372036854775807; do
  expect_error "run --tokens $t beyond the memory" "error: --tokens: expected at most " -- \
    run --model "$FIX" --layer 1 --tokens "$t" --quiet
  grep -qE -- "--tokens: expected at most [0-9]+ tokens for this machine's memory, got $t \([0-9.]+ KiB a token .* beside [0-9.]+ KiB of weights, within [0-9.]+ GiB available memory\); give fewer tokens$" "$TMP/stderr" &&
    [ "$last_rc" -eq 1 ] && [ ! -s "$TMP/stdout" ] ||
    { echo "FAIL run --tokens $t: message, exit code ($last_rc) or output"; cat "$TMP/stdout" "$TMP/stderr"; failures=$((failures + 1)); }
done
# A --csv that cannot be written fails before the benchmark, with the OS reason.
expect_error "bench --csv a directory" "--csv: $OUTDIR: exists and is not a regular file (a directory" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --csv "$OUTDIR"
expect_error "bench --csv in a missing folder" "$TMP/no/such/dir: No such file or directory" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --csv "$TMP/no/such/dir/c.csv"
expect_error "bench --csv \"\"" "--csv: expected a path, got an empty string" -- \
  bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --csv ""
expect_usage "bench --csv with --ep-size" "--csv: not written by the parallel bench" -- \
  bench --ep-size 2 --shapes qwen3-cpu --tokens 1 --csv "$OUTDIR/c.csv"
# --min-time: finite and at most an hour (a measurement also stops at 1000 runs).
for v in inf nan 1e9 -1; do
  expect_usage "bench --min-time $v" "--min-time: expected a decimal number in [0, 3600], got \"$v\"" -- \
    bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time "$v"
done

# bench --backend cuda without a GPU (or without the CUDA backend): an error, as
# `run --backend cuda` gives, not a skipped benchmark with exit code 0.
if ! nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  expect_error "bench --backend cuda without a GPU" "--backend cuda: " -- \
    bench --backend cuda --shapes qwen3 --tokens 1
  expect_error "run --backend cuda without a GPU" "--backend cuda: " -- \
    run --backend cuda --model "$FIX" --layer 1 --tokens 1
fi

# --dump-dir: checked before the benchmark runs, with the OS reason.
expect_error "bench --dump-dir missing" "--dump-dir $TMP/no-dump: No such file or directory" -- \
  bench --backend cuda --shapes qwen3 --tokens 1 --dump-dir "$TMP/no-dump"
expect_error "bench --dump-dir a file" "--dump-dir $FIX/config.json: expected a directory" -- \
  bench --backend cuda --shapes qwen3 --tokens 1 --dump-dir "$FIX/config.json"

# A standard output that cannot be written (a full disk: /dev/full) is an error, exit 1,
# not exit 0 with a cut or empty file (inspect --json > x.json).
if [ -w /dev/full ]; then
  for args in "inspect $FIX --json" "run --model $FIX --layer 1 --tokens 2" "--help" "--version"; do
    rc=0
    # shellcheck disable=SC2086
    "$BIN" $args >/dev/full 2>"$TMP/stderr" || rc=$?
    problem=""
    if [ "$rc" -ne 1 ] || [ "$(wc -l <"$TMP/stderr")" -ne 1 ] ||
      ! grep -q "^fusedmoe: error: the standard output is incomplete: No space left on device$" "$TMP/stderr"; then
      problem="exit $rc"
    fi
    verdict "fusedmoe $args >/dev/full" "$problem"
  done
fi

# ... and leaves no output file: the report reaches the standard output before
# run --output / bench --csv is renamed into place (it used to be written first).
# The same with the standard output closed (>&-): the output's temporary file
# must not take descriptor 1 and receive the report (it did, and exited 0).
stdout_fails() { # $1: full (>/dev/full) or closed (>&-); the rest: the arguments
  local how=$1 rc=0
  shift
  if [ "$how" = full ]; then
    "$BIN" "$@" >/dev/full 2>"$TMP/stderr" || rc=$?
  else
    "$BIN" "$@" >&- 2>"$TMP/stderr" || rc=$?
  fi
  if [ "$rc" -ne 1 ] || ! grep -q "^fusedmoe: error: the standard output is incomplete: " "$TMP/stderr" ||
    [ -n "$(ls -A "$OUTDIR")" ]; then
    echo "FAIL fusedmoe $* (stdout $how): exit $rc, left: $(ls -A "$OUTDIR")"
    sed 's/^/  stderr: /' "$TMP/stderr"
    failures=$((failures + 1))
  else
    echo "ok   fusedmoe $* (stdout $how): exit 1, no file left"
  fi
  rm -rf "${OUTDIR:?}"/* "$OUTDIR"/.[!.]* 2>/dev/null || true
}
for args in "run --model $FIX --layer 1 --tokens 3 --output $OUTDIR/of.safetensors" \
  "bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline --csv $OUTDIR/of.csv"; do
  # shellcheck disable=SC2086
  if [ -w /dev/full ]; then stdout_fails full $args; fi
  # shellcheck disable=SC2086
  stdout_fails closed $args
done
# An existing read-only output (no write bit: root may still write it, and the
# rename ignored the mode) is refused before the work, naming the option; the file
# is kept as it was.
mkdir -p "$TMP/ro"
for c in "run|--output|$TMP/ro/out.safetensors|--model $FIX --layer 1 --tokens 2" \
  "bench|--csv|$TMP/ro/out.csv|--shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline"; do
  IFS='|' read -r cmd flag file rest <<<"$c"
  echo keep >"$file"
  chmod 444 "$file"
  # shellcheck disable=SC2086
  expect_error "$cmd $flag read-only" "$flag: $file: is read-only (mode 0444); will not replace it" -- \
    $cmd $rest $flag "$file"
  [ "$(cat "$file")" = keep ] && [ "$(ls -A "$TMP/ro")" = "$(basename "$file")" ] ||
    { echo "FAIL $cmd $flag read-only: the file was replaced: $(ls -A "$TMP/ro")"; failures=$((failures + 1)); }
  rm -f "$file"
done
# Another user's file is refused before the work, naming why: mode 0644, not
# "read-only" but not writable by this user (both uids); mode 0666 in a sticky
# directory (1777), where only its owner may replace it (the rename failed after
# the work, the report printed). Run as nobody where the tests run as root and su
# lets nobody reach the binary and the model; else said skipped.
owned_dir=$(mktemp -d)
owned="$owned_dir/owned.safetensors"
if [ "$(id -u)" = 0 ] && id nobody >/dev/null 2>&1 && chmod 755 "$owned_dir" &&
  su nobody -s /bin/sh -c "'$BIN' --version && test -r '$FIX/config.json'" >/dev/null 2>&1; then
  for c in "another user's file|755|644|is not writable by this user (uid [0-9]*; the file's owner uid 0, mode 0644)" \
    "another user's file in a sticky directory|1777|666|belongs to another user (uid 0) in a sticky directory ($owned_dir: only a file's owner may replace it)"; do
    IFS='|' read -r what dir_mode file_mode why <<<"$c"
    chmod "$dir_mode" "$owned_dir"
    echo keep >"$owned"
    chmod "$file_mode" "$owned"
    rc=0
    su nobody -s /bin/sh -c "'$BIN' run --model '$FIX' --layer 1 --tokens 2 --output '$owned'" \
      >"$TMP/stdout" 2>"$TMP/stderr" || rc=$?
    problem=""
    if [ "$rc" -ne 1 ] || [ "$(cat "$owned")" != keep ] || [ -s "$TMP/stdout" ] ||
      ! grep -q "^fusedmoe: error: --output: $owned: $why; will not replace it" "$TMP/stderr"; then
      problem="exit $rc, $(wc -l <"$TMP/stdout") lines of report"
    fi
    verdict "run --output $what" "$problem"
  done
else
  echo "skip run --output another user's file (and in a sticky directory): needs root and su to nobody"
fi
rm -rf "$owned_dir"
# A write that fails (a full disk; here the file size limit, ulimit -f 0: fusedmoe
# ignores SIGXFSZ, so the write fails with EFBIG instead of killing it) names the
# option; bench and run still print their whole report (bench printed nothing: the
# CSV's header failed first; run stopped before its summary), then the error, exit
# 1, and no file is left. run's summary has no
# "output" line for the file it did not write. The standard streams are pipes (the
# limit is on files).
for c in "run|--output|$TMP/ro/out.safetensors|--model $FIX --layer 1 --tokens 2|^time " \
  "bench|--csv|$TMP/ro/out.csv|--shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline|^largest peak resident memory"; do
  IFS='|' read -r cmd flag file rest report <<<"$c"
  rc=0
  # shellcheck disable=SC2086
  { (ulimit -f 0; exec "$BIN" $cmd $rest $flag "$file") 2>&1 1>&3 | cat >"$TMP/stderr"; } 3>&1 |
    cat >"$TMP/stdout" || rc=$?
  if [ "$rc" -ne 1 ] ||
    ! grep -q "^fusedmoe: error: $flag: $file: write failed: File too large.* (the report above is complete)$" "$TMP/stderr" ||
    [ "$(wc -l <"$TMP/stderr")" -ne 1 ] || [ -n "$(ls -A "$TMP/ro")" ] ||
    ! grep -q "$report" "$TMP/stdout" || grep -q "^output " "$TMP/stdout"; then
    echo "FAIL $cmd $flag on a full disk: exit $rc, left: $(ls -A "$TMP/ro")"
    sed 's/^/  stderr: /' "$TMP/stderr"
    sed 's/^/  stdout: /' "$TMP/stdout" | tail -3
    failures=$((failures + 1))
  else
    echo "ok   $cmd $flag on a full disk: $(cat "$TMP/stderr")"
  fi
done
rm -rf "$TMP/ro"
# No command at all: an error in lower case as the others (CLI11 said "A subcommand is required").
expect_usage "no command" "error: a command is required: expected inspect, run or bench (see fusedmoe --help)" --

# A weights name that is there but unusable (a directory, a dangling link) is an
# error naming it, for inspect (not "none found", exit 0) and run (not "neither
# model.safetensors nor ..." when the link is there).
mkdir -p "$TMP/dirweights/model.safetensors" "$TMP/dangling"
cp "$FIX/config.json" "$TMP/dirweights/"
cp "$FIX/config.json" "$TMP/dangling/"
ln -s "$TMP/no-such-file" "$TMP/dangling/model.safetensors"
expect_error "inspect: model.safetensors a directory" "model.safetensors: not a regular file (a directory)" -- \
  inspect "$TMP/dirweights"
expect_error "inspect: model.safetensors a dangling link" "dangling/model.safetensors: cannot open" -- \
  inspect "$TMP/dangling"
expect_error "run: model.safetensors a dangling link" "dangling/model.safetensors: cannot open" -- \
  run --model "$TMP/dangling" --layer 1 --tokens 1

# An output name a little under the file system's limit: its temporary's name is
# longer; the error says so instead of blaming the name given.
long=$(printf 'a%.0s' $(seq 1 240)).safetensors
expect_error "--output near NAME_MAX" "bytes: the output's 252 and " -- \
  run --model "$FIX" --layer 1 --tokens 1 --output "$OUTDIR/$long"

# A closed pipe (run ... | head -c 0): the pipe's read end is closed before the run
# starts, so the report's write gets SIGPIPE for certain; the run dies of it
# (exit 141 in a shell) and leaves neither the file nor its temporary.
for args in "run --model $FIX --layer 1 --tokens 3 --output $OUTDIR/of.safetensors" \
  "bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 --no-baseline --csv $OUTDIR/of.csv"; do
  # shellcheck disable=SC2086
  sig=$(python3 - "$BIN" $args <<'PY'
import os, subprocess, sys
r, w = os.pipe()
os.close(r)  # no reader: the first write to w raises SIGPIPE
# restore_signals (the default) gives the child SIGPIPE's default disposition back.
p = subprocess.run(sys.argv[1:], stdout=w, stderr=subprocess.DEVNULL)
print(p.returncode)
PY
  )
  if [ "$sig" != "-13" ] || [ -n "$(ls -A "$OUTDIR")" ]; then
    echo "FAIL fusedmoe $args into a closed pipe: returncode $sig (expected -13, SIGPIPE), left: $(ls -A "$OUTDIR")"
    failures=$((failures + 1))
  else
    echo "ok   fusedmoe $args into a closed pipe: SIGPIPE, no file left"
  fi
  rm -rf "${OUTDIR:?}"/* "$OUTDIR"/.[!.]* 2>/dev/null || true
done

# An unknown command is named, with the valid ones.
expect_error "unknown command" "unknown command 'bogus': expected inspect, run or bench (see" -- bogus
# A command in capitals or misspelt: the nearest one suggested (session 30's trial).
expect_usage "command in capitals" "unknown command 'RUN': expected inspect, run or bench; did you mean run?" -- RUN
expect_usage "misspelt command" "unknown command 'bnch': expected inspect, run or bench; did you mean bench?" -- bnch
expect_usage "command with two letters swapped" "unknown command 'rnu': expected inspect, run or bench; did you mean run?" -- rnu
# An option typed with an em or en dash (a word processor's): named, with the option.
expect_usage "option with an em dash" "'—tokens' starts with an em dash (U+2014), not two hyphens: did you mean --tokens?" -- run —tokens 3
# ... where it took inspect's PATH (the path then named as the extra argument), and
# before the command (session 31's second trial).
expect_usage "inspect option with an em dash before the path" "inspect: unexpected argument '$FIX': expected one PATH; '—json' starts with an em dash (U+2014), not two hyphens: did you mean --json?" -- inspect —json "$FIX"
expect_usage "top-level option with an em dash" "unknown command '—help': expected inspect, run or bench; '—help' starts with an em dash (U+2014), not two hyphens: did you mean --help?" -- —help
# ... and where it took inspect's PATH alone (no such path): the option named.
expect_usage "inspect option with an em dash as the path" "inspect: —help: no such model directory or file; '—help' starts with an em dash (U+2014), not two hyphens: did you mean --help?" -- inspect —help
expect_usage "option with an en dash" "'–seed=2' starts with an en dash (U+2013), not two hyphens: did you mean --seed?" -- run –seed=2
# An option before its command: said so, with the command line in the right order.
expect_usage "an option before the command" "--tokens: an option of run and bench, given before the command; the command comes first, e.g. fusedmoe run --tokens 3 " -- --tokens 3
expect_usage "an option of inspect before it" "--json: an option of inspect, given before the command; the command comes first, e.g. fusedmoe inspect --json $FIX " -- --json "$FIX"
expect_usage "an option before a later command" "--tokens: an option of run and bench, given before the command; the command comes first, e.g. fusedmoe run --tokens 3 --seed 1 " -- --tokens 3 run --seed 1
# An unknown option before the command is named (not blamed on the command).
expect_usage "unknown option before the command" "unknown option --bogus before the command: fusedmoe itself takes only --help and --version" -- --bogus run --tokens 1
expect_usage "unknown short option alone" "unknown option -v before the command" -- -v
expect_usage "-- before the command" "'--' before the command" -- -- run --tokens 1

# --tolerance -0 is 0 (not echoed "-0"); 1e-400 underflows to 0, within the option's
# range, so it is taken as 0; a range without 0 says it underflows.
for v in -0 1e-400; do
  expect_error "--tolerance $v" "relative L2 error" -- run --model "$FIX" --layer 1 --tokens 5 --seed 1 \
    --reference "$REF" --reference-key layers.1.T5.input --tolerance "$v" --output "$TMP/tol.safetensors"
  grep -qF -- "> tolerance 0" "$TMP/stderr" && grep -qF -- "(tolerance 0): FAIL" "$TMP/stdout" ||
    { echo "FAIL --tolerance $v: not read as 0"; cat "$TMP/stdout" "$TMP/stderr"; failures=$((failures + 1)); }
done
expect_usage "bench --memory-fraction 1e-400" "--memory-fraction: expected a decimal number in [0.01, 0.95], got \"1e-400\" (it underflows to 0)" -- \
  bench --shapes qwen3-cpu --tokens 1 --memory-fraction 1e-400
expect_usage "bench --memory-fraction 1e400" "--memory-fraction: expected a decimal number in [0.01, 0.95], got \"1e400\" (beyond the range of a double)" -- \
  bench --shapes qwen3-cpu --tokens 1 --memory-fraction 1e400

# bench at T = 0 has no speedup, share of the roofline nor bound ("-" in the table,
# empty in the CSV); one thread and one tensor are singular.
"$BIN" bench --shapes qwen3-cpu --max-experts 8 --tokens 0 --min-time 0 --threads 1 --csv "$TMP/t0.csv" >"$TMP/stdout" 2>&1 || true
if ! grep -qE '^\| 0 \|.*\| - \| - \|.*\| - \| [0-9.e+-]+ \|$' "$TMP/stdout" || ! grep -q "^- CPU: .*, 1 thread, GEMM" "$TMP/stdout" ||
  ! grep -qE ",0,[0-9.]+,[0-9.e+-]+,[0-9.]+,[0-9.]+,,,.*,,[0-9.e+-]*,0$" "$TMP/t0.csv"; then
  echo "FAIL bench T = 0 speedup / 1 thread"; cat "$TMP/stdout" "$TMP/t0.csv"; failures=$((failures + 1))
else
  echo "ok   bench T = 0: $(grep '^| 0 |' "$TMP/stdout")"
fi
rm -f "$TMP/t0.csv"
python3 - "$TMP/one.safetensors" <<'PY'
import json, struct, sys
h = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + bytes(4))
PY
"$BIN" inspect "$TMP/one.safetensors" | grep -q "^1 tensor, 4 B$" ||
  { echo "FAIL inspect of one tensor: not '1 tensor'"; "$BIN" inspect "$TMP/one.safetensors"; failures=$((failures + 1)); }

# --model: "" is no model (not the bundled one); a .safetensors file stands for
# its model only beside its config.json.
expect_error "--model \"\"" "--model: expected a path, got an empty string" -- run --model "" --tokens 2
mkdir -p "$TMP/weights-only" && cp "$FIX/model.safetensors" "$TMP/weights-only/"
expect_error "--model a .safetensors file without config.json" "$TMP/weights-only/config.json" -- \
  run --model "$TMP/weights-only/model.safetensors" --layer 1 --tokens 2
expect_error "--output \"\"" "--output: expected a path, got an empty string" -- \
  run --model "$FIX" --layer 1 --tokens 2 --output ""
expect_usage "inspect \"\"" "PATH: expected a path, got an empty string" -- inspect ""
expect_error "--input \"\"" "--input: expected a path, got an empty string" -- \
  run --model "$FIX" --layer 1 --input ""
# An empty key is a key given empty, not one left out (trial finding).
expect_error "--input-key \"\"" "--input-key: expected a tensor name, got an empty string" -- \
  run --model "$FIX" --layer 1 --input "$FIX/model.safetensors" --input-key ""
expect_error "--reference-key \"\"" "--reference-key: expected a tensor name, got an empty string" -- \
  run --model "$FIX" --layer 1 --tokens 2 --reference "$FIX/model.safetensors" --reference-key ""

# --input that is no tensor file: named as such, with the OS reason, before any key.
expect_error "--input a directory" "--input $TMP: not a regular file (a directory)" -- \
  run --model "$FIX" --layer 1 --input "$TMP"
# A typed backslash in a quoted argument is written as \\ (a name typed as
# "m\x0ai.npy" read as "m<newline>i.npy" does; session 29's trial).
expect_error "--input with a backslash" "--input $TMP/m\\\\x0ai.npy: cannot open" -- \
  run --model "$FIX" --layer 1 --input "$TMP/m\\x0ai.npy"
expect_error "--input with a newline" "--input $TMP/m\\x0ai.npy: cannot open" -- \
  run --model "$FIX" --layer 1 --input "$TMP/m"$'\n'"i.npy"
expect_error "--input a config.json" "--input $FIX/config.json: neither a .npy file nor a valid .safetensors file" -- \
  run --model "$FIX" --layer 1 --input "$FIX/config.json"
# A damaged safetensors file (its data section cut) is named as one, not as
# "neither a .npy file nor ..." (session 29's trial).
python3 "$ST" write-f32 "$TMP/whole.safetensors" x 2 128
head -c -100 "$TMP/whole.safetensors" >"$TMP/cut-input.safetensors"
expect_error "--input a damaged safetensors" "--input $TMP/cut-input.safetensors: not a valid .safetensors file (" -- \
  run --model "$FIX" --layer 1 --input "$TMP/cut-input.safetensors" --input-key x
head -c 20 "$TMP/whole.safetensors" >"$TMP/cut-header.st"  # cut inside its header
expect_error "--input a safetensors cut in its header" "--input $TMP/cut-header.st: not a valid .safetensors file (" -- \
  run --model "$FIX" --layer 1 --input "$TMP/cut-header.st" --input-key x
expect_error "--input missing (.txt)" "--input $TMP/x.txt: cannot open: No such file or directory" -- \
  run --model "$FIX" --layer 1 --input "$TMP/x.txt"
expect_error "--input missing (.npy)" "--input $TMP/none.npy: cannot open: No such file or directory" -- \
  run --model "$FIX" --layer 1 --input "$TMP/none.npy"
# Malformed .npy headers: named errors, nothing allocated for a shape the data does not fill.
python3 - "$TMP" <<'PY'
import struct, sys
def npy(name, header, data=b"\0" * 512):
    h = header.encode()
    h += b" " * ((64 - (10 + len(h) + 1) % 64) % 64) + b"\n"
    open(f"{sys.argv[1]}/{name}", "wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + data)
npy("unclosed.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 128, }")
npy("negative.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (-1, 128), }")
npy("plus.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (+2, 128), }")
npy("huge.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000, 128), }")
npy("record.npy", "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,), }")
npy("unbraced.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 128), ")
npy("nodict.npy", "'descr': '<f4', 'fortran_order': False, 'shape': (2, 128)}")
npy("overflow.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4611686018427387904), }")
npy("beyond64.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551617, 128), }")
npy("beyond63.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (9223372036854775808, 128), }")
npy("twice.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 128), 'shape': (1, 128)}")
npy("extra.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 128), 'order': 'C'}")
npy("nofortran.npy", "{'descr': '<f4', 'shape': (1, 128)}")
npy("fals.npy", "{'descr': '<f4', 'fortran_order': Fals, 'shape': (1, 128)}")
npy("nocomma.npy", "{'descr': '<f4' 'fortran_order': False, 'shape': (1, 128)}")
h = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 128), }"
open(f"{sys.argv[1]}/v4.npy", "wb").write(b"\x93NUMPY\x04\x00" + struct.pack("<I", len(h)) + h + b"\0" * 512)
# Cut short: after the magic, in the header's length, in the header.
open(f"{sys.argv[1]}/magic.npy", "wb").write(b"\x93NUMPY")
open(f"{sys.argv[1]}/cutlen.npy", "wb").write(b"\x93NUMPY\x02\x00\x76\x00")
open(f"{sys.argv[1]}/cuthdr.npy", "wb").write(b"\x93NUMPY\x01\x00\x76\x00{'descr'")
h = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 128), }".ljust(117) + b"\n"
open(f"{sys.argv[1]}/trailing.npy", "wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + b"\0" * 520)
PY
expect_error ".npy shape unclosed" "error: --input $TMP/unclosed.npy: .npy header: malformed shape" -- \
  run --model "$FIX" --layer 1 --input "$TMP/unclosed.npy"
# ... quoting what stands there without the header's padding (it quoted ~30 spaces).
if grep -q ' $' "$TMP/stderr"; then
  verdict ".npy shape error without the padding" "trailing spaces"
else
  verdict ".npy shape error without the padding" ""
fi
# A header that is no dict: named as such, not read on to a data-length error.
expect_error ".npy header without its closing brace" "error: --input $TMP/unbraced.npy: malformed .npy header: expected a dict {'descr': ..., 'fortran_order': ..., 'shape': (...)}, but it has no closing '}' (header: \"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 128),\")" -- \
  run --model "$FIX" --layer 1 --input "$TMP/unbraced.npy"
expect_error ".npy header without its opening brace" "error: --input $TMP/nodict.npy: malformed .npy header: expected a dict" -- \
  run --model "$FIX" --layer 1 --input "$TMP/nodict.npy"
expect_error ".npy negative size" "error: --input $TMP/negative.npy: .npy header: expected the shape's sizes as non-negative decimal integers (as numpy writes them), got (-1, 128)" -- \
  run --model "$FIX" --layer 1 --input "$TMP/negative.npy"
# numpy writes plain decimal sizes; its reader (ast.literal_eval) would take "+2", the
# strict header reader (README) does not, and says what it takes.
expect_error ".npy size with a sign" "error: --input $TMP/plus.npy: .npy header: expected the shape's sizes as non-negative decimal integers (as numpy writes them), got (+2, 128)" -- \
  run --model "$FIX" --layer 1 --input "$TMP/plus.npy"
expect_error ".npy shape beyond its data" "error: --input $TMP/huge.npy: .npy data shorter than its shape [1000000000000, 128]: 512 bytes" -- \
  run --model "$FIX" --layer 1 --input "$TMP/huge.npy"
# Bytes after the array: an error, as a safetensors file's trailing bytes are (it was read).
expect_error ".npy trailing bytes" "error: --input $TMP/trailing.npy: .npy data longer than its shape [1, 128]: 520 bytes, expected 512" -- \
  run --model "$FIX" --layer 1 --input "$TMP/trailing.npy"
expect_error ".npy shape overflowing 64 bits" "error: --input $TMP/overflow.npy: .npy header: the shape (4611686018427387904, 4611686018427387904) overflows 64 bits" -- \
  run --model "$FIX" --layer 1 --input "$TMP/overflow.npy"
# A size that int64 cannot hold: named as beyond 64 bits (it read "expected non-negative sizes").
expect_error ".npy size beyond 64 bits" "error: --input $TMP/beyond64.npy: .npy header: the size 18446744073709551617 in the shape (18446744073709551617, 128) is beyond 64 bits (2^64 or more)" -- \
  run --model "$FIX" --layer 1 --input "$TMP/beyond64.npy"
expect_error ".npy size beyond int64" "error: --input $TMP/beyond63.npy: .npy header: the size 9223372036854775808 in the shape (9223372036854775808, 128) is beyond the signed 64-bit range (expected at most 2^63 - 1)" -- \
  run --model "$FIX" --layer 1 --input "$TMP/beyond63.npy"
expect_error ".npy structured dtype" "error: --input $TMP/record.npy: .npy structured dtypes (record arrays) are not supported" -- \
  run --model "$FIX" --layer 1 --input "$TMP/record.npy"
# A dtype --input and --reference do not take: the message lists the ones they take (it
# listed the integer and bool codes too, which the option then refused).
python3 - "$TMP" <<'PY'
import sys
for name, descr, size in (("int32", "<i4", 4), ("complex", "<c8", 8)):
    h = ("{'descr': '%s', 'fortran_order': False, 'shape': (1, 128), }" % descr).encode().ljust(117) + b"\n"
    open(f"{sys.argv[1]}/{name}.npy", "wb").write(b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + bytes(128 * size))
PY
for name in int32 complex; do
  descr=$([ $name = int32 ] && echo "<i4" || echo "<c8")
  expect_error ".npy $name --input" "error: --input $TMP/$name.npy: .npy dtype '$descr' not supported (expected f2, f4 or f8, little- or big-endian)" -- \
    run --model "$FIX" --layer 1 --input "$TMP/$name.npy"
  expect_error ".npy $name --reference" "error: --reference $TMP/$name.npy: .npy dtype '$descr' not supported (expected f2, f4 or f8, little- or big-endian)" -- \
    run --model "$FIX" --layer 1 --tokens 1 --reference "$TMP/$name.npy"
done
rm -f "$TMP/int32.npy" "$TMP/complex.npy"
# The header's dict is read entry by entry: a key given twice (numpy takes the last
# value, this reader took the first), a key numpy does not know, a missing key, a value
# or separator out of place: each an error naming it (all but the first were read on as
# if the header were right); another format version is named, not read as version 2.
expect_error ".npy key given twice" "error: --input $TMP/twice.npy: .npy header: key 'shape' given more than once" -- \
  run --model "$FIX" --layer 1 --input "$TMP/twice.npy"
expect_error ".npy unknown key" "error: --input $TMP/extra.npy: .npy header: unexpected key 'order' (expected 'descr', 'fortran_order' and 'shape')" -- \
  run --model "$FIX" --layer 1 --input "$TMP/extra.npy"
expect_error ".npy without fortran_order" "error: --input $TMP/nofortran.npy: .npy header has no 'fortran_order'" -- \
  run --model "$FIX" --layer 1 --input "$TMP/nofortran.npy"
expect_error ".npy fortran_order neither True nor False" "error: --input $TMP/fals.npy: malformed .npy header: expected True or False for 'fortran_order' at byte 34 of the header, got \"Fals, 'shape': (1, 128)}" -- \
  run --model "$FIX" --layer 1 --input "$TMP/fals.npy"
printf '\x93NUMPY\x01\x00\x10\x00{garbage}      \n' >"$TMP/garbage.npy"
expect_error ".npy header's newline written as \\x0a" "error: --input $TMP/garbage.npy: malformed .npy header: expected a quoted key at byte 1 of the header, got \"garbage}      \\x0a\"" -- \
  run --model "$FIX" --layer 1 --input "$TMP/garbage.npy"
expect_error ".npy entries without a comma" "error: --input $TMP/nocomma.npy: malformed .npy header: expected ',' or '}' after the value of 'descr' at byte 16" -- \
  run --model "$FIX" --layer 1 --input "$TMP/nocomma.npy"
expect_error ".npy format version 4.0" "error: --input $TMP/v4.npy: .npy format version 4.0 not supported (expected 1.0, 2.0 or 3.0)" -- \
  run --model "$FIX" --layer 1 --input "$TMP/v4.npy"
# A file cut short before its data: named as truncated, with the size it has and needs (a
# file cut right after its magic was reported as "bad magic").
expect_error ".npy cut after its magic" "error: --input $TMP/magic.npy: truncated .npy file: 6 bytes, expected at least 10 (the 6-byte magic, the 2-byte format version and the header's length; nothing follows the magic)" -- \
  run --model "$FIX" --layer 1 --input "$TMP/magic.npy"
expect_error ".npy cut in its header length" "error: --input $TMP/cutlen.npy: truncated .npy file: 10 bytes, expected at least 12 (the magic, the format version and the 4-byte header length of version 2.0)" -- \
  run --model "$FIX" --layer 1 --input "$TMP/cutlen.npy"
# A zip archive (numpy.savez's .npz) is named as one, not by the "header length" its
# first bytes make (session 30's trial).
printf 'PK\x03\x04\x14\x00\x00\x00\x00\x00' >"$TMP/arrays.npz"
expect_error ".npz as --input" "error: --input $TMP/arrays.npz: a zip archive (numpy.savez's .npz or a torch.save file), not a .npy or .safetensors file" -- \
  run --model "$FIX" --layer 1 --input "$TMP/arrays.npz"
expect_error ".npy --reference cut in its header" "error: --reference $TMP/cuthdr.npy: truncated .npy file: 18 bytes, expected at least 128 (the 10-byte preamble and the 118-byte header it announces)" -- \
  run --model "$FIX" --layer 1 --tokens 2 --reference "$TMP/cuthdr.npy"
expect_error "--input .safetensors without --input-key" "--input-key is required with a .safetensors file" -- \
  run --model "$FIX" --layer 1 --input "$REF"
# The reader's errors name the option whose file it is, as the others do (they
# began with the path alone).
expect_error ".npy --reference format version 4.0" "error: --reference $TMP/v4.npy: .npy format version 4.0 not supported" -- \
  run --model "$FIX" --layer 1 --input "$REF" --input-key layers.1.T64.input --reference "$TMP/v4.npy"

# --output through a symbolic link to a missing file: refused (README), nothing created.
ln -s "$TMP/missing-target.safetensors" "$OUTDIR/dangling.safetensors"
rc=0
"$BIN" run --model "$FIX" --layer 1 --tokens 2 --output "$OUTDIR/dangling.safetensors" \
  >"$TMP/stdout" 2>"$TMP/stderr" || rc=$?
if [ "$rc" -ne 1 ] || ! grep -qF "symbolic link to a missing file" "$TMP/stderr" ||
  [ -e "$TMP/missing-target.safetensors" ] || [ "$(ls -A "$OUTDIR")" != dangling.safetensors ]; then
  echo "FAIL --output a dangling symbolic link (exit $rc)"; cat "$TMP/stderr"; failures=$((failures + 1))
else
  echo "ok   --output a dangling symbolic link: $(cat "$TMP/stderr")"
fi
rm -f "$OUTDIR/dangling.safetensors"
# --output /dev/stdout with stdout a pipe: a link to a FIFO, refused as one (it was
# "symbolic link to a missing file", the pipe having no path).
{
  rc=0
  "$BIN" run --model "$FIX" --layer 1 --tokens 2 --output /dev/stdout 2>"$TMP/stderr" || rc=$?
  echo "$rc" >"$TMP/rc"
} | cat >/dev/null
rc=$(cat "$TMP/rc")
if [ "$rc" -ne 1 ] ||
  ! grep -qF -- "--output: /dev/stdout: exists and is not a regular file (a device, FIFO or socket" "$TMP/stderr"; then
  echo "FAIL --output /dev/stdout to a pipe (exit $rc)"; cat "$TMP/stderr"; failures=$((failures + 1))
else
  echo "ok   --output /dev/stdout to a pipe: $(cat "$TMP/stderr")"
fi
# --output in a folder that does not exist: an error naming --output before the
# layer runs (the temporary is created first; it used to fail after the work),
# and nothing left behind.
expect_error "--output in a missing folder" "--output: $OUTDIR/nodir/o.safetensors: cannot create a temporary file in $OUTDIR/nodir" -- \
  run --model "$FIX" --layer 1 --tokens 2 --output "$OUTDIR/nodir/o.safetensors"
grep -q "^time " "$TMP/stdout" 2>/dev/null && { echo "FAIL --output in a missing folder: the layer ran first"; failures=$((failures + 1)); }
[ -z "$(ls -A "$OUTDIR")" ] || { echo "FAIL --output in a missing folder: left $(ls -A "$OUTDIR")"; failures=$((failures + 1)); }

# Absurd sizes in config.json: an error naming the field and value, not "out of memory".
for field in n_routed_experts moe_intermediate_size hidden_size; do
  mkdir -p "$TMP/huge-$field" && cp "$FIX/model.safetensors" "$TMP/huge-$field/"
  python3 - "$FIX/config.json" "$TMP/huge-$field/config.json" "$field" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
assert sys.argv[3] in c
c[sys.argv[3]] = 100000000000
json.dump(c, open(sys.argv[2], "w"))
PY
  expect_error "config.json $field = 1e11" "field '$field': expected <= " -- \
    run --model "$TMP/huge-$field" --layer 1 --tokens 2
  expect_error "inspect: config.json $field = 1e11" "got 100000000000" -- inspect "$TMP/huge-$field"
done

# inspect on a FIFO or a symbolic link to a device: named as run names them.
mkfifo "$TMP/config-fifo.json"
ln -s /dev/zero "$TMP/zero-link.json"
for p in "$TMP/config-fifo.json:a FIFO" "$TMP/zero-link.json:a device or socket"; do
  expect_error "inspect ${p##*:}" "${p%%:*}: not a regular file (${p##*:})" -- inspect "${p%%:*}"
  expect_error "run --model ${p##*:}" "${p%%:*}: not a regular file (${p##*:})" -- \
    run --model "${p%%:*}" --tokens 1
done

# The summary quotes an --output path with a newline as \x0a, on one line.
"$BIN" run --model "$FIX" --layer 1 --tokens 2 --quiet --output "$TMP/o"$'\n'"ut.safetensors" \
  >"$TMP/stdout" 2>"$TMP/stderr"
if ! grep -qxF "output         $TMP/o\x0aut.safetensors (output, topk_ids, topk_weights, router_logits)" \
  "$TMP/stdout" || grep -q "^ut.safetensors" "$TMP/stdout"; then
  echo "FAIL --output with a newline in the summary:"; cat "$TMP/stdout"; failures=$((failures + 1))
else
  echo "ok   --output with a newline in the summary"
fi

# inspect fails cleanly too.
rc=0
"$BIN" inspect "$TMP/unknown" >/dev/null 2>"$TMP/stderr" || rc=$?
if [ "$rc" -eq 0 ] || [ "$rc" -ge 128 ] || [ "$(wc -l <"$TMP/stderr")" -ne 1 ]; then
  echo "FAIL inspect of an unknown model_type (exit $rc)"; cat "$TMP/stderr"; failures=$((failures + 1))
fi

[ "$failures" -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "all error cases ok"
