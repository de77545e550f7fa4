"""`python -m flux_train.submit`: the generated sbatch script and per-node commands field by field (pyxis,
apptainer, docker, podman: engine options, mounts, GPU passthrough, ulimits, the per-node check), hostile
config strings staying inert, and one clear error per bad input.

These tests check the commands we generate: pyxis (an srun plugin) and docker run nowhere here, and a fake
`srun` shim (below) only records its arguments. tests/cluster/test_slurm_submit.py runs podman and apptainer for real,
tests/cluster/test_container.py the per-node check."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_outputs import set_flags

from flux_train.cli import time_minutes
from flux_train.cluster import container
from flux_train.cluster import submit as sub
from flux_train.container_engines import ENGINES
from flux_train.training import preemption

SYSTEM = "configs/systems/cpu_02x02.yaml"


def dry(capsys, tmp_path, *args: str) -> tuple[str, list[str]]:
    """(sbatch script, the per-node srun argv) of a dry run."""
    assert sub.main(["--config", SYSTEM, "--dry-run", "--set", f"slurm.folder={tmp_path}/sub/%j", *args]) == 0
    out = capsys.readouterr().out
    script = out.split("# ---- sbatch script ----\n", 1)[1].split("# ---- per-node command", 1)[0]
    return script, srun_argv(script)


def srun_argv(script: str) -> list[str]:
    """The batch script's srun command, as bash splits it (a quoted word may span lines)."""
    command = shlex.split(script.split("\n# command\n", 1)[1].split("\n# teardown\n", 1)[0])
    return command[command.index("srun") :]


def program(argv: list[str]) -> list[str]:
    """What srun runs: everything after srun's options (submitit's --unbuffered --output X --error Y, then ours)."""
    assert argv[:2] == ["srun", "--unbuffered"] and argv[2] == "--output" and argv[4] == "--error"
    i = 6
    while argv[i].startswith("--"):
        i += 1
    return argv[i:]


def sbatch_flags(script: str) -> dict[str, str]:
    """The #SBATCH options as sbatch reads them: from the comment lines before the first command (sbatch stops
    there), each one word with quotes as a shell takes them and an unquoted '#' starting a comment."""
    flags = {}
    for line in script.split("\n")[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            (word,) = shlex.split(line[len("#SBATCH ") :], comments=True)
            key, _, value = word.partition("=")
            flags[key] = value
    return flags


def test_sbatch_script_one_task_per_node_with_requeue(capsys, tmp_path):
    script, argv = dry(
        capsys,
        tmp_path,
        "--nodes",
        "4",
        "--partition",
        "gpu",
        "--account",
        "proj",
        "--qos",
        "high",
        "--time",
        "2:30:00",
        "--job-name",
        "flux run",
        "--set",
        "slurm.cpus_per_task=16",
        "--set",
        "train.global_batch_size=16",
    )
    flags = sbatch_flags(script)
    assert flags["--nodes"] == "4" and flags["--ntasks-per-node"] == "1" and flags["--gpus-per-node"] == "2"
    assert flags["--partition"] == "gpu" and flags["--account"] == "proj" and flags["--qos"] == "high"
    assert flags["--time"] == "150" and flags["--job-name"] == "flux run" and flags["--cpus-per-task"] == "16"
    assert flags["--signal"] == "USR2@60" and "--requeue" in flags and flags["--open-mode"] == "append"
    assert "--kill-on-bad-exit=1" in argv and "--cpus-per-task=16" in argv
    assert program(argv) == [sys.executable, "-u", "-m", "submitit.core._submit", f"{tmp_path}/sub/%j"]
    assert f"export FLUX_REQUEUE_FLAG={tmp_path}/sub/${{FLUX_JOB_ID}}/requeue.flag" in script
    assert script.split("# teardown", 1)[1].strip().splitlines() == preemption.teardown()


@pytest.mark.parametrize("flagged", [True, False])
def test_the_teardown_requeues_only_a_flagged_job_and_keeps_sruns_status(tmp_path, flagged):
    """The teardown lines of both batch scripts (submitit's and slurm/flux.sbatch) after an srun that exited 7:
    with the agent's flag a requeue through scontrol (a recording stand-in here), the flag gone; without, none."""
    _fake_command(tmp_path / "bin", "scontrol", tmp_path / "scontrol.json")
    flag = tmp_path / "requeue.flag"
    if flagged:
        flag.touch()
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "FLUX_REQUEUE_FLAG": str(flag),
    }
    done = subprocess.run(
        ["bash", "-c", "\n".join(["(exit 7)", *preemption.teardown()])],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 7 and not flag.exists()
    if flagged:
        assert json.loads((tmp_path / "scontrol.json").read_text()) == ["requeue", "42"]
        assert "flux-train: requeueing job 42" in done.stdout
    else:
        assert not (tmp_path / "scontrol.json").exists() and done.stdout == ""
    assert 'source "$requeue_script"' in (Path(preemption.REQUEUE_SCRIPT).parent / "flux.sbatch").read_text()


def test_the_plain_sbatch_script_passes_srun_flags_and_its_arguments_as_given(tmp_path):
    """slurm/flux.sbatch run by bash with a recording srun: FLUX_SRUN_ARGS split on whitespace only (a '*' is no
    glob there, $(...) no command), and the script's arguments passed on whole."""
    canary = tmp_path / "canary"
    (tmp_path / "flux.sqsh").touch()  # what ./*.sqsh would match as a glob
    _fake_command(tmp_path / "bin", "srun", tmp_path / "srun.json")
    flags = ["--container-image", "./*.sqsh", f"--container-mounts=$(mkdir${{IFS}}{canary})"]
    args = ["--config", SYSTEM, "--set", f"logging.out_dir={tmp_path}/a b;$(touch {canary})`touch {canary}`"]
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": os.getcwd(),
        "SLURM_JOB_ID": "42",
        "FLUX_REQUEUE_FLAG": str(tmp_path / "flag"),
        "FLUX_PYTHON": "",
        "FLUX_SRUN_ARGS": " ".join(flags),
    }
    script = Path(preemption.REQUEUE_SCRIPT).parent / "flux.sbatch"
    done = subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    argv = json.loads((tmp_path / "srun.json").read_text())
    assert argv == ["--kill-on-bad-exit=1", *flags, "python3", "-u", "-m", "flux_train.cluster.launch", *args]
    assert not canary.exists()


