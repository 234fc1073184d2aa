#!/usr/bin/env bash
# `mpirun fusedmoe run/bench` with ranks that do not fit together: a clear
# error on the ranks, exit code 2 (a usage error), before any collective that
# could misbehave, and never a hang, a crash or a silently wrong output.
#   - options that differ between ranks (MPMD `-np 1 A : -np 1 B`): the error
#     names the option and each rank's value; so do input files that differ
#     under one path (per-rank working directories);
#   - a world size that the parallel sizes do not account for (also -np 2
#     without --ep-size: not two separate runs writing the same file);
#   - FUSEDMOE_COMM_TIMEOUT_S out of range or not plain decimal.
# Usage: bash cli_ranks.sh MPIEXEC "PRE_FLAGS" NP_FLAG FUSEDMOE_BIN
set -uo pipefail
mpiexec=$1; pre=$2; npflag=$3; BIN=$4
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export FUSEDMOE_COMM_TIMEOUT_S=20
fail=0

# expect_error WANT_RC PATTERN MIN_LINES -- MPIRUN ARGS...: mpirun exits
# WANT_RC, at least MIN_LINES ranks print "fusedmoe: error: rank R: <PATTERN>",
# no rank crashes, and no output file is written.
expect_error() {
  local want_rc=$1 pattern=$2 min_lines=$3; shift 4
  rm -f "$TMP/out.safetensors"
  timeout 100 "$@" >"$TMP/log" 2>&1
  local rc=$?
  local lines
  lines=$(grep -cE "^fusedmoe: error: rank [0-9]+: $pattern" "$TMP/log")
  if [ "$rc" -ne "$want_rc" ] || [ "$lines" -lt "$min_lines" ] ||
     grep -qE "Signal|signal [0-9]|free\(\)|Segmentation" "$TMP/log" ||
     [ -e "$TMP/out.safetensors" ]; then
    echo "FAIL (rc $rc, want $want_rc; $lines error lines, want >= $min_lines): $*"
    cat "$TMP/log"; fail=1
  else
    echo "ok: $(grep -m1 -E "^fusedmoe: error: rank [0-9]+: $pattern" "$TMP/log")"
  fi
}

M="$mpiexec $pre"
R="$BIN run --seed 7 --quiet --output $TMP/out.safetensors"
disagree='fusedmoe run: the ranks disagree on'
# Each of these crashed (heap corruption, segfault) or wrote a wrong output.
expect_error 2 "$disagree --tokens: 8 on rank 0, 16 on rank 1 \(every rank" 2 -- \
  $M "$npflag" 1 $R --tokens 8 --ep-size 2 : "$npflag" 1 $R --tokens 16 --ep-size 2
expect_error 2 "$disagree --tokens: 8 on rank 0, 16 on rank 1" 2 -- \
  $M "$npflag" 1 $R --tokens 8 --tp-size 2 : "$npflag" 1 $R --tokens 16 --tp-size 2
expect_error 2 "$disagree --compute-dtype: bf16 on rank 0, f32 on rank 1" 2 -- \
  $M "$npflag" 1 $R --tokens 8 --ep-size 2 --compute-dtype bf16 : "$npflag" 1 $R --tokens 8 --ep-size 2
expect_error 2 "$disagree --dispatch-dtype: f32 on rank 0, fp8 on rank 1" 2 -- \
  $M "$npflag" 1 $R --tokens 8 --ep-size 2 --dispatch-dtype f32 : \
  "$npflag" 1 $R --tokens 8 --ep-size 2 --dispatch-dtype fp8
expect_error 2 "$disagree --layer: 1 on rank 0, 2 on rank 1" 2 -- \
  $M "$npflag" 1 $R --tokens 16 --layer 1 --ep-size 2 : "$npflag" 1 $R --tokens 16 --layer 2 --ep-size 2
expect_error 2 "$disagree --expert-placement: contiguous on rank 0, round-robin on rank 1" 2 -- \
  $M "$npflag" 1 $R --tokens 16 --ep-size 2 : \
  "$npflag" 1 $R --tokens 16 --ep-size 2 --expert-placement round-robin
expect_error 2 "$disagree --output: .*out.safetensors on rank 0, \(not given\) on rank 1" 2 -- \
  $M "$npflag" 1 $R --tokens 8 --ep-size 2 : "$npflag" 1 "$BIN" run --seed 7 --quiet --tokens 8 --ep-size 2
# One path, other data (node-local files): was a silently wrong output.
mkdir -p "$TMP/w0" "$TMP/w1"
"$BIN" run --tokens 4 --seed 1 --quiet --output "$TMP/w0/in.safetensors" >/dev/null 2>&1
"$BIN" run --tokens 4 --seed 2 --quiet --output "$TMP/w1/in.safetensors" >/dev/null 2>&1
expect_error 2 "$disagree --input contents: [0-9]+ bytes, FNV-1a [0-9a-f]+ on rank 0, [0-9]+ bytes, FNV-1a [0-9a-f]+ on rank 1" 2 -- \
  $M "$npflag" 1 -wdir "$TMP/w0" "$BIN" run --quiet --output "$TMP/out.safetensors" \
  --input in.safetensors --input-key output --ep-size 2 : \
  "$npflag" 1 -wdir "$TMP/w1" "$BIN" run --quiet --output "$TMP/out.safetensors" \
  --input in.safetensors --input-key output --ep-size 2
expect_error 2 "fusedmoe bench: the ranks disagree on --tokens: 1 on rank 0, 2 on rank 1" 2 -- \
  $M "$npflag" 1 "$BIN" bench --ep-size 2 --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0 : \
  "$npflag" 1 "$BIN" bench --ep-size 2 --shapes qwen3-cpu --max-experts 8 --tokens 2 --min-time 0

# World size vs parallel sizes, checked before MPI starts: this hung (rank 1
# waited in MPI_Init for rank 0, which never initialised MPI).
sizes='--ep-size 1 --tp-size 1 --dp-size 1: expected 1 rank, but the MPI launcher started 2 \(mpirun -np 2\)'
expect_error 2 "$sizes" 1 -- \
  $M "$npflag" 1 $R --tokens 8 : "$npflag" 1 $R --tokens 8 --ep-size 2
expect_error 2 "$sizes" 1 -- $M "$npflag" 2 $R --tokens 8
expect_error 2 "$sizes" 1 -- \
  $M "$npflag" 2 "$BIN" bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --min-time 0
expect_error 2 "--ep-size 3 --tp-size 1 --dp-size 1: expected 3 ranks, but the MPI launcher started 2" 1 -- \
  $M "$npflag" 2 $R --tokens 8 --ep-size 3

# A timeout beyond the clock's range timed out at once ("after 1e+10 s"); one
# not plain decimal was taken (" 16", 0x10). Usage errors, before any collective.
for v in 1e10 " 16" 0x10; do
  expect_error 2 "FUSEDMOE_COMM_TIMEOUT_S: expected a decimal number of seconds in \\(0, 1e\\+09\\], got \"$v\"" 1 -- \
    env FUSEDMOE_COMM_TIMEOUT_S="$v" $M "$npflag" 2 $R --tokens 8 --ep-size 2
done

# The same options everywhere still run (and rank 0 writes the output).
rm -f "$TMP/out.safetensors"
if ! $M "$npflag" 2 $R --tokens 8 --ep-size 2 >"$TMP/log" 2>&1 || [ ! -s "$TMP/out.safetensors" ]; then
  echo "FAIL: the matching run"; cat "$TMP/log"; fail=1
fi
exit $fail
