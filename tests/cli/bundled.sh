#!/usr/bin/env bash
# `fusedmoe run` without --model uses the bundled tiny DeepSeek-V3 model and
# matches HF's output; random inputs (--tokens/--seed), --repeat, --threads and
# .npy input work; the README's quick-start command line passes; a tiny
# `fusedmoe bench` run completes and writes its CSV.
# Usage: bash bundled.sh FUSEDMOE_BIN TEST_DATA_DIR MODELS_DIR
set -euo pipefail
BIN=$1 MODELS=$3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
REF="$MODELS/tiny-deepseek-v3/reference.safetensors"

# The README's main command (without --model and, once, without --layer).
"$BIN" run --layer 1 --input "$REF" --input-key layers.1.T64.input \
  --reference "$REF" --reference-key layers.1.T64.output_f64 --output "$TMP/out.safetensors" | tee "$TMP/log"
grep -q "tiny-deepseek-v3" "$TMP/log"
grep -q "relative L2 error .*: ok" "$TMP/log"
grep -q "expert load" "$TMP/log"
python3 "$HERE/st_util.py" check-run-output "$TMP/out.safetensors" 64 128 4 16
"$BIN" run --input "$REF" --input-key layers.1.T5.input --reference "$REF" \
  --reference-key layers.1.T5.output_f64 --quiet | grep -q "layer          1:"
"$BIN" run --layer 2 --input "$REF" --input-key layers.2.T5.input --reference "$REF" \
  --reference-key layers.2.T5.output_f64 --compute-dtype bf16 --threads 1 --repeat 3 --quiet |
  grep -q "median of 3"

# Random input: the same seed gives the same output, file written.
"$BIN" run --tokens 17 --seed 7 --output "$TMP/a.safetensors" --quiet >/dev/null
"$BIN" run --tokens 17 --seed 7 --output "$TMP/b.safetensors" --quiet --threads 1 >/dev/null
cmp "$TMP/a.safetensors" "$TMP/b.safetensors" || { echo "FAIL: same seed, different output"; exit 1; }
python3 "$HERE/st_util.py" check-run-output "$TMP/a.safetensors" 17 128 4 16
# The random seed run prints (any 64-bit value, also >= 2^63) reproduces that run.
"$BIN" run --tokens 3 --output "$TMP/r1.safetensors" --quiet | tee "$TMP/seedlog" >/dev/null
s=$(sed -n 's/.*seed \([0-9]*\).*/\1/p' "$TMP/seedlog" | head -1)
[ -n "$s" ] || { echo "FAIL: no seed printed"; cat "$TMP/seedlog"; exit 1; }
"$BIN" run --tokens 3 --seed "$s" --output "$TMP/r2.safetensors" --quiet >/dev/null
cmp "$TMP/r1.safetensors" "$TMP/r2.safetensors" || { echo "FAIL: printed seed $s does not reproduce"; exit 1; }
"$BIN" run --tokens 3 --seed 17340365956510856471 --quiet >/dev/null
# The tolerance is printed as given (was rounded to one digit: "1.608e-07 > tolerance 2e-07").
"$BIN" run --layer 1 --input "$REF" --input-key layers.1.T64.input --reference "$REF" \
  --reference-key layers.1.T64.output_f64 --tolerance 1.6e-7 --quiet >"$TMP/tol" 2>&1 || true
grep -q "tolerance 1.6e-07" "$TMP/tol" || { echo "FAIL: tolerance not printed as given"; cat "$TMP/tol"; exit 1; }
"$BIN" run --tokens 0 --quiet | grep -q "T = 0"
# ... and against a reference of no rows: said so, not "the reference is all zeros".
python3 "$HERE/st_util.py" npy "$TMP/t0.npy" f 0 128 0
"$BIN" run --input "$TMP/t0.npy" --reference "$TMP/t0.npy" --quiet >"$TMP/t0.txt" 2>&1 || true
grep -q "(T = 0: no elements to compare): ok" "$TMP/t0.txt" ||
  { echo "FAIL: run at T = 0 against a reference"; cat "$TMP/t0.txt"; exit 1; }