def test_the_plain_sbatch_options_come_from_the_config():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flux_train.training.preemption",
            "--config",
            SYSTEM,
            "--set",
            "slurm.signal_delay_s=90",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.split() == ["--requeue", "--signal=USR2@90"]


def test_pyxis(capsys, tmp_path):
    _, argv = dry(
        capsys,
        tmp_path,
        "--runtime",
        "pyxis",
        "--container-image",
        "./flux.sqsh",
        "--mounts",
        "/datasets/cc12m:/data:ro,/scratch",
    )
    cwd = os.getcwd()
    assert "--container-image=./flux.sqsh" in argv
    assert (
        f"--container-mounts={cwd}:{cwd},{tmp_path}/sub:{tmp_path}/sub,/datasets/cc12m:/data:ro,"
        f"/scratch:/scratch" in argv
    )
    assert f"--container-workdir={cwd}" in argv
    # pyxis passes the job's environment itself; the image's Python is resolved inside the container
    assert program(argv) == ["/usr/bin/env", "python3", "-u", "-m", "submitit.core._submit", f"{tmp_path}/sub/%j"]


@pytest.mark.parametrize("profile,flag", [("nvidia", "--nv"), ("amd", "--rocm")])
def test_apptainer(capsys, tmp_path, profile, flag):
    _, argv = dry(
        capsys,
        tmp_path,
        "--runtime",
        "apptainer",
        "--container-image",
        "/images/flux.sif",
        "--mounts",
        "/data",
        "--set",
        f"env.profile={profile}",
    )
    cwd = os.getcwd()
    assert program(argv) == [
        "apptainer",
        "exec",
        flag,
        f"--bind={cwd}:{cwd},{tmp_path}/sub:{tmp_path}/sub,/data:/data",
        f"--pwd={cwd}",
        "/images/flux.sif",
        "/usr/bin/env",
        "python3",
        "-u",
        "-m",
        "submitit.core._submit",
        f"{tmp_path}/sub/%j",
    ]


