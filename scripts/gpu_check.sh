#!/usr/bin/env bash
# The GPU check, one command on a CUDA machine, run from the repository root:
#
#     bash scripts/gpu_check.sh
#
# 1. installs the wheels in .whl/ (the runtime dependencies that machine lacks) into /tmp/site;
#    the project itself runs from this checkout (PYTHONPATH, `python -m tokentrail`: no console script)
# 2. prints nvidia-smi and the versions that matter, and imports the server, worker and CLI
# 3. takes the tiny chatml model carried in .whl/tiny-chatml (built here by `tokentrail model tiny`),
#    or builds it when it is absent
# 4. runs the engine contract suite on the hf engine on that device (float32: logprobs within 1e-4 of
#    a teacher-forced pass on the same device, TF32 off), then once in bfloat16 (informational)
# 5. runs the pipeline benchmark there: engine alone and tokentrail embedded, OA and OpenAI front
#    doors, single-turn and agent loops, concurrency 8 and 32 (table, JSON, plot)
# 6. time allowing, the same benchmark (OpenAI front door) on a ~290M-parameter random-weights Llama
#    with the tiny tokenizer, in bfloat16, where the GPU rather than the pipeline sets the pace
#
# Everything useful lands in $OUT (at most 8 files): summary.txt (each step's rc and seconds), env.log,
# contract.log, pipeline.log, pipeline.json, pipeline_<device>.png, big.log, big.json. A failing step
# does not stop the later ones; the script exits with 1 if any step failed (the informational bfloat16
# contract run aside), summary.txt says which (rc 124: the step reached its time limit).
#
# The same script runs anywhere (a CPU check of the script itself):
#     GPU_CHECK_DEVICE=cpu GPU_CHECK_DURATION=2 GPU_CHECK_CONCURRENCY=8 GPU_CHECK_INSTALL=0 \
#         OUT=/tmp/gpu-check bash scripts/gpu_check.sh
# Variables: GPU_CHECK_DEVICE (cuda), GPU_CHECK_DTYPE (float32), GPU_CHECK_DURATION (s per point, 6),
# GPU_CHECK_CONCURRENCY (8,32), GPU_CHECK_INSTALL (1: install the wheels), GPU_CHECK_WHEELS (.whl),
# GPU_CHECK_SITE (/tmp/site), GPU_CHECK_MODEL (a model dir; default the carried tiny model),
# GPU_CHECK_BIG (1 on cuda, 0 on cpu), GPU_CHECK_BIG_LAYERS (24), GPU_CHECK_BUDGET_S (360: the big-model
# step is skipped when it would end later), GPU_CHECK_PYTHON (python3), GPU_CHECK_SKIP (steps to leave out,
# space-separated: contract contract-bf16 pipeline big).

set -u
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
T0=$(date +%s)

DEVICE=${GPU_CHECK_DEVICE:-cuda}
DTYPE=${GPU_CHECK_DTYPE:-float32}
DURATION=${GPU_CHECK_DURATION:-6}
CONCURRENCY=${GPU_CHECK_CONCURRENCY:-8,32}
INSTALL=${GPU_CHECK_INSTALL:-1}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
MODEL=${GPU_CHECK_MODEL:-$ROOT/.whl/tiny-chatml}
BUDGET_S=${GPU_CHECK_BUDGET_S:-360}
PY=${GPU_CHECK_PYTHON:-python3}
if [ "$DEVICE" = cuda ]; then BIG=${GPU_CHECK_BIG:-1}; else BIG=${GPU_CHECK_BIG:-0}; fi
BIG_LAYERS=${GPU_CHECK_BIG_LAYERS:-24}
SKIP=" ${GPU_CHECK_SKIP:-} "

OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
ENV_LOG=$OUT/env.log
: >"$SUMMARY"
: >"$ENV_LOG"
exec 3>&1  # the console, for the steps' status lines whatever their output is redirected to
export DEVICE DTYPE DURATION CONCURRENCY WHEELS SITE MODEL PY BIG BIG_LAYERS

