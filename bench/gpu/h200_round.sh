#!/usr/bin/env bash
# The one-H200 GPU round (nvidia-h200), in steps that fit the device tool's calls and its
# 30 s warm window:  bash bench/gpu/h200_round.sh STEP [STEP ...]
#   setup      install the carried megatron-core wheel (.whl/) into the machine's python3
#   bg NAME..  copy the tree to /tmp/round/tree_<time> and start the named tasks there in a new
#              session (setsid), one after another, so they go on while later calls stage
#              Transformer Engine; their results land in /tmp/round/out. A task named `wait`
#              inside such a list waits for the background lists started before it (timings
#              then run alone on the GPU)
#   par NAME.. the same with each task in a list of its own (correctness tasks side by side)
#   wait       wait (at most WAIT_S seconds, default 540) for the background lists
#   after:NAME inside a list: wait until task NAME (of any list) has ended
#   NAME       run one task in the foreground (results in /tmp/round/out)
#   summary    print every result JSON, compact and cut to SUMMARY_CHARS each
#   pack       tar /tmp/round/out into $OUT/round_<date>.tgz (the tool returns at most 8 files)
# Tasks: smoke budget_loads ab_cost ep_hybridep8 ep_deepep slice_table te_install hybridep_real uccl_real ep_on_one_gpu ep_uccl deepep_v1_build hybridep_build device_checks cuda_graph_train graph_te_diag experts_te bias permute
#        layer_bench graphs recompute pretrain_local pretrain_te pretrain_small pretrain_det
#        pretrain_det32 te_init_check pretrain_qwen3 fused_experts fused_experts_tests slice_bench host_profile pretrain_slice
#        pretrain_slice_det megatron_tools det_numerics (QuACK: source /tmp/quack_env.sh first)
#        apex_build text_data real_text real_force real_dsv3 (the real-settings table, below)
#        rerun_check wgrad_check fp8_check fp8_wgrad_check; ab_arch layer_parity (issue 51).
# Transformer Engine comes from ../shared/tools/te-on-device (source /tmp/te_env.sh first); the
# HybridEP build (.gpu/hybridep, bench/gpu/HYBRIDEP.md), the uccl pieces (.gpu/uccl,
# .gpu/uccl-wheel), DeepEP V1 intranode (.gpu/deepep-v1; `.gpu/deepep-src/build.sh v1|hybrid`
# builds it, or HybridEP, there from DeepEP's sources) and Megatron-LM's pretrain_gpt.py
# (.gpu/megatron-lm) are carried, never committed.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROUND=${ROUND:-/tmp/round}
RES=$ROUND/out
mkdir -p "$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

