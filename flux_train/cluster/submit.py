"""`python -m flux_train.submit`: one command from a login node puts a multi-node training job on Slurm.

    python -m flux_train.submit --config configs/systems/H200_08x08.yaml [--nodes 8] [--set section.key=value]
        [--gpus-per-node 8] [--partition P] [--account A] [--qos Q] [--time 4:00:00] [--job-name NAME]
        [--exclude HOSTS] [--runtime RUNTIME] [--container-image IMAGE]
        [--mounts SRC[:DST[:ro]],...] [--runs N] [--skip-preflight] [--dry-run | --local]

Every flag overrides the system config's value. submitit submits one Slurm task per node; srun starts it
in the container (flux_train.cluster.container, with the engine container.runtime names in
flux_train/container_engines.py: options on the srun line, or the command srun runs after a step in which every
node checks its engine, image and mounts), and there
flux_train.cluster.launch.NodeAgent starts the node's workers. The resolved config travels in the job's
pickle. A Slurm run starts with the pre-flight checks (flux_train.training.preflight) unless --skip-preflight.

`--runs N` is a campaign: N independent runs as one Slurm job array (they may run side by side where the
cluster has room, and each requeues on its own; a dependency chain would serialise them for nothing), run i in
<logging.out_dir>/run_<i> with seed train.seed + i; `python -m flux_train.results <logging.out_dir>` scores them.
Preemption and requeue follow flux_train.training.preemption: submitit's `--signal` from slurm.signal_delay_s,
the requeue flag file exported by the script's setup, its teardown sourced from slurm/requeue.sh.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import os
import re
import reprlib
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from dataprep.folder_lock import missing_folders, remove_empty
from dataprep.lifetime import die_with_parent
from flux_train.cli import submit_parser
from flux_train.cluster import container
from flux_train.cluster.launch import LOCAL_JOB_ID_ENV, NodeAgent, env_vars, write_job_config
from flux_train.config import (
    Config,
    ContainerConfig,
    accumulation_steps,
    checkpoint_dir,
    eval_interval_steps,
    load_config,
    mesh_shape,
    validate,
)
from flux_train.container_engines import ENGINES
from flux_train.errors import UserError, reports_user_errors
from flux_train.masking import mask_text, masked
from flux_train.private_apis import sbatch_script
from flux_train.training import preemption


class SubmitError(UserError):
    """Bad input; the message names it and the fix."""


# what sbatch_parameters puts on #SBATCH lines for the requeue and preemption contract, one task per node and the
# log paths submitit reads: slurm.additional cannot replace them
OWN_DIRECTIVES = "requeue no-requeue signal nodes ntasks-per-node output error open-mode array".split()
DIRECTIVE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")

# submitit's name for a job: <array job>_<task> in a job array, else Slurm's job id
JOB_ID_SHELL = "${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"


def shell_job_path(folder: str, name: str) -> str:
    """A shell word for <folder>/<name> with %j expanded as submitit expands it, everything else quoted."""
    return "${FLUX_JOB_ID}".join(shlex.quote(part) for part in os.path.join(folder, name).split("%j"))


def campaign(cfg: Config, runs: int) -> list[Config]:
    """One config per run: run i in <logging.out_dir>/run_<i> (its checkpoints in its own folder too), seed
    train.seed + i. A single run stays as configured."""
    if runs == 1:
        return [cfg]
    width = len(str(runs - 1))
    configs = []
    for i in range(runs):
        run = copy.deepcopy(cfg)
        run.train.seed = cfg.train.seed + i
        run.logging.out_dir = os.path.join(cfg.logging.out_dir, f"run_{i:0{width}d}")
        if cfg.checkpoint.dir:
            run.checkpoint.dir = os.path.join(cfg.checkpoint.dir, f"run_{i:0{width}d}")
        configs.append(run)
    return configs


def sbatch_parameters(cfg: Config, folder: str, srun_container_args: list[str]) -> dict:
    """submitit SlurmExecutor parameters: one task per node, USR2 before the limit, requeue teardown."""
    s = cfg.slurm
    check = container.node_check(cfg)
    params = {
        "nodes": s.nodes,
        "ntasks_per_node": 1,
        "gpus_per_node": s.gpus_per_node,
        "time": s.time_min,
        "job_name": s.job_name,
        "mem": f"{s.mem_gb}G" if s.mem_gb else "0",
        "signal_delay_s": s.signal_delay_s,
        "setup": [
            f'FLUX_JOB_ID="{JOB_ID_SHELL}"',
            'FLUX_JOB_ID="${FLUX_JOB_ID:-$SLURM_JOB_ID}"',
            f"export {preemption.REQUEUE_FLAG_ENV}={shell_job_path(folder, 'requeue.flag')}",
            *(
                [
                    "# every node checks its container engine, image and mounts; each names itself on failure",
                    f"srun --ntasks-per-node=1 {shlex.join(check)} || exit 1",
                ]
                if check
                else []
            ),
        ],
        "teardown": preemption.teardown(),
        # one dead node agent ends the job; Slurm 22.05-23.02 srun does not inherit --cpus-per-task
        "srun_args": [
            "--kill-on-bad-exit=1",
            *([f"--cpus-per-task={s.cpus_per_task}"] if s.cpus_per_task else []),
            *srun_container_args,
        ],
        "additional_parameters": {
            "requeue": True,
            **{k: True if v.lower() == "true" else v for k, v in s.additional.items()},
        },
    }
    for key in ("partition", "account", "qos", "exclude"):
        if getattr(s, key):
            params[key] = getattr(s, key)
    if s.cpus_per_task:
        params["cpus_per_task"] = s.cpus_per_task
    if s.exclusive:
        params["exclusive"] = True
    return params


def check_directives(cfg: Config) -> None:
    """Refuse what cannot go on an #SBATCH line as it is (submitit quotes the rest). sbatch reads its directives
    line by line: a line break would end them, the rest of the value running as a command and the directives after
    it dropped (--requeue, --signal, --time, ...); and it reads a backslash as an escape, also inside quotes. In
    slurm.folder, the log paths' folder, sbatch would expand a %-pattern other than submitit's %j."""
    s = cfg.slurm
    flags = {dotted: "--" + flag.replace("_", "-") for flag, dotted in FLAGS.items()}
    values = {
        f"slurm.{k}": getattr(s, k) or "" for k in ("job_name", "partition", "account", "qos", "exclude", "folder")
    }
    for name in s.additional:
        if not DIRECTIVE_NAME.fullmatch(name):
            raise SubmitError(f"slurm.additional.{name!r}: not an sbatch option name (letters, digits, '-' and '_')")
        if name.replace("_", "-") in OWN_DIRECTIVES:
            raise SubmitError(
                f"slurm.additional.{name}: flux-train sets --{name.replace('_', '-')} itself (requeue and preemption, "
                "one task per node, the log paths): remove it, or use slurm.nodes, slurm.signal_delay_s, slurm.folder"
            )
    values.update({f"slurm.additional.{name}": value for name, value in s.additional.items()})
    for key, value in values.items():
        bad = next((c for c in value if c == "\\" or not c.isprintable()), None)
        if bad is None:
            continue
        where = f"{key} ({flags[key]})" if key in flags else key
        shown = reprlib.repr(mask_text(value, cfg.env.masked_vars))
        why = "a backslash as an escape" if bad == "\\" else "them line by line: only printable characters are safe"
        raise SubmitError(f"{where} {shown}: {bad!r} cannot go in an #SBATCH line (sbatch reads {why}): remove it")
    if "%" in s.folder.replace("%j", ""):
        raise SubmitError(
            f"slurm.folder {s.folder!r}: sbatch would expand its '%' in the log paths; use no '%' but %j (the job id)"
        )


# ---------------------------------------------------------------------------------------------------
# command line


FLAGS = {
    "nodes": "slurm.nodes",
    "gpus_per_node": "slurm.gpus_per_node",
    "partition": "slurm.partition",
    "account": "slurm.account",
    "qos": "slurm.qos",
    "time": "slurm.time_min",
    "job_name": "slurm.job_name",
    "exclude": "slurm.exclude",
    "runtime": "container.runtime",
    "container_image": "container.image",
    "mounts": "container.mounts",
}


def resolve_config(args: argparse.Namespace) -> Config:
    """The system config, its --set overrides, then the flags (already typed by the parser), checked."""
    cfg = load_config(args.config, args.overrides)
    for flag, dotted in FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            section, key = dotted.split(".")
            setattr(getattr(cfg, section), key, value)
    if args.skip_preflight:
        cfg.preflight.enabled = False
    elif not args.local:
        cfg.preflight.enabled = True  # a Slurm run checks its nodes before the clock starts
    world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
    validate(cfg, world_size=world, gpus_per_node=cfg.slurm.gpus_per_node)
    mesh_shape(cfg.parallel, world, cfg.slurm.gpus_per_node)  # a mesh that does not fit stops here, not in the job
    s, c = cfg.slurm, cfg.container
    if not 0 < s.signal_delay_s < s.time_min * 60:
        raise SubmitError(
            f"slurm.signal_delay_s={s.signal_delay_s} must be between 0 and the time limit "
            f"({s.time_min} min): it is how long before the limit the job starts its checkpoint"
        )
    engine = container.engine_of(c)
    if engine.needs_image and not c.image:
        raise SubmitError(
            f"container runtime {c.runtime} needs an image: pass --container-image or set "
            f"container.image in {args.config}"
        )
    if args.local and engine.srun_plugin:
        *others, last = [name for name, e in ENGINES.items() if not e.srun_plugin]
        raise SubmitError(
            f"--local cannot use {engine.name} (it is an srun plugin): add --runtime {', '.join(others)} or {last}"
        )
    # what cannot go in the batch script or the environment, a malformed mount, ulimit or container.python stops
    # here, before anything runs
    check_directives(cfg)
    env_vars(cfg)
    container.mounts(cfg)
    container.ulimits(cfg)
    container.command(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------------
# the three ways out


def local_image_missing(c: ContainerConfig) -> bool:
    """An image named by a path (Engine.image_is_path: a squashfs, a .sif) that this host does not have: the nodes,
    which usually share the submit host's filesystems, will not have it either."""
    image = c.image or ""
    return container.engine_of(c).image_is_path(image) and not Path(image).exists()


