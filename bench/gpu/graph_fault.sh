#!/usr/bin/env bash
# Issue 15: why the graphed sync-free FlexMoELayer faulted at replay, and whether the fix holds.
#   OUT=/some/dir bash bench/gpu/graph_fault.sh        # one H200, at most ~5.5 minutes wall
# (setup, then two waves of at most WAVE_TIMEOUT=150 s; the sanitizer runs, SAN_TIMEOUT=230 s,
# run beside the waves; PROBE and SAN may be overridden for a dry run of this script.)
# Every experiment is bench/gpu/graph_probe.py in its own process (a fault poisons the CUDA
# context) under its own `timeout`, at the failing shapes: DeepSeek-V3-like at 128 tokens/expert
# ("ds128") and Qwen3-30B-A3B at 512 ("qw512"). Three compute-sanitizer runs start first and
# run beside two waves of the others (each wave in parallel, WAVE_TIMEOUT s per process).
# Logs: $OUT/graph_fault_logs/<name>.log; results: $OUT/graph_fault.json; a summary on stdout.
# "fix" = this branch's code; "old" = --old-flag, the routing-check flag update before the fix.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OUT="${OUT:-/tmp/graph_fault_out}"
WAVE_TIMEOUT=${WAVE_TIMEOUT:-150}
SAN_TIMEOUT=${SAN_TIMEOUT:-230}
LOGS="$OUT/graph_fault_logs"
mkdir -p "$LOGS"
T0=$(date +%s)
python3 -c "import megatron.core" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/megatron_core-*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/graph_fault_gpu.txt"
SAN=${SAN:-$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)}
PROBE=${PROBE:-python3 bench/gpu/graph_probe.py}
DS="--shape deepseek_v3_like --tokens-per-expert 128"
QW="--shape qwen3_30b_a3b --tokens-per-expert 512"

# name | expected outcome | environment | probe arguments
SANITIZER=(
  "san_nocache_dispatch_ds128|pass, 0 memcheck errors|PYTORCH_NO_CUDA_MEMORY_CACHING=1|--part dispatch --mode eager --steps 1 $DS"
  "san_nocache_dispatch_qw512|pass, 0 memcheck errors|PYTORCH_NO_CUDA_MEMORY_CACHING=1|--part dispatch --mode eager --steps 1 $QW"
  "san_dispatch_ds128|pass, 0 memcheck errors||--part dispatch --mode eager --steps 2 $DS"
)
WAVE_A=(
  "fix_dispatch_ds128|pass||--part dispatch --steps 5 $DS"
  "fix_dispatch_qw512|pass||--part dispatch --steps 5 $QW"
  "fix_layer_ds128|pass||--part layer --steps 5 $DS"
  "fix_layer_qw512|pass||--part layer --steps 5 $QW"
  "old_blocking_dispatch_ds128|fault at fwd replay 0|CUDA_LAUNCH_BLOCKING=1 TORCH_SHOW_CPP_STACKTRACES=1|--part dispatch --old-flag $DS"
  "old_blocking_dispatch_qw512|fault at fwd replay 0|CUDA_LAUNCH_BLOCKING=1 TORCH_SHOW_CPP_STACKTRACES=1|--part dispatch --old-flag $QW"
  "nocache_eager_dispatch_ds128|pass|PYTORCH_NO_CUDA_MEMORY_CACHING=1|--part dispatch --mode eager --steps 3 $DS"
  "nocache_eager_dispatch_qw512|pass|PYTORCH_NO_CUDA_MEMORY_CACHING=1|--part dispatch --mode eager --steps 3 $QW"
  "fix_layer_qw1024|pass||--part layer --steps 3 --shape qwen3_30b_a3b --tokens-per-expert 1024"
  "fix_layer_qw2048|pass (chunked expert MLP)||--part layer --steps 2 --shape qwen3_30b_a3b --tokens-per-expert 2048"
)
WAVE_B=(
  "old_dispatch_qw128|pass (as before the fix at this size)||--part dispatch --old-flag --shape qwen3_30b_a3b --tokens-per-expert 128"
  "old_noemptycache_dispatch_ds128|pass (old flag mapped, inactive)||--part dispatch --old-flag --no-empty-cache $DS"
  "old_noemptycache_dispatch_qw512|pass (old flag mapped, inactive)||--part dispatch --old-flag --no-empty-cache $QW"
  "old_pinned_dispatch_ds128|pass||--part dispatch --pin-flags $DS"
  "old_pinned_dispatch_qw512|pass||--part dispatch --pin-flags $QW"
  "fix_whole_dispatch_ds128|pass||--part dispatch --mode whole_graph --steps 5 $DS"
  "fix_whole_dispatch_qw512|pass||--part dispatch --mode whole_graph --steps 5 $QW"
  "old_whole_dispatch_ds128|pass (one capture: old flag freed but mapped)||--part dispatch --mode whole_graph --old-flag $DS"
  "fix_torchgathers_dispatch_ds128|pass||--part dispatch --torch-gathers $DS"
  "fix_layer_ds512|pass||--part layer --steps 3 --shape deepseek_v3_like --tokens-per-expert 512"
)