task() {  # name timeout_s command...: one task, its log and exit code recorded; never aborts
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  (export OUT=$RES PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"; timeout "$limit" "$@") > "$RES/$name.log" 2>&1
  local rc=$?
  printf '%s\trc=%s\t%ss\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" | tee -a "$RES/tasks.tsv"
  tail -5 "$RES/$name.log"
}

# The real-settings tasks' common environment (TE when staged; graphed_slice.sh says when it is not).
# QuACK (staged by ../shared/tools/quack-on-device) adds the expert weight gradients into main_grad in
# the budget mode (experts/wgrad.py); it is put on the path only after wgrad_check passed.
REAL_ENV="{ [ ! -f /tmp/te_env.sh ] || source /tmp/te_env.sh; } && \
{ [ ! -f /tmp/quack_wgrad_ok ] || source /tmp/quack_env.sh; } && export FUSION_WGRAD=1 BUDGET_POLICY=rerun \
MEDIAN_FROM=5 TEXT_DATA=\${TEXT_DATA:-$ROUND/data/pydoc} OVERLAP=\${OVERLAP:-auto} &&"

run_task() {
  case $1 in
    hybridep_real) task hybridep_real 480 $PY bench/gpu/hybridep_real.py ${HYBRIDEP_ARGS:-} ;;
    uccl_real) task uccl_real 200 $PY bench/gpu/uccl_real.py ;;
    ep_on_one_gpu) task ep_on_one_gpu 800 $PY bench/gpu/ep_on_one_gpu.py ${EP_ARGS:-} ;;
    ep_uccl) task ep_uccl 300 env OUT=$RES/uccl $PY bench/gpu/ep_on_one_gpu.py --backends uccl_ep --worlds 4 8 ;;
    # its fused-experts case needs QuACK (staged in earlier calls: /tmp/quack_env.sh)
    ep_hybridep8) task ep_hybridep8 420 bash -c "[ -f /tmp/quack_env.sh ] && source /tmp/quack_env.sh; \
        OUT=$RES/hybridep8 $PY bench/gpu/ep_on_one_gpu.py --backends hybridep --worlds 8" ;;
    ep_deepep) task ep_deepep 120 env OUT=$RES/deepep $PY bench/gpu/ep_on_one_gpu.py --backends deepep --worlds 4 8 ;;
    # AB_KINDS="dropless budget recompute graphs" adds issue 38's recompute and graph benchmarks
    ab_cost) task ab_cost 900 bash bench/gpu/ab_cost.sh ;;
    # Transformer Engine's install from what earlier calls staged: the parts in /tmp/te and the kit
    # copied to /tmp/te_stage/kit (so a list started before the kit arrived can run it).
    te_install) task te_install 420 bash /tmp/te_stage/kit/device.sh install /tmp/te_stage ;;
    deepep_v1_build) task deepep_v1_build 300 env PYTHON=$PY bash .gpu/deepep-src/build.sh v1 ;;
    hybridep_build) task hybridep_build 300 env PYTHON=$PY bash .gpu/deepep-src/build.sh hybrid ;;
    device_checks) task device_checks 240 bash -c "$PY -m pytest tests/dispatcher/test_errors.py -q -rs \
        -p no:cacheprovider -k 'device_value_checks or sm_count'; $PY -m pytest tests/experts/test_kernels.py \
        tests/experts/test_bias.py -q -rs -p no:cacheprovider" ;;
    cuda_graph_train) task cuda_graph_train 300 $PY bench/gpu/cuda_graph_train.py --steps 50 ;;
    graph_te_diag) task graph_te_diag 420 bash -c 'for v in default no-weakref dense dense,no-weakref; do \
        flags=$(echo ,$v | sed "s/,default//; s/,/ --/g"); '"$PY"' bench/gpu/cuda_graph_train.py --steps 20 \
        --modes local_whole_layer $flags --out $OUT/cuda_graph_train_te_diag_${v/,/_}.json | tail -2; done' ;;
    experts_te) task experts_te 300 $PY bench/gpu/experts_te_tests.py ;;
    bias) task bias 120 $PY bench/gpu/bias_bench.py --quick ;;
    permute) task permute 300 bash -c "$PY -m pytest tests/dispatcher/test_gather_kernels.py -q -rs \
        -p no:cacheprovider; tests=\$?; $PY bench/permute_bench.py --dtype bf16 fp32; exit \$((tests | \$?))" ;;
    smoke) task smoke 300 $PY -m pytest tests/experts/test_mlp.py tests/dispatcher/test_indexed_rows.py -q -rs \
        -p no:cacheprovider ;;  # the layer's expert paths on CUDA (after a change no GPU has seen)
    layer_bench) task layer_bench 330 $PY bench/moe_layer_bench.py ${LAYER_ARGS:-} ;;
    graphs) task graphs 360 $PY bench/moe_layer_graphs.py ${GRAPHS_ARGS:---tokens-per-expert 128 512 1024 --steps 50} ;;
    recompute) task recompute 200 $PY bench/gpu/moe_recompute.py --layers 4 --iters 30 --warmup 5 --profile ;;
    pretrain_local) task pretrain_local 320 env RUNS="local_native local_ext" bash bench/gpu/pretrain_megatron_lm.sh ;;
    pretrain_te) task pretrain_te 320 env RUNS="te_native te_ext" bash bench/gpu/pretrain_megatron_lm.sh ;;
    pretrain_small) task pretrain_small 420 env RUNS="local_native local_ext te_native te_ext" \
        bash bench/gpu/pretrain_megatron_lm.sh ;;
    pretrain_det) task pretrain_det 580 env RUNS="${DET_RUNS:-det_local_native det_local_ext det_local_ext_sequential_mlp \
        det_te_native det_te_ext det_te_ext_te_grouped_mlp}" bash bench/gpu/pretrain_megatron_lm.sh ;;
    pretrain_det32) task pretrain_det32 480 env RUNS="${DET32_RUNS:-det32_local_native det32_local_ext det32_te_native \
        det32_te_ext}" bash bench/gpu/pretrain_megatron_lm.sh ;;
    te_init_check) task te_init_check 120 $PY bench/gpu/te_init_check.py ;;
    fused_experts) task fused_experts 300 $PY bench/gpu/fused_experts_check.py ${FUSED_ARGS:-} ;;
    fused_experts_tests) task fused_experts_tests 300 $PY -m pytest tests/experts/test_fused.py tests/experts/test_kernels.py tests/megatron/test_fused_experts.py -q -rfs --tb=short \
        -p no:cacheprovider ;;
    pretrain_qwen3) task pretrain_qwen3 420 env RUNS="${QWEN3_RUNS:-qwen3_te_native qwen3_te_ext qwen3_te_ext_te_grouped_mlp}" \
        bash bench/gpu/pretrain_megatron_lm.sh ;;
    # Issue 27: one MoE layer at per-rank loads (bench/moe_slice_bench.py), and pretrain_gpt.py on
    # the Qwen3-30B-A3B EP8 rank slice (the slice_* / det_slice_* runs of pretrain_megatron_lm.sh).
    slice_bench) task slice_bench 420 $PY bench/moe_slice_bench.py ${SLICE_ARGS:-} ;;
    host_profile) task host_profile 300 $PY bench/gpu/host_profile.py ${HOST_PROFILE_ARGS:-} ;;
    pretrain_slice) task pretrain_slice 480 env RUNS="${SLICE_RUNS:-slice_native slice_ext slice_ext_grouped_mm}" \
        bash bench/gpu/pretrain_megatron_lm.sh ;;
    pretrain_slice_det) task pretrain_slice_det 480 env RUNS="${DET_SLICE_RUNS:-det_slice_ext det_slice_ext_repeat \
        det_slice_ext_grouped_mm det_slice_native det_slice_native_unfused_swiglu}" bash bench/gpu/pretrain_megatron_lm.sh ;;
    megatron_tools) task megatron_tools 570 bash -c "te() { [ -f /tmp/te_env.sh ] && source /tmp/te_env.sh; true; }; \
        (te; bash bench/gpu/megatron_functional.sh unit_tests > \$OUT/megatron_unit_tests.console 2>&1) & u=\$!; \
        for what in ${MEGATRON_TOOLS:-functional hybrid}; do (te; bash bench/gpu/megatron_functional.sh \$what); done; \
        wait \$u" ;;
    # Issue 41's numerics: the budget mode beside Megatron's own rounding-only variant, and
    # Megatron's dense model under the same graph settings (bench/gpu/graphed_slice.sh, det_*).
    # Issue 41's table on one card (graphed_slice_<card>_table.json): the baseline and the
    # budget mode's whole-iteration graphs first, then the rest of the table as time allows.
    slice_table) task slice_table 600 bash -c "source /tmp/te_env.sh && OVERLAP=\${OVERLAP:-1} TIMEOUT=150 \
        CALL_BUDGET=\${TABLE_CALL_BUDGET:-560} MEDIAN_FROM=5 TAG=table RUNS='${TABLE_RUNS:-native_recipe ext_budget_full native_eager \
        ext_eager ext_recipe ext_budget_local native_attn ext_budget_eager}' bash bench/gpu/graphed_slice.sh" ;;
    # The budget factor the slice's routing needs at EP 2/4/8, forced balance and aux loss alone.
    budget_loads) task budget_loads 420 bash -c "source /tmp/te_env.sh && OVERLAP=\${OVERLAP:-1} TIMEOUT=200 \
        CALL_BUDGET=\${LOADS_CALL_BUDGET:-400} \
        MEDIAN_FROM=5 TAG=loads RUNS='loads_ext_budget_eager aux_loads_ext_budget_eager' \
        bash bench/gpu/graphed_slice.sh --iters ${LOADS_ITERS:-40}" ;;
    det_numerics) task det_numerics 570 bash -c "source /tmp/te_env.sh && SLICE_LAYERS=4 OVERLAP=1 TIMEOUT=150 \
        CALL_BUDGET=550 MEDIAN_FROM=5 TAG=det_spread RUNS='${DET_NUMERICS_RUNS:-det_ext_eager det_ext_budget_eager \
        det_native_eager det_native_unfused_eager det_dense_eager det_dense_local det_dense_full}' \
        bash bench/gpu/graphed_slice.sh --iters 50" ;;
    # The real-settings table (issue 48), most evidence first; every run with Megatron's gradient-
    # accumulation fusion (apex_build: apex's fused_weight_gradient_mlp_cuda into /tmp/apexbuild from
    # the carried .gpu/apex, ~1 min) and the budget runs with the rerun policy. text_data keeps the
    # carried dataset (.gpu/data/pydoc.*, bench/data/build_text_dataset.py) in $ROUND/data while the
    # machine is warm. real_text: the Qwen3 slice on that text with the aux loss alone, REAL_ITERS
    # (200) iterations: the baseline, native's graphed drop-and-pad at 1.25, the budget mode's
    # whole-iteration graphs with factor auto (~4-6 min each). real_force: forced balance on mock
    # data, 12 iterations (continuity with earlier tables; 6 runs, ~9 min with OVERLAP=0).
    # real_dsv3: the DeepSeek-V3-like slice (3 layers, vocab 32768: fits an 80 GB H100), 12 iterations,
    # DSV3_DATA (text) and DSV3_BALANCE (aux). OVERLAP=auto: start-ups overlap on an H200 only. The
    # first two outlast a 600 s device call: run the three as one background list, e.g.
    # bg "wait real_text real_force real_dsv3", and `wait` in the calls after it.
    # The GPU checks of the gradient-accumulation fusion, the rerun policy and the FP8 experts
    # (each script's docstring says what it checks); QuACK and TE where staged.
    rerun_check) task rerun_check 300 bash -c "$PY bench/gpu/rerun_check.py && $PY bench/gpu/rerun_check.py --graphs" ;;
    wgrad_check) task wgrad_check 420 bash -c "{ [ ! -f /tmp/quack_env.sh ] || source /tmp/quack_env.sh; } \
        && $PY bench/gpu/wgrad_fusion_check.py && { [ ! -f /tmp/quack_env.sh ] || touch /tmp/quack_wgrad_ok; }" ;;
    fp8_check) task fp8_check 420 bash -c "{ [ ! -f /tmp/te_env.sh ] || source /tmp/te_env.sh; } \
        && $PY bench/gpu/fp8_experts_check.py" ;;
    fp8_wgrad_check) task fp8_wgrad_check 300 $PY bench/gpu/fp8_wgrad_check.py ;;
    # Issue 51's GPU must-holds: this tree against the one before the redesign (.gpu/ab_base, made
    # by `AB_BASE=<commit> bash bench/gpu/ab_cost.sh prepare`), ABBA, every kind; Megatron's layer
    # against FlexMoELayer at EP 1 (fp32 and bf16); local-graph training bitwise equal to eager is
    # the task cuda_graph_train.
    ab_arch) task ab_arch 1100 env AB_KINDS="dropless budget recompute graphs" bash bench/gpu/ab_cost.sh ;;
    layer_parity) task layer_parity 300 $PY -m torch.distributed.run --standalone --nproc-per-node 1 \
        bench/gpu/megatron_layer_parity.py ;;
    apex_build) task apex_build 300 bash -c "[ -e /tmp/apexbuild/fused_weight_gradient_mlp_cuda.so ] \
        || bash .gpu/apex/build.sh" ;;
    text_data) task text_data 60 bash -c "mkdir -p $ROUND/data && cp .gpu/data/pydoc.* $ROUND/data/ \
        && ls -l $ROUND/data" ;;
    real_text) task real_text "${REAL_TASK_S:-1800}" bash -c "$REAL_ENV TAG=real_text DATA=text BALANCE=aux \
        TIMEOUT=\${REAL_TIMEOUT:-480} CALL_BUDGET=\$((${REAL_TASK_S:-1800} - 60)) \
        RUNS='${REAL_TEXT_RUNS:-native_recipe native_dnp125 ext_budget_full_auto}' \
        bash bench/gpu/graphed_slice.sh --iters ${REAL_ITERS:-200}" ;;
    real_force) task real_force 960 bash -c "$REAL_ENV TAG=real_force DATA=mock BALANCE=force TIMEOUT=150 \
        CALL_BUDGET=\${FORCE_CALL_BUDGET:-900} RUNS='${REAL_FORCE_RUNS:-native_recipe native_dnp100 native_dnp125 \
        ext_recipe ext_budget_full ext_budget_full_auto}' bash bench/gpu/graphed_slice.sh --iters 12" ;;
    real_dsv3) task real_dsv3 600 bash -c "$REAL_ENV TAG=real_dsv3 DATA=${DSV3_DATA:-text} \
        BALANCE=${DSV3_BALANCE:-aux} DSV3_LAYERS=3 DSV3_VOCAB=32768 TIMEOUT=200 \
        CALL_BUDGET=\${DSV3_CALL_BUDGET:-570} \
        RUNS='${REAL_DSV3_RUNS:-dsv3_native_recipe dsv3_native_dnp125 dsv3_ext_budget_full_auto}' \
        bash bench/gpu/graphed_slice.sh --iters 12" ;;
    *) echo "unknown task $1"; return 2 ;;
  esac
}