def job_summary(cfg: Config, runs: int) -> list[str]:
    """What the job will do, in a few lines, ahead of the script that does it."""
    s, t, c = cfg.slurm, cfg.train, cfg.container
    world = s.nodes * s.gpus_per_node
    ckpt = cfg.checkpoint
    saves = f"every {ckpt.every_steps} steps, the last {ckpt.keep} kept" if ckpt.every_steps else "none on a cadence"
    image = (
        f"{c.runtime}, image {c.image}"
        if container.engine_of(c).needs_image
        else f"{c.runtime} (the submit host's Python on each node)"
    )
    return [
        f"{s.nodes} node(s) x {s.gpus_per_node} GPUs = {world} workers, {cfg.parallel.strategy}, compute "
        f"{t.compute_dtype}, FP8 {cfg.perf.fp8}",
        f"global batch {t.global_batch_size} = micro-batch {t.micro_batch_size} x accumulation "
        f"{accumulation_steps(cfg, world)} x {world} GPUs; at most {t.max_steps} steps, eval every "
        f"{eval_interval_steps(cfg)} steps against {cfg.eval.target}",
        f"run folder {cfg.logging.out_dir}" + (f" (+ a folder per run of the {runs})" if runs > 1 else ""),
        f"checkpoints in {checkpoint_dir(cfg)}: {saves}; resume {ckpt.resume}",
        f"pre-flight {'on' if cfg.preflight.enabled else 'off (--skip-preflight)'}; container {image}; "
        f"time limit {s.time_min} min, requeued up to {s.max_requeue} times",
        f"data {cfg.data.source}" + (f" from {cfg.data.path}" if cfg.data.path else ""),
    ]


