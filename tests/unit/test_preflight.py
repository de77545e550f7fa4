"""Pre-flight refuses a node before the run's clock starts, naming the host and the fix: its node checks. Through
the trainer: tests/runs/test_preflight.py."""

import pytest

from flux_train.config import load_config
from flux_train.training import preflight


def test_node_checks_name_disk_and_dataset_problems(tmp_path):
    import torch

    cfg = load_config(
        "configs/debug.yaml",
        [
            f"logging.out_dir={tmp_path}",
            "preflight.min_free_disk_gb=1e9",
            "data.source=energon",
            f"data.path={tmp_path}",
        ],
    )
    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / "dataset.yaml").write_text("x")
    (tmp_path / "train").mkdir()
    problems = preflight.node_problems(cfg, torch.device("cpu"), 1)
    assert any("free for the checkpoint folder" in p for p in problems)
    assert any("free for the log folder" in p for p in problems)
    assert any(p.endswith("has no val/ split") for p in problems)


def test_node_checks_name_a_folder_this_node_cannot_write(tmp_path):
    """A checkpoint folder under a regular file stands in for a read-only mount (permission bits do not stop root,
    and the check writes rather than reads them)."""
    import torch

    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = load_config(
        "configs/debug.yaml",
        [f"logging.out_dir={tmp_path / 'run'}", f"checkpoint.dir={blocker / 'checkpoints'}", "data.source=synthetic"],
    )
    problems = preflight.node_problems(cfg, torch.device("cpu"), 1)
    assert problems == [f"the checkpoint folder {blocker / 'checkpoints'} is not writable here (Not a directory)"]
    assert not list((tmp_path / "run").iterdir())  # the probe leaves nothing behind


@pytest.mark.parametrize("source", ["synthetic", "energon"])
def test_data_of_another_latent_size_than_the_captured_graph_is_refused_before_init_start(tmp_path, source):
    """perf.cuda_graphs captures the step on latents of perf.warmup_latent_size; a set of 8x8 latents against the
    default 32 stopped a GPU run at its first step, after run_start ('batch input 'img' has shape ...'). The check
    runs in check_inputs, before init_start; a GPU host is what turns the graphs on (ddp, the warm-up), so the device
    is named cuda here, where no CUDA call is made. energon: the fixture dataset our dataprep writes, with its own
    description of its shape."""
    import torch

    graphed = ["parallel.strategy=ddp", "train.compute_dtype=bfloat16", "perf.warmup_iters=1", f"data.source={source}"]
    cfg = load_config("configs/debug.yaml", [f"logging.out_dir={tmp_path}", *graphed])
    said = "data.synthetic_latent_size" if source == "synthetic" else "flux_dataset.yaml"
    with pytest.raises(preflight.ConfigError) as refused:
        preflight.check_inputs(cfg, torch.device("cuda"), 1)
    assert str(refused.value).startswith("perf.cuda_graphs: the data's latents are 8x8 (") and said in str(
        refused.value
    )
    assert str(refused.value).endswith(
        "), the step graph is captured on 32x32 (perf.warmup_latent_size): set perf.warmup_latent_size=8, or "
        "perf.cuda_graphs=false"
    )
    for fine in (["perf.warmup_latent_size=8"], ["perf.cuda_graphs=false"]):
        preflight.check_inputs(
            load_config("configs/debug.yaml", [f"logging.out_dir={tmp_path}", *graphed, *fine]), torch.device("cuda"), 1
        )