export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
export TOKENTRAIL_CACHE_DIR=${TOKENTRAIL_CACHE_DIR:-/tmp/tokentrail-cache}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing outside can be reached there

elapsed() { echo $(($(date +%s) - T0)); }
if ! command -v timeout >/dev/null; then
    timeout() { shift 5 && "$@"; } # no coreutils timeout: run without a limit (always called as -s INT -k 20 N)
fi
want() { # want STEP: not named in GPU_CHECK_SKIP
    case "$SKIP" in *" $1 "*) echo "$1 skipped (GPU_CHECK_SKIP)" | tee -a "$SUMMARY"; return 1 ;; esac
}

# step NAME TIMEOUT_S COMMAND...: runs it (a function of this script too) under a time limit (SIGINT, so
# that the benchmark stops its server and worker; SIGKILL 20 s later) and records its rc and seconds in
# summary.txt. Often the left side of a pipe (a subshell): summary.txt, not a variable, keeps the rcs.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name (limit ${limit}s, at $(elapsed)s)" >&3
    if declare -F "$1" >/dev/null; then
        timeout -s INT -k 20 "$limit" bash -c '"$@"' step "$@"
    else
        timeout -s INT -k 20 "$limit" "$@"
    fi
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - start))s (done at $(elapsed)s)" | tee -a "$SUMMARY" >&3
    return "$rc"
}

# ---- 1. the wheels --------------------------------------------------------------------------------
install_wheels() {
    shopt -s nullglob
    local wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ "${#wheels[@]}" -eq 0 ]; then
        echo "no wheels in $WHEELS"
        return 1
    fi
    echo "${#wheels[@]} wheels from $WHEELS into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}
export -f install_wheels
if [ "$INSTALL" = 1 ]; then
    step install 120 install_wheels 2>&1 | tee -a "$ENV_LOG"
    export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
    echo "install skipped (GPU_CHECK_INSTALL=$INSTALL)" >>"$ENV_LOG"
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

# ---- 2. the machine and the versions --------------------------------------------------------------
environment() {
    echo "device=$DEVICE dtype=$DTYPE duration=$DURATION concurrency=$CONCURRENCY big=$BIG python=$PY"
    echo "PYTHONPATH=$PYTHONPATH"
    uname -a
    nproc
    free -g 2>/dev/null | head -2
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "no nvidia-smi"; fi
    "$PY" - "$DEVICE" <<'EOF'
import importlib, importlib.metadata as md, sys

print("python", sys.version.split()[0], sys.executable)
for dist in ("torch", "transformers", "tokenizers", "huggingface-hub", "safetensors", "numpy", "fastapi", "starlette",
             "pydantic", "pydantic-core", "sqlalchemy", "uvicorn", "websockets", "httpx", "anyio", "typer", "rich",
             "click", "typing-extensions", "uvloop", "pyarrow", "matplotlib", "psutil"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist} MISSING")
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "matmul precision", torch.get_float32_matmul_precision())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs")
failed = []
for mod in ("tokentrail.cli", "server.app", "worker.engines.hf", "worker.client", "worker.runner", "text_client.repl",
            "benchmarks.pipeline.cli", "benchmarks.pipeline.engine", "benchmarks.pipeline.stack"):
    try:
        m = importlib.import_module(mod)
        print(f"  import {mod}: ok ({m.__file__})")
    except Exception as exc:  # report them all, then fail
        failed.append(mod)
        print(f"  import {mod}: FAILED {type(exc).__name__}: {exc}")
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    failed.append("cuda")
sys.exit(1 if failed else 0)
EOF
}
export -f environment
step environment 90 environment 2>&1 | tee -a "$ENV_LOG"

# ---- 3. the model ---------------------------------------------------------------------------------
if [ ! -f "$MODEL/tokentrail.json" ] && [ ! -f "$MODEL/config.json" ]; then
    MODEL=/tmp/tiny-chatml
    step build-model 300 "$PY" -m tokentrail model tiny --out "$MODEL" 2>&1 | tee -a "$ENV_LOG"
