#!/usr/bin/env bash
# fault.sh MPIEXEC "PRE_FLAGS" NP_FLAG NP PROGRAM: runs test_parallel_fault in
# both modes with a 2 s communicator timeout and checks that mpirun exits
# non-zero, that a surviving rank reports the timeout, and that it took well
# under the test's limit (no hang).
set -u
mpiexec=$1; pre=$2; npflag=$3; np=$4; prog=$5
fail=0
for mode in exit stuck; do
  start=$(date +%s)
  # orte_allowed_exit_without_sync: let the survivors notice by themselves
  # (mpirun would otherwise kill them when the early rank exits).
  out=$(FUSEDMOE_COMM_TIMEOUT_S=2 OMPI_MCA_orte_allowed_exit_without_sync=1 \
        timeout 60 "$mpiexec" $pre "$npflag" "$np" "$prog" "$mode" 2>&1)
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  echo "---- mode $mode: rc $rc, ${elapsed} s"
  echo "$out" | grep -v '^\s*$' | head -20
  if [ "$rc" -eq 0 ]; then echo "FAIL ($mode): mpirun exited 0"; fail=1; fi
  if [ "$rc" -eq 124 ]; then echo "FAIL ($mode): hung (killed after 60 s)"; fail=1; fi
  if ! echo "$out" | grep -q "fusedmoe::Error: MPI .*timed out after 2 s (FUSEDMOE_COMM_TIMEOUT_S)"; then
    echo "FAIL ($mode): no rank reported the communicator timeout"; fail=1
  fi
  if [ "$elapsed" -gt 30 ]; then echo "FAIL ($mode): took ${elapsed} s"; fail=1; fi
done

# The last rank stops before a communicator's creation: the others time out
# there, naming it (the rank that did not arrive), and no rank hangs.
start=$(date +%s)
out=$(FUSEDMOE_COMM_TIMEOUT_S=2 timeout 60 "$mpiexec" $pre "$npflag" "$np" "$prog" late 2>&1)
rc=$?
elapsed=$(( $(date +%s) - start ))
echo "---- mode late: rc $rc, ${elapsed} s"
echo "$out" | grep -v '^\s*$' | head -20
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]; then echo "FAIL (late): rc $rc"; fail=1; fi
last=$((np - 1))
if ! echo "$out" | grep -qE "MPI communicator creation \(rank [0-9]+ of $np\): timed out after 2 s \(FUSEDMOE_COMM_TIMEOUT_S\) waiting for rank $last, which did not reach it"; then
  echo "FAIL (late): no rank named rank $last as the one that did not arrive"; fail=1
fi
if [ "$elapsed" -gt 30 ]; then echo "FAIL (late): took ${elapsed} s"; fail=1; fi

# Ranks that disagree on a message size: an error naming both sizes on every
# rank, no write past the receive buffer (rc 4), no hang.
out=$(FUSEDMOE_COMM_TIMEOUT_S=20 timeout 60 "$mpiexec" $pre "$npflag" "$np" "$prog" mismatch 2>&1)
rc=$?
echo "---- mode mismatch: rc $rc"
echo "$out" | grep -v '^\s*$' | head -20
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]; then echo "FAIL (mismatch): rc $rc"; fail=1; fi
if echo "$out" | grep -q "written past the receive buffer"; then
  echo "FAIL (mismatch): buffer overrun"; fail=1
fi
# Each rank names a peer whose message has another size than it expects.
named=$(echo "$out" | grep -cE "rank [0-9]+ sent a message of [0-9]+ bytes, this rank expected [0-9]+")
if [ "$named" -lt 2 ]; then echo "FAIL (mismatch): $named ranks named both sizes"; fail=1; fi
exit $fail
