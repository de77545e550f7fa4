"""The precision component (flux_train/training/precision.py) and its table of recipes: the table is the config's, no
recipe name is compared anywhere else, a state of another recipe is refused, delayed scaling warns of values that
keep saturating. The trainer's runs under each recipe: tests/runs/test_precision.py; the GPU variants:
tests/gpu/test_gpu.py."""

import ast
import typing
from pathlib import Path

import pytest
import torch

from flux_train.config import ConfigError, ModelConfig, PerfConfig, load_config
from flux_train.errors import StateMisfit
from flux_train.model import flow
from flux_train.model.flux import build_model, materialize
from flux_train.precision_recipes import RECIPES
from flux_train.training.precision import NoFP8, Precision, precision_for

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
TINY = ModelConfig(  # two blocks of a width FP8 takes (multiples of 16)
    flavor="t",
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    axes_dims_rope=[4, 6, 6],
)


def test_the_recipe_table_holds_the_configs_recipes_and_impls():
    hints = typing.get_type_hints(PerfConfig)
    assert tuple(RECIPES) == typing.get_args(hints["fp8"])
    impls = set(typing.get_args(hints["fp8_impl"]))
    for name, recipe in RECIPES.items():
        assert recipe.name == name and set(recipe.e4m3_weights) <= set(recipe.impls) <= impls, name


def recipe_comparisons(path: Path) -> list[str]:
    """Where the module at `path` compares something with an FP8 recipe's name (or a bench row named for one)."""
    names = [name for name, recipe in RECIPES.items() if recipe.fp8]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [
                c for side in (node.left, *node.comparators) for c in ast.walk(side) if isinstance(c, ast.Constant)
            ]
            named = [c.value for c in sides if isinstance(c.value, str) and c.value.split("-")[-1] in names]
            found += [f"{path.name}:{node.lineno} {c}" for c in named]
    return found


def test_no_fp8_recipe_name_is_compared_outside_the_recipes_table(tmp_path):
    """Every reader asks the table (flux_train/precision_recipes.py) what a recipe does instead of comparing its
    name; the check finds a comparison however it is written."""
    modules = sorted((ROOT / "flux_train").rglob("*.py"))
    assert [hit for path in modules for hit in recipe_comparisons(path)] == []
    planted = tmp_path / "planted.py"
    planted.write_text('a = x == "delayed"\nb = y in ("none", "rowwise")\nc = row != "ours-fp8-tensorwise"\n')
    assert recipe_comparisons(planted) == [
        "planted.py:1 delayed",
        "planted.py:2 rowwise",
        "planted.py:3 ours-fp8-tensorwise",
    ]


def test_an_impl_without_the_recipe_is_refused_naming_the_one_that_has_it():
    with pytest.raises(
        ConfigError, match="perf.fp8=delayed: perf.fp8_impl=torchao has no such recipe; set perf.fp8_impl=ours"
    ):
        load_config("configs/debug.yaml", ["perf.fp8=delayed", "perf.fp8_impl=torchao"])


# ------------------------------------------------------------------------------------------ a precision's lifecycle


def attached(**perf) -> tuple[torch.nn.Module, Precision]:
    """The tiny model converted and attached as the trainer does (fp32 weights, no layout), its zero-initialised
    layers moved off zero so every gradient flows."""
    precision = precision_for(PerfConfig(**perf), CPU)
    model = materialize(build_model(TINY), CPU, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    precision.convert(model)
    precision.attach(model)
    return model, precision


def train_step(model: torch.nn.Module, precision: Precision, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    inputs = dict(
        img=torch.randn(2, 64, 64, generator=g),
        img_ids=flow.image_ids(16, 16, CPU),
        txt=torch.randn(2, 16, 4096, generator=g),
        txt_ids=flow.text_ids(16, CPU),
        timesteps=torch.rand(2, generator=g),
        y=torch.randn(2, 768, generator=g),
    )
    model(**inputs).square().mean().backward()
    precision.after_step()


@pytest.mark.parametrize("growth,warns", [(1.25, True), (1.05, False)])
def test_delayed_scaling_warns_once_naming_the_pairs_whose_values_keep_saturating(growth, warns):
    """A weight growing 25 % a step outgrows its 4-step amax history every step, by more than an e4m3 step (1/8):
    its largest values saturate. Once the histories have filled, the first window of 4 steps names it, once.
    Growing 5 % a step, it overflows its scale too (fp8_overflows counts it), but by less than e4m3's rounding:
    no warning. The same batch every step: nothing else moves."""
    model, precision = attached(fp8="delayed", fp8_amax_history=4)
    grown = model.get_submodule("double_blocks.0.img_mlp.0")
    lines = []
    for step in range(1, 17):
        train_step(model, precision)
        with torch.no_grad():
            grown.weight.mul_(growth)
        lines.append(precision.warning(step))
    said = [(step, line) for step, line in enumerate(lines, 1) if line]
    assert precision.metrics()["fp8_overflows"] >= 12  # the grown weight at least, every step from the second
    if not warns:
        assert said == []
        return
    assert len(said) == 1 and said[0][0] == 8, said
    line = said[0][1]
    assert line.startswith("FP8 delayed scaling: the values of ") and " in at least a quarter of steps 5-8 (" in line
    assert "(double_blocks.0.img_mlp.0 W" in line and line.endswith("perf.fp8_margin=1 doubles the headroom")


def test_a_precision_refuses_a_state_it_cannot_take_and_keeps_its_own():
    """Another history length, another recipe, or no history where one is kept: StateMisfit, saying what the
    state holds and what this run has, and nothing changed."""
    model, four = attached(fp8="delayed", fp8_amax_history=4)
    for seed in (1, 2):
        train_step(model, four, seed)
    state = four.state_dict()
    assert state["history"].shape == (10, 3, 4) and state["history"].any()
    model8, eight = attached(fp8="delayed", fp8_amax_history=8)
    train_step(model8, eight, 3)
    before = eight.state_dict()
    with pytest.raises(StateMisfit, match=r"history of shape \(10, 3, 4\), .* perf.fp8_amax_history=8"):
        eight.load_state_dict(state)
    with pytest.raises(StateMisfit, match=r"holds no amax history \(saved without perf.fp8=delayed\)"):
        eight.load_state_dict({})
    after = eight.state_dict()
    assert torch.equal(after["history"], before["history"]) and torch.equal(after["overflows"], before["overflows"])
    for perf in ({"fp8": "tensorwise"}, {"fp8": "rowwise"}, {"fp8": "tensorwise", "fp8_impl": "torchao"}, {}):
        name = perf.get("fp8", "none")
        with pytest.raises(StateMisfit, match=f"holds FP8 amax histories .*, perf.fp8={name} keeps none"):
            attached(**perf)[1].load_state_dict(state)
    NoFP8().load_state_dict({})  # a state of a recipe without one: nothing to take