# .npy input (float64, as numpy writes it by default).
python3 - "$REF" "$TMP/x.npy" <<'PY'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
b, e = h["layers.1.T5.input"]["data_offsets"]
vals = struct.unpack("<%df" % (5 * 128), raw[8 + n + b:8 + n + e])
header = "{'descr': '<f8', 'fortran_order': False, 'shape': (5, 128), }"
header += " " * (63 - (10 + len(header)) % 64) + "\n"
with open(sys.argv[2], "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
    f.write(struct.pack("<%dd" % len(vals), *vals))
# The same values big-endian, f8 and f4 (byte-swapped on load, as the Python API does),
# and little-endian f4 to compare with.
# dq4: the le4 array under a header that numpy reads as well, written otherwise: the
# keys in double quotes, in another order, with spaces around ':' and no trailing comma;
# no4: 'f4' with no byte-order character (native); py2: Python 2's longs in the shape.
for name, code, fmt in (("be8", ">f8", ">%dd"), ("be4", ">f4", ">%df"), ("le4", "<f4", "<%df"),
                        ("dq4", "<f4", "<%df"), ("no4", "f4", "<%df"), ("py2", "<f4", "<%df")):
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (5, 128), }" % code
    if name == "dq4":
        header = '{ "shape" : ( 5 , 128 ) , "fortran_order" : False , "descr" : "<f4" }'
    if name == "py2":
        header = "{'descr': '<f4', 'fortran_order': False, 'shape': (5L, 128L), }"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    with open(sys.argv[2].replace("x.npy", name + ".npy"), "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack(fmt % len(vals), *vals))
PY
"$BIN" run --layer 1 --input "$TMP/x.npy" --reference "$REF" --reference-key layers.1.T5.output_f64 --quiet |
  grep -q "relative L2 error .*: ok"
for n in be8 be4 le4 dq4 no4 py2; do
  "$BIN" run --layer 1 --input "$TMP/$n.npy" --reference "$REF" --reference-key layers.1.T5.output_f64 \
    --output "$TMP/$n.safetensors" --quiet | grep -q "relative L2 error .*: ok"
done
cmp "$TMP/be4.safetensors" "$TMP/le4.safetensors" || { echo "FAIL: big-endian .npy input differs"; exit 1; }
cmp "$TMP/dq4.safetensors" "$TMP/le4.safetensors" || { echo "FAIL: .npy header in double quotes read otherwise"; exit 1; }
cmp "$TMP/no4.safetensors" "$TMP/le4.safetensors" || { echo "FAIL: .npy 'f4' (no byte order) read otherwise"; exit 1; }
cmp "$TMP/py2.safetensors" "$TMP/le4.safetensors" || { echo "FAIL: .npy shape (5L, 128L) read otherwise"; exit 1; }
# A .npy file is told by its content, whatever its name.
cp "$TMP/x.npy" "$TMP/x.bin"
"$BIN" run --layer 1 --input "$TMP/x.bin" --reference "$REF" --reference-key layers.1.T5.output_f64 --quiet |
  grep -q "relative L2 error .*: ok"

# --model may name the checkpoint's .safetensors file (its folder's config.json):
# the same output as the directory.
"$BIN" run --model "$MODELS/tiny-deepseek-v3/model.safetensors" --layer 1 --input "$REF" \
  --input-key layers.1.T5.input --reference "$REF" --reference-key layers.1.T5.output_f64 --quiet |
  grep -q "relative L2 error .*: ok"

# A model in a folder whose name is not UTF-8 (Latin-1 "mod\xe8le"): inspect (text and
# JSON) and run --output work, the path's byte written as U+FFFD in their JSON (each
# failed with nlohmann's "[json.exception.type_error.316] invalid UTF-8 byte").
latin1="$TMP/$(printf 'mod\xe8le')"
cp -r "$MODELS/tiny-deepseek-v3" "$latin1"
"$BIN" inspect "$latin1" | grep -q "MoE layers: 1, 2"
"$BIN" inspect --json "$latin1" >"$TMP/latin1.json"
"$BIN" run --model "$latin1" --tokens 2 --output "$TMP/latin1-out.safetensors" --quiet >/dev/null
python3 - "$TMP/latin1.json" "$TMP/latin1-out.safetensors" <<'PY'
import json, struct, sys
j = json.load(open(sys.argv[1], encoding="utf-8"))
assert j["path"].endswith("/mod\ufffdle"), j["path"]
raw = open(sys.argv[2], "rb").read()
meta = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["__metadata__"]
assert meta["model"].endswith("/mod\ufffdle"), meta
PY

# A tiny benchmark run (8 experts of the CPU target shape) with CSV output.
"$BIN" bench --shapes qwen3-cpu --max-experts 8 --tokens 1,3 --min-time 0 --csv "$TMP/bench.csv" >"$TMP/bench.txt"
grep -q "peak fp32 FMA" "$TMP/bench.txt"
grep -q "E capped 64 -> 8" "$TMP/bench.txt"
[ "$(wc -l <"$TMP/bench.csv")" -eq 3 ] || { echo "FAIL: bench CSV"; cat "$TMP/bench.csv"; exit 1; }
[ -z "$(find "$TMP" -name '.bench.csv.*')" ] || { echo "FAIL: bench CSV temporary left"; exit 1; }
python3 - "$TMP/bench.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for r in rows:
    assert float(r["ours_s"]) > 0 and float(r["baseline_s"]) > 0, r
    assert float(r["rel_diff"]) < 1e-4, r  # fusedmoe and the BLAS loop agree (f32)
    # Never above the roofline: a ceiling a row beats is raised to what it achieved.
    assert 0 < float(r["roofline_frac"]) <= 1 and r["ceiling_raised"] in ("0", "1"), r
PY
# The table's % roofline likewise (a row that beat a ceiling is marked *, with a note).
awk -F'|' '/^\| [0-9]+ \|/ { p = $7; gsub(/[ %*]/, "", p); if (p + 0 > 100) bad = 1 } END { exit bad }' \
  "$TMP/bench.txt" || { echo "FAIL: bench % roofline above 100"; cat "$TMP/bench.txt"; exit 1; }
if grep -q '%\* |' "$TMP/bench.txt"; then grep -q '^\\\* faster than the ceiling measured' "$TMP/bench.txt"; fi
# A second run replaces the file in full.
"$BIN" bench --shapes qwen3-cpu --max-experts 8 --tokens 2 --min-time 0 --no-baseline --csv "$TMP/bench.csv" >/dev/null
[ "$(wc -l <"$TMP/bench.csv")" -eq 2 ] || { echo "FAIL: bench CSV not replaced"; cat "$TMP/bench.csv"; exit 1; }
# --no-baseline: the baseline's columns are empty, not 0 (no time, no difference measured).
python3 - "$TMP/bench.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for r in rows:
    assert float(r["ours_s"]) > 0, r
    assert all(r[c] == "" for c in ("baseline_s", "baseline_gflops", "speedup", "rel_diff")), r
PY
echo ok

# Interrupted (SIGINT, SIGTERM) while bench --csv runs (>= 2 s per row): no CSV and no
# temporary file left behind (the CLI's signal handler removes unfinished temporaries).
mkdir "$TMP/int"
for sig in INT TERM; do
  rc=0
  timeout -s "$sig" 2 "$BIN" bench --shapes qwen3-cpu --max-experts 8 --tokens 1,16,64,256 \
    --min-time 2 --csv "$TMP/int/c.csv" >/dev/null 2>&1 || rc=$?
  [ "$rc" -eq 124 ] || { echo "FAIL: bench was not interrupted by SIG$sig (exit $rc)"; exit 1; }
  [ -z "$(ls -A "$TMP/int")" ] || { echo "FAIL: SIG$sig left $(ls -A "$TMP/int")"; exit 1; }
done

# Started with SIGINT and SIGHUP ignored (a script's background job, nohup): they stay
# ignored; SIGTERM still ends the run, leaving no temporary.
( trap '' INT HUP; exec "$BIN" bench --shapes qwen3-cpu --max-experts 8 --tokens 1,16,64,256 \
  --min-time 2 --csv "$TMP/int/c.csv" >/dev/null 2>&1 ) &
ignorer=$!
sleep 1
kill -INT "$ignorer" && kill -HUP "$ignorer" && sleep 0.5
kill -0 "$ignorer" 2>/dev/null || { echo "FAIL: an inherited SIGINT / SIGHUP ignore was not kept"; exit 1; }
kill -TERM "$ignorer"
rc=0
wait "$ignorer" || rc=$?
[ "$rc" -eq 143 ] || { echo "FAIL: SIGTERM after ignored SIGINT: exit $rc, expected 143"; exit 1; }
[ -z "$(ls -A "$TMP/int")" ] || { echo "FAIL: SIGTERM left $(ls -A "$TMP/int")"; exit 1; }
echo ok inherited signal ignores

# Killed by SIGKILL (no handler runs) while run --output works: its temporary is left,
# named .<name>.fusedmoe-tmp.<pid>.*; the next run --output to the same path removes it
# (its process is gone) and leaves a live process's temporary alone.
mkdir "$TMP/kill"
"$BIN" run --tokens 4096 --repeat 100000 --quiet --output "$TMP/kill/o.safetensors" >/dev/null 2>&1 &
victim=$!
for _ in $(seq 200); do
  [ -n "$(ls -A "$TMP/kill")" ] && break
  sleep 0.05
done
kill -KILL "$victim"
wait "$victim" 2>/dev/null || true
left=$(ls -A "$TMP/kill")
case "$left" in
  ".o.safetensors.fusedmoe-tmp.$victim."?*) ;;
  *) echo "FAIL: SIGKILL left '$left', expected .o.safetensors.fusedmoe-tmp.$victim.*"; exit 1 ;;
