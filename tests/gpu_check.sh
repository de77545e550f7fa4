#!/usr/bin/env bash
# Everything that needs GPUs, by stage (logs under $OUT, a short summary printed last):
#   bash tests/gpu_check.sh tests      GPU tests: tests/gpu/, and the kernels' and FP8's tests of tests/unit
#                                      on the GPU (Triton kernels vs references in bf16, graphed vs eager on 1 and 2
#                                      GPUs, the layouts at 4; GPU_TESTS_K="expr" selects some, as pytest -k): on 4+
#                                      GPUs four groups side by side (~7 min), else one after another (over 20 min;
#                                      TESTS_TIMEOUT, 1500 s, cuts each group)
#   bash tests/gpu_check.sh casts      the FP8 cast kernel alone at every operand shape of a batch-16 step, vs its byte floor
#   bash tests/gpu_check.sh fwdbwd     one-GPU forward+backward bench, stock vs ours, FP8 (ours, torchao), ablations
#                                      (FWDBWD_ROWS=a,b selects rows, ATTENTION=cudnn|flash|auto sets perf.attention,
#                                      BATCH="8 4" the batches, DEPTH="6 12" double and single blocks (default the
#                                      full model), NO_PROFILE=" " no profiles, SAME_PROCESS=1 all rows in one
#                                      process, EXTRA="--set k=v" more settings)
#   bash tests/gpu_check.sh graphs     the trainer with/without CUDA graphs at micro-batch 16 and 4 (1 GPU,
#                                      flux-schnell's width at 6+12 blocks: the 12B model's optimizer needs 2 GPUs),
#                                      and forward+backward of the same model for the step efficiency (FP8=delayed
#                                      for FP8, MBS="16 4" the micro-batches, ACCUM=n accumulation)
#   bash tests/gpu_check.sh fp8-numerics   STEPS (1000) steps bf16 vs FP8 (delayed) on a learnable synthetic stream
#                                      (1 GPU, 4 + 8 blocks): the losses' largest gap after step 100, FP8 overflows;
#                                      FP8_GPU=m runs the FP8 run on GPU m beside the bf16 one
#   bash tests/gpu_check.sh step-small two-GPU training step at flux-schnell's width and 6 + 12 blocks, micro-batch 8:
#                                      stock FSDP2, ours ddp bf16 and FP8 delayed, graphs on and off (80 GB GPUs;
#                                      DEPTH="19 38" the full model on two H200, VARIANTS="none:false delayed:true"
#                                      our rows as FP8 recipe:graphs, EXTRA="--set k=v" more settings)
#   bash tests/gpu_check.sh step       full flux-schnell training step on all GPUs: stock FSDP2 vs ours (fsdp, ddp,
#                                      FP8, accumulation 4, graphs), profiles, eval rate, step efficiency refs
#   bash tests/gpu_check.sh whole      the whole model at its GBS (512) on all GPUs, with accumulation, in the system
#                                      config of the host's kind (WHOLE_CONFIG; configs/systems/H100_01x04.yaml on 4
#                                      H100), profiled: stock FSDP2 at micro-batch 8 without checkpointing, stock with
#                                      diffusers' checkpointing, ours bf16 and FP8 delayed, in the config's layout
#                                      and micro-batch (WHOLE_MB sets another, EXTRA="--set k=v" more settings of
#                                      our rows); WHOLE_ROWS="stock stock-ac bf16 fp8" picks (on 4 H100 unprofiled:
#                                      stock 45-90 s, bf16 80 s, FP8 100-155 s, the row's row_s; all four fit a call)
#   bash tests/gpu_check.sh trainer    the trainer itself on all GPUs, the whole model as a system config runs it
#                                      (TRAINER_CONFIG; default configs/systems/H100_01x04.yaml, H200_01x04.yaml on
#                                      H200s) on synthetic data of the bench's shapes, TRAINER_STEPS (30) steps:
#                                      preempted after the first logged step (SIGUSR2: a checkpoint, exit 75), then
#                                      the same command resumed to the end, an eval and a final save where a second
#                                      checkpoint fits (TRAINER_DIR the run folder, default in /dev/shm where the
#                                      12B state, 143 GB, fits; FP8=delayed for FP8; TRAINER_PHASE=preempt, then
#                                      resume: the two runs in two calls; each run cut at TRAINER_TIMEOUT, 560 s;
#                                      EXTRA="--set k=v" more settings)
#   bash tests/gpu_check.sh checkpoint save/load and async-save timings of the trainer's full state on all GPUs,
#                                      flux-schnell's width at reduced depth (the 12B state, ~167 GB, is larger
#                                      than some machines' disks); the GB/s rates carry over to the full model
# Each bench command is cut off after STAGE_TIMEOUT seconds (default 420), so one hang does not take the call.
# Stages can be combined: bash tests/gpu_check.sh tests fwdbwd. One-GPU stages take GPU=n (default 0), so two of
# them can run side by side on a two-GPU machine (GPU=1 bash tests/gpu_check.sh fp8-numerics &).
set -u
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # what the nvidia env profile sets on Slurm
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}  # NGPU=2: a CPU rehearsal (trainer)
ROWS="$OUT/rows.jsonl"
LIMIT=${STAGE_TIMEOUT:-420}
ONE=${GPU:-0}
# the unit tests that run on the GPU where there is one: the kernels' and FP8's
ON_THE_GPU_TOO=(tests/unit/test_kernels.py tests/unit/test_fp8.py)
DEPTH_SET=${DEPTH:+--set model.num_layers=${DEPTH% *} --set model.num_single_layers=${DEPTH#* }}
bench() { timeout "$LIMIT" python3 -m flux_train.bench --json "$ROWS" "$@"; }
tbench() { timeout "$LIMIT" torchrun --standalone --nproc_per_node="$NGPU" -m flux_train.bench --json "$ROWS" "$@"; }
log() { echo "[$(date +%T)] $*"; }
gpu_tests() {  # name, CUDA_VISIBLE_DEVICES, pytest's arguments: each test's outcome in gpu_tests.log as it ends
  local name=$1 gpus=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus timeout "${TESTS_TIMEOUT:-1500}" python3 -m pytest -v -p no:cacheprovider --durations=8 \
    "$@" > "$OUT/gpu_tests_$name.log" 2>&1
  grep -E " (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests_$name.log" | sed "s/^/[$name] /" >> "$OUT/gpu_tests.log"
  log "gpu tests ($name): $(tail -n 1 "$OUT/gpu_tests_$name.log")"
}
kind() { python3 -c "import torch; print('H200' if 'H200' in torch.cuda.get_device_name() else 'H100')"; }
of_config() {  # a config file, a Python expression of its `cfg` (checkpoint_bytes at hand): the value printed
  python3 -c "from flux_train.config import load_config
from flux_train.training.checkpoint_size import checkpoint_bytes
cfg = load_config('$1'); print($2)"
}

for stage in "$@"; do
  case $stage in
  tests)
    if [ "$NGPU" -ge 4 ] && [ -z "${GPU_TESTS_K:-}" ]; then
      # four groups side by side (the tests are small: they share GPUs), of about 6-7 minutes each as measured on
      # 4 H100 (one after another they take over 20); a group's first GPU runs its one-GPU tests
      MULTI="four_ranks or two_gpus or trainer_graphed_steps or user_first"
      gpu_tests four 0,1,2,3 tests/gpu/test_gpu.py -k four_ranks &
      gpu_tests two 0,1 tests/gpu/test_gpu.py -k two_gpus &
      gpu_tests one 2 tests/gpu -k "not ($MULTI)" &
      gpu_tests kernels 3,2 "${ON_THE_GPU_TOO[@]}" tests/gpu/test_gpu.py -k "not test_gpu.py or user_first or trainer_graphed_steps" &
      wait
    else
      gpu_tests all "$ONE" tests/gpu "${ON_THE_GPU_TOO[@]}" ${GPU_TESTS_K:+-k "$GPU_TESTS_K"}
    fi ;;
  fwdbwd)
    ALL=stock-eager,stock,ours,ours-fp8-delayed,ours-fp8-tensorwise,ours-fp8-rowwise,torchao-fp8-tensorwise,torchao-fp8-rowwise,ours-no-graphs,ours-no-compile,ours-torch-rmsnorm
    for batch in ${BATCH:-16}; do
      CUDA_VISIBLE_DEVICES=$ONE bench --mode fwdbwd --batch "$batch" --steps 8 ${NO_PROFILE:---profile} \
        --rows "${FWDBWD_ROWS:-$ALL}" --set perf.attention="${ATTENTION:-auto}" $DEPTH_SET ${EXTRA:-} \
        ${SAME_PROCESS:+--same-process} >> "$OUT/fwdbwd_gpu$ONE.log" 2>&1 || log "fwdbwd batch $batch: rows failed (fwdbwd_gpu$ONE.log)"
      log "fwdbwd batch $batch ${DEPTH:+depth $DEPTH }done: $(grep -c '^ROW {' "$OUT/fwdbwd_gpu$ONE.log") rows so far"
    done ;;
  casts)
    CUDA_VISIBLE_DEVICES=$ONE bench --mode casts --batch "${BATCH:-16}" >> "$OUT/casts.log" 2>&1 || log "casts failed: see casts.log"
    log "casts done" ;;
  graphs)
    SMALL="--config configs/systems/H200_01x08.yaml --set model.num_layers=6 --set model.num_single_layers=12
           --set parallel.strategy=ddp --set perf.attention=auto --set perf.fp8=${FP8:-none} --set perf.fp8_impl=ours"
    for mb in ${MBS:-16 4}; do
      CUDA_VISIBLE_DEVICES=$ONE bench --mode fwdbwd --batch $mb --steps 8 --rows ours $SMALL \
        >> "$OUT/graphs.log" 2>&1 || log "fwdbwd mb $mb failed: see graphs.log"
      for g in false true; do
        CUDA_VISIBLE_DEVICES=$ONE timeout "$LIMIT" torchrun --standalone --nproc_per_node=1 -m flux_train.bench --json "$ROWS" \
          --mode step --rows ours $SMALL --set train.micro_batch_size=$mb --set perf.cuda_graphs=$g --steps 10 \
          --accum "${ACCUM:-1}" ${PROFILE_STEP:+--profile} >> "$OUT/graphs.log" 2>&1 || log "graphs mb $mb $g failed: see graphs.log"
      done
    done
    log "graphs done" ;;
  fp8-numerics)
    NUM="--config configs/systems/H200_01x08.yaml --set model.num_layers=4 --set model.num_single_layers=8
         --set data.source=synthetic --set data.synthetic_train_samples=512 --set data.synthetic_val_samples=64
         --set data.synthetic_text_len=256 --set data.synthetic_latent_size=32 --set train.micro_batch_size=8
         --set train.global_batch_size=8 --set train.lr=1e-4 --set train.warmup_steps=20 --set train.max_steps=${STEPS:-1000}
         --set eval.enabled=false --set logging.log_every=10 --set logging.progress_bar=false --set parallel.strategy=ddp
         --set checkpoint.every_steps=0 --set perf.attention=auto --set perf.fp8_impl=ours"
    for fp8 in none delayed; do  # side by side where FP8_GPU names a second GPU (each run needs ~40 GB)
      gpu=$ONE; [ $fp8 = delayed ] && gpu=${FP8_GPU:-$ONE}
      CUDA_VISIBLE_DEVICES=$gpu python3 -m flux_train.train $NUM --set perf.fp8=$fp8 --set logging.out_dir="$OUT/num_$fp8" \
        > "$OUT/num_$fp8.log" 2>&1 || log "fp8 numerics $fp8 failed: see num_$fp8.log" &
      [ "${FP8_GPU:-$ONE}" = "$ONE" ] && wait
    done
    wait
    python3 - "$OUT" <<'EOF' | tee "$OUT/fp8_numerics.txt"
