#!/usr/bin/env bash
# Runs the CUDA tests and benchmark on a device machine, from binaries built
# here (scripts/device_pack.sh puts them with their libraries in .devbin/).
# Usage (on the device, repository root): scripts/device_run.sh [tests|cli|python|sanitize|bench|layer|ep|ncu|all] [gtest filter]
# Env: BENCH_ARGS (e.g. --sweep), SKIP_TORCH=1, TORCH_ITERS; ep: EP_TRANSPORTS, EP_TOKENS,
# EP_SHAPES, EP_BENCH_ARGS (e.g. --dispatch-dtype fp8 --combine-dtype bf16), EP_BENCH_TAG
# (log name suffix), EP_SKIP_CHECKS=1 (the bench only).
# Logs go to $OUT (or ./out).
set -uo pipefail
what=${1:-all}
filter=${2:-*}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
root=$PWD
# Test data paths are compiled in as /work/main/tests/data: point that at this tree.
if [ "$root" != /work/main ]; then mkdir -p /work && ln -sfn "$root" /work/main; fi
# Libraries packed by device_pack.sh; the device's own come first where it has them.
[ -f "$root/.devbin/lib.tar.xz" ] && tar -C "$root/.devbin" -xJf "$root/.devbin/lib.tar.xz"
[ -f "$root/.devbin/bin.tar.xz" ] && tar -C "$root/.devbin" -xJf "$root/.devbin/bin.tar.xz"
# NCCL: the one in the device image's PyTorch (nvidia-nccl-cu13).
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:$root/.devbin/lib${nccl_lib:+:$nccl_lib}
bin=$root/.devbin
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in $(cd "$bin" && ls test_cuda_*); do
    FUSEDMOE_COMM_TIMEOUT_S=5 timeout 300 "$bin/$t" --gtest_filter="$filter" >"$OUT/$t.log" 2>&1
    r=$?
    [ $r -ne 0 ] && rc=1
    echo "== $t rc=$r: $(grep -E '^\[  (PASSED|FAILED)|tests ran' "$OUT/$t.log" | tr '\n' ' ')"
    grep -E "Failure|FAILED|error|Expected|Which is|actual|seed" "$OUT/$t.log" | head -25
  done
fi
if [ "$what" = cli ] || [ "$what" = all ]; then
  # `fusedmoe run --backend cuda` end to end: every HF fixture's MoE layers at
  # T = 64 and the bundled model, checked against transformers' float64 output.
  n=0
  for dir in tests/data/hf/*/ tests/data/fp8/*/ models/tiny-deepseek-v3/; do
    ref=$dir/reference.safetensors
    [ -f "$ref" ] || continue
    for key in $(python3 -c "import json,struct,sys; f=open(sys.argv[1],'rb'); n=struct.unpack('<Q',f.read(8))[0]; print(' '.join(k for k in json.loads(f.read(n)) if k.endswith('.T64.input')))" "$ref"); do
      layer=${key#layers.}; layer=${layer%%.*}
      line=$(timeout 60 "$bin/fusedmoe" run --backend cuda --model "$dir" --layer "$layer" --input "$ref" \
        --input-key "$key" --reference "$ref" --reference-key "${key%.input}.output_f64" --quiet 2>&1)
      r=$?
      [ $r -ne 0 ] && rc=1
      n=$((n + 1))
      echo "$(basename "$dir") layer $layer rc=$r: $(echo "$line" | grep -E '^reference|error' | tr '\n' ' ')" | tee -a "$OUT/cli.log"
    done
  done
  echo "== fusedmoe run --backend cuda: $n runs"
fi
if [ "$what" = python ] || [ "$what" = all ]; then
  # The Python package (packed extension + python/fusedmoe) on torch CUDA tensors,
  # then the per-call overhead benchmark.
  pyt=$(mktemp -d) && mkdir -p "$pyt/fusedmoe" && cp python/fusedmoe/* "$pyt/fusedmoe/" &&
    cp "$bin"/_ext.cpython-*.so "$pyt/fusedmoe/"
  PYTHONPATH=$pyt PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
    python/tests --deselect python/tests/test_stubs.py::test_stub_is_current >"$OUT/pytest.log" 2>&1
  r=$?
  [ $r -ne 0 ] && rc=1
  echo "== pytest rc=$r: $(tail -1 "$OUT/pytest.log")"
  grep -E "FAILED|Error" "$OUT/pytest.log" | head -20
  PYTHONPATH=$pyt timeout 150 python3 python/benchmarks/cuda_overhead.py --repeat 500 --rounds 5 \
    --passes 2 >"$OUT/python_overhead.txt" 2>&1
  echo "== python overhead rc=$?"
  tail -14 "$OUT/python_overhead.txt"
fi
if [ "$what" = sanitize ] || [ "$what" = all ]; then
  # compute-sanitizer on small cases (memcheck: bounds and leaks; racecheck: shared memory).
  timeout 150 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
    "$bin/test_cuda_gemm" >"$OUT/memcheck_gemm.log" 2>&1
  echo "== memcheck test_cuda_gemm rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck_gemm.log" | tr '\n' ' ')"
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/test_cuda_fused_experts" \
    --gtest_filter='*Decode*' >"$OUT/memcheck_decode.log" 2>&1
  echo "== memcheck decode kernels rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck_decode.log" | tr '\n' ' ')"
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/test_cuda_runner" \
    --gtest_filter='Architectures/*' >"$OUT/memcheck_runner.log" 2>&1
  echo "== memcheck test_cuda_runner rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck_runner.log" | tr '\n' ' ')"
  timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 "$bin/test_cuda_runner" \
    --gtest_filter='Architectures/*.*/deepseek_v3' >"$OUT/racecheck_runner.log" 2>&1
  echo "== racecheck test_cuda_runner rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/racecheck_runner.log" | tr '\n' ' ')"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  mkdir -p /tmp/dump
  timeout 300 "$bin/bench_cuda_moe" --dump-dir /tmp/dump ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.md"
  if [ -z "${SKIP_TORCH:-}" ]; then
    PYTHONUNBUFFERED=1 timeout 300 python3 bench/cuda/torch_baseline.py /tmp/dump --iters ${TORCH_ITERS:-10} \
      2>&1 | tee "$OUT/bench_torch.md"
  fi
