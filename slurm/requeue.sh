# The batch script's teardown, sourced right after srun on the batch host (flux_train/training/preemption.py has the
# whole contract): a node agent whose workers saved a checkpoint on Slurm's warning signal has created
# $FLUX_REQUEUE_FLAG; requeue the job from here, where Slurm's client is. srun's exit status stays the job's.
flux_rc=$?
if [ -f "$FLUX_REQUEUE_FLAG" ]; then
  rm -f "$FLUX_REQUEUE_FLAG"
  echo "flux-train: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit $flux_rc
