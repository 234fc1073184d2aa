#!/usr/bin/env bash
# End-to-end: `mpirun -np N fusedmoe run ... --ep-size/--tp-size/--dp-size` on
# the HF fixtures writes what one rank writes: the same file, byte for byte,
# for EP (every architecture, N = 2, 3, 4); the same routing and an output
# within 1e-6 relative for TP, EP x TP and DP + EP. Also `fusedmoe bench
# --ep-size 2` reports dispatch / combine bandwidth.
# Usage: bash cli_parallel.sh MPIEXEC "PRE_FLAGS" NP_FLAG FUSEDMOE_BIN TEST_DATA_DIR
set -euo pipefail
mpiexec=$1; pre=$2; npflag=$3; BIN=$4; DATA=$5
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export FUSEDMOE_COMM_TIMEOUT_S=60

compare() {  # compare SINGLE PARALLEL EXACT(1|0)
  python3 - "$1" "$2" "$3" <<'PY'
import json, math, struct, sys
def read(p):
    raw = open(p, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    return h, raw[8 + n:]
(ha, da), (hb, db) = read(sys.argv[1]), read(sys.argv[2])
exact = sys.argv[3] == "1"
for name in ("output", "topk_ids", "topk_weights", "router_logits"):
    a, b = ha[name], hb[name]
    assert a["dtype"] == b["dtype"] and a["shape"] == b["shape"], (name, a, b)
    xa = da[a["data_offsets"][0]:a["data_offsets"][1]]
    xb = db[b["data_offsets"][0]:b["data_offsets"][1]]
    if xa == xb:
        continue
    if exact or name != "output":
        sys.exit(f"{name}: differs from the single-rank run")
    fa = struct.unpack(f"<{len(xa) // 4}f", xa)
    fb = struct.unpack(f"<{len(xb) // 4}f", xb)
    num = sum((x - y) ** 2 for x, y in zip(fa, fb))
    den = sum(x * x for x in fa)
    rel = math.sqrt(num / den) if den else math.sqrt(num)
    if not rel <= 1e-6:
        sys.exit(f"output: relative L2 difference {rel:.3e} > 1e-6")
PY
}

runs=0
for dir in "$DATA"/hf/*/; do
  arch=$(basename "$dir")
  ref="$dir/reference.safetensors"
  # The first MoE layer (DeepSeek-V3 starts with a dense one).
  L=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["moe_layers"][0])' \
        <("$BIN" inspect "$dir" --json))
  args=(run --model "$dir" --layer "$L" --input "$ref" --input-key "layers.$L.T64.input" --quiet)
  "$BIN" "${args[@]}" --output "$TMP/single.safetensors" >/dev/null
  layouts=("2 --ep-size 2" "3 --ep-size 3" "4 --ep-size 4 --expert-placement round-robin")
  case "$arch" in
    qwen2_moe | gpt_oss | llama4)
      layouts+=("2 --tp-size 2" "4 --ep-size 2 --tp-size 2" "3 --ep-size 3 --dp-size 3"
                "4 --ep-size 2 --dp-size 2 --tp-size 2" "2 --ep-size 2 --dispatch-dtype bf16") ;;
  esac
  for l in "${layouts[@]}"; do
    read -r np flags <<<"$l"
    out="$TMP/par.safetensors"
    rm -f "$out"
    if ! $mpiexec $pre "$npflag" "$np" "$BIN" "${args[@]}" $flags --output "$out" \
        >"$TMP/log" 2>&1; then
      echo "FAIL $arch -np $np $flags:"; cat "$TMP/log"; exit 1
    fi
    exact=0
    case "$flags" in *tp-size* | *dp-size*) exact=0 ;; *) exact=1 ;; esac
    # bf16 payload with f32 compute rounds the hidden states: not the single-rank result.
    case "$flags" in *bf16*)
      grep -q "ep 2, tp 1, dp 1" "$TMP/log" || { echo "FAIL $arch: no parallel line"; exit 1; }
      runs=$((runs + 1)); continue ;;
    esac
    compare "$TMP/single.safetensors" "$out" "$exact" ||
      { echo "FAIL $arch -np $np $flags"; cat "$TMP/log"; exit 1; }
    runs=$((runs + 1))
  done
  echo "ok $arch"
done
echo "$runs parallel runs match the single-rank output"

# --reference with a lossy --dispatch-dtype and no --tolerance: the default allows
# for the payload's rounding (f32 compute; on the fixtures bf16 ~3e-3, fp8 up to
# ~4e-2), so a correct run passes and says why; a --tolerance given still rules.
dir="$DATA/hf/qwen3_moe"
ref_args=(run --model "$dir" --layer 0 --input "$dir/reference.safetensors" --input-key layers.0.T64.input
          --reference "$dir/reference.safetensors" --reference-key layers.0.T64.output_f64 --quiet --ep-size 2)
for dd in bf16 fp8; do
  $mpiexec $pre "$npflag" 2 "$BIN" "${ref_args[@]}" --dispatch-dtype "$dd" >"$TMP/log" 2>&1 ||
    { echo "FAIL: --dispatch-dtype $dd failed its default tolerance"; cat "$TMP/log"; exit 1; }
  grep -q "the default for --dispatch-dtype $dd): ok" "$TMP/log" || { echo "FAIL: $dd line"; cat "$TMP/log"; exit 1; }
  if $mpiexec $pre "$npflag" 2 "$BIN" "${ref_args[@]}" --dispatch-dtype "$dd" --tolerance 1e-5 >"$TMP/log" 2>&1; then
    echo "FAIL: --dispatch-dtype $dd --tolerance 1e-5 passed"; cat "$TMP/log"; exit 1
  fi
done
echo "ok --reference default tolerance with a lossy dispatch"

# The payloads as run (auto resolved) are named in the report and the output's metadata.
$mpiexec $pre "$npflag" 2 "$BIN" run --model "$dir" --layer 0 --tokens 4 --ep-size 2 \
  --dispatch-dtype fp8 --output "$TMP/fp8.safetensors" >"$TMP/log" 2>&1 ||
  { echo "FAIL: fp8 run"; cat "$TMP/log"; exit 1; }
grep -q "^parallel .*ep 2, tp 1, dp 1, experts contiguous; dispatch fp8 e4m3 (1x128 scales), combine f32;" \
  "$TMP/log" || { echo "FAIL: fp8 payload not in the report"; cat "$TMP/log"; exit 1; }
$mpiexec $pre "$npflag" 2 "$BIN" run --model "$dir" --layer 0 --tokens 4 --ep-size 2 \
  --compute-dtype bf16 --output "$TMP/auto.safetensors" >"$TMP/log" 2>&1 ||
  { echo "FAIL: auto run"; cat "$TMP/log"; exit 1; }
python3 - "$TMP/fp8.safetensors" "$TMP/auto.safetensors" <<'PY'
import json, struct, sys
def meta(p):
    raw = open(p, "rb").read()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["__metadata__"]
m = meta(sys.argv[1])
assert m["parallel"] == "ep 2, tp 1, dp 1, experts contiguous; dispatch fp8 e4m3 (1x128 scales), combine f32", m
assert m["backend"] == "cpu", m
m = meta(sys.argv[2])
assert m["parallel"].endswith("dispatch bf16, combine f32"), m  # auto with bf16 compute
PY
echo "ok payloads named in the report and the metadata"

# Wrong rank count: a clear error.
if $mpiexec $pre "$npflag" 2 "$BIN" run --tokens 4 --ep-size 3 >"$TMP/log" 2>&1; then
  echo "FAIL: --ep-size 3 on 2 ranks succeeded"; exit 1
fi
grep -q "expected 3 ranks, but the MPI launcher started 2" "$TMP/log" ||
  { echo "FAIL: no rank-count message"; cat "$TMP/log"; exit 1; }

# expect_rank_usage NAME NP PATTERN -- ARGS...: `mpirun -np NP fusedmoe ARGS`
# exits 2 with an error line matching PATTERN (every rank hits it, the first
# to report ends the job).
expect_rank_usage() {
  local name=$1 np=$2 pattern=$3 rc=0
  shift 4
  $mpiexec $pre "$npflag" "$np" "$BIN" "$@" >"$TMP/log" 2>&1 || rc=$?
  [ "$rc" -eq 2 ] || { echo "FAIL: $name: exit $rc, expected 2"; cat "$TMP/log"; exit 1; }
  grep -qE "^fusedmoe: error: rank [0-9]+: $pattern" "$TMP/log" ||
    { echo "FAIL: $name: no '$pattern'"; cat "$TMP/log"; exit 1; }
  echo "ok $name"
}

# More EP ranks than experts (mixtral: 8): a usage error naming --ep-size (it
# named ExpertMap's ep_size).
expect_rank_usage "--ep-size beyond the experts" 9 \
  "--ep-size 9: expected at most num_experts = 8 \(" -- \
  run --model "$DATA/hf/mixtral" --tokens 4 --ep-size 9
grep -q "ExpertMap" "$TMP/log" && { echo "FAIL: ExpertMap named"; cat "$TMP/log"; exit 1; }

# More TP ranks than intermediate columns: a usage error naming --tp-size (it
# named MoEConfig's tp_size with exit 1). A copy of mixtral whose config says
# intermediate_size 1, so that two ranks exceed it (the check runs before any
# weight is read).
cp -r "$DATA/hf/mixtral" "$TMP/tp_model"
sed -i 's/"intermediate_size": 48/"intermediate_size": 1/' "$TMP/tp_model/config.json"
expect_rank_usage "--tp-size beyond the intermediate size" 2 \
  "--tp-size 2: expected at most intermediate_size = 1 \(" -- \
  run --model "$TMP/tp_model" --tokens 4 --tp-size 2

# An argument error: every rank that hits it prints it, with its rank.
if $mpiexec $pre "$npflag" 2 "$BIN" run --tokens 4 --ep-size 0 >"$TMP/log" 2>&1; then
  echo "FAIL: --ep-size 0 succeeded"; exit 1
fi
for r in 0 1; do
  [ "$(grep -c "^fusedmoe: error: rank $r: run --ep-size" "$TMP/log")" -eq 1 ] ||
    { echo "FAIL: rank $r does not print the argument error once"; cat "$TMP/log"; exit 1; }
done

# bench --ep-size 2: one table row per T with bandwidths.
$mpiexec $pre "$npflag" 2 "$BIN" bench --ep-size 2 --shapes qwen3-cpu --max-experts 8 \
  --tokens 1,16 --min-time 0 >"$TMP/bench" 2>&1 || { cat "$TMP/bench"; exit 1; }
grep -q "dispatch GB/s" "$TMP/bench" || { echo "FAIL: bench has no bandwidth"; cat "$TMP/bench"; exit 1; }
[ "$(grep -c '^| 1[6]\? |' "$TMP/bench")" -eq 2 ] || { echo "FAIL: bench rows"; cat "$TMP/bench"; exit 1; }
echo "ok bench --ep-size 2"
