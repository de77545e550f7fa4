import pytest

from flux_train.config import ConfigError, eval_interval_steps, load_config, validate


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
