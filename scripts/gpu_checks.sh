#!/usr/bin/env bash
# The prepared GPU checks (issue #35): what a lent GPU host runs first, in one call of at most
# 9 minutes (run it with the device tool's timeout_s=560), most important first, each with its own
# timeout, each writing its results as it ends (a run cut short still leaves the earlier ones). Results: $OUT (the device tool's folder) or
# ./gpu-results: summary.txt (one line per check: status and seconds), <check>.log, and
# results.json (what bench/sections/gpu_checks.py renders into BENCHMARKS-cuda.md: parameters, tokens/s,
# step and memory per run, the rehearsed ranks, plan.target's estimate; MFU computed when rendered).
#
#   bash scripts/gpu_checks.sh            # on the GPU host, from the repository root
#   GPU_CHECKS_SMALL=1 bash scripts/gpu_checks.sh   # the same flow on CPU at toy sizes (a dry run)
#   GPU_CHECKS_ONLY="target-8b results" bash scripts/gpu_checks.sh   # a rerun of some checks
#   GPU_CHECKS_SECONDS=380 GPU_CHECKS_PACK=1 ...   # another deadline; the results packed for the device tool
#   GPU_CHECKS_PP4_RANKS="[3]" GPU_CHECKS_FIT_SEQS="256 128" ...  # the pp=4 rehearsal's ranks; the fit's two lengths
#
# The GPU image may carry another torch (2.11 on the first host) and lack Hydra: put the packages
# it lacks on PYTHONPATH (the device tool's `carry`), as docs/testing.md says. docs/testing.md also
# gives each check's seconds on an H100 and the device tool's call for the checks not yet run there.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SMALL="${GPU_CHECKS_SMALL:-}"
DEVICE=cuda; [ -n "$SMALL" ] && DEVICE=cpu

# The checks share one deadline (GPU_CHECKS_SECONDS, 470 s by default), leaving the last 30 s of the
# 9 minutes to the results: a check gets its own limit or what is left, and none starts with < 15 s.
DEADLINE=$(( $(date +%s) + ${GPU_CHECKS_SECONDS:-470} ))
check() {  # check NAME SECONDS COMMAND...: run it, log it, note its status and time
    local name=$1 limit=$2 start rc left
    shift 2
    if [ -n "${GPU_CHECKS_ONLY:-}" ] && [[ " $GPU_CHECKS_ONLY " != *" $name "* ]]; then
        return
    fi
    start=$(date +%s)
    left=$(( DEADLINE - start ))
    [ "$name" = results ] && left=$limit
    if [ "$left" -lt 15 ]; then
        echo "$name: not run (out of time)" | tee -a "$OUT/summary.txt"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
}

# A Llama-1B-shaped built-in transformer (16 layers of 2048, 32k vocabulary, sequence 2048), random
# init, pp=1; toy sizes for the dry run.
if [ -n "$SMALL" ]; then
    SHAPE=(model.dim=64 model.n_layers=2 model.n_heads=4 data.vocab_size=256 train.seq_len=64 train.batch_size=4)
else
    SHAPE=(model.dim=2048 model.n_layers=16 model.n_heads=16 data.vocab_size=32000 train.seq_len=2048
           train.batch_size=8)
fi
RUN=(python -m runner "device=$DEVICE" parallel.pp=1 parallel.microbatches=1 "${SHAPE[@]}" train.steps=8
     profile.enabled=false checkpoint.every=0)

: > "$OUT/summary.txt"
check env 30 python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
check pytest-gpu 120 python -m pytest -m gpu -q -p no:cacheprovider
# Per-action CUDA spans in a real run (runner/pipeline/device_spans.py): a profiled pp=1 run, 2 microbatches,
# of a model that keeps the device busy (4 layers of 2048, sequence 2048, bf16), its timeline.json's actions
# against the device's copies of the same compute: ranges in its torch trace (bench.sections.gpu_checks's
# timeline_check: durations and starts, action by action; on CPU the trace's host ranges).
if [ -n "$SMALL" ]; then
    TL_SHAPE=("${SHAPE[@]}")
else
    TL_SHAPE=(model.dim=2048 model.n_layers=4 model.n_heads=16 data.vocab_size=32000 train.seq_len=2048
              train.batch_size=8)
fi
check timeline-cuda 90 bash -c '"${@:2}" && python -c "import sys; from bench.sections.gpu_checks import timeline_main
sys.exit(timeline_main(sys.argv[1]))" "$1"' _ "$OUT/runs/timeline-cuda" python -m runner "device=$DEVICE" parallel.pp=1 \
    parallel.microbatches=2 "${TL_SHAPE[@]}" train.steps=6 train.precision=bf16 checkpoint.every=0 \
    "hydra.run.dir=$OUT/runs/timeline-cuda"
check 1b-bf16 150 "${RUN[@]}" train.precision=bf16 "hydra.run.dir=$OUT/runs/1b-bf16"
# The same model, data and optimizer in a hand-written loop (bench/programs/single_loop.py): the
# runner's overhead on one device.
check loop-1b-bf16 90 python bench/programs/single_loop.py "$OUT/runs/1b-bf16" "$OUT/loop-1b-bf16.json" 8
check 1b-fp32 150 "${RUN[@]}" train.precision=fp32 "hydra.run.dir=$OUT/runs/1b-fp32"
check 1b-bf16-compile 180 "${RUN[@]}" train.precision=bf16 train.compile=true "hydra.run.dir=$OUT/runs/1b-bf16-compile"