import json, sys
def rows(tag):
    try:
        return [r for r in map(json.loads, open(f"{sys.argv[1]}/num_{tag}/metrics.jsonl")) if "loss" in r]
    except OSError:
        return []
a = {r["step"]: r["loss"] for r in rows("none")}
fp8 = rows("delayed")
b = {r["step"]: r["loss"] for r in fp8}
steps = [s for s in sorted(a) if s > 100 and s in b]
worst = max((abs(b[s] / a[s] - 1) for s in steps), default=float("nan"))
print("fp8 numerics: logged steps after 100:", len(steps), "largest |fp8/bf16 - 1|:", round(worst, 4), "(goal < 0.01)")
print("bf16:", [round(a[s], 4) for s in steps][::10])
print("fp8: ", [round(b[s], 4) for s in steps][::10])
# fp8_overflows: (layer, operand) pairs whose step maximum exceeded what their scale held, counted from the start
counts = [(r["step"], r.get("fp8_overflows", 0)) for r in fp8]
per_step = [(s, (n - m) / (s - t)) for (t, m), (s, n) in zip([(0, 0)] + counts, counts)]
print("fp8 overflows: total", counts[-1][1] if counts else None, "per step by logging window (every 10th):",
      [(s, round(x, 2)) for s, x in per_step][::10])