esac
[ "$(wc -l <<<"$left")" -eq 1 ] || { echo "FAIL: SIGKILL left $left"; exit 1; }
: >"$TMP/kill/.o.safetensors.fusedmoe-tmp.$$.live00"  # this shell's: a live process
"$BIN" run --tokens 2 --quiet --output "$TMP/kill/o.safetensors" >/dev/null
[ "$(ls -A "$TMP/kill" | sort | tr '\n' ' ')" = ".o.safetensors.fusedmoe-tmp.$$.live00 o.safetensors " ] ||
  { echo "FAIL: after the next run --output: $(ls -A "$TMP/kill")"; exit 1; }
echo ok stale temporary

# Threads by default: the CPUs the process may run on (taskset -c 0: one), not every
# core of the machine (trial).
if command -v taskset >/dev/null; then
  line=$(taskset -c 0 "$BIN" run --tokens 2 | grep '^threads')
  case "$line" in "threads        1 (GEMM "*) ;; *) false ;; esac || { echo "FAIL: taskset -c 0: '$line', expected one thread"; exit 1; }
  echo ok threads under taskset
fi

# Installed with a prefix chosen at install time (cmake --install build --prefix DIR): the
# executable finds the model installed beside it, DIR/share/fusedmoe/models (it looked in
# the prefix configured at build time, /usr/local by default, wherever it was put).
mkdir -p "$TMP/prefix/bin" "$TMP/prefix/share/fusedmoe/models"
cp "$BIN" "$TMP/prefix/bin/fusedmoe"
cp -r "$MODELS/tiny-deepseek-v3" "$TMP/prefix/share/fusedmoe/models/"
"$TMP/prefix/bin/fusedmoe" run --tokens 1 >"$TMP/installed.log" ||
  { echo "FAIL: installed fusedmoe run --tokens 1"; cat "$TMP/installed.log"; exit 1; }
grep -q "^model  *$TMP/prefix/share/fusedmoe/models/tiny-deepseek-v3 " "$TMP/installed.log" ||
  { echo "FAIL: installed fusedmoe did not use its own model"; cat "$TMP/installed.log"; exit 1; }
echo ok installed