def dry_run(cfg: Config, runs: int) -> None:
    from flux_train.cluster.launch import IFNAME_VARS, Node, local_dir_for, wanted_env, worker_args

    cfg = masked(cfg)  # everything shown is built from the config with its secrets masked
    folder = os.path.abspath(cfg.slurm.folder)
    srun_args, python = container.command(cfg)
    command_line = f"{shlex.join(python)} -u -m submitit.core._submit {shlex.quote(folder)}"
    array = {"map_count": runs} if runs > 1 else {}
    script = sbatch_script(command_line, folder, **sbatch_parameters(cfg, folder, srun_args), **array)
    # the words of the script's command, also where a quoted word spans lines
    command = shlex.split(script.split("\n# command\n", 1)[1].split("\n# teardown\n", 1)[0])
    node = Node("%j", 0, cfg.slurm.nodes, "<node>", "<first host>", 0)
    local_dir = local_dir_for(cfg, node)
    print("# flux-train dry run: nothing was submitted\n# ---- the job ----")
    print("\n".join("#   " + line for line in job_summary(cfg, runs)))
    print("# ---- sbatch script ----")
    print(script)
    print("# ---- per-node command (srun runs it once per node), one argument per line ----")
    print("\n".join("  " + shlex.quote(arg) for arg in command[command.index("srun") :]))
    print(
        "# ---- then on each node, flux_train.cluster.launch: environment (a variable already set in the job wins) ----"
    )
    for key, value in wanted_env(cfg, local_dir).items():
        note = (
            "  # each node's default-route interface, found at start" if key in IFNAME_VARS and value == "auto" else ""
        )
        print(f"  {key}={shlex.quote(value)}{note}")
    print(
        f"# ---- and {cfg.slurm.gpus_per_node} workers per node x {cfg.slurm.nodes} nodes, torch elastic "
        f"launch with static rendezvous on the first host, each running ----"
    )
    print("  " + shlex.join(["python", *worker_args(local_dir / "config.yaml")]))
    if runs > 1:
        print(f"# ---- a campaign of {runs} runs: one array task each ----")
        for i, run in enumerate(campaign(cfg, runs)):
            print(f"  task {i}: train.seed={run.train.seed} logging.out_dir={run.logging.out_dir}")
        print(f"# ---- then: python -m flux_train.results {shlex.quote(cfg.logging.out_dir)}")


