"""The container engines `container.runtime` names, one class each, in one table (ENGINES) that everything about an
engine comes from: the config's accepted values, the srun options and the command line that put each node's agent in
its container, the GPU passthrough, which images are paths, and the engine's lines in the per-node check.
flux_train/cluster/container.py resolves the config's container settings into a `Launch` and hands it to the engine
the config names; nothing else compares an engine's name. No torch and no project imports here: the config reads the
table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, TypeAlias


@dataclass(frozen=True)
class Launch:
    """What an engine starts: the config's container settings, resolved and checked (flux_train/cluster/container.py
    makes it)."""

    image: str
    binds: tuple[str, ...]  # SRC:DST[:ro], the submit directory and submitit's folder first
    workdir: str
    python: tuple[str, ...]  # the image's interpreter (container.python, split)
    gpu_args: tuple[str, ...]  # container.gpu_args, else the engine's own for env.profile
    env: tuple[str, ...]  # the names of the variables to pass in, for an engine that starts from the image's own
    ulimits: dict[str, str]  # NAME -> SOFT[:HARD]
    infiniband: bool  # env.ib_hca is set: the node's InfiniBand devices go in
    extra_args: tuple[str, ...]  # container.extra_args


class Engine:
    """One value of container.runtime. The defaults are those of an engine that needs none of them."""

    name: ClassVar[str]
    needs_image: ClassVar[bool] = True
    # the container comes from srun's own options, so there is none without srun (submit --local cannot use it)
    srun_plugin: ClassVar[bool] = False
    # bash lines of the per-node check (flux_train/cluster/container.py), after the engine is found on PATH and the
    # mount sources exist, before the trial start: that the engine works and has the image on this node. They read
    # $engine, $image and call fail (and last) of the check; no single quotes (the batch script quotes the check as
    # one word). None: no check (no container, or an engine that reports its own errors on each node).
    image_check: ClassVar[str | None] = None

    def srun_options(self, launch: Launch) -> list[str]:
        """srun's options for the agent's step."""
        return []

    def argv(self, launch: Launch) -> list[str]:
        """What srun runs, up to the Python command's own arguments: the engine's command and the image's Python."""
        raise NotImplementedError(f"container.runtime {self.name} starts no container")

    def gpu_args(self, profile: str) -> list[str]:
        """GPU passthrough for env.profile, where container.gpu_args is null."""
        return []

    def image_is_path(self, image: str) -> bool:
        """Whether container.image names a file on the shared filesystem (so the submit host should have it too)."""
        return False


def path_like(image: str) -> bool:
    """An image given as a path: a squashfs (pyxis) or a .sif (apptainer), or anything starting with / ./ ../"""
    return image.startswith(("/", "./", "../")) or image.endswith((".sqsh", ".sif"))


class NoContainer(Engine):
    """runtime none: no container and no image; each node runs the submit host's Python (flux_train/cluster/
    container.py reads none of the container settings for it)."""

    name = "none"
    needs_image = False


class Pyxis(Engine):
    """pyxis, an srun plugin: the container comes from srun's options, so only the agent's step is in it (the batch
    script and its requeue teardown stay on the host). It passes the job's environment, keeps the node's limits and
    reports its own errors on each node."""

    name = "pyxis"
    srun_plugin = True

    def srun_options(self, launch: Launch) -> list[str]:
        return [
            f"--container-image={launch.image}",
            "--container-mounts=" + ",".join(launch.binds),
            f"--container-workdir={launch.workdir}",
            *launch.extra_args,
        ]

    def argv(self, launch: Launch) -> list[str]:
        return list(launch.python)

    def image_is_path(self, image: str) -> bool:
        return path_like(image)


class Apptainer(Engine):
    """apptainer exec: passes the job's environment and keeps the node's limits; the image is a .sif, a sandbox
    folder or a URI."""

    name = "apptainer"
    image_check = r"""[[ $image == *://* || -r $image ]] || fail "image $image is missing or unreadable here:" \
  "copy it to every node (a shared filesystem), or fix container.image"
"""

    def argv(self, launch: Launch) -> list[str]:
        return [
            self.name,
            "exec",
            *launch.gpu_args,
            "--bind=" + ",".join(launch.binds),
            f"--pwd={launch.workdir}",
            *launch.extra_args,
            launch.image,
            *launch.python,
        ]

    def gpu_args(self, profile: str) -> list[str]:
        return {"nvidia": ["--nv"], "amd": ["--rocm"]}.get(profile, [])

    def image_is_path(self, image: str) -> bool:
        return path_like(image)


class Docker(Engine):
    """docker run: the container starts from the image's environment (the variables the agent needs are passed in
    by name), with the host's network and IPC, the ulimits and, with env.ib_hca, the InfiniBand devices; the image is
    a tag in the node's store."""

    name = "docker"
    nvidia_gpus: ClassVar[tuple[str, ...]] = ("--gpus=all",)
    amd_gpus: ClassVar[tuple[str, ...]] = (
        "--device=/dev/kfd",
        "--device=/dev/dri",
        "--group-add=video",
        "--security-opt=seccomp=unconfined",
    )
    image_check = r"""out=$("$engine" version 2>&1) \
  || fail "$engine does not work here ($(last "$out")): start its service, or choose another container.runtime"
"$engine" image inspect "$image" >/dev/null 2>&1 || fail "image $image is not in the $engine image store here:" \
  "build or load it on every node ($engine load -i FILE), or fix container.image"
"""

    def argv(self, launch: Launch) -> list[str]:
        return [
            self.name,
            "run",
            "--rm",
            "--init",
            "--network=host",
            "--ipc=host",
            *[f"--ulimit={name}={value}" for name, value in launch.ulimits.items()],
            *launch.gpu_args,
            *(["--device=/dev/infiniband", "--cap-add=IPC_LOCK"] if launch.infiniband else []),
            *[f"--volume={bind}" for bind in launch.binds],
            f"--workdir={launch.workdir}",
            *[f"--env={name}" for name in launch.env],
            *launch.extra_args,
            launch.image,
            *launch.python,
        ]

    def gpu_args(self, profile: str) -> list[str]:
        return list({"nvidia": self.nvidia_gpus, "amd": self.amd_gpus}.get(profile, ()))


class Podman(Docker):
    """podman run, as docker run; NVIDIA's GPUs through CDI."""

    name = "podman"
    nvidia_gpus = ("--device=nvidia.com/gpu=all",)


ENGINES: dict[str, Engine] = {
    engine.name: engine
    for engine in (
        NoContainer(),
        Pyxis(),
        Apptainer(),
        Docker(),
        Podman(),
    )
}

# container.runtime's type: the table's names. pyright cannot read a Literal made at run time, so it checks the key
# as a str (nothing compares it with a name: the engine is asked)
if TYPE_CHECKING:
    EngineName: TypeAlias = str
else:
    EngineName = Literal[tuple(ENGINES)]
