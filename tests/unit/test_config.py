import os
from pathlib import Path

import pytest

from flux_train.config import ConfigError, eval_interval_steps, graphs_on, keys, load_config, validate

CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
GENERATED = "<!-- generated from the fields of flux_train/config/: everything below -->\n"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_compose_in_order_and_file_wins(tmp_path):
    write(tmp_path, "base.yaml", "train: {lr: 1.0e-3, max_steps: 5}\n")
    cfg_path = write(tmp_path, "run.yaml", "defaults: [base, model/flux-debug]\ntrain: {max_steps: 7}\n")
    cfg = load_config(cfg_path)
    assert cfg.train.lr == 1e-3 and cfg.train.max_steps == 7
    assert cfg.model.flavor == "flux-debug" and cfg.model.num_layers == 2


def test_set_overrides_parse_yaml_values(tmp_path):
    cfg = load_config(
        write(tmp_path, "c.yaml", "{}\n"),
        [
            "train.lr=5e-4",
            "perf.warmup_iters=1",
            "model.axes_dims_rope=[8, 28, 28]",
            "model.attention_head_dim=64",
            "logging.out_dir=/tmp/x y",
        ],
    )
    assert cfg.train.lr == 5e-4 and cfg.perf.warmup_iters == 1
    assert cfg.model.axes_dims_rope == [8, 28, 28] and cfg.logging.out_dir == "/tmp/x y"


def test_unknown_key_names_path_and_accepted_keys(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "c.yaml", "train: {learning_rate: 1.0}\n"))
    assert "unknown key 'train.learning_rate'" in str(err.value)
    assert "lr" in str(err.value) and "warmup_steps" in str(err.value)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trian'"):
        load_config(write(tmp_path, "c.yaml", "trian: {lr: 1.0}\n"))


def test_wrong_type_names_path_and_expected(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "c.yaml", "train: {global_batch_size: '512x'}\n"))
    assert "train.global_batch_size" in str(err.value) and "expected an integer" in str(err.value)
    with pytest.raises(ConfigError, match=r"perf.compile: 'fast' is not accepted; expected one of 'none'"):
        load_config(write(tmp_path, "d.yaml", "perf: {compile: fast}\n"))


def test_indivisible_batch_is_one_clear_message(tmp_path):
    cfg = load_config(write(tmp_path, "c.yaml", "train: {global_batch_size: 100, micro_batch_size: 16}\n"))
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=4)
    msg = str(err.value)
    assert "train.global_batch_size 100" in msg and "16 x data-parallel size 4 = 64" in msg


def test_impossible_values(tmp_path):
    with pytest.raises(ConfigError, match="model.axes_dims_rope: must sum to attention_head_dim"):
        load_config(write(tmp_path, "c.yaml", "model: {axes_dims_rope: [16, 56, 50]}\n"))
    with pytest.raises(ConfigError, match="train.caption_dropout_prob"):
        load_config(write(tmp_path, "d.yaml", "train: {caption_dropout_prob: 1.5}\n"))


def test_missing_file_and_bad_default(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="defaults: cannot find 'nothere'"):
        load_config(write(tmp_path, "c.yaml", "defaults: [nothere]\n"))


@pytest.mark.parametrize(
    "gbs,steps,samples", [(512, 512, 262144), (2048, 128, 262144), (2304, 114, 262656), (4096, 64, 262144)]
)
def test_eval_interval(tmp_path, gbs, steps, samples):
    cfg = load_config(write(tmp_path, "c.yaml", f"train: {{global_batch_size: {gbs}}}\n"))
    assert eval_interval_steps(cfg) == steps
    assert eval_interval_steps(cfg) * gbs == samples


def test_recipes_match_reference_table():
    expected = {512: (2.0e-4, 1600), 1024: (2.5e-4, 800), 2048: (2.5e-4, 0), 4096: (4.0e-4, 100)}
    for gbs, (lr, warmup) in expected.items():
        t = load_config(f"configs/recipes/gbs{gbs}.yaml").train
        assert (t.global_batch_size, t.lr, t.warmup_steps) == (gbs, lr, warmup)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["perf.cuda_graphs=true", "perf.warmup_iters=2"],
            "perf.cuda_graphs: FSDP2 gathers weights into fresh buffers",
        ),
        (["perf.cuda_graphs=true", "parallel.strategy=ddp"], "set perf.warmup_iters >= 1"),
    ],
)
def test_layout_and_graph_combinations_that_cannot_work_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, "c.yaml", "{}\n"), overrides)


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.path=", "data.path: empty; give a value, or null to leave it unset"),  # an unset $DATA
        ("logging.out_dir=", "logging.out_dir: empty; give a value, or null to leave it unset"),
        ("checkpoint.dir= ", "checkpoint.dir: empty; give a value, or null to leave it unset"),
        ("logging.mllog_file=logs/mllog.log", "logging.mllog_file: a file name in logging.out_dir, not a path, got"),
        ("train.lr=1e309", "train.lr: expected a finite number, got inf"),
        (f"train.lr={'9' * 400}", "train.lr: expected a finite number, got inf"),
        ("eval.target=.nan", "eval.target: expected a finite number, got nan"),
        ("train.adam_eps=-.inf", "train.adam_eps: expected a finite number, got -inf"),
        ("model.num_layers=-1", "model.num_layers: must be >= 0, got -1"),
        ("train.seed=-5", "train.seed: must be in [0, 4294967295], got -5"),
        ("train.seed=99999999999", "train.seed: must be in [0, 4294967295], got 99999999999"),
        ("parallel.timeout_s=0", "parallel.timeout_s: must be in [10, 604800], got 0"),
        ("parallel.dp_shard=0", "parallel.dp_shard: must be -1 (auto) or >= 1, got 0"),
        ("train.adam_beta2=1.0", "train.adam_beta2: must be in [0, 1), got 1.0"),
        ("env.master_port=70000", "env.master_port: must be in [0, 65535], got 70000"),
        ("data.num_workers=-2", "data.num_workers: must be >= 0, got -2"),
        ("model.axes_dims_rope=[2, 7, 7]", "model.axes_dims_rope: every axis must be a positive even number"),
        ("perf.warmup_latent_size=7", "perf.warmup_latent_size: must be a positive even number (2x2 patches), got 7"),
        ("data.synthetic_latent_size=0", "data.synthetic_latent_size: must be a positive even number (2x2 patches)"),
        ("train.lr=*x", "--set 'train.lr=*x': line 1: an alias (*name); write the value out instead"),
        ('logging.out_dir="/tmp/a\\nb"', "logging.out_dir: '/tmp/a\\nb' holds a control character"),
    ],
)
def test_empty_and_nonsensical_values_are_refused_in_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/debug.yaml", [override])
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_an_unset_shell_variable_as_the_data_path_ends_the_run_in_one_line(capsys):
    """`--set data.path=$DATA` with DATA unset: not the debug fixture, not a traceback; exit 2 (reports_user_errors)."""
    from flux_train.training.train import main

    assert main(["--config", "configs/systems/H200_08x08.yaml", "--set", "data.path="]) == 2
    assert capsys.readouterr().err == "config error: data.path: empty; give a value, or null to leave it unset\n"