def run_local(cfg: Config, runs: int) -> int:
    """The per-node agent on this machine (in the container when one is configured), in the foreground; a
    campaign's runs one after the other."""
    for run in campaign(cfg, runs):
        code = run_one_local(run)
        if code:
            return code
    return 0


def run_one_local(cfg: Config) -> int:
    job_id = f"local-{os.getpid()}"  # one id for the folder and the agent's log lines
    run_dir = Path(cfg.slurm.folder.replace("%j", job_id)).resolve()
    create_folder(run_dir)
    config_file = run_dir / "config.yaml"
    write_job_config(cfg, config_file)
    _, python = container.command(cfg)
    check = container.node_check(cfg)
    if check and subprocess.call(check):
        return 1  # the check has named the problem
    argv = [*python, "-u", "-m", "flux_train.cluster.launch", "--local", "--config", str(config_file)]
    print(f"running on this machine: {shlex.join(mask_text(arg, cfg.env.masked_vars) for arg in argv)}", flush=True)
    # the agent gets SIGTERM (and passes it on to its workers) when this process ends, even by SIGKILL
    agent = subprocess.Popen(
        argv,
        env={**os.environ, LOCAL_JOB_ID_ENV: job_id},
        preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM),
    )
    try:
        code = agent.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the agent as well: it stops its workers
        code = agent.wait()
    if code:
        print(f"submit --local: job {job_id}: the agent (pid {agent.pid}) {ended(code)}", file=sys.stderr, flush=True)
    else:
        print(f"submit --local: job {job_id} ended; the run's outputs are in {Path(cfg.logging.out_dir).resolve()}")
    return 128 - code if code < 0 else code


