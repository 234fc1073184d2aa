#!/usr/bin/env bash
# `fusedmoe inspect`: prints every fixture (and the bundled model) with its
# model type, MoE layers and weight bytes; --json is valid JSON that agrees
# with the fixture's config.json; a .safetensors file lists its tensors.
# Usage: bash inspect.sh FUSEDMOE_BIN TEST_DATA_DIR MODELS_DIR
set -euo pipefail
BIN=$1 DATA=$2 MODELS=$3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

n=0
for dir in "$DATA"/hf/*/ "$MODELS"/*/; do
  name=$(basename "$dir")
  "$BIN" inspect "$dir" >"$TMP/text"
  model_type=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["model_type"])' "$dir/config.json")
  for want in "model type     $model_type" "MoE layers:" "experts" "routing" "activation" "total"; do
    grep -qF "$want" "$TMP/text" || { echo "FAIL $name: text output lacks '$want'"; cat "$TMP/text"; exit 1; }
  done
  "$BIN" inspect "$dir" --json >"$TMP/json"
  python3 -m json.tool "$TMP/json" >/dev/null || { echo "FAIL $name: --json is not valid JSON"; exit 1; }
  python3 - "$TMP/json" "$dir/config.json" <<'PY' || { echo "FAIL $name: JSON content"; cat "$TMP/json"; exit 1; }
import json, sys
j = json.load(open(sys.argv[1]))
cfg = json.load(open(sys.argv[2]))
text = cfg.get("text_config", cfg)
assert j["model_type"] == cfg["model_type"], j["model_type"]
assert j["moe_layers"], "no MoE layers"
given = any(k in d for d in (text, cfg) for k in ("dtype", "torch_dtype"))
assert j["dtype_given"] == given, (j["dtype_given"], given)
assert len(j["layers"]) == len(j["moe_layers"])
for layer in j["layers"]:
    c = layer["config"]
    assert c["hidden_size"] == text["hidden_size"], c
    assert 0 < c["top_k"] <= c["num_experts"], c
    assert layer["bytes"] > 0 and layer["tensors"] > 0, layer
    assert set(layer["weight_dtypes"]) == {"bf16"}, layer["weight_dtypes"]
assert j["moe_bytes_total"] == sum(l["bytes"] for l in j["layers"])
PY
  n=$((n + 1))
done
[ "$n" -ge 8 ] || { echo "FAIL: only $n models inspected"; exit 1; }

# A model whose config.json makes no layer MoE: an error saying that fusedmoe cannot
# run it (exit 1, as run's), text or --json, as an unsupported model_type is (it was
# described as "MoE layers: none" with exit code 0).
mkdir -p "$TMP/dense"
cp "$DATA/hf/deepseek_v3/model.safetensors" "$TMP/dense/"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["first_k_dense_replace"] = c["num_hidden_layers"]; json.dump(c, open(sys.argv[2], "w"))' \
  "$DATA/hf/deepseek_v3/config.json" "$TMP/dense/config.json"
for json_flag in "" --json; do
  rc=0; "$BIN" inspect "$TMP/dense" $json_flag >"$TMP/text" 2>"$TMP/err" || rc=$?
  [ "$rc" -eq 1 ] && [ ! -s "$TMP/text" ] &&
    grep -qF "fusedmoe: error: $TMP/dense: the model has no MoE layer fusedmoe can run (model_type 'deepseek_v3', 3 layers" "$TMP/err" ||
    { echo "FAIL: inspect $json_flag of a model without MoE layers (exit $rc)"; cat "$TMP/text" "$TMP/err"; exit 1; }
done
rc=0; "$BIN" run --model "$TMP/dense" --tokens 2 >/dev/null 2>"$TMP/err" || rc=$?
[ "$rc" -eq 1 ] && grep -qF "fusedmoe: error: --model: $TMP/dense: the model has no MoE layer fusedmoe can run (model_type 'deepseek_v3', 3 layers, none of them MoE by its config.json)" "$TMP/err" || { echo "FAIL: run of a model without MoE layers (exit $rc)"; cat "$TMP/err"; exit 1; }