# Llama-3-8B-shaped ranks rehearsed (a config-only directory: nothing is downloaded), at pp=4 and at
# FSDP dp=8, and plan.target's memory estimate for the same layouts.
python - "$OUT/llama-8b" "$SMALL" <<'EOF'
import sys
from transformers import LlamaConfig
small = bool(sys.argv[2])
LlamaConfig(hidden_size=64 if small else 4096, intermediate_size=128 if small else 14336,
            num_hidden_layers=4 if small else 32, num_attention_heads=4 if small else 32,
            num_key_value_heads=2 if small else 8, vocab_size=256 if small else 128256,
            max_position_embeddings=8192, tie_word_embeddings=False).save_pretrained(sys.argv[1])
EOF
SEQ=512; [ -n "$SMALL" ] && SEQ=32
HF=(model=hf "model.path=$OUT/llama-8b" model.pretrained=false "train.seq_len=$SEQ" train.batch_size=8 train.precision=bf16)
# On the H100 (2026-11-27) an fp32 rank of pp=4 took about a minute (start, build, 3 tracked steps at
# 0.9 s, the timed and profiled ones): bf16, and room for the 4 stage positions one after another.
# (Since then a rehearsal tracks one step, not two, and runs its ranks in one process: not yet timed on a GPU.)
# Most of a rank is its build: each module initialised whole on the CPU (about 2.5 s an 8B decoder layer on
# a CPU core), so FSDP's one rank initialises all 32. No profiled step (no trace): the time goes to the ranks.
check rehearse-8b-pp4 200 python -m runner rehearse=on "device=$DEVICE" "${HF[@]}" parallel.pp=4 parallel.microbatches=4 \
    "rehearse.ranks=${GPU_CHECKS_PP4_RANKS:-null}" profile.enabled=false "hydra.run.dir=$OUT/runs/rehearse-8b-pp4"
check rehearse-8b-fsdp8 150 python -m runner rehearse=on "device=$DEVICE" "${HF[@]}" parallel.pp=1 parallel.dp=8 \
    parallel.dp_mode=fsdp parallel.microbatches=1 profile.enabled=false "hydra.run.dir=$OUT/runs/rehearse-8b-fsdp8"
check target-8b 120 python -m runner.plan "${HF[@]}" "plan.target='NVIDIA H100'" plan.world_size=8 \
    "hydra.run.dir=$OUT/runs/target-8b"

# Lowest priority: rehearse.time_fit_seq_len on the same pp=4 ranks, times measured at S/4 and S/8 (128
# and 64 tokens) and fitted to S = 512 (docs/rehearsal.md, "How close the scaled times are"), against
# rehearse-8b-pp4's full-length times: each stage action's ratio and, where every pipeline rank was
# fitted, the composed step's, as the CPU rehearsal_scale bench section reports them (BENCHMARKS-cuda.md).
# A fitted rank is built three times (memory at S, times at S/4 and at S/8), each initialising its
# quarter of the 8B model on the CPU (about 20 s on an H100 host): rank 3 alone (the head's stage, the
# vocabulary-sized projection the fit is for) by default; GPU_CHECKS_FIT_RANKS=null fits all four
# ranks and composes the step (about 300 s: a call of its own, with 450 s for the check).
# GPU_CHECKS_FIT_SEQS="<time_seq_len> <time_fit_seq_len>" fits from other lengths (S/4 and S/8 read
# 2.6-3.0x the full-length times on an H200, where such short actions are bound by their launches).
FIT_LIMIT=240; [ "${GPU_CHECKS_FIT_RANKS:-}" = null ] && FIT_LIMIT=450
read -r FIT_SEQ FIT_SHORTER <<< "${GPU_CHECKS_FIT_SEQS:-$(( SEQ / 4 )) $(( SEQ / 8 ))}"
check rehearse-8b-pp4-fit "$FIT_LIMIT" python -m runner rehearse=on "device=$DEVICE" "${HF[@]}" parallel.pp=4 parallel.microbatches=4 \
    "rehearse.ranks=${GPU_CHECKS_FIT_RANKS:-[3]}" "rehearse.time_seq_len=$FIT_SEQ" \
    "rehearse.time_fit_seq_len=$FIT_SHORTER" profile.enabled=false "hydra.run.dir=$OUT/runs/rehearse-8b-pp4-fit"

# What the runs measured, in one file (the benchmark section's own reading, rendered into
# BENCHMARKS-cuda.md: bench/sections/gpu_checks.py): per pp=1 run its parameters, tokens/s, step and
# peak memory; the hand-written loop's steps; each rehearsed rank; plan.target's estimate beside it.
check results 30 python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

from bench.sections.gpu_checks import collect

out = Path(sys.argv[1])
(out / "results.json").write_text(json.dumps(collect(out), indent=1))
print((out / "results.json").read_text())
EOF

# The device tool brings back at most 8 files, 2 folders down: with GPU_CHECKS_PACK=1 (its calls, docs/testing.md)
# everything but summary.txt and results.json goes into one gpu-checks.tar.gz (the traces too while it stays
# under 15 MiB).
if [ -n "${GPU_CHECKS_PACK:-}" ]; then
    PACK=$(mktemp -d)
    tar -czf "$PACK/gpu-checks.tar.gz" -C "$OUT" --exclude=./summary.txt --exclude=./results.json .
    if [ "$(stat -c %s "$PACK/gpu-checks.tar.gz")" -gt $(( 15 * 1024 * 1024 )) ]; then
        tar -czf "$PACK/gpu-checks.tar.gz" -C "$OUT" --exclude=./summary.txt --exclude=./results.json --exclude=traces .
    fi
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name results.json -exec rm -rf {} +
    mv "$PACK/gpu-checks.tar.gz" "$OUT/" && rmdir "$PACK"
    ls -l "$OUT"
fi