def create_folder(folder: Path) -> None:
    """The job's log folder (slurm.folder), made now: a place this host cannot make it is one line."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = f"{exc.filename} is a file" if isinstance(exc, FileExistsError) else exc.strerror
        raise SubmitError(
            f"slurm.folder: cannot create {folder} ({why}); choose a folder this host can write"
        ) from None


def ended(code: int) -> str:
    """How a child process ended, from Popen's return code (-N: signal N)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def sbatch_refusal(stderr: str) -> str:
    """The line for sbatch's refusal: its own reason (its last line), and what to check."""
    reason = (stderr.strip().splitlines() or ["no message"])[-1].removeprefix("sbatch: error: ")
    if "configuration source" in reason.lower() or "slurm.conf" in reason.lower():  # the client without a cluster
        return (
            f"this host has Slurm's sbatch but no Slurm configuration ({reason}): submit from a Slurm login node, "
            "or use --local to run on this machine, or --dry-run to see the job; nothing was queued"
        )
    if "slurm controller" in reason.lower():
        return (
            f"sbatch cannot reach the Slurm controller ({reason}): check that slurmctld is up and reachable "
            "from this host (scontrol ping), then submit again; nothing was queued"
        )
    return (
        f"sbatch refused the job ({reason}): check --partition, --account, --qos, --time and --gpus-per-node "
        "against the cluster (sinfo, sacctmgr show assoc user=$USER)"
    )


def submit(cfg: Config, runs: int) -> None:
    import submitit
    from submitit.core.utils import FailedJobError, JobPaths

    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise SubmitError(
            "sbatch/srun not found on PATH: run this on a Slurm login node, or use --local to run "
            "on this machine, or --dry-run to see the job"
        )
    folder = os.path.abspath(cfg.slurm.folder)
    staging = JobPaths.get_first_id_independent_folder(folder)  # pickles and script go here
    made = missing_folders(staging)
    create_folder(staging)
    before = set(staging.iterdir())
    srun_args, python = container.command(cfg)
    # requeue counting is the agent's (slurm.max_requeue), not submitit's: its USR2 handler is replaced
    executor = submitit.SlurmExecutor(folder=folder, python=shlex.join(python))
    executor.update_parameters(**sbatch_parameters(cfg, folder, srun_args))
    try:
        # submitit prints sbatch's stderr as well as raising it: the one line below carries it
        with contextlib.redirect_stderr(io.StringIO()), executor.batch():  # more than one job: a job array
            jobs = [executor.submit(NodeAgent(run)) for run in campaign(cfg, runs)]
    except FailedJobError as exc:
        for path in set(staging.iterdir()) - before:  # the refused job's files, and the folders made for them
            path.unlink()
        remove_empty(made)
        raise SubmitError(sbatch_refusal(str(exc))) from None
    job = jobs[0]
    whole = job.job_id.split("_")[0]
    what = f"job {job.job_id}" if runs == 1 else f"job array {whole} ({runs} runs, tasks {whole}_0..{whole}_{runs - 1})"
    print(
        f"submitted {what}: {cfg.slurm.nodes} nodes x {cfg.slurm.gpus_per_node} GPUs, container {cfg.container.runtime}"
    )
    print(f"log folder: {job.paths.stdout.parent} (one <job>_<node>_log.out/.err per node)")
    print(f"follow:     tail -F {shlex.quote(str(job.paths.stdout))} {shlex.quote(str(job.paths.stderr))}")
    print(f"status:     squeue -j {whole}    cancel: scancel {whole}")
    if runs > 1:
        print(f"results:    python -m flux_train.results {shlex.quote(cfg.logging.out_dir)} (when all runs have ended)")


@reports_user_errors
def main(argv=None) -> int:
    args = submit_parser().parse_args(argv)
    cfg = resolve_config(args)
    from flux_train.tools.plan import submit_line  # imports torch (the model's size): only once the config is good

    plan, warnings = submit_line(cfg)  # refuses a job whose memory cannot fit its GPUs, naming what would
    for warning in warnings:
        print(f"submit: warning: {warning}", file=sys.stderr)
    if local_image_missing(cfg.container):
        print(
            f"submit: warning: container.image {cfg.container.image} does not exist on this host; the job's srun "
            "fails unless the nodes have it at that path",
            file=sys.stderr,
        )
    if args.dry_run:
        print(plan)
        dry_run(cfg, args.runs)
    elif args.local:
        return run_local(cfg, args.runs)
    else:
        submit(cfg, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