def test_docker_nvidia_with_infiniband(capsys, tmp_path):
    _, argv = dry(
        capsys,
        tmp_path,
        "--runtime",
        "docker",
        "--container-image",
        "flux-train:cuda",
        "--mounts",
        "/data:/data:ro",
        "--set",
        "env.profile=nvidia",
        "--set",
        "env.ib_hca=mlx5",
        "--set",
        "container.env=[HF_HOME]",
    )
    cmd = program(argv)
    image = cmd.index("flux-train:cuda")
    options, python = cmd[2:image], cmd[image + 1 :]
    assert cmd[:2] == ["docker", "run"] and python[:2] == ["/usr/bin/env", "python3"]
    assert {"--rm", "--init", "--network=host", "--ipc=host", "--ulimit=memlock=-1:-1"} <= set(options)
    assert {"--gpus=all", "--device=/dev/infiniband", "--cap-add=IPC_LOCK"} <= set(options)
    cwd = os.getcwd()
    assert [o for o in options if o.startswith("--volume=")] == [
        f"--volume={cwd}:{cwd}",
        f"--volume={tmp_path}/sub:{tmp_path}/sub",
        "--volume=/data:/data:ro",
    ]
    assert f"--workdir={cwd}" in options
    passed = {o.split("=", 1)[1] for o in options if o.startswith("--env=")}
    # what the agent needs from Slurm and submitit, the requeue flag, the multicast switches, and config extras
    assert {
        "SLURM_JOB_ID",
        "SLURM_JOB_NODELIST",
        "SLURM_NODEID",
        "SLURM_JOB_NUM_NODES",
        "SLURM_PROCID",
        "SLURM_RESTART_COUNT",
        "SUBMITIT_EXECUTOR",
        "FLUX_REQUEUE_FLAG",
        "NCCL_NVLS_ENABLE",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
        "HF_HOME",
    } <= passed
    assert all("=" not in name for name in passed)  # names only: values come from the job, not the login node


def test_docker_amd_and_podman_nvidia_devices(capsys, tmp_path):
    _, argv = dry(
        capsys, tmp_path, "--runtime", "docker", "--container-image", "flux-train:rocm", "--set", "env.profile=amd"
    )
    options = program(argv)
    assert {"--device=/dev/kfd", "--device=/dev/dri", "--group-add=video", "--security-opt=seccomp=unconfined"} <= set(
        options
    )
    assert "--gpus=all" not in options and "--device=/dev/infiniband" not in options
    _, argv = dry(
        capsys, tmp_path, "--runtime", "podman", "--container-image", "flux-train:cuda", "--set", "env.profile=nvidia"
    )
    assert program(argv)[:2] == ["podman", "run"] and "--device=nvidia.com/gpu=all" in program(argv)


def test_ulimits_add_to_memlock_and_replace_or_drop_it(capsys, tmp_path):
    def ulimits(*sets: str) -> list[str]:
        _, argv = dry(
            capsys,
            tmp_path,
            "--runtime",
            "podman",
            "--container-image",
            "img",
            *set_flags(sets),
        )
        return [o for o in program(argv) if o.startswith("--ulimit")]

    assert ulimits() == ["--ulimit=memlock=-1:-1"]
    assert ulimits("container.ulimits.nofile=1024:4096") == ["--ulimit=memlock=-1:-1", "--ulimit=nofile=1024:4096"]
    assert ulimits("container.ulimits.memlock=8388608") == ["--ulimit=memlock=8388608"]
    assert ulimits("container.ulimits.memlock=") == []  # the engine's own limit
    _, argv = dry(capsys, tmp_path, "--runtime", "apptainer", "--container-image", "/i.sif")
    assert not [o for o in program(argv) if o.startswith("--ulimit")]  # apptainer keeps the node's limits


@pytest.mark.parametrize(
    "runtime,profile,gpu_args,present,absent",
    [
        ("podman", "nvidia", None, ["--device=nvidia.com/gpu=all"], ["--gpus=all"]),
        ("podman", "nvidia", "[--gpus=all]", ["--gpus=all"], ["--device=nvidia.com/gpu=all"]),  # nvidia's hook
        ("docker", "nvidia", "[]", [], ["--gpus=all"]),
        (
            "docker",
            "amd",
            "['--device=/dev/kfd', '--device=/dev/dri/renderD128']",
            ["--device=/dev/kfd", "--device=/dev/dri/renderD128"],
            ["--device=/dev/dri", "--group-add=video"],
        ),
        ("apptainer", "amd", None, ["--rocm"], ["--nv"]),
        ("apptainer", "nvidia", "[--nvccli]", ["--nvccli"], ["--nv"]),
    ],
)
def test_gpu_passthrough_per_engine_and_overridable(capsys, tmp_path, runtime, profile, gpu_args, present, absent):
    sets = ["--set", f"container.gpu_args={gpu_args}"] if gpu_args else []
    _, argv = dry(
        capsys, tmp_path, "--runtime", runtime, "--container-image", "img", "--set", f"env.profile={profile}", *sets
    )
    options = program(argv)
    options = options[: options.index("img")]
    assert all(o in options for o in present) and not any(o in options for o in absent), options


