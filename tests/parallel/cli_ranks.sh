#!/usr/bin/env bash
# `mpirun fusedmoe run/bench` with ranks that do not fit together: a clear
# error on the ranks, exit code 2 (a usage error), before any collective that
# could misbehave, and never a hang, a crash or a silently wrong output.
#   - options that differ between ranks (MPMD `-np 1 A : -np 1 B`): the error
#     names the option and each rank's value; so do input files and layer
#     weights that differ under one path (per-rank working directories);
#   - a world size that the parallel sizes do not account for (also -np 2
#     without --ep-size: not two separate runs writing the same file);
#   - FUSEDMOE_COMM_TIMEOUT_S out of range or not plain decimal (on every
#     rank, or on one: each rank says why it stopped);
#   - ranks that run different commands (--help, inspect, --version beside
#     run / bench; run beside bench) or whose command lines do not parse;
#   - an error on one rank only, before the run or during it: the job ends at
#     once (well under the timeout) with that rank's exit code, and token
#     numbers in errors are positions in the whole input.
# Usage: bash cli_ranks.sh MPIEXEC "PRE_FLAGS" NP_FLAG FUSEDMOE_BIN
set -uo pipefail
mpiexec=$1; pre=$2; npflag=$3; BIN=$4
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export FUSEDMOE_COMM_TIMEOUT_S=20
fail=0

# expect_error WANT_RC PATTERN MIN_LINES -- MPIRUN ARGS...: mpirun exits
# WANT_RC within 15 s (no rank waits out the 20 s timeout), at least MIN_LINES
# ranks print "fusedmoe: error: rank R: <PATTERN>", no rank crashes, and no
# output file is written.
expect_error() {
  local want_rc=$1 pattern=$2 min_lines=$3; shift 4
  rm -f "$TMP/out.safetensors"
  local t0=$SECONDS
  timeout 100 "$@" >"$TMP/log" 2>&1
  local rc=$? took=$((SECONDS - t0))
  local lines
  lines=$(grep -cE "^fusedmoe: error: rank [0-9]+: $pattern" "$TMP/log")
  if [ "$rc" -ne "$want_rc" ] || [ "$lines" -lt "$min_lines" ] || [ "$took" -ge 15 ] ||
     grep -qE "Signal|signal [0-9]|free\(\)|Segmentation" "$TMP/log" ||
     [ -e "$TMP/out.safetensors" ]; then
    echo "FAIL (rc $rc, want $want_rc; $lines error lines, want >= $min_lines; $took s): $*"
    cat "$TMP/log"; fail=1
  else
    echo "ok: $(grep -m1 -E "^fusedmoe: error: rank [0-9]+: $pattern" "$TMP/log")"
  fi
}