fi
echo "model: $MODEL ($(du -sh "$MODEL" 2>/dev/null | cut -f1))" | tee -a "$SUMMARY"

# ---- 4. the engine contract -----------------------------------------------------------------------
want contract && step contract 150 "$PY" tests/engine_contract.py --engine hf --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" 2>&1 | tee "$OUT/contract.log"
if [ "$DEVICE" = cuda ] && want contract-bf16; then
    # informational: 16-bit rounding differs between a batched decode step and a teacher-forced pass
    echo "=== informational: the same suite in bfloat16 (tolerance 0.5)" >>"$OUT/contract.log"
    step contract-bf16-informational 120 "$PY" tests/engine_contract.py --engine hf --model "$MODEL" \
        --device "$DEVICE" --dtype bfloat16 2>&1 | tee -a "$OUT/contract.log"
fi

# ---- 5. the pipeline benchmark --------------------------------------------------------------------
want pipeline && step pipeline 300 "$PY" benchmarks/pipeline.py --engine hf --device "$DEVICE" --dtype "$DTYPE" \
    --arms engine,embedded --api oa,openai --workload single,agent --concurrency "$CONCURRENCY" \
    --duration "$DURATION" --model-dir "$MODEL" --json-out "$OUT/pipeline.json" \
    --plot "$OUT/pipeline_$DEVICE.png" 2>&1 | tee "$OUT/pipeline.log"

# ---- 6. a bigger model ----------------------------------------------------------------------------
# about 10 s to build, an engine child and a stack to start, 4 points per arm: 8 x DURATION + ~80 s
BIG_NEEDS=$((8 * ${DURATION%.*} + 80))
if [ "$BIG" = 1 ] && [ $(($(elapsed) + BIG_NEEDS)) -le "$BUDGET_S" ] && want big; then
    big_model() {
        "$PY" - "$MODEL" /tmp/big-model "$DEVICE" "$BIG_LAYERS" <<'EOF'
import shutil, sys, time
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, LlamaForCausalLM

tiny, out, device, layers = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
config = AutoConfig.from_pretrained(tiny)
config.update({"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": layers,
               "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64})
torch.manual_seed(0)
with torch.device(device):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
model.generation_config = GenerationConfig.from_pretrained(tiny)
out.mkdir(parents=True, exist_ok=True)
model.save_pretrained(out)
for f in tiny.iterdir():  # the tokenizer and chat template
    if f.is_file() and f.name not in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(f, out / f.name)
n = sum(p.numel() for p in model.parameters())
print(f"big model: {n / 1e6:.0f}M parameters (random weights, bfloat16) in {out}, {time.perf_counter() - t0:.1f}s")
EOF
    }
    export -f big_model
    step big-model 90 big_model 2>&1 | tee "$OUT/big.log"
    LEFT=$((BUDGET_S + 60 - $(elapsed)))  # its limit: what the budget leaves, plus a minute
    step big-pipeline $((LEFT > 60 ? LEFT : 60)) "$PY" benchmarks/pipeline.py --engine hf --device "$DEVICE" \
        --dtype bfloat16 \
        --arms engine,embedded --api openai --workload single,agent --concurrency "$CONCURRENCY" \
        --duration "$DURATION" --model-dir /tmp/big-model --json-out "$OUT/big.json" 2>&1 | tee -a "$OUT/big.log"
elif [ "$BIG" = 1 ]; then
    echo "big model skipped (at $(elapsed)s of ${BUDGET_S}s it needs ~${BIG_NEEDS}s)" | tee -a "$SUMMARY"
fi

FIRST_RC=$(awk '$1 !~ /informational/ && $2 ~ /^rc=/ { rc = substr($2, 4); if (rc != 0) { print rc; exit } }' "$SUMMARY")
echo "total $(elapsed)s, first failing rc ${FIRST_RC:-0}" | tee -a "$SUMMARY"
# 1 for any failure (a step's own rc, 124 at its time limit included, is in summary.txt): an exit
# status of 124 would read as the whole command running out of time
[ "${FIRST_RC:-0}" = 0 ]