@pytest.mark.parametrize("runtime", ["docker", "podman", "apptainer", "pyxis", "none"])
def test_each_node_checks_its_container_before_starting_it(capsys, tmp_path, runtime):
    """docker, podman and apptainer: a step before the agents' runs the check on every node; its trial start is
    the agent's own command with an import in place of submitit's entry point. pyxis reports its own errors."""
    image = "./flux.sqsh" if runtime == "pyxis" else "img"
    script, argv = dry(
        capsys,
        tmp_path,
        "--runtime",
        runtime,
        "--container-image",
        image,
        "--mounts",
        "/data:/d:ro",
        "--set",
        "container.python=/opt/venv/bin/python",
    )
    setup = script.split("# setup\n", 1)[1].split("# command", 1)[0]
    if runtime in ("pyxis", "none"):
        assert "srun" not in setup and "flux-train-check" not in script
        return
    words = shlex.split(setup[setup.index("srun ") :])
    check = container.node_check_script(ENGINES[runtime].image_check)
    assert words[:5] == ["srun", "--ntasks-per-node=1", "bash", "-c", check]
    assert words[5:8] == ["flux-train-check", runtime, image] and words[-3:] == ["||", "exit", "1"]
    assert words[8 : words.index("--")] == [os.getcwd(), f"{tmp_path}/sub", "/data"]  # every mount source
    trial = words[words.index("--") + 1 : -3]
    assert program(argv)[-5:] == ["/opt/venv/bin/python", "-u", "-m", "submitit.core._submit", f"{tmp_path}/sub/%j"]
    assert trial == program(argv)[:-4] + ["-c", "import flux_train, submitit"]