# no_abort WHAT: the last expect_error's job ended without MPI_Abort.
no_abort() {
  if grep -q "MPI_ABORT" "$TMP/log"; then
    echo "FAIL $1: ended in MPI_Abort"; cat "$TMP/log"; fail=1
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
# The file missing on one rank: that rank's own error (exit 1), the other "not
# run" (it was reported as a disagreement with "(unreadable)", exit 2).
mkdir -p "$TMP/w2"
expect_error 1 "--input in.safetensors: cannot open: No such file or directory" 1 -- \
  $M "$npflag" 1 -wdir "$TMP/w0" "$BIN" run --quiet --output "$TMP/out.safetensors" \
  --input in.safetensors --input-key output --ep-size 2 : \
  "$npflag" 1 -wdir "$TMP/w2" "$BIN" run --quiet --output "$TMP/out.safetensors" \
  --input in.safetensors --input-key output --ep-size 2
grep -qE "^fusedmoe: error: rank 0: not run: rank 1 stopped with an error" "$TMP/log" ||
  { echo "FAIL missing input on rank 1: rank 0 did not say 'not run'"; cat "$TMP/log"; fail=1; }
no_abort "missing input on one rank"
# One --model path, one config.json, other weights (node-local checkpoints of the same
# shapes): ran silently. The ranks compare a sampled hash of each tensor they all load
# whole: the router and the shared experts (--ep-size), the routed experts too
# (--dp-size without --ep-size / --tp-size); every rank names the first that differs.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODEL=$("$BIN" --help | sed -n 's/^Bundled model: //p')
mkdir -p "$TMP/d0/m" "$TMP/d1/m"
cp "$MODEL/config.json" "$MODEL/model.safetensors" "$TMP/d0/m/"
cp "$MODEL/config.json" "$TMP/d1/m/"
hash='sampled FNV-1a [0-9a-f]{16}'
for case in "layers.1.mlp.gate.weight|gate_weight \(the router\): bf16 \[16, 128\]|--ep-size 2" \
  "layers.1.mlp.shared_experts.up_proj|shared_experts.w13: bf16 \[1, 96, 128\]|--ep-size 2" \
  "layers.1.mlp.experts.3.up_proj|experts.w13: bf16 \[16, 96, 128\]|--dp-size 2"; do
  IFS="|" read -r tensor what sizes <<<"$case"
  python3 "$HERE/../cli/st_util.py" corrupt negate "$MODEL/model.safetensors" \
    "$TMP/d1/m/model.safetensors" "$tensor" >/dev/null
  # shellcheck disable=SC2086
  expect_error 2 "$disagree the weights of layer 1 as loaded, $what, $hash on rank 0, .*, $hash on rank 1 .*; the ranks read different checkpoints under --model m \(with the same config.json\): give every rank the same files" 2 -- \
    $M "$npflag" 1 -wdir "$TMP/d0" $R --model m --tokens 8 $sizes : \
    "$npflag" 1 -wdir "$TMP/d1" $R --model m --tokens 8 $sizes
  no_abort "different weights ($tensor)"
done
rm -rf "$TMP/d0" "$TMP/d1"
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

# Open MPI's size variable set by hand, no mpirun (a trial finding: "expected 2
# ranks, got 1" contradicted the launcher size believed before): the error
# says the environment and MPI disagree.
if "$mpiexec" --version 2>&1 | grep -qiE "open ?mpi|openrte|open-mpi"; then
  expect_error 2 "the environment says an MPI launcher started 2 ranks .*, but MPI started 1" 1 -- \
    env OMPI_COMM_WORLD_SIZE=2 $R --tokens 8 --ep-size 2
  # ... and with sizes for one rank, checked before MPI starts: the variable is
  # named as the source of the count (session 27's trial).
  expect_error 2 ".*: expected 1 rank, but the environment says an MPI launcher started 2 \(OMPI_COMM_WORLD_SIZE, PMI_SIZE or SLURM_STEP_NUM_TASKS\): without an MPI launcher, run without those variables; under mpirun -np 2, run one rank" 1 -- \
    env OMPI_COMM_WORLD_SIZE=2 $R --tokens 8
fi

# The hint names sizes that fit the options given (it said --ep-size 2 to
# --ep-size 2 --tp-size 2, and --ep-size 3 to --tp-size 2 on 3 ranks).
expect_error 2 "--ep-size 2 --tp-size 2 --dp-size 1: expected 4 ranks, .*; start 4 ranks \(mpirun -np 4\), or give sizes for 2 ranks .*, e\.g\. --ep-size 1 --tp-size 2\$" 1 -- \
  $M "$npflag" 2 $R --tokens 8 --ep-size 2 --tp-size 2
expect_error 2 "--ep-size 1 --tp-size 2 --dp-size 1: expected 2 ranks, .*, e\.g\. --tp-size 3\$" 1 -- \
  $M "$npflag" 3 $R --tokens 8 --tp-size 2
expect_error 2 "--ep-size 2 --tp-size 1 --dp-size 2: expected 2 ranks, .*, e\.g\. --ep-size 2 --tp-size 2 --dp-size 2\$" 1 -- \
  $M "$npflag" 4 $R --tokens 8 --ep-size 2 --dp-size 2

# A GPU-only misuse under mpirun: every rank's usage error, on any machine (it said
# "no CUDA device found" on one without a GPU).
expect_error 2 "--dispatch-dtype bf16 with --compute-dtype f16: with --backend cuda the experts take f16 inputs" 2 -- \
  $M "$npflag" 2 $R --tokens 8 --ep-size 2 --backend cuda --compute-dtype f16 --dispatch-dtype bf16
# A machine (or a build) without a GPU fails alike on every rank: each rank
# prints the error and exits 1, no MPI_Abort (the device was looked for after
# the ranks' collectives began, and a failing rank ended the job with
# MPI_Abort, on most runs). Three runs: the abort was a race.
if ! nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  for i in 1 2 3; do
    expect_error 1 "--backend cuda: (no CUDA device found|this build of fusedmoe has no CUDA backend)\$" 2 -- \
      $M "$npflag" 2 $R --tokens 8 --ep-size 2 --backend cuda --dispatch-dtype fp8
    no_abort "--backend cuda without a GPU, run $i"
  done
fi
# ... and with the f16 compute of an f16 checkpoint (its config.json's dtype; checked
# once it is read, still before any device).
F16="$TMP/f16"
mkdir -p "$F16"
BUNDLED=$("$BIN" --help | sed -n 's/^Bundled model: //p')
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["dtype"] = "float16"; json.dump(c, open(sys.argv[2], "w"))' \
  "$BUNDLED/config.json" "$F16/config.json"
cp "$BUNDLED/model.safetensors" "$F16/"
expect_error 2 "--dispatch-dtype bf16: with --backend cuda the experts of .*/f16 compute in f16 \(an f16 checkpoint, no --compute-dtype given\); expected --dispatch-dtype auto \(f16 records\) or fp8, or --compute-dtype bf16" 2 -- \
  $M "$npflag" 2 $R --model "$F16" --tokens 8 --ep-size 2 --backend cuda --dispatch-dtype bf16
rm -rf "$F16"

# Ranks that run different commands: a usage error naming each rank's, not a
# hang (--help, --version and inspect never started MPI: the other rank waited
# in MPI_Init) nor a --model disagreement (run beside bench).
for cmd in "--help" "--version" "inspect"; do
  args=$cmd; [ "$cmd" = inspect ] && args="inspect $TMP"
  expect_error 2 "the ranks ran different commands: $cmd on rank 0, run on rank 1 \(every rank" 2 -- \
    $M "$npflag" 1 "$BIN" $args : "$npflag" 1 $R --tokens 8 --ep-size 2
done
expect_error 2 "the ranks ran different commands: run --help on rank 0, bench on rank 1 " 2 -- \
  $M "$npflag" 1 "$BIN" run --help : "$npflag" 1 "$BIN" bench --ep-size 2 --tokens 1
expect_error 2 "the ranks ran different commands: run on ranks 0,2, bench on rank 1 " 3 -- \
  $M "$npflag" 1 $R --tokens 8 --ep-size 3 : "$npflag" 1 "$BIN" bench --ep-size 3 --tokens 1 : \
  "$npflag" 1 $R --tokens 8 --ep-size 3
# A command line that does not parse on one rank: that rank prints its error
# (it printed nothing: only rank 0 printed argument errors), the other says why
# it did not run.
expect_error 2 'run --tokens: expected .*x' 1 -- \
  $M "$npflag" 1 $R --tokens 8 --ep-size 2 : "$npflag" 1 $R --tokens x --ep-size 2
grep -qE '^fusedmoe: error: rank 1: run --tokens: expected' "$TMP/log" &&
  grep -qE '^fusedmoe: error: rank 0: not run: the command line of rank 1 does not parse' "$TMP/log" ||
  { echo "FAIL: rank 1's parse error, rank 0's note"; cat "$TMP/log"; fail=1; }
# The same one on every rank: every rank prints it, with its rank.
expect_error 2 'run --ep-size: expected .*0' 2 -- \
  $M "$npflag" 2 $R --tokens 8 --ep-size 0

# During the run (a bad token among rank 1's rows): rank 1 prints its error
# and the job ends with its exit code (rank 0 waited out the timeout in
# all_to_all_v, then blamed rank 1); the token is the one of the whole input
# (it was the index among rank 1's rows: 1 of 4, not 5 of 8).
# A NaN in the --input file is named from the file itself, before the run, by
# every rank (each reads the whole input), at its token in the whole input.
H=$("$BIN" run --tokens 1 --seed 1 --quiet | sed -n 's/.* H \([0-9]*\),.*/\1/p')
# write_npy FILE H ROW VALUES...: [8, H] f32, 0.5 but row ROW starts with VALUES
# (repeated over the row when the last one is "...").
write_npy() {
  python3 - "$@" <<'PY'
import struct, sys
path, H, row = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
repeat = sys.argv[-1] == "..."
vals = [float(v) for v in sys.argv[4:len(sys.argv) - repeat]]
data = [0.5] * (8 * H)
for c in range(H if repeat else len(vals)):
    data[row * H + c] = vals[c % len(vals)]
hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (8, %d), }" % H
hdr += " " * (63 - (10 + len(hdr)) % 64) + "\n"
with open(path, "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode())
    f.write(struct.pack("<%df" % len(data), *data))
PY
}
write_npy "$TMP/nan.npy" "$H" 5 0.5 0.5 nan
write_npy "$TMP/big.npy" "$H" 5 0.5 0.5 3e38 3e38
write_npy "$TMP/nanlogits.npy" "$H" 5 3e38 -3e38 ...
RI="$BIN run --quiet --output $TMP/out.safetensors --ep-size 2 --input"
expect_error 1 '--input .*nan.npy: expected finite values, got NaN at token 5, column 2$' 1 -- \
  $M "$npflag" 2 $RI "$TMP/nan.npy"
expect_error 1 '--input .*big.npy: the layer.s output has a non-finite value at token 5, column 0 ' 1 -- $M "$npflag" 2 $RI "$TMP/big.npy"
# (finite inputs whose gate GEMM overflows: the logits are the layer's own, named so)
expect_error 1 '--input .*nanlogits.npy: the router logits computed from it and the model.s gate weights: expected no NaN, got NaN at token 5, expert [0-9]+ \(of 8 tokens ' 1 -- \
  $M "$npflag" 2 $RI "$TMP/nanlogits.npy"
# An error on one rank only, before the run: the others stop at their first
# collective with the same exit code and say why.
cp "$TMP/big.npy" "$TMP/in1.npy"
expect_error 2 '--output .*in1.npy: is the same file as --input' 1 -- \
  $M "$npflag" 1 $RI "$TMP/big.npy" : "$npflag" 1 "$BIN" run --quiet --ep-size 2 \
  --input "$TMP/in1.npy" --output "$TMP/in1.npy"
grep -qE '^fusedmoe: error: rank 0: not run: rank 1 stopped with an error' "$TMP/log" ||
  { echo "FAIL: rank 0 does not say why it stopped"; cat "$TMP/log"; fail=1; }
# DP: rank 1 runs rows 4..7 there too.
expect_error 1 '--input .*nan.npy: expected finite values, got NaN at token 5, column 2$' 1 -- \
  $M "$npflag" 2 $RI "$TMP/nan.npy" --dp-size 2
# An error on rank 0 after the ranks' last collective (the reference check):
# its own exit code, no other rank left waiting.
write_npy "$TMP/half.npy" "$H" 0 0.5
write_npy "$TMP/ref.npy" "$H" 0 1 ...
expect_error 1 'output differs from reference .*ref.npy: relative L2 error' 1 -- \
  $M "$npflag" 2 "$BIN" run --quiet --ep-size 2 --input "$TMP/half.npy" --reference "$TMP/ref.npy"
grep -q "MPI_ABORT" "$TMP/log" && { echo "FAIL: MPI_Abort after the last collective"; cat "$TMP/log"; fail=1; }

# A timeout beyond the clock's range timed out at once ("after 1e+10 s"); one
# not plain decimal was taken (" 16", 0x10). Usage errors, before any collective.
for v in 1e10 " 16" 0x10; do
  expect_error 2 "FUSEDMOE_COMM_TIMEOUT_S: expected a decimal number of seconds in \\(0, 1e\\+09\\], got \"$v\"" 1 -- \
    env FUSEDMOE_COMM_TIMEOUT_S="$v" $M "$npflag" 2 $R --tokens 8 --ep-size 2
done

# FUSEDMOE_EP_TRANSPORT not auto, nccl or peer: checked where FUSEDMOE_COMM_TIMEOUT_S is,
# on the CPU backend too (it was ignored there): a usage error on every rank, exit 2,
# before any collective.
for v in bogus Peer; do
  expect_error 2 "FUSEDMOE_EP_TRANSPORT: expected auto, nccl or peer, got '$v'\$" 2 -- \
    env FUSEDMOE_EP_TRANSPORT="$v" $M "$npflag" 2 $R --tokens 8 --ep-size 2
  no_abort "FUSEDMOE_EP_TRANSPORT=$v"
done
# ... on one rank only: that rank's error, the other stops ("not run"), exit 2.
expect_error 2 "FUSEDMOE_EP_TRANSPORT: expected auto, nccl or peer, got 'bogus'\$" 1 -- \
  $M "$npflag" 1 $R --tokens 8 --ep-size 2 : "$npflag" 1 env FUSEDMOE_EP_TRANSPORT=bogus $R --tokens 8 --ep-size 2
grep -qE "^fusedmoe: error: rank 0: not run: rank 1 stopped with an error" "$TMP/log" ||
  { echo "FAIL: FUSEDMOE_EP_TRANSPORT=bogus on rank 1 only: rank 0 does not say why it stopped"; cat "$TMP/log"; fail=1; }

# ... also on one rank only (MPMD: its environment alone has the value): that rank
# prints its error and the first other rank says why it did not run (it was ended by
# mpirun without a word), exit code 2, and no rank waits for another.
both_errors() {  # both_errors BAD_RANK VALUE: each rank's line in $TMP/log
  grep -qE "^fusedmoe: error: rank $1: FUSEDMOE_COMM_TIMEOUT_S: expected .*, got \"$2\"$" "$TMP/log" &&
    grep -qE "^fusedmoe: error: rank $((1 - $1)): not run: rank $1 has a bad FUSEDMOE_COMM_TIMEOUT_S \(see its error\)$" "$TMP/log" ||
    { echo "FAIL: FUSEDMOE_COMM_TIMEOUT_S=$2 on rank $1 only: not each rank's error"; cat "$TMP/log"; fail=1; }
}
one_bad() {  # one_bad BAD_RANK VALUE: the mpirun command line
  local ok=(run --seed 7 --quiet --output "$TMP/out.safetensors" --tokens 8 --ep-size 2)
  local a=("$BIN" "${ok[@]}") b=(env FUSEDMOE_COMM_TIMEOUT_S="$2" "$BIN" "${ok[@]}")
  if [ "$1" = 0 ]; then cmd=($M "$npflag" 1 "${b[@]}" : "$npflag" 1 "${a[@]}")
  else cmd=($M "$npflag" 1 "${a[@]}" : "$npflag" 1 "${b[@]}"); fi
}
for v in abc -3; do
  for bad in 0 1; do
    one_bad $bad "$v"
    expect_error 2 "FUSEDMOE_COMM_TIMEOUT_S: expected a decimal number of seconds in \\(0, 1e\\+09\\], got \"$v\"" 1 -- "${cmd[@]}"
    both_errors $bad "$v"
    no_abort "FUSEDMOE_COMM_TIMEOUT_S=$v on rank $bad only"
  done
done
# Under a launcher that does not end the job when a rank exits with an error (here
# mpirun with orte_abort_on_non_zero_status 0) the other rank waited in MPI_Init, with no
# deadline, for the one that had stopped before it: a hang.
one_bad 1 abc
t0=$SECONDS
OMPI_MCA_orte_abort_on_non_zero_status=0 timeout 60 "${cmd[@]}" >"$TMP/log" 2>&1
rc=$?
if [ "$rc" -eq 124 ] || [ $((SECONDS - t0)) -ge 15 ]; then
  echo "FAIL: FUSEDMOE_COMM_TIMEOUT_S=abc on rank 1 only, no abort on exit: $((SECONDS - t0)) s (rc $rc)"
  cat "$TMP/log"; fail=1
else
  both_errors 1 abc
  echo "ok: FUSEDMOE_COMM_TIMEOUT_S=abc on rank 1 only, no abort on exit: $((SECONDS - t0)) s"
fi

# Numbers in the disagreement are the shortest text of each double (0.1, not
# 0.10000000000000001), still telling apart doubles that differ in the last bit.
B="$BIN bench --shapes qwen3-cpu --max-experts 8 --tokens 1 --ep-size 2"
expect_error 2 "fusedmoe bench: the ranks disagree on --min-time: 0\.1 on rank 0, 0\.2 on rank 1 " 2 -- \
  $M "$npflag" 1 $B --min-time 0.1 : "$npflag" 1 $B --min-time 0.2
expect_error 2 "fusedmoe bench: the ranks disagree on --min-time: 0\.1 on rank 0, 0\.10000000000000002 on rank 1 " 2 -- \
  $M "$npflag" 1 $B --min-time 0.1 : "$npflag" 1 $B --min-time 0.10000000000000002

# Expert shares over the memory budget: the bytes needed, the budget and both options
# (Mixtral's 8 experts need 5.25 GiB: over 0.01 of any machine with less than 525 GiB).
if python3 -c 'import os, sys; sys.exit(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 100 >= 5637144576)'; then
  expect_error 1 "mixtral: the ranks' expert shares need .*, over the budget of .* \(--memory-fraction 0\.01 of .* physical memory\); give a larger --memory-fraction or fewer experts \(--max-experts\)" 1 -- \
    $M "$npflag" 2 "$BIN" bench --ep-size 2 --shapes mixtral --tokens 1 --memory-fraction 0.01
fi

# The tokens' buffers beside the expert shares: over the budget, an error naming
# --tokens on every rank before anything is printed or allocated (200000 tokens a
# rank were killed by the out-of-memory killer). 1e15 tokens fit no machine.
# Every rank says so, before any other collective (it ended in MPI_Abort).
expect_error 1 "--tokens: expected at most [0-9]+ per rank for this machine's memory, got 1000000000000000 \(shape 'qwen3-cpu': .* give fewer --tokens or a larger --memory-fraction" 2 -- \
  $M "$npflag" 2 "$BIN" bench --ep-size 2 --shapes qwen3-cpu --max-experts 8 --tokens 1,1000000000000000 --min-time 0
no_abort "bench --tokens 1e15 --ep-size 2"
grep -q "^# fusedmoe bench" "$TMP/log" && { echo "FAIL: bench --tokens 1e15 printed its header first"; fail=1; }
# The budget is each rank's worst case, not an even share of the routed rows: with
# 16 experts a rank (E_local 16 >= k 8) one rank may receive both ranks' tokens with
# 8 routed rows each (all-to-one routing), at least 2 x 8 x (8 H + 4 I) bytes a token
# of each rank (permuted input, expert output f32 [H], activation [I]), for each of
# the 2 ranks. The most the error allows must fit that beside the expert shares
# (2 x 16 x 3 H I f32); the even-routing budget allowed ~2x more.
expect_error 1 "--tokens: expected at most [0-9]+ per rank for this machine's memory, got 1000000000000000 \(shape 'qwen3-cpu': .* each budgeted for the most it can receive \(every rank's tokens\)" 1 -- \
  $M "$npflag" 2 "$BIN" bench --ep-size 2 --shapes qwen3-cpu --max-experts 32 --tokens 1000000000000000 --min-time 0
most=$(grep -m1 -oE "expected at most [0-9]+ per rank" "$TMP/log" | grep -oE "[0-9]+")
if ! python3 -c '
import os, sys
most = int(sys.argv[1]); H, I = 2048, 768
budget = int(0.25 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
shares = 2 * 16 * 3 * H * I * 4
sys.exit(0 if most * 2 * (2 * 8 * (8 * H + 4 * I)) <= budget - shares else 1)' "${most:-0}"; then
  echo "FAIL: bench --ep-size 2: --tokens up to $most a rank allowed, more than the worst-case routing fits"; fail=1
else
  echo "ok: bench --ep-size 2 budgets the worst-case routing ($most tokens a rank at most)"
fi

# run: the ranks' buffers for T tokens (each rank's worst case) beside their weights
# must fit the machine's memory, which the ranks on it share: more tokens are an
# error naming --tokens and the most that fit, not ranks the OOM killer ends.
# Every rank says so, before any collective: it ended in MPI_Abort (the check
# came after the seed's broadcast).
expect_error 1 "--tokens: expected at most [0-9]+ tokens for this machine's memory, got 1000000000000000 \(.* shared by the 2 ranks on it\); give fewer tokens" 2 -- \
  $M "$npflag" 2 $R --tokens 1000000000000000 --ep-size 2
no_abort "run --tokens 1e15 --ep-size 2"
# So does an --input of more tokens than fit (a sparse .npy: its header says
# physical memory / 4096 tokens of [T, H] f16).
python3 - "$TMP/many.npy" "$H" <<'PY'
import os, sys
path, H = sys.argv[1], int(sys.argv[2])
T = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4096
header = "{'descr': '<f2', 'fortran_order': False, 'shape': (%d, %d), }" % (T, H)
header += " " * (63 - (len(header) + 10) % 64) + "\n"
with open(path, "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
    f.truncate(f.tell() + T * H * 2)
PY
expect_error 1 "--input .*many.npy: expected at most [0-9]+ tokens for this machine's memory, got [0-9]+ " 2 -- \
  $M "$npflag" 2 $RI "$TMP/many.npy"
no_abort "run --input (too many tokens) --ep-size 2"
rm -f "$TMP/many.npy"
# An error of one rank alone in its own work after the options check (here its
# model folder has no weights: node-local files): the other says why it stops.
BUNDLED=$("$BIN" --help | sed -n 's/^Bundled model: //p')
mkdir -p "$TMP/m0/m" "$TMP/m1/m"
cp "$BUNDLED/config.json" "$BUNDLED/model.safetensors" "$TMP/m0/m/"
cp "$BUNDLED/config.json" "$TMP/m1/m/"
expect_error 1 "--model: m: checkpoint directory has neither model.safetensors" 1 -- \
  $M "$npflag" 1 -wdir "$TMP/m0" "$BIN" run --model m --quiet --tokens 8 --ep-size 2 : \
  "$npflag" 1 -wdir "$TMP/m1" "$BIN" run --model m --quiet --tokens 8 --ep-size 2
grep -qE '^fusedmoe: error: rank 0: not run: rank 1 stopped with an error' "$TMP/log" ||
  { echo "FAIL: rank 0 does not say why it stopped"; cat "$TMP/log"; fail=1; }
no_abort "one rank's model without weights"

# --help, --version and inspect on every rank: printed once, by rank 0 (as run
# reports), exit code 0.
MODEL=$("$BIN" --help | sed -n 's/^Bundled model: //p')
for c in "--help:Bundled model: " "run --help:Tensor name in the --reference file" "--version:fusedmoe 0.1.0" \
  "inspect $MODEL:model type "; do
  rc=0; $M "$npflag" 2 "$BIN" ${c%%:*} >"$TMP/log" 2>&1 || rc=$?
  n=$(grep -cF -- "${c#*:}" "$TMP/log")
  if [ "$rc" -ne 0 ] || [ "$n" -ne 1 ]; then
    echo "FAIL: mpirun -np 2 fusedmoe ${c%%:*}: exit $rc, '${c#*:}' printed $n times (want once)"
    cat "$TMP/log"; fail=1
  else
    echo "ok: mpirun -np 2 fusedmoe ${c%%:*}: printed once"
  fi
done

# The same options everywhere still run (and rank 0 writes the output).
rm -f "$TMP/out.safetensors"
if ! $M "$npflag" 2 $R --tokens 8 --ep-size 2 >"$TMP/log" 2>&1 || [ ! -s "$TMP/out.safetensors" ]; then
  echo "FAIL: the matching run"; cat "$TMP/log"; fail=1
fi
exit $fail
