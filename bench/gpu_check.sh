#!/usr/bin/env bash
# The GPU check in one call (a lent H100 / H200 with its own torch and Triton): install this checkout,
# then the stages named in STAGES, most wanted first, each within its own cap and the time left:
#   env      the card, driver, torch / Triton / transformers versions
#   flash    bench/kernels.py's flash attention cases alone
#   step     bench/step.py at the default shape (plain HF, Liger, tplayers at TP 1 on both backends)
#   step32k  bench/step.py at vocabulary 32000
#   kernels  bench/kernels.py (the GEMMs and flash attention first, then the rest), no tests
#   sweep    bench/sweep.py: every candidate tile config of the TMA GEMM and flash attention
#   tests    `pytest -m kernel tests` under TPLAYERS_TEST_DEVICE=cuda
# Wheels in .whl/ (liger-kernel, a transformers of the tested version) go first on PYTHONPATH.
# Writes $OUT/run.log (everything) and $OUT/results.tgz (bench/out, remade after each stage).
#   usage: [STAGES="step kernels"] bash bench/gpu_check.sh [SECONDS, default 480]
set -u
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
END=$(($(date +%s) + ${1:-480}))
STAGES=${STAGES:-"env step kernels sweep tests"}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

log() { echo "[$(date +%T)] $*" | tee -a "$OUT/run.log"; }

stage() { # stage NAME CAP CMD...: CMD within min(CAP, seconds left), its output into run.log
    local name=$1 cap=$2 left=$((END - $(date +%s)))
    shift 2
    [[ " $STAGES " == *" $name "* ]] || return 0
    ((left < cap)) && cap=$left
    if ((cap < 20)); then
        log "$name: skipped (${left}s left)"
        return 0
    fi
    log "$name: up to ${cap}s: $*"
    timeout -k 5 "$cap" "$@" >>"$OUT/run.log" 2>&1
    log "$name: exit $?"
    tar czf "$OUT/results.tgz" --exclude=out/gpu -C bench out 2>/dev/null
}

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$OUT/run.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/run.log" 2>&1 || log "install failed"

stage env 30 bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
    python3 -c "import liger_kernel" && echo liger-kernel importable'
stage flash 80 python3 bench/kernels.py --no-tests --only flash_attention --out bench/out/flash
stage step 170 python3 bench/step.py --steps 8
stage kernels 110 env TRITON_PRINT_AUTOTUNING=1 python3 bench/kernels.py --no-tests --only matmul flash_attention \
    --out bench/out/kernels
stage kernels 80 python3 bench/kernels.py --no-tests --only grouped_matmul swiglu vocab_ce grad_stats \
    --out bench/out/kernels_rest
stage sweep 120 python3 bench/sweep.py
stage step32k 120 python3 bench/step.py --steps 8 --vocab 32000 --out bench/out/step32k
stage tests 240 env TPLAYERS_TEST_DEVICE=cuda python3 -m pytest -m kernel tests -v -n 12 --tb=short -rfE \
    -p no:cacheprovider
log "done"
grep -E "FAILED|^\[|^(hf|liger|tplayers)|^(matmul|flash|grouped|swiglu|vocab|unscale)|passed|failed|Error" "$OUT/run.log" | tail -n 150