def _fake_command(bin_dir: Path, name: str, record: Path, then: str = "") -> None:
    """A stand-in Slurm command (srun, scontrol, sbatch) that records its argv, then runs `then`: no Slurm, no
    container engine here."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(
        f"#!{sys.executable}\nimport json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n{then}"
    )
    (bin_dir / name).chmod(0o755)


# words with line breaks: quoted words in the script's commands (bash reads them whole), refused on #SBATCH lines
LINE_BREAKS = ["two\nlines", "line\u2028separator", "carriage\rreturn"]


@pytest.mark.parametrize("runtime", ["pyxis", "docker"])
def test_hostile_config_strings_stay_inert(capsys, tmp_path, runtime):
    marker = tmp_path / "pwned"
    evil = f'x\'; touch {marker}; echo "$(touch {marker})" `touch {marker}`'
    image = f"img:1 $(touch {marker});\"q'"
    mount_src = tmp_path / f"my data;$(touch {marker})"
    folder = tmp_path / "sub dir $(x)"
    script, _ = dry(
        capsys,
        tmp_path,
        "--runtime",
        runtime,
        "--container-image",
        image,
        "--job-name",
        evil,
        "--mounts",
        f"{mount_src}:/data",
        "--set",
        f"slurm.folder={folder}/%j",
        "--set",
        f"container.extra_args={json.dumps([evil, *LINE_BREAKS])}",
    )
    assert sbatch_flags(script)["--job-name"] == evil
    # run the script's setup and command lines with a recording srun in place of Slurm's
    record = tmp_path / "argv.json"
    _fake_command(tmp_path / "bin", "srun", record)
    body = script.split("# setup\n", 1)[1].split("# teardown", 1)[0]
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "42"}
    done = subprocess.run(
        ["bash", "-c", body + '\necho "flag=$FLUX_REQUEUE_FLAG"'], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert f"flag={folder}/42/requeue.flag" in done.stdout
    assert not marker.exists()
    argv = json.loads(record.read_text())
    assert all(word in argv for word in LINE_BREAKS)  # one word each, as bash reads the script
    if runtime == "pyxis":
        assert f"--container-image={image}" in argv and evil in argv
        assert f"--container-mounts={os.getcwd()}:{os.getcwd()},{folder}:{folder},{mount_src}:/data" in argv
    else:
        assert image in argv and evil in argv and f"--volume={mount_src}:/data" in argv
    assert argv[-1] == f"{folder}/%j"


def _slurm_stand_ins(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """sbatch and srun on PATH as stand-ins that record what they get (the real Slurm runs the legitimate path in
    tests/cluster/test_slurm_submit.py): (sbatch's argv record, the batch script it was given)."""
    record, script = tmp_path / "sbatch.json", tmp_path / "script.sh"
    copy = f"import shutil; shutil.copy(sys.argv[-1], {str(script)!r}); print('Submitted batch job 4242')\n"
    _fake_command(tmp_path / "bin", "sbatch", record, then=copy)
    _fake_command(tmp_path / "bin", "srun", tmp_path / "srun.json")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    return record, script


@pytest.mark.parametrize(
    "args,message",
    [
        (["--job-name", "flux\ntouch CANARY"], "config error: slurm.job_name: 'flux\\ntouch "),
        (["--partition", "gpu\u2028touch CANARY"], "config error: slurm.partition: 'gpu\\u2028touch "),
        (["--account", "proj\r"], "config error: slurm.account: 'proj\\r' holds a control character"),
        (["--qos", "high\\"], "slurm.qos (--qos) 'high\\\\': '\\\\' cannot go in an #SBATCH line (sbatch reads a"),
        (["--set", 'slurm.exclude="n1\\0"'], "config error: slurm.exclude: 'n1\\x00' holds a control character"),
        (["--set", 'slurm.additional={comment: "a\\n$(touch CANARY)"}'], "slurm.additional.comment 'a\\n$(t"),
        (["--set", 'slurm.additional={"x\\ntouch CANARY": "1"}'], "slurm.additional.'x\\ntouch "),
        (["--set", "slurm.additional={signal: USR1@5}"], "slurm.additional.signal: flux-train sets --signal itself"),
        (["--set", "slurm.additional={no_requeue: 'true'}"], "flux-train sets --no-requeue itself"),
        (
            ["--set", 'slurm.folder="TMP/a\\nb/%j"'],
            "config error: slurm.folder: 'TMP/a\\nb/%j' holds a control character",
        ),
        (["--set", "slurm.folder=TMP/%u/%j"], "slurm.folder 'TMP/%u/%j': sbatch would expand its '%'"),
        (["--set", 'env.vars={"A=B": x}'], "config error: env.vars: 'A=B' is not a variable name"),
        (["--set", 'env.vars={"A\\nB": x}'], "config error: env.vars: 'A\\nB' is not a variable name"),
        (["--set", 'env.vars={HF_TOKEN: "a\\0b"}'], "env.vars.HF_TOKEN: a NUL character cannot be in"),
        (
            ["--runtime", "docker", "--container-image", "img", "--set", "container.env=[X=1]"],
            "config error: container.env: 'X=1' is not a variable name",
        ),
        (
            ["--runtime", "podman", "--container-image=--privileged"],
            "container.image '--privileged': starts with '-', so podman would read it as an option",
        ),
    ],
)
@pytest.mark.parametrize("mode", [[], ["--dry-run"]])
def test_what_cannot_go_in_the_script_is_refused_before_anything_runs(
    capsys, tmp_path, monkeypatch, args, message, mode
):
    """A value that would end the #SBATCH block (and run the rest as a command, the directives after it dropped),
    be read otherwise by sbatch, replace the job's own directives, or not be one environment variable: one line
    naming the key, exit 2, sbatch never called, nothing written; --dry-run refuses the same."""
    record, _ = _slurm_stand_ins(tmp_path, monkeypatch)
    canary = tmp_path / "canary"

    def fill(text: str) -> str:
        return text.replace("CANARY", str(canary)).replace("TMP", str(tmp_path))

    argv = ["--config", SYSTEM, "--set", f"slurm.folder={tmp_path}/sub/%j", *mode, *map(fill, args)]
    assert sub.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and fill(message) in err, err
    assert not record.exists() and not canary.exists() and not (tmp_path / "sub").exists()


def test_hostile_values_reach_sbatch_whole_and_stay_inert(capsys, tmp_path, monkeypatch):
    """The real submit path (submitit) with quotes, $(...), backticks, ';', '#', '%', a leading '-' and a long value
    in what goes on #SBATCH lines, and in the container's srun options: the script sbatch gets passes `bash -n`,
    every directive is read (none cut off before the first command, each value whole), and run by bash with a
    recording srun, it runs no other command."""
    _, script_file = _slurm_stand_ins(tmp_path, monkeypatch)
    canary = tmp_path / "canary"
    evil = f'x\'; touch {canary}; "$(touch {canary})" `touch {canary}` # 100%j ✓'
    values = {
        "--job-name": evil,
        "--partition": f"gpu;touch {canary}",
        "--account": f"-x$(touch {canary})",
        "--qos": "q'\"#",
        "--comment": "long " * 400 + evil,
    }
    folder = tmp_path / f"sub dir;$(touch {canary}) #x"
    image = f"./img $(touch {canary})'"
    args = [f"{flag}={value}" for flag, value in values.items() if flag != "--comment"]
    args += ["--runtime=pyxis", f"--container-image={image}"]
    args += set_flags(
        {"slurm.folder": json.dumps(f"{folder}/%j"), "slurm.additional": json.dumps({"comment": values["--comment"]})}
    )
    assert sub.main(["--config", SYSTEM, *args]) == 0
    assert "submitted job 4242" in capsys.readouterr().out
    script = script_file.read_text()
    assert subprocess.run(["bash", "-n", str(script_file)], capture_output=True).returncode == 0
    flags = sbatch_flags(script)
    assert {key: flags.get(key) for key in values} == values
    assert flags["--requeue"] == "" and flags["--signal"] == "USR2@60" and flags["--time"] == "30"
    assert flags["--nodes"] == "2" and flags["--output"] == f"{folder}/%j/%j_0_log.out"
    env = {**os.environ, "SLURM_JOB_ID": "4242", "FLUX_REQUEUE_FLAG": str(tmp_path / "flag")}
    done = subprocess.run(["bash", str(script_file)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert not canary.exists()
    argv = json.loads((tmp_path / "srun.json").read_text())
    assert f"--container-image={image}" in argv and argv[-1] == f"{folder}/%j"


def test_a_refused_job_is_one_line_and_leaves_none_of_its_files(capsys, tmp_path, monkeypatch):
    """sbatch refusing the job: one line with sbatch's reason, exit 2, and the pickles and script submitit staged
    for it in slurm.folder removed."""
    refuse = (
        "sys.stderr.write('sbatch: error: Invalid account or account/partition combination specified\\n'); sys.exit(1)"
    )
    _fake_command(tmp_path / "bin", "sbatch", tmp_path / "sbatch.json", then=refuse)
    _fake_command(tmp_path / "bin", "srun", tmp_path / "srun.json")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert sub.main(["--config", SYSTEM, "--set", f"slurm.folder={tmp_path}/sub/%j"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "sbatch refused the job (Invalid account or account/partition" in err, err
    assert (tmp_path / "sbatch.json").exists() and not [p for p in (tmp_path / "sub").rglob("*") if p.is_file()]
    # what sbatch was given had been staged there (the check above is not empty for want of anything staged)
    script = Path(json.loads((tmp_path / "sbatch.json").read_text())[-1])
    assert script.parent == tmp_path / "sub" and not script.exists(), script


def test_secrets_are_masked_in_the_dry_run_and_reach_the_job(capsys, tmp_path, monkeypatch):
    """Values of secret-looking variables (by name, or by env.masked_vars) in env.vars, in the container's options
    and in sbatch's --export: `***` everywhere in the dry run; the script sbatch gets still has them."""
    sets = {
        "env.vars": "{HF_TOKEN: hf_s3cr3t, SITE_AUTH: auth_s3cr3t, NCCL_DEBUG: INFO}",
        "env.masked_vars": "['*_auth']",
        "container.extra_args": "['--env=WANDB_API_KEY=wandb_s3cr3t', -e, 'db_password=db_s3cr3t']",
        "slurm.additional": "{export: 'ALL,AWS_SECRET_ACCESS_KEY=aws_s3cr3t'}",
    }
    args = ["--config", SYSTEM, "--runtime", "docker", "--container-image", "img", *set_flags(sets)]
    args += ["--set", f"slurm.folder={tmp_path}/sub/%j"]
    assert sub.main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t" not in out
    script = out.split("# ---- sbatch script ----\n", 1)[1].split("# ---- per-node command", 1)[0]
    assert sbatch_flags(script)["--export"] == "ALL,AWS_SECRET_ACCESS_KEY=***"
    assert {"--env=WANDB_API_KEY=***", "db_password=***"} <= set(srun_argv(script))
    assert "  HF_TOKEN='***'\n  SITE_AUTH='***'\n  NCCL_DEBUG=INFO\n" in out
    _, script_file = _slurm_stand_ins(tmp_path, monkeypatch)
    assert sub.main(args) == 0
    assert "s3cr3t" not in capsys.readouterr().out
    submitted = script_file.read_text()
    assert sbatch_flags(submitted)["--export"] == "ALL,AWS_SECRET_ACCESS_KEY=aws_s3cr3t"
    assert {"--env=WANDB_API_KEY=wandb_s3cr3t", "db_password=db_s3cr3t"} <= set(srun_argv(submitted))


@pytest.mark.slurm  # submitit's SlurmExecutor needs srun
def test_dry_run_script_is_the_one_submitit_submits(capsys, tmp_path):
    if shutil.which("srun") is None:
        pytest.skip("submitit's SlurmExecutor needs srun on PATH")
    import submitit

    from flux_train.config import load_config

    script, _ = dry(capsys, tmp_path, "--runtime", "docker", "--container-image", "img")
    cfg = load_config(SYSTEM, [f"slurm.folder={tmp_path}/sub/%j", "container.runtime=docker", "container.image=img"])
    folder = f"{tmp_path}/sub/%j"
    srun_args, python = container.command(cfg)
    executor = submitit.SlurmExecutor(folder=folder, python=shlex.join(python))
    executor.update_parameters(**sub.sbatch_parameters(cfg, folder, srun_args))
    assert executor._make_submission_file_text(executor._submitit_command_str, "uid") == script.rstrip("\n")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nodes", "0"], "argument --nodes: must be >= 1, got 0"),
        (["--runtime", "singularity"], "argument --runtime: invalid choice: 'singularity'"),
        (["--time", "soon"], "argument --time: expected minutes, H:MM:SS or D-HH:MM:SS, got 'soon'"),
    ],
)
def test_bad_flags_one_clear_message(capsys, tmp_path, args, message):
    with pytest.raises(SystemExit) as exit_:
        sub.main(["--config", SYSTEM, "--set", f"slurm.folder={tmp_path}/sub/%j", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "sub").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--config", "configs/systems/nope.yaml"], "config file not found: configs/systems/nope.yaml"),
        (
            ["--config", SYSTEM, "--runtime", "docker"],
            "container runtime docker needs an image: pass --container-image",
        ),
        (["--config", SYSTEM, "--nodes", "3"], "train.global_batch_size 8 is not divisible by"),
        (["--config", SYSTEM, "--mounts", "/a:b"], "container mount '/a:b': the destination must be an absolute path"),
        (["--config", SYSTEM, "--local", "--runtime", "pyxis", "--container-image", "x"], "--local cannot use pyxis"),
        (["--config", SYSTEM, "--time", "1"], "slurm.signal_delay_s=60 must be between 0 and the time limit (1 min)"),
        (
            ["--config", SYSTEM, "--set", "container.ulimits.nofile=lots"],
            "container.ulimits.nofile='lots': expected SOFT or SOFT:HARD in whole numbers (-1: unlimited)",
        ),
        (
            ["--config", SYSTEM, "--set", "container.ulimits.files=1"],
            "container.ulimits.files: unknown limit; accepted: ",
        ),
        (
            [
                "--config",
                SYSTEM,
                "--runtime",
                "docker",
                "--container-image",
                "x",
                "--set",
                "container.python=python3 'x",
            ],
            'container.python "python3 \'x": No closing quotation (it is split like a shell command line)',
        ),
    ],
)
def test_bad_input_one_clear_message(capsys, tmp_path, args, message):
    assert sub.main([*args, "--set", f"slurm.folder={tmp_path}/sub/%j"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "sub").exists()


def test_no_slurm_on_path(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    assert sub.main(["--config", SYSTEM, "--set", f"slurm.folder={tmp_path}/sub/%j"]) == 2
    err = capsys.readouterr().err
    assert "sbatch/srun not found on PATH" in err and "--local" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "sub").exists()


@pytest.mark.parametrize(
    "text,minutes", [("90", 90), ("1:30:00", 90), ("2-00", 2880), ("1-0:0:30", 1441), ("10:30", 11)]
)
def test_time_formats(text, minutes):
    assert time_minutes(text) == minutes


@pytest.mark.parametrize("system", sorted(p.stem for p in Path("configs/systems").glob("*.yaml")))
def test_system_configs_resolve_and_dry_run(capsys, tmp_path, system):
    assert (
        sub.main(
            ["--config", f"configs/systems/{system}.yaml", "--dry-run", "--set", f"slurm.folder={tmp_path}/sub/%j"]
        )
        == 0
    )
    nodes, gpus = (int(x) for x in system.split("_")[1].split("x")[:2])
    flags = sbatch_flags(capsys.readouterr().out.split("# ---- sbatch script ----\n", 1)[1])
    assert flags["--nodes"] == str(nodes) and flags["--gpus-per-node"] == str(gpus)


def test_the_dry_run_starts_with_what_the_job_will_do(capsys, tmp_path):
    """Ahead of the script: the split of the batch, the folders, the checkpoints, pre-flight, the container; the
    interface variables' `auto` is said to be resolved on each node; an image path missing here is a warning."""
    argv = ["--config", "configs/systems/H200_08x08.yaml", "--dry-run", "--set", f"slurm.folder={tmp_path}/s/%j"]
    assert sub.main([*argv, "--container-image", str(tmp_path / "missing.sqsh")]) == 0
    out, err = capsys.readouterr()
    job = out.split("# ---- the job ----\n", 1)[1].split("# ---- sbatch script ----", 1)[0]
    for said in (
        "8 node(s) x 8 GPUs = 64 workers, ddp",
        "global batch 1024 = micro-batch 16 x accumulation 1 x 64 GPUs",
        "run folder runs/flux",
        "checkpoints in runs/flux/checkpoints: every 500 steps, the last 2 kept; resume auto",
        f"pre-flight on; container pyxis, image {tmp_path / 'missing.sqsh'}",
    ):
        assert said in job, (said, job)
    assert "NCCL_SOCKET_IFNAME=auto  # each node's default-route interface, found at start" in out
    assert err.strip() == (
        f"submit: warning: container.image {tmp_path / 'missing.sqsh'} does not exist on this host; the job's srun "
        "fails unless the nodes have it at that path"
    )
    (tmp_path / "here.sqsh").write_bytes(b"")
    assert sub.main([*argv, "--container-image", str(tmp_path / "here.sqsh")]) == 0
    assert capsys.readouterr().err == ""


def test_sbatch_without_a_slurm_configuration_is_not_blamed_on_partition_or_account():
    """A host with the Slurm client but no cluster (sbatch: fatal: Could not establish a configuration source)."""
    line = sub.sbatch_refusal("sbatch: fatal: Could not establish a configuration source")
    assert "no Slurm configuration" in line and "--local" in line and "--dry-run" in line
    assert "--partition" not in line and "--account" not in line
    assert "--partition" in sub.sbatch_refusal("sbatch: error: Invalid account or account/partition combination")


ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "assets" / "golden" / "submit_dry_run_H200_08x08.txt"


def test_the_dry_run_of_a_system_is_the_reviewed_one(capsys, tmp_path, monkeypatch):
    """H200_08x08's dry run (8 nodes of pyxis, ddp), with the config's own values, is tests/assets/golden/'s copy: a
    change to the summary, the batch script, the node command, its environment or the worker line shows in that
    file's diff. What depends on the host is replaced: the submit directory (here a scratch folder) and the
    repository; node-local scratch is /tmp (no TMPDIR). FLUX_GOLDEN_REGENERATE=1 rewrites the copy."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TMPDIR", raising=False)
    assert sub.main(["--config", str(ROOT / "configs/systems/H200_08x08.yaml"), "--dry-run"]) == 0
    plan, shown = capsys.readouterr().out.split("\n", 1)
    # the plan line follows measured.yaml's figures: test_plan.py and docs/operating.md's examples check it
    assert plan.startswith("# plan (H200 x 64, ddp bf16")
    shown = shown.replace(str(tmp_path), "<submit dir>").replace(str(ROOT), "<repository>")
    if os.environ.get("FLUX_GOLDEN_REGENERATE"):
        GOLDEN.write_text(shown)
    assert shown.splitlines() == GOLDEN.read_text().splitlines(), (
        f"the dry run differs from {GOLDEN.relative_to(ROOT)}: if the change is meant, FLUX_GOLDEN_REGENERATE=1 "
        "rewrites it, and the diff is reviewed with the change"
    )


def test_the_cluster_modules_load_no_checkpoint_code():
    """Submitting and the per-node agent never read or write a checkpoint: importing the cluster modules and the planner, in a
    fresh interpreter, leaves torch's distributed checkpointing (what the trainer saves with) unloaded."""
    # and the planner, whose plan line and fit check submit prints
    modules = ", ".join(
        [*(f"flux_train.cluster.{m}" for m in ("submit", "launch", "worker", "container")), "flux_train.tools.plan"]
    )
    code = f"import sys, {modules}; print('torch.distributed.checkpoint' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stderr
