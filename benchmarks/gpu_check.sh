#!/usr/bin/env bash
# The one check a session runs when it is lent a GPU (H200, python3 3.12 with torch and triton, no Hydra, no network):
#   bash benchmarks/gpu_check.sh          (carry .whl: benchmarks/fetch_gpu_wheels.sh fills it here, once)
# Steps, each under its own `timeout`, all within GPU_CHECK_BUDGET seconds (default 300), going on after failures:
# nvidia-smi; the twin checkpoint; pytest -m gpu; decode on CUDA (graphs and eager, batch 1 8 64, one pass); the
# KDA/MLA kernel benchmark (tp 1); a serve smoke test (a graph per sampling mode, the openai client, 8 concurrent
# streams, SIGTERM); load on CUDA (one run). Output in $OUT (default /tmp/gpu_check), seven files: gpu_check.log
# (everything printed), summary.json (per step: exit code, seconds, limit), pytest.xml, decode.json,
# kda_kernel.json, serve.json, load.json. Then, as a second command: benchmarks/decode_48b.py (README there).
# Exit 0: every step passed; 1: a step failed or timed out; 2: no CUDA device here (nothing run; the JSON says so).
# GPU_CHECK_DRY=1 rehearses every step on the CPU (device cpu, the twin, a few tokens, the kernels under Triton's
# interpreter at toy shapes; limits x GPU_CHECK_SLACK, 4) and must exit 0 there: a step's own bugs show before a GPU
# does (tests/unit/test_gpu_check.py runs it with a larger GPU_CHECK_BUDGET).
#
# Limits on the H200 (torch 2.11, issue 38's first run): decode took about 12 s a launch.py point (6 points), load
# about 10 s a run, so one pass of each fits its limit with room; the whole script should end in about 4 minutes.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/gpu_check}"
if [ -z "${GPU_CHECK_INNER:-}" ]; then  # everything below goes to the log too; tee is done when we exit
    mkdir -p "$OUT"
    GPU_CHECK_INNER=1 bash "$0" "$@" 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
cd "$ROOT"
START=$SECONDS
BUDGET="${GPU_CHECK_BUDGET:-300}"
DRY="${GPU_CHECK_DRY:-}"
SLACK="${GPU_CHECK_SLACK:-$([ -n "$DRY" ] && echo 4 || echo 1)}"  # a rehearsal's CPU is slower: its limits x4
export PYTHONUNBUFFERED=1 K3DIST_CACHE="${K3DIST_CACHE:-/tmp/k3cache}" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -n "${GPU_CHECK_DRY:-}" ] && export CUDA_VISIBLE_DEVICES=""  # a rehearsal runs on the CPU even beside a GPU
WORK="$(mktemp -d /tmp/gpu_check_work.XXXX)"  # step records and Markdown copies: not among $OUT's files
STEPS="$WORK/steps.tsv"
: >"$STEPS"

summary() {  # summary.json from the steps so far (rewritten after each step, so a kill still leaves it)
    python3 - "$STEPS" "$WORK/env.json" "$OUT/summary.json" "$1" <<'EOF'
import json, sys
steps = [dict(zip(("step", "rc", "seconds", "limit"), line.split("\t"))) for line in open(sys.argv[1]) if line.strip()]
steps = [{k: v if k == "step" else int(v) for k, v in s.items()} | {"timed_out": s["rc"] in ("124", "137")}
         for s in steps]
try:
    env = json.load(open(sys.argv[2]))
except (OSError, ValueError):
    env = {}
json.dump({"status": sys.argv[4], **env, "steps": steps}, open(sys.argv[3], "w"), indent=1)
EOF
}

step() {  # step NAME LIMIT_S COMMAND...: run under min(limit, what the budget has left); record exit code and time
    local name=$1 limit=$2
    shift 2
    limit=$((limit * SLACK))
    local left=$((BUDGET - (SECONDS - START) - 5))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
        echo "=== $name: skipped, the budget is spent"
        printf '%s\t125\t0\t0\n' "$name" >>"$STEPS"
        summary running
        return
    fi
    echo "=== $name (limit ${limit}s, at ${SECONDS}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0))s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$STEPS"
    summary running
}

timeout 60 python3 - "$WORK/env.json" <<'EOF'
import json, platform, sys
import torch
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
json.dump(env, open(sys.argv[1], "w"))
print("gpu_check:", env)
sys.exit(0 if env["device"] else 3)
EOF
if [ $? -ne 0 ] && [ -z "${GPU_CHECK_DRY:-}" ]; then
    echo "gpu_check: no CUDA device visible to python3's torch: nothing to check on this machine"
    for name in decode kda_kernel serve load; do
        echo '{"skipped": "no CUDA device"}' >"$OUT/$name.json"
    done
    summary "skipped: no CUDA device"
    exit 2
fi

if compgen -G ".whl/*.whl" >/dev/null; then  # Hydra and its dependencies: nothing can be fetched there
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 -c "import hydra, omegaconf" || echo "gpu_check: no hydra/omegaconf: carry .whl (benchmarks/fetch_gpu_wheels.sh)"

if [ -n "$DRY" ]; then  # the same steps on the CPU, at the smallest sizes that still run each one
    DEV=cpu
    SMI=(python3 -c "print('gpu_check dry run: no GPU, no nvidia-smi')")
    DECODE=(--device cpu --worlds 1 --batches 1 --compile auto --max-new-tokens 4 --no-transformers --timeout 200)
    KERNELS=(--device cpu --tp 1 --batches 1 --lengths 64)
    SERVE=(--device cpu --batch 2 --cap 256 --max-tokens 4)
else
    DEV=cuda
    SMI=(nvidia-smi)
    DECODE=(--device cuda --batches 1 8 64 --compile auto off --timeout 60)
    KERNELS=(--tp 1)
    SERVE=(--device cuda --batch 8)
fi

step nvidia-smi 20 "${SMI[@]}"
step twin 60 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import common; print(common.twin_dir())"
step pytest-gpu 90 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --junitxml="$OUT/pytest.xml"
step decode 120 python3 benchmarks/decode.py "${DECODE[@]}" --repeats 1 \
    --json "$OUT/decode.json" --out-md "$WORK/decode-$DEV.md"
step kda_kernel 60 python3 benchmarks/kda_kernel.py "${KERNELS[@]}" --json "$OUT/kda_kernel.json"
step serve 60 python3 benchmarks/serve_smoke.py "${SERVE[@]}" --json "$OUT/serve.json"
step load 40 python3 benchmarks/load.py --device "$DEV" --worlds 1 --repeats 1 --timeout $((30 * SLACK)) \
    --json "$OUT/load.json" --out-md "$WORK/load-$DEV.md"

if awk -F'\t' '$2 != 0 {bad = 1} END {exit bad}' "$STEPS"; then
    summary passed
    echo "gpu_check: every step passed in $((SECONDS - START))s"
    exit 0
fi
summary failed
echo "gpu_check: some steps failed ($((SECONDS - START))s): see summary.json"
exit 1