def billion_laughs() -> str:
    """Nine levels of nine aliases each: 342 bytes that name 9**9 (387 million) strings."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{','.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "content,message",
    [
        (b"train: {lr: 1.0e-3}\n# caf\xe9\n", "not UTF-8 text (byte 25); save it as UTF-8"),
        (billion_laughs().encode(), "line 2: an alias (*name); write the value out instead"),
        (b"defaults: {model: flux-debug}\n", "defaults: expected a list of config names, e.g. [model/flux-debug], got"),
        (b"defaults: [model/flux-debug, [x]]\n", "defaults: expected a list of config names"),
        (b"train: {lr: [1,\n", "not valid YAML: while parsing a flow node expected the node content"),
        (b"train:\n  lr: 1.0e-3\n  lr: 1.0e-4\n", "line 3: key 'lr' given twice in one mapping (first on line 2)"),
    ],
)
def test_a_config_file_that_is_not_a_config_is_refused_in_one_line_fast(tmp_path, content, message):
    import time

    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert time.perf_counter() - t0 < 5
    assert str(err.value).startswith(f"{path}: {message}") and "\n" not in str(err.value), str(err.value)


def markdown(text: str) -> str:
    """Help text as a Markdown table cell shows it as written: | would end the cell, <name> would be read as an HTML
    tag, *TOKEN* as emphasis."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def key_tables() -> str:
    """docs/config.md's generated part: a table per section, a row per key, from the fields."""
    lines, section = [], None
    for key in keys():
        if key.name.split(".")[0] != section:
            section = key.name.split(".")[0]
            lines += ["", f"## {section}", "", "| key | type | default | what it does |", "|---|---|---|---|"]
        cells = [f"`{key.name}`", markdown(key.accepted()), f"`{key.default_text()}`", markdown(key.help)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def test_config_md_shows_every_key_as_its_field_declares_it():
    """docs/config.md below its marker is the tables made from the fields now; FLUX_DOCS_REGENERATE=1 rewrites it."""
    intro, marker, generated = CONFIG_DOC.read_text().partition(GENERATED)
    assert marker, f"{CONFIG_DOC} has lost its line {GENERATED.strip()}"
    if os.environ.get("FLUX_DOCS_REGENERATE"):
        CONFIG_DOC.write_text(intro + marker + key_tables())
        generated = key_tables()
    assert generated == key_tables(), (
        "docs/config.md differs from the fields of flux_train/config/ (FLUX_DOCS_REGENERATE=1 rewrites it)"
    )


@pytest.mark.parametrize(
    "sets, device, graphed",
    [
        (["parallel.strategy=ddp", "perf.fp8=delayed", "perf.warmup_iters=1"], "cuda", True),
        (["parallel.strategy=ddp", "perf.warmup_iters=1"], "cuda", True),  # bf16 too
        (["parallel.strategy=fsdp", "perf.warmup_iters=1"], "cuda", False),
        (["parallel.strategy=fsdp", "perf.fp8=delayed", "perf.warmup_iters=1"], "cuda", False),  # cannot capture
        (["parallel.strategy=ddp", "perf.fp8=delayed", "perf.warmup_iters=1"], "cpu", False),
        (["parallel.strategy=ddp", "perf.fp8=delayed", "perf.warmup_iters=0"], "cuda", False),  # nothing to capture in
        (
            ["parallel.strategy=ddp", "perf.fp8=delayed", "perf.warmup_iters=1", "train.inject_nan_at_step=3"],
            "cuda",
            False,
        ),
        (["parallel.strategy=ddp", "perf.warmup_iters=1", "perf.cuda_graphs=true"], "cuda", True),
        (["parallel.strategy=ddp", "perf.fp8=delayed", "perf.warmup_iters=1", "perf.cuda_graphs=false"], "cuda", False),
    ],
)
def test_cuda_graphs_auto_captures_the_ddp_step_wherever_it_can_on_a_gpu(sets, device, graphed):
    """perf.cuda_graphs=auto (the default): the step is a CUDA graph wherever it can be captured (ddp, bf16 or FP8,
    a GPU, a warm-up to capture in, no NaN hook); true and false decide by themselves."""
    assert graphs_on(load_config("configs/debug.yaml", sets), device) is graphed