# The fp8 checkpoint: named as fp8 with its block scales; the same config over bf16
# weights (a checkpoint dequantized and saved again): said so, not "e4m3 weights"
# (session 30's trial).
"$BIN" inspect "$DATA/fp8/deepseek_v3_fp8" >"$TMP/text"
grep -qF "quantization   fp8: e4m3 weights, 128 x 128 block scales" "$TMP/text" ||
  { echo "FAIL: inspect of the fp8 checkpoint"; cat "$TMP/text"; exit 1; }
mkdir -p "$TMP/fp8cfg"
cp "$DATA/hf/deepseek_v3/model.safetensors" "$TMP/fp8cfg/"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["quantization_config"] = json.load(open(sys.argv[2]))["quantization_config"]; json.dump(c, open(sys.argv[3], "w"))' \
  "$DATA/hf/deepseek_v3/config.json" "$DATA/fp8/deepseek_v3_fp8/config.json" "$TMP/fp8cfg/config.json"
"$BIN" inspect "$TMP/fp8cfg" >"$TMP/text"
grep -qF "quantization   fp8 in config.json, but the MoE weights hold no fp8 tensor" "$TMP/text" &&
  ! grep -qF "e4m3 weights" "$TMP/text" ||
  { echo "FAIL: inspect of bf16 weights with an fp8 config"; cat "$TMP/text"; exit 1; }

# A .safetensors file: its tensors, with dtype and shape.
"$BIN" inspect "$DATA/hf/mixtral/reference.safetensors" >"$TMP/text"
grep -qE "layers\.0\.T64\.output_f64 +f64 +\[64, 128\]" "$TMP/text" || { echo "FAIL: safetensors listing"; cat "$TMP/text"; exit 1; }
"$BIN" inspect "$DATA/hf/mixtral/reference.safetensors" --json | python3 -m json.tool >/dev/null

# ... told by its content, whatever the name, as `run --input` tells files apart:
# the same listing for a .st copy (it was refused as no config.json); and
# `run --model` takes a checkpoint so named beside its config.json.
cp "$DATA/hf/mixtral/reference.safetensors" "$TMP/reference.st"
"$BIN" inspect "$TMP/reference.st" >"$TMP/text-st" || { echo "FAIL: inspect of a .st file"; cat "$TMP/text-st"; exit 1; }
grep -qE "layers\.0\.T64\.output_f64 +f64 +\[64, 128\]" "$TMP/text-st" || { echo "FAIL: .st listing"; cat "$TMP/text-st"; exit 1; }
"$BIN" inspect "$TMP/reference.st" --json | python3 -c 'import json,sys; assert json.load(sys.stdin)["tensors"]'
mkdir -p "$TMP/st-model"
cp "$DATA/hf/mixtral/config.json" "$TMP/st-model/"
cp "$DATA/hf/mixtral/model.safetensors" "$TMP/st-model/weights.st"
"$BIN" run --model "$TMP/st-model/weights.st" --layer 0 --tokens 2 --quiet >"$TMP/text-st" ||
  { echo "FAIL: run --model a .st checkpoint"; cat "$TMP/text-st"; exit 1; }
grep -q "^layer          0: 8 experts" "$TMP/text-st" || { echo "FAIL: run --model .st"; cat "$TMP/text-st"; exit 1; }
# A config.json is still a model, and a damaged .safetensors name still its own error.
"$BIN" inspect "$DATA/hf/mixtral/config.json" | grep -q "model type     mixtral"
head -c 100 "$DATA/hf/mixtral/reference.safetensors" >"$TMP/cut.safetensors"
rc=0; "$BIN" inspect "$TMP/cut.safetensors" >/dev/null 2>"$TMP/err" || rc=$?
[ "$rc" -eq 1 ] && grep -qF "$TMP/cut.safetensors" "$TMP/err" || { echo "FAIL: truncated .safetensors (exit $rc)"; cat "$TMP/err"; exit 1; }