fi
if [ "$what" = layer ] || [ "$what" = all ]; then
  # The whole layer through MoERunner (graph vs eager, routed part alone) and routing alone.
  timeout 300 "$bin/bench_cuda_layer" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/bench_layer.md"
fi
if [ "$what" = ep ] || [ "$what" = all ]; then
  # Expert parallelism over NCCL on every visible GPU (needs >= 2; test_cuda_nccl's
  # EveryVisibleGpu* tests run in `tests`): mpirun, one rank per GPU, against one GPU.
  export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared machines (device KINDS.md)
  ngpu=$(nvidia-smi -L | wc -l)
  if [ "$ngpu" -lt 2 ] || ! command -v mpirun >/dev/null; then
    echo "== ep: skipped ($ngpu GPU(s), mpirun $(command -v mpirun || echo missing))"
  else
    # EP's local experts run the mma.sync kernels; pinned to them, one GPU gives the same bits.
    export FUSEDMOE_CUDA_EXPERTS=mma
    mpi=(mpirun --allow-run-as-root --oversubscribe -np "$ngpu" -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE
      -x FUSEDMOE_CUDA_EXPERTS -x FUSEDMOE_COMM_TIMEOUT_S=60)
    # T = 2 and 1 too: one GPU then sums in the decode w2 kernel (no shared expert), EP in
    # finalize (at T = 1 one rank has no token).
    # Both transports (FUSEDMOE_EP_TRANSPORT): NCCL all-to-all and stores into peer GPU memory.
    # EP_SKIP_CHECKS=1: the bench only.
    for transport in $([ -n "${EP_SKIP_CHECKS:-}" ] || echo "${EP_TRANSPORTS:-nccl peer}"); do
      for tokens in 256 2 1; do
        for m in "$root/models/tiny-deepseek-v3" tests/data/hf/qwen2_moe tests/data/hf/mixtral; do
          timeout 60 "$bin/fusedmoe" run --backend cuda --model "$m" --tokens $tokens --seed 1 \
            --output "$OUT/one.safetensors" --quiet >"$OUT/ep_one.log" 2>&1
          FUSEDMOE_EP_TRANSPORT=$transport timeout 120 "${mpi[@]}" -x FUSEDMOE_EP_TRANSPORT \
            "$bin/fusedmoe" run --backend cuda --ep-size "$ngpu" --model "$m" \
            --tokens $tokens --seed 1 --reference "$OUT/one.safetensors" --reference-key output \
            --tolerance 1e-6 --quiet >"$OUT/ep_run.log" 2>&1
          r=$?
          [ $r -ne 0 ] && rc=1
          echo "== ep run ($transport) $(basename "$m") T=$tokens on $ngpu GPUs vs one GPU rc=$r: $(grep -E 'reference|error' "$OUT/ep_run.log" | head -3 | tr '\n' ' ')" | tee -a "$OUT/ep_checks.log"
        done
      done
    done
    unset FUSEDMOE_CUDA_EXPERTS
    mpi=(mpirun --allow-run-as-root --oversubscribe -np "$ngpu" -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE
      -x FUSEDMOE_EP_TRANSPORT)
    # The peer transport's experts on the sm90 path where they have many rows
    # (T = 512: one GPU takes it too; the tiles may differ, E vs E / P experts):
    # within bf16 rounding of one GPU.
    if [ -z "${EP_SKIP_CHECKS:-}" ] && [[ " ${EP_TRANSPORTS:-nccl peer} " == *" peer "* ]]; then
      for m in "$root/models/tiny-deepseek-v3" tests/data/hf/qwen2_moe tests/data/hf/mixtral; do
        timeout 60 "$bin/fusedmoe" run --backend cuda --model "$m" --tokens 512 --seed 1 \
          --output "$OUT/one.safetensors" --quiet >"$OUT/ep_one.log" 2>&1
        FUSEDMOE_EP_TRANSPORT=peer timeout 120 "${mpi[@]}" "$bin/fusedmoe" run --backend cuda --ep-size "$ngpu" --model "$m" \
          --tokens 512 --seed 1 --reference "$OUT/one.safetensors" --reference-key output \
          --tolerance 1e-3 --quiet >"$OUT/ep_run.log" 2>&1
        r=$?
        [ $r -ne 0 ] && rc=1
        echo "== ep run (peer, sm90 experts) $(basename "$m") T=512 on $ngpu GPUs vs one GPU rc=$r: $(grep -E 'reference|error' "$OUT/ep_run.log" | head -3 | tr '\n' ' ')" | tee -a "$OUT/ep_checks.log"
      done
    fi
    # The peer transport with one GPU visible to each rank (CUDA_VISIBLE_DEVICES
    # per rank, as some launchers set it): the windows map through CUDA IPC.
    if [ -z "${EP_SKIP_CHECKS:-}" ] && [[ " ${EP_TRANSPORTS:-nccl peer} " == *" peer "* ]]; then
      m=tests/data/hf/qwen2_moe
      timeout 60 "$bin/fusedmoe" run --backend cuda --model "$m" --tokens 256 --seed 1 \
        --output "$OUT/one.safetensors" --quiet >"$OUT/ep_one.log" 2>&1
      FUSEDMOE_EP_TRANSPORT=peer timeout 120 "${mpi[@]}" bash -c \
        'CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK exec "$0" "$@"' "$bin/fusedmoe" run \
        --backend cuda --ep-size "$ngpu" --model "$m" --tokens 256 --seed 1 \
        --reference "$OUT/one.safetensors" --reference-key output --tolerance 1e-6 \
        >"$OUT/ep_run.log" 2>&1
      r=$?
      [ $r -ne 0 ] && rc=1
      echo "== ep run (peer, one visible GPU a rank) $(basename "$m") T=256 on $ngpu GPUs vs one GPU rc=$r: $(grep -E 'reference|error|transport' "$OUT/ep_run.log" | head -3 | tr '\n' ' ')" | tee -a "$OUT/ep_checks.log"
    fi
    for transport in ${EP_TRANSPORTS:-nccl peer}; do
      FUSEDMOE_EP_TRANSPORT=$transport timeout 300 "${mpi[@]}" "$bin/fusedmoe" bench --backend cuda \
        --ep-size "$ngpu" --shapes ${EP_SHAPES:-deepseek,qwen3,mixtral} \
        --tokens ${EP_TOKENS:-1,128,1024,4096} ${EP_BENCH_ARGS:-} 2>&1 | tee "$OUT/ep_bench_$transport${EP_BENCH_TAG:-}.md"
    done
  fi
fi
if [ "$what" = ncu ] || [ "$what" = all ]; then
  # Where the tensor-core path stands: the w13 GEMM of Mixtral at T = 4096.
  timeout 150 ncu --clock-control none -k regex:grouped_gemm_kernel --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis \
    "$bin/bench_cuda_moe" --shapes mixtral --tokens 4096 --routings 1 --iters 1 >"$OUT/ncu.txt" 2>&1
  echo "== ncu rc=$?"
  grep -E "grouped_gemm_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Executed Ipc|Stall|Warp Cycles Per Issued|One or More|No Eligible" "$OUT/ncu.txt" | head -40
fi
exit $rc
