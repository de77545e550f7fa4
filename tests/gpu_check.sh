#!/usr/bin/env bash
# Everything that needs GPUs, in one call (writes logs under $OUT, prints a short summary last):
#   bash tests/gpu_check.sh            # on a host with >= 2 GPUs (4 for the FSDP step rows)
# 1. GPU tests (RMSNorm vs float64, compiled/graphed vs eager, attention backend)
# 2. flux-debug loss parity, 1 GPU vs 2 GPUs
# 3. one-GPU forward+backward bench: stock diffusers vs ours, ablations, FP8 rows, in the same process
# 4. full training step, FSDP2 over all GPUs: stock diffusers + FSDP2 vs our trainer (>= 20 steps), and ours
#    with gradient accumulation 4
set -u
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")

CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")"

DEBUG="--config configs/debug.yaml --set data.source=synthetic --set perf.attention=auto --set train.device=cuda
       --set train.max_steps=6 --set train.micro_batch_size=4 --set logging.log_every=1 --set eval.every_steps=3
       --set eval.target=0 --set logging.progress_bar=false"
for n in 1 2; do
  torchrun --standalone --nproc_per_node=$n -m flux_train.train $DEBUG --set logging.out_dir="$OUT/parity$n" \
    > "$OUT/parity$n.log" 2>&1 || echo "parity run on $n GPU(s) failed: see $OUT/parity$n.log"
done
python3 - "$OUT" <<'EOF'
import json, sys
def losses(n):
    try:
        return [round(json.loads(l)["loss"], 6) for l in open(f"{sys.argv[1]}/parity{n}/metrics.jsonl") if '"loss"' in l]
    except OSError:
        return None
print("parity 1 GPU:", losses(1)); print("parity 2 GPU:", losses(2))
EOF

CUDA_VISIBLE_DEVICES=0 python3 -m flux_train.bench --config configs/bench.yaml --ablate --fp8 rowwise,tensorwise \
  --steps 8 --json "$OUT/fwdbwd.json" > "$OUT/fwdbwd.log" 2>&1 || echo "fwdbwd bench failed: see $OUT/fwdbwd.log"
STEP="--config configs/systems/H200_01x08.yaml --mode step"
torchrun --standalone --nproc_per_node="$NGPU" -m flux_train.bench $STEP --steps 20 --json "$OUT/step.json" \
  > "$OUT/step.log" 2>&1 || echo "step bench failed: see $OUT/step.log"
torchrun --standalone --nproc_per_node="$NGPU" -m flux_train.bench $STEP --steps 5 --accum 4 --json "$OUT/accum.json" \
  > "$OUT/accum.log" 2>&1 || echo "accumulation step bench failed: see $OUT/accum.log"
grep -h -A12 "matmul ceiling" "$OUT/fwdbwd.log" "$OUT/step.log" "$OUT/accum.log"