# A sharded model with one shard missing: described in full, the layers that need
# the shard each with an error naming it, exit code 1 (README: a layer that fails
# prints the loader's error).
mkdir -p "$TMP/one-gone"
cp "$DATA/hf/deepseek_v3/config.json" "$TMP/one-gone/"
cp "$DATA/hf/deepseek_v3/model.safetensors" "$TMP/one-gone/model-00001-of-00002.safetensors"
# The folder's index: layer 2's tensors in a shard that is not there.
gone_index() {
  python3 - "$TMP/one-gone" <<'PY'
import json, struct, sys
d = sys.argv[1]
raw = open(f"{d}/model-00001-of-00002.safetensors", "rb").read()
names = [k for k in json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]]) if k != "__metadata__"]
json.dump({"weight_map": {k: "gone.safetensors" if ".layers.2." in k else "model-00001-of-00002.safetensors" for k in names}},
          open(f"{d}/model.safetensors.index.json", "w"))
PY
}
gone_index
rc=0; "$BIN" inspect "$TMP/one-gone" >"$TMP/text" 2>"$TMP/err" || rc=$?
grep -qF "model type     deepseek_v3" "$TMP/text" && grep -qE "^  layer 1 +[1-9]" "$TMP/text" &&
  grep -qF "error: $TMP/one-gone/model.safetensors.index.json: the shard of tensor 'model.layers.2." "$TMP/text" &&
  grep -qF "$TMP/one-gone/gone.safetensors: cannot open: No such file or directory" "$TMP/text" &&
  grep -qxF "fusedmoe: error: inspect: 1 of 2 MoE layers cannot be loaded (the report names each one's error)" "$TMP/err" &&
  [ "$rc" -eq 1 ] || { echo "FAIL: inspect with a missing shard (exit $rc)"; cat "$TMP/text" "$TMP/err"; exit 1; }
# The index itself names the model (it was read as a config.json: "required field
# 'model_type' is missing"): the same description as its folder's.
rc=0; "$BIN" inspect "$TMP/one-gone/model.safetensors.index.json" >"$TMP/text2" 2>/dev/null || rc=$?
[ "$rc" -eq 1 ] && diff <(sed 1d "$TMP/text") <(sed 1d "$TMP/text2") >/dev/null ||
  { echo "FAIL: inspect of an index (exit $rc)"; cat "$TMP/text2"; exit 1; }
# An index of another name is the one read (as run --model reads it), not the
# folder's model.safetensors.index.json: its missing tensor fails the layer.
python3 - "$TMP/one-gone" <<'PY'
import json, sys
d = sys.argv[1]
j = json.load(open(f"{d}/model.safetensors.index.json"))
j["weight_map"] = {k: "model-00001-of-00002.safetensors" for k in j["weight_map"]}
json.dump(j, open(f"{d}/model.safetensors.index.json", "w"))  # the folder's: every tensor there
gone = next(k for k in j["weight_map"] if ".layers.1." in k and "experts" in k)
del j["weight_map"][gone]
json.dump(j, open(f"{d}/other.safetensors.index.json", "w"))
print(gone, file=open(f"{d}/gone.txt", "w"))
PY
rc=0; "$BIN" inspect "$TMP/one-gone/model.safetensors.index.json" >/dev/null 2>&1 || rc=$?
[ "$rc" -eq 0 ] || { echo "FAIL: inspect of the folder's full index (exit $rc)"; exit 1; }
rc=0; "$BIN" inspect "$TMP/one-gone/other.safetensors.index.json" >"$TMP/text3" 2>&1 || rc=$?
[ "$rc" -eq 1 ] && grep -qF "$(cat "$TMP/one-gone/gone.txt")" "$TMP/text3" ||
  { echo "FAIL: inspect of another index (exit $rc)"; cat "$TMP/text3"; exit 1; }
mv "$TMP/one-gone/model.safetensors.index.json" "$TMP/one-gone/model.safetensors.index.json.full"
rc=0; "$BIN" inspect "$TMP/one-gone/other.safetensors.index.json" --json >"$TMP/json3" || rc=$?
python3 -c 'import json,sys; j = json.load(open(sys.argv[1])); assert j["weights"] and [x["weights_ok"] for x in j["layers"]] == [False, True], j' "$TMP/json3" &&
  [ "$rc" -eq 1 ] || { echo "FAIL: inspect --json of the only index, another name (exit $rc)"; cat "$TMP/json3"; exit 1; }
