#!/usr/bin/env bash
# End-to-end: `fusedmoe run` on every HF fixture (tests/data/hf/<arch>), every MoE
# layer, T = 1, 5, 64, f32 and bf16 compute, matches transformers' float64
# output (relative L2 <= 1e-5 f32, <= 1e-2 bf16) and writes the four tensors
# with the right shapes; so does the FP8 DeepSeek-V3 fixture (tests/data/fp8).
# Usage: bash run_fixtures.sh FUSEDMOE_BIN TEST_DATA_DIR MODELS_DIR
set -euo pipefail
BIN=$1 DATA=$2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

runs=0
for dir in "$DATA"/hf/*/; do
  arch=$(basename "$dir")
  "$BIN" inspect "$dir" --json >"$TMP/$arch.json"
  read -r layers H K E < <(python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))
c = j["layers"][0]["config"]
print(",".join(str(l) for l in j["moe_layers"]), c["hidden_size"], c["top_k"],
      c["num_experts"] + c["num_zero_experts"])' "$TMP/$arch.json")
  [ -n "$layers" ] || { echo "FAIL $arch: no MoE layers reported"; exit 1; }
  ref="$dir/reference.safetensors"
  for L in ${layers//,/ }; do
    for T in 1 5 64; do
      for dt in f32 bf16; do
        out="$TMP/out-$arch-$L-$T-$dt.safetensors"
        if ! "$BIN" run --model "$dir" --layer "$L" --compute-dtype "$dt" \
            --input "$ref" --input-key "layers.$L.T$T.input" \
            --reference "$ref" --reference-key "layers.$L.T$T.output_f64" \
            --output "$out" --quiet >"$TMP/log" 2>&1; then
          echo "FAIL $arch layer $L T=$T $dt:"; cat "$TMP/log"; exit 1
        fi
        grep -q "relative L2 error" "$TMP/log" || { echo "FAIL $arch: no error line"; cat "$TMP/log"; exit 1; }
        python3 "$HERE/st_util.py" check-run-output "$out" "$T" "$H" "$K" "$E" ||
          { echo "FAIL $arch layer $L T=$T $dt: bad output file"; exit 1; }
        runs=$((runs + 1))
      done
    done
  done
  echo "ok $arch (layers $layers)"
done
# DeepSeek-V3 FP8 checkpoint (128x128 block scales): the loader dequantizes; the
# result matches transformers' float64 run on the dequantized weights.
fp8="$DATA/fp8/deepseek_v3_fp8"
if [ -d "$fp8" ]; then
  for L in 1 2; do
    for T in 1 7 200; do
      out="$TMP/out-fp8-$L-$T.safetensors"
      if ! "$BIN" run --model "$fp8" --layer "$L" --input "$fp8/reference.safetensors" \
          --input-key "layers.$L.T$T.input" --reference "$fp8/reference.safetensors" \
          --reference-key "layers.$L.T$T.output_dequant_f64" --output "$out" --quiet >"$TMP/log" 2>&1; then
        echo "FAIL fp8 layer $L T=$T:"; cat "$TMP/log"; exit 1
      fi
      python3 "$HERE/st_util.py" check-run-output "$out" "$T" 256 4 16
      runs=$((runs + 1))
    done
  done
  echo "ok deepseek_v3_fp8 (layers 1,2)"
fi
[ "$runs" -ge 6 ] || { echo "FAIL: only $runs runs (no fixtures in $DATA/hf?)"; exit 1; }

# The reference check can fail: a tolerance of 0 must be rejected (exit 1, one line).
dir="$DATA/hf/mixtral"
set +e
"$BIN" run --model "$dir" --layer 0 --input "$dir/reference.safetensors" --input-key layers.0.T5.input \
  --reference "$dir/reference.safetensors" --reference-key layers.0.T5.output_f64 --tolerance 0 \
  >"$TMP/log" 2>"$TMP/err"
rc=$?
set -e
[ "$rc" -eq 1 ] || { echo "FAIL: --tolerance 0 gave exit $rc"; cat "$TMP/err"; exit 1; }
grep -q "^fusedmoe: error: output differs from reference" "$TMP/err" || { cat "$TMP/err"; exit 1; }
# ...and a wrong reference (another T's output) fails too.
set +e
"$BIN" run --model "$dir" --layer 1 --input "$dir/reference.safetensors" --input-key layers.1.T5.input \
  --reference "$dir/reference.safetensors" --reference-key layers.0.T5.output_f64 >/dev/null 2>"$TMP/err"
rc=$?
set -e
[ "$rc" -eq 1 ] || { echo "FAIL: a wrong reference passed (exit $rc)"; exit 1; }
# References of extreme magnitude: the relative L2 error in scaled f64 norms, not
# inf / inf (printed as -nan) for 1e200 nor x / 0 ("all zeros") for 1e-200. The
# fixture's own output times c: the error is ||out - c out|| / ||c out|| =
# |1 - c| / c, 1 for c = 1e200 and 1e200 for c = 1e-200.
{
  "$BIN" run --model "$dir" --layer 0 --input "$dir/reference.safetensors" --input-key layers.0.T5.input \
    --output "$TMP/base.safetensors" --quiet >/dev/null
  for c in 1e200 1e-200; do
    python3 - "$TMP/base.safetensors" "$c" "$TMP/ref-$c.npy" <<'PY'
import array, json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])["output"]
b, e = h["data_offsets"]
out = array.array("f")
out.frombytes(raw[8 + n + b:8 + n + e])  # f32, little-endian on x86
c = float(sys.argv[2])
rows, cols = h["shape"]
head = "{'descr': '<f8', 'fortran_order': False, 'shape': (%d, %d), }" % (rows, cols)
head += " " * (63 - (10 + len(head)) % 64) + "\n"
with open(sys.argv[3], "wb") as f:  # .npy 1.0, f64: the output times c
    f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head.encode("latin1"))
    f.write(struct.pack("<%dd" % len(out), *[v * c for v in out]))
PY
    set +e
    "$BIN" run --model "$dir" --layer 0 --input "$dir/reference.safetensors" --input-key layers.0.T5.input \
      --reference "$TMP/ref-$c.npy" --output "$TMP/o.safetensors" --quiet >"$TMP/log" 2>"$TMP/err"
    rc=$?
    set -e
    line=$(grep "^reference " "$TMP/log" || true)
    err=$(sed -n 's/.*relative L2 error \([^ ]*\) .*/\1/p' <<<"$line")
    python3 - "$c" "$err" <<'PY' && [ "$rc" -eq 1 ] &&
import math, sys
c, got = float(sys.argv[1]), float(sys.argv[2])
want = abs(1 - c) / c  # ||out - c out|| / ||c out||
assert math.isfinite(got) and abs(got - want) <= 1e-3 * want, (got, want)
PY
      ! grep -q "all zeros" "$TMP/log" ||
      { echo "FAIL: --reference scaled by $c (exit $rc): $line"; cat "$TMP/err"; exit 1; }
    echo "ok   --reference scaled by $c: $line"
  done
}
echo "ok: $runs runs"