EOF
    ;;
  step-small)  # two 80 GB GPUs: the full model's ddp optimizer does not fit, its width at 6 + 12 blocks does
    # (DEPTH="19 38" on two H200: the full model); VARIANTS="fp8:graphs ..." picks our rows
    SMALL="--mode step --config configs/systems/H200_01x08.yaml --set train.micro_batch_size=8 --steps 10
           ${DEPTH_SET:---set model.num_layers=6 --set model.num_single_layers=12} ${EXTRA:-}"
    tbench $SMALL --rows stock > "$OUT/step_small.log" 2>&1 || log "stock step failed"
    for variant in ${VARIANTS:-none:true none:false delayed:true delayed:false}; do
      fp8=${variant%:*} g=${variant#*:}
      tbench $SMALL --rows ours --set parallel.strategy=ddp --set perf.fp8=$fp8 --set perf.cuda_graphs=$g \
        ${PROFILE_STEP:+--profile} >> "$OUT/step_small.log" 2>&1 || log "ours step fp8=$fp8 graphs=$g failed"
    done
    log "step-small done: $(grep -c '^ROW {' "$OUT/step_small.log") rows" ;;
  step)  # the comparison that matters: stock vs ours, bf16 and FP8, with profiles and step-efficiency references
    STEP="--mode step --config configs/systems/H200_01x08.yaml --set train.micro_batch_size=8 --steps 10"
    tbench $STEP --rows stock ${STOCK_PROFILE---profile} > "$OUT/step_stock.log" 2>&1 || log "stock step failed"
    log "stock step done"
    tbench $STEP --rows ours --profile --set parallel.strategy=ddp > "$OUT/step_ddp.log" 2>&1 || log "ddp step failed"
    log "ddp step done"
    tbench $STEP --rows ours --profile --set parallel.strategy=ddp --set perf.fp8=tensorwise --set perf.fp8_impl=torchao \
      > "$OUT/step_ddp_fp8.log" 2>&1 || log "ddp fp8 step failed"
    log "ddp fp8 step done"
    tbench $STEP --rows ours --profile --set parallel.strategy=ddp --set perf.fp8=delayed \
      > "$OUT/step_ddp_fp8_delayed.log" 2>&1 || log "ddp fp8 delayed step failed (out of memory is a one-line stop, exit 5)"
    log "ddp fp8 delayed step done"
    [ -n "${SKIP_REFS:-}" ] && continue
    for fp8 in none tensorwise; do  # step-efficiency references: one GPU, forward+backward at the micro-batch
      CUDA_VISIBLE_DEVICES=0 bench --mode fwdbwd --batch 8 --steps 8 --rows ours --set perf.fp8=$fp8 \
        --set perf.fp8_impl=torchao --set perf.cuda_graphs=false >> "$OUT/step_refs.log" 2>&1
    done
    log "step stage done" ;;
  step-more)  # graphs at micro-batch 4, accumulation, the fsdp layout (before), NCCL's Simple protocol
    STEP="--mode step --config configs/systems/H200_01x08.yaml --set train.micro_batch_size=8 --steps 8"
    for g in true false; do
      tbench $STEP --rows ours --profile --set parallel.strategy=ddp --set train.micro_batch_size=4 \
        --set perf.cuda_graphs=$g >> "$OUT/step_graphs.log" 2>&1 || log "graphs=$g step mb 4 failed"
    done
    log "graphs done"
    tbench $STEP --rows ours --set parallel.strategy=ddp --accum 4 --steps 3 > "$OUT/step_accum.log" 2>&1 \
      || log "accum step failed"
    log "accum done"
    tbench $STEP --rows ours --set parallel.strategy=fsdp --steps 4 > "$OUT/step_fsdp.log" 2>&1 || log "fsdp step failed"
    log "fsdp done"
    NCCL_PROTO=Simple tbench $STEP --rows ours --set parallel.strategy=ddp --set perf.fp8=tensorwise \
      --set perf.fp8_impl=torchao > "$OUT/step_simple.log" 2>&1 || log "simple step failed"
    log "step-more stage done" ;;
  whole)  # the whole model at its GBS on all GPUs in the system config of the host's kind, each row profiled
    SYS=${WHOLE_CONFIG:-configs/systems/$(kind)_01x0$NGPU.yaml}
    GBS=$(of_config "$SYS" cfg.train.global_batch_size) MB=${WHOLE_MB:-$(of_config "$SYS" cfg.train.micro_batch_size)}
    WHOLE="--mode step --config $SYS --steps 2 ${NO_PROFILE:---profile}" ACC=$((GBS / (MB * NGPU)))
    OURS="$WHOLE --rows ours --set train.micro_batch_size=$MB --accum $ACC --set perf.warmup_iters=1 ${EXTRA:-}"
    log "whole: $SYS, ours $(of_config "$SYS" cfg.parallel.strategy) at $MB x $ACC a GPU"
    for row in ${WHOLE_ROWS:-stock stock-ac bf16 fp8}; do
      case $row in
        stock) tbench $WHOLE --rows stock --set parallel.activation_checkpointing=false --set train.micro_batch_size=8 \
                 --accum $((GBS / (8 * NGPU))) ;;
        stock-ac) tbench $WHOLE --rows stock --set train.micro_batch_size=$MB --accum $ACC ;;
        bf16) tbench $OURS ;;
        fp8) tbench $OURS --set perf.fp8=delayed ;;
        *) echo "unknown whole row $row (stock, stock-ac, bf16, fp8)"; exit 2 ;;
      esac >> "$OUT/whole_$row.log" 2>&1 || log "whole $row failed: see whole_$row.log"
      log "whole $row: $(grep -h '^ROW' "$OUT/whole_$row.log" | tail -1 | cut -c1-160)"
    done ;;
  trainer)
    SYS=${TRAINER_CONFIG:-configs/systems/$(kind)_01x0$NGPU.yaml} N=${TRAINER_STEPS:-30} PHASE=${TRAINER_PHASE:-both}
    TLIMIT=${TRAINER_TIMEOUT:-560}  # each run's (a phase fits a 10-minute call)
    CKPT_GB=$(of_config "$SYS" "int(checkpoint_bytes(cfg) / 1e9) + 1")
    free_gb() { df --output=avail -B1000000000 "$1" | tail -n 1 | tr -d " "; }
    # host memory writes a checkpoint many times faster than a local disk (0.5-0.7 GB/s measured): the 12B state,
    # 143 GB, goes to /dev/shm where it fits
    SHM=/tmp; [ "$(free_gb /dev/shm)" -gt $((CKPT_GB * 11 / 10)) ] && SHM=/dev/shm
    RUN=${TRAINER_DIR:-$SHM/flux_trainer_run}
    mkdir -p "$RUN"
    # where only one checkpoint fits (a 235 GB disk), the resumed run ends without its final save
    FINAL=true; [ "$(free_gb "$RUN")" -lt $((CKPT_GB * 21 / 10)) ] && FINAL=false
    [ "$PHASE" = resume ] && FINAL=$(cat "$RUN/.final" 2>/dev/null || echo false)
    log "trainer: $SYS, $N steps, run folder $RUN ($(free_gb "$RUN") GB free, a checkpoint ${CKPT_GB} GB, final save: $FINAL)"
    TRAIN=(torchrun --standalone --nproc_per_node="$NGPU" -m flux_train.train
      --config "$SYS" --set logging.out_dir="$RUN"
      --set data.source=synthetic --set data.synthetic_text_len=256 --set data.synthetic_latent_size=32
      --set perf.warmup_latent_size=32 --set data.synthetic_train_samples=512 --set data.synthetic_val_samples=256
      --set perf.fp8="${FP8:-none}" --set logging.log_every=5 --set train.max_steps="$N" --set eval.every_steps="$N"
      --set checkpoint.keep=1 --set checkpoint.final="$FINAL" --set preflight.min_free_disk_gb="$CKPT_GB" ${EXTRA:-})
    # TRAINER_PHASE: both (one call: ~15 min for the 12B state on a local disk), preempt, or resume (two calls,
    # the machine held between them: the run folder stays)
    if [ "$PHASE" != resume ]; then
      rm -rf "$RUN"; mkdir -p "$RUN"; echo "$FINAL" > "$RUN/.final"
      # preempted as Slurm would (SIGUSR2 to the workers) at the first logged step: a checkpoint at the next one
      # and exit 75
      # the run cut at TLIMIT too: it stops at the logged step after the signal (the stop vote rides on the
      # metrics' all-reduce), saves, and on a 12B state the save's first copy into pinned host memory took 150 s
      # (4 H200); TRAINER_STEPS should leave a logged step after the first one
      timeout "$TLIMIT" "${TRAIN[@]}" > "$OUT/trainer.log" 2>&1 &
      CUT=$! DEADLINE=$((SECONDS + TLIMIT))
      until grep -q "^step " "$OUT/trainer.log" || ! kill -0 $CUT 2>/dev/null || [ $SECONDS -gt $DEADLINE ]; do
        sleep 2
      done
      pkill -USR2 -P "$(pgrep -P $CUT)"  # the workers: children of torchrun, the child of timeout
      wait $CUT; log "trainer: the preempted run exited $? (torchrun says 1 when its workers stop with 75, saved)"
      grep -h "^step \|saved\|stopped\|finished" "$OUT/trainer.log" | tee "$OUT/trainer.txt"
    fi
    if [ "$PHASE" != preempt ]; then
      # the same command resumes from the checkpoint, runs to step N and evaluates
      timeout "$TLIMIT" "${TRAIN[@]}" > "$OUT/trainer_resumed.log" 2>&1; log "trainer: the resumed run exited $?"
      grep -h "^step \|resum\|finished\|saved\|stopped\|val_loss" "$OUT/trainer_resumed.log" | tee -a "$OUT/trainer.txt"
      rm -rf "$RUN"
    fi
    log "trainer stage done" ;;
  checkpoint)
    tbench --mode step --config configs/systems/H200_01x08.yaml --rows ours --set parallel.strategy=ddp \
      --set train.micro_batch_size=8 --set model.num_layers="${CKPT_DOUBLE:-2}" \
      --set model.num_single_layers="${CKPT_SINGLE:-4}" --steps 5 --checkpoint "${CKPT_DIR:-/tmp/flux_ckpt_bench}" \
      > "$OUT/checkpoint.log" 2>&1 || log "checkpoint bench failed: see checkpoint.log"
    grep "^CHECKPOINT" "$OUT/checkpoint.log" | tee "$OUT/checkpoint.txt"
    log "checkpoint stage done" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
python3 -m flux_train.bench --table "$ROWS" 2>&1 | tee "$OUT/table.txt"