mv "$TMP/one-gone/model.safetensors.index.json.full" "$TMP/one-gone/model.safetensors.index.json"
gone_index
rc=0; "$BIN" inspect "$TMP/one-gone" --json >"$TMP/json" 2>"$TMP/err" || rc=$?
python3 -c 'import json,sys; l = json.load(open(sys.argv[1]))["layers"]; assert [x["weights_ok"] for x in l] == [True, False] and "gone.safetensors" in l[1]["weights_error"], l' "$TMP/json" &&
  grep -qF "fusedmoe: error: inspect: 1 of 2 MoE layers cannot be loaded" "$TMP/err" &&
  [ "$rc" -eq 1 ] || { echo "FAIL: inspect --json with a missing shard (exit $rc)"; cat "$TMP/err"; exit 1; }

# Tensors of dtypes HF's safetensors knows and fusedmoe does not read (an MXFP4
# checkpoint's F8_E8M0 scales, U32 tensors): listed by the file's dtype string and
# marked, exit 0 (the file was refused: "unknown safetensors dtype"); get() alone
# refuses them, as `run --input` shows.
python3 - "$TMP" <<'PY'
import json, struct, sys
d = sys.argv[1]
h = json.dumps({"s": {"dtype": "F8_E8M0", "shape": [2, 2], "data_offsets": [0, 4]},
                "u": {"dtype": "U32", "shape": [1], "data_offsets": [4, 8]},
                "w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}).encode()
open(f"{d}/mx.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"\0" * 12)
PY
"$BIN" inspect "$TMP/mx.safetensors" >"$TMP/text" || { echo "FAIL: inspect of a file with U32 and F8_E8M0"; cat "$TMP/text"; exit 1; }
grep -qE "^  s +F8_E8M0 +\[2, 2\]  \(dtype not supported by fusedmoe\)$" "$TMP/text" &&
  grep -qE "^  u +U32 +\[1\]  \(dtype not supported by fusedmoe\)$" "$TMP/text" &&
  grep -qE "^  w +f32 +\[1\]$" "$TMP/text" && grep -qF "3 tensors, 12 B" "$TMP/text" ||
  { echo "FAIL: listing of a file with U32 and F8_E8M0"; cat "$TMP/text"; exit 1; }
"$BIN" inspect "$TMP/mx.safetensors" --json |
  python3 -c 'import json,sys; t = json.load(sys.stdin)["tensors"]; assert [(x["dtype"], x.get("supported")) for x in t] == [("F8_E8M0", False), ("U32", False), ("f32", None)], t'
rc=0; "$BIN" run --model "$DATA/hf/mixtral" --input "$TMP/mx.safetensors" --input-key u >/dev/null 2>"$TMP/err" || rc=$?
[ "$rc" -eq 1 ] && grep -qF -- "--input 'u' in $TMP/mx.safetensors: expected dtype f32, bf16, f16 or f64, got U32" "$TMP/err" ||
  { echo "FAIL: run --input of a U32 tensor (exit $rc)"; cat "$TMP/err"; exit 1; }

# Names that would print blank ('' and ' ') are quoted, and a multi-byte UTF-8 name
# is padded by characters, not bytes: its dtype column lines up with the others (trial).
python3 - "$TMP" <<'PY'
import json, struct, sys
d = sys.argv[1]
h = json.dumps({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                " ": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                "h\u00e9llo.w\u00f6rld": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
                "plain": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}).encode()
open(f"{d}/names.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"\0" * 16)
PY
"$BIN" inspect "$TMP/names.safetensors" >"$TMP/text" || { echo "FAIL: inspect of odd names"; cat "$TMP/text"; exit 1; }
python3 - "$TMP/text" <<'PY' || { echo "FAIL: listing of odd names"; cat "$TMP/text"; exit 1; }
import sys
rows = [l for l in open(sys.argv[1], encoding="utf-8").read().splitlines() if l.endswith("f32    [1]")]
assert [r.split()[0] for r in rows] == ["''", "'", "h\u00e9llo.w\u00f6rld", "plain"], rows
assert len({r.index("f32") for r in rows}) == 1, rows  # one column, in characters
PY

# Control characters in a file's text (a tensor name, metadata, config.json's
# architectures), in the text output and in errors that quote it: written as \xNN,
# never sent to the terminal raw (an ESC sequence could clear or recolour it).
python3 - "$TMP" <<'PY'
import json, os, shutil, struct, sys
d = sys.argv[1]
def write(path, header, data):
    h = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + data)
write(f"{d}/esc.safetensors", {"__metadata__": {"note\u001b[2J": "a\u001b]0;x\u0007b"},
                                "w\u001b[31m": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
h = b'{"w\\u001b[2J": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "w\\u001b[2J": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
open(f"{d}/esc-dup.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"\0" * 4)
PY
"$BIN" inspect "$TMP/esc.safetensors" >"$TMP/text"
rc=0; "$BIN" inspect "$TMP/esc-dup.safetensors" >/dev/null 2>"$TMP/err" || rc=$?
if grep -q $'[\x01-\x08\x0b-\x1f\x7f]' "$TMP/text" "$TMP/err" ||
  ! grep -qF 'w\x1b[31m' "$TMP/text" || ! grep -qF 'metadata note\x1b[2J = a\x1b]0;x\x07b' "$TMP/text" ||
  [ "$rc" -ne 1 ] || ! grep -qF "tensor 'w\\x1b[2J' more than once" "$TMP/err"; then
  echo "FAIL: control characters of a file reached the terminal (exit $rc)"; od -c "$TMP/text" "$TMP/err" | head -20; exit 1
fi

# Names of any width (session 28's focused trial): wide CJK and emoji, combining
# marks, a right-to-left override, a backslash and one name past the column's cap.
# The text listing keeps the dtype column where the longest capped name puts it
# (terminal cells, not code points), the override and the backslash escaped;
# --json is ASCII (non-ASCII as \uXXXX) and gives the names back as they are.
python3 - "$TMP" <<'PY'
import json, struct, sys
names = ["experts.\u4e13\u5bb6.w1", "e\U0001f600.w2", "cafe\u0301.w3", "ab\u202ecd", "a\\u200bb",
         "long." + "x" * 120, "plain"]
h = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                for i, n in enumerate(names)}).encode()
open(sys.argv[1] + "/wide.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"\0" * 4 * len(names))
json.dump(names, open(sys.argv[1] + "/wide-names.json", "w"))
PY
"$BIN" inspect "$TMP/wide.safetensors" >"$TMP/text"
"$BIN" inspect --json "$TMP/wide.safetensors" >"$TMP/json"
python3 - "$TMP/text" "$TMP/json" "$TMP/wide-names.json" <<'PY' || { echo "FAIL: inspect of names of any width"; cat "$TMP/text" "$TMP/json"; exit 1; }
import json, sys, unicodedata
def cells(s):
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
               for c in s)
text = open(sys.argv[1], encoding="utf-8").read()
rows = [l for l in text.splitlines() if l.endswith("[1]")]
assert len(rows) == 7, rows
cols = {cells(r[: r.index(" f32 ")]) for r in rows if "long." not in r}
assert len(cols) == 1, (cols, rows)  # one column for every name within the cap
assert "\u202e" not in text and "ab\\u202ecd" in text, text
assert "a\\\\u200bb" in text, text
raw = open(sys.argv[2], "rb").read()
assert all(b < 0x80 for b in raw), "inspect --json is not ASCII"
got = [t["name"] for t in json.loads(raw)["tensors"]]
assert sorted(got) == sorted(json.load(open(sys.argv[3]))), got
PY

# --help works and exits 0; no command is a usage error.
"$BIN" --help | grep -q inspect
"$BIN" run --help | grep -q -- --reference-key
# "fusedmoe help [COMMAND]" prints the same text as --help.
cmp <("$BIN" help) <("$BIN" --help) || { echo "FAIL: help differs from --help"; exit 1; }
cmp <("$BIN" help bench) <("$BIN" bench --help) || { echo "FAIL: help bench"; exit 1; }
cmp <("$BIN" help help) <("$BIN" --help) || { echo "FAIL: help help"; exit 1; }
rc=0; "$BIN" help nosuch >/dev/null 2>"$TMP/help_err" || rc=$?
[ "$rc" -eq 2 ] && grep -q "unknown command 'nosuch'" "$TMP/help_err" ||
  { echo "FAIL: help nosuch: rc $rc, $(cat "$TMP/help_err")"; exit 1; }
rc=0; "$BIN" >/dev/null 2>&1 || rc=$?
[ "$rc" -ne 0 ] || { echo "FAIL: no command accepted"; exit 1; }
echo "ok: $n models"