: > "$OUT/graph_fault_plan.txt"
launch() {  # launch <timeout> <sanitize 0|1> <spec>
  local limit=$1 sanitize=$2 name expect envs args
  IFS='|' read -r name expect envs args <<< "$3"
  echo "$name|$expect|$envs|$args|$sanitize" >> "$OUT/graph_fault_plan.txt"
  local cmd="$PROBE $args --variant $name"
  if [[ $sanitize == 1 ]]; then
    local api="--report-api-errors no"
    [[ $envs == *NO_CUDA_MEMORY_CACHING* ]] || api=""
    cmd="$SAN --tool memcheck --print-limit 10 $api $cmd"
  fi
  ( echo "+ env $envs timeout -k 10 $limit $cmd"
    env $envs timeout -k 10 "$limit" $cmd
    echo "@@rc $?" ) > "$LOGS/$name.log" 2>&1 &
  LAUNCHED+=($!)
}

SAN_PIDS=()
if [[ -n $SAN ]]; then
  LAUNCHED=()
  for spec in "${SANITIZER[@]}"; do launch "$SAN_TIMEOUT" 1 "$spec"; done
  SAN_PIDS=("${LAUNCHED[@]}")
else
  echo "compute-sanitizer not found: the sanitizer runs are skipped" | tee "$OUT/graph_fault_no_sanitizer.txt"
fi
run_wave() {  # run_wave <label> <spec>...: all in parallel, then wait for them
  local label=$1
  shift
  LAUNCHED=()
  for spec in "$@"; do launch "$WAVE_TIMEOUT" 0 "$spec"; done
  wait "${LAUNCHED[@]}"
  echo "$label done at $(( $(date +%s) - T0 )) s"
}
run_wave "wave A" "${WAVE_A[@]}"
run_wave "wave B" "${WAVE_B[@]}"
[[ ${#SAN_PIDS[@]} -gt 0 ]] && wait "${SAN_PIDS[@]}"
echo "all done at $(( $(date +%s) - T0 )) s"

python3 - "$OUT" <<'EOF'
import json, os, re, sys

out = sys.argv[1]
logs = os.path.join(out, "graph_fault_logs")
rows = []
for line in open(os.path.join(out, "graph_fault_plan.txt")):
    name, expect, envs, args, sanitize = line.rstrip("\n").split("|")
    text = open(os.path.join(logs, name + ".log"), errors="replace").read()
    probe = None
    for ln in text.splitlines():
        if "@@probe " in ln:
            probe = json.loads(ln.split("@@probe ", 1)[1])
    rc = re.findall(r"^@@rc (\d+)", text, re.M)
    row = dict(name=name, expect=expect, env=envs, args=args, rc=int(rc[-1]) if rc else None)
    if probe is None:
        tail = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("=========")][-6:]
        row.update(passed=False, stage=None,
                   error=("timeout " if row["rc"] in (124, 137) else "") + "no @@probe line; log tail: " + " | ".join(tail)[-900:])
    else:
        row.update(probe)
    if sanitize == "1":
        lines = text.splitlines()
        errors = []
        for i, ln in enumerate(lines):
            if re.match(r"=+ (Invalid|Out-of-range|Misaligned|Malformed|Cuda API error|Program hit)", ln) and len(errors) < 6:
                block = [ln.strip("= ")]
                for nxt in lines[i + 1:i + 7]:
                    s = nxt.strip("= ").strip()
                    if re.match(r"(at |by thread|Address|and is|Device Frame)", s):
                        block.append(s)
                errors.append(" / ".join(block)[:400])
        summary = [ln.strip("= ") for ln in lines if "ERROR SUMMARY" in ln]
        row["sanitizer"] = dict(summary=summary[-1] if summary else None, first_errors=errors)
    rows.append(row)
json.dump(rows, open(os.path.join(out, "graph_fault.json"), "w"), indent=1)

def flag_state(r):
    reads = r.get("captured_flag_reads") or []
    if not reads:
        return "-"
    return ",".join("mapped/" + str(x.get("block_state")) if x["mapped"] else "UNMAPPED" for x in reads)

print(f"\n{'experiment':34} {'passed':6} {'stage':14} {'flag read by capture':22} expected / error / sanitizer")
for r in rows:
    err = (r.get("error") or "").strip().splitlines()
    err = err[-1][:150] if err else ""
    san = r.get("sanitizer")
    extra = f" | sanitizer: {san['summary']}; {san['first_errors'][:2]}" if san else ""
    probs = r.get("problems") or []
    print(f"{r['name']:34} {str(r.get('passed')):6} {str(r.get('stage'))[:14]:14} {flag_state(r)[:22]:22} "
          f"[{r['expect']}] {err}{' ' + str(probs[:2]) if probs else ''}{extra}")
print(f"\nwrote {os.path.join(out, 'graph_fault.json')}")
EOF
exit 0