step=${1:-}
while [ $# -gt 0 ]; do
  step=$1; shift
  case $step in
    setup)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RES/nvidia_smi.txt"
      $PY -c "import megatron.core" 2>/dev/null || $PY -m pip install -q --no-index --no-deps .whl/megatron_core-*.whl
      $PY -c "import torch, megatron.core as m; print('torch', torch.__version__, 'mcore', m.__version__)" | tee "$RES/versions.txt" ;;
    bg|par)
      names="$*"; set --
      tree="$ROUND/tree_$(date +%s%N)"  # a later call replaces this working tree; the copy stays
      mkdir -p "$tree" && cp -a . "$tree/"
      if [ "$step" = bg ]; then lists=("$names"); else read -ra lists <<< "$names"; fi
      for list in "${lists[@]}"; do
        id=$(date +%s%N); touch "$ROUND/running_$id"  # removed when the list ends; `wait` reads them
        (cd "$tree" && BG_ID=$id setsid nohup bash -c "for t in $list; do bash bench/gpu/h200_round.sh \$t; done; \
          rm -f $ROUND/running_$id" > "$tree.$id.log" 2>&1 < /dev/null &)
        echo "background list $id: $list"
      done ;;
    after:*)  # after:NAME waits (at most WAIT_S seconds) until task NAME has ended in any list
      for _ in $(seq "${WAIT_S:-540}"); do grep -q "^${step#after:}	" "$RES/tasks.tsv" 2>/dev/null && break; sleep 1; done ;;
    wait)  # for the background lists started before this one (all, outside a list)
      mine=$(ls "$ROUND"/running_* 2>/dev/null | while read -r f; do [[ "$f" > "$ROUND/running_${BG_ID:-z}" ]] || [ "$f" = "$ROUND/running_${BG_ID:-}" ] || echo "$f"; done)
      for _ in $(seq "${WAIT_S:-540}"); do
        left=0; for f in $mine; do [ -e "$f" ] && left=1; done; [ $left = 0 ] && break; sleep 1
      done
      cat "$RES/tasks.tsv" ;;
    summary)  # every result JSON on stdout, compact (the reply's output tail comes back even
              # when the files under $OUT do not)
      $PY - "$RES" "${SUMMARY_CHARS:-1800}" <<'PYEOF'
import glob, json, os, sys
res, limit = sys.argv[1], int(sys.argv[2])
for path in sorted(glob.glob(os.path.join(res, "**", "*.json"), recursive=True)):
    try:
        text = json.dumps(json.load(open(path)), separators=(",", ":"))
    except Exception as exc:
        text = f"unreadable: {exc}"
    print(f"@@ {os.path.relpath(path, res)} {len(text)} {text[:limit]}")
PYEOF
      ;;
    pack)
      cp "$ROUND"/tree_*.log "$RES/" 2>/dev/null; cp /tmp/te/build.log "$RES/te_build.log" 2>/dev/null
      tar czf "$OUT/round_$(date +%H%M%S).tgz" -C "$RES" . && ls -la "$OUT" ;;
    *) run_task "$step" ;;
  esac
done
