"""The layouts on the CPU: mesh shapes, compiled blocks' checkpoint names, each layout has what the Layout protocol
declares and the trainer calls nothing else, ddp's gradient checks and updates. Ranks training against one rank:
tests/runs/test_parallel.py."""

import re

import pytest

from flux_train.config import ParallelConfig, mesh_shape


@pytest.mark.parametrize(
    "world,local,shard,replicate,expected",
    [
        (16, 8, -1, -1, (2, 8)),  # default: shard within a node, replicate across nodes
        (8, 8, -1, -1, (1, 8)),
        (16, 8, 16, -1, (1, 16)),  # plain FSDP over everything
        (16, 8, -1, 4, (4, 4)),
    ],
)
def test_mesh_shape(world, local, shard, replicate, expected):
    assert mesh_shape(ParallelConfig(dp_shard=shard, dp_replicate=replicate), world, local) == expected


@pytest.mark.parametrize(
    "shard,replicate,world,message",
    [
        (3, -1, 8, r"parallel.dp_shard=3 does not divide the 8 ranks of this run; choose a divisor of 8 or -1"),
        (2, 2, 8, r"parallel.dp_replicate 2 x parallel.dp_shard 2 != the 8 ranks of this run; set one of them to -1"),
    ],
)
def test_mesh_shape_rejects_meshes_that_do_not_fit(shard, replicate, world, message):
    from flux_train.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        mesh_shape(ParallelConfig(dp_shard=shard, dp_replicate=replicate), world, 8)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_compiled_blocks_keep_checkpoint_names_and_initial_weights(strategy):
    """Checkpoints move between runs with and without perf.compile, and weights do not depend on the layout:
    same names, same initial values as a plain model."""
    import torch
    import torch.distributed as dist

    from flux_train.config import load_config
    from flux_train.model.flux import build_model, materialize, reference_init
    from flux_train.training.distributed import build_mesh
    from flux_train.training.layout import build_training
    from flux_train.training.perf import compile_blocks

    cfg = load_config("configs/debug.yaml", [f"parallel.strategy={strategy}"])
    plain = dict(materialize(build_model(cfg.model), torch.device("cpu"), seed=5).named_parameters())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = compile_blocks(build_model(cfg.model), "block")  # torch.compile wraps lazily: nothing compiles
        training = build_training(
            model, build_mesh(cfg.parallel, 1, 1, "cpu"), cfg.parallel, cfg.train, torch.float32, torch.device("cpu")
        )
        training.assign_weights(reference_init(model, 5, "cpu"))
        saved = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in training.state_dict()["model"].items()
        }
        assert set(saved) == set(plain) and not any("_orig_mod" in k for k in saved)
        assert all(torch.equal(plain[k], saved[k]) for k in plain)
    finally:
        dist.destroy_process_group()


def layout_methods() -> list[str]:
    from flux_train.training.layout import Layout

    return [name for name, value in vars(Layout).items() if callable(value) and not name.startswith("_")]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_each_layout_has_what_the_layout_protocol_declares(strategy):
    """The trainer drives either layout through layout.Layout: each has its model and every method, taking the
    protocol's parameters."""
    import inspect

    import torch
    import torch.distributed as dist

    from flux_train.config import load_config
    from flux_train.model.flux import build_model
    from flux_train.training.distributed import build_mesh
    from flux_train.training.layout import Layout, build_training

    cfg = load_config("configs/debug.yaml", [f"parallel.strategy={strategy}"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = build_mesh(cfg.parallel, 1, 1, "cpu")
        layout = build_training(
            build_model(cfg.model), mesh, cfg.parallel, cfg.train, torch.float32, torch.device("cpu")
        )
    finally:
        dist.destroy_process_group()
    assert isinstance(layout.model, torch.nn.Module)
    assert len(layout_methods()) == 10
    for name in layout_methods():
        declared = list(inspect.signature(getattr(Layout, name)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(layout, name)).parameters) == declared, name


def test_the_trainer_uses_only_what_the_layout_protocol_declares():
    """What the Trainer calls on the layout build_training gave it is in layout.Layout, so either layout serves."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[2] / "flux_train/training/train.py").read_text())
    held = next(  # the Trainer's attribute that holds the layout
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        if getattr(node.value.func, "id", None) == "build_training"
        for target in node.targets
    )
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == held
    }
    assert used and used <= {*layout_methods(), "model"}, used - {*layout_methods(), "model"}


def test_ddp_names_the_parameter_that_received_no_gradient_or_two():
    """ddp takes each parameter's gradient from its hook: one that gets none, in the last micro-batch or an earlier
    one (whose slice would keep the previous step's), or two in one micro-batch stops the step naming it."""
    import torch
    import torch.distributed as dist

    from flux_train.config import load_config
    from flux_train.model.flux import build_model
    from flux_train.training.distributed import build_mesh
    from flux_train.training.layout import build_training

    cfg = load_config("configs/debug.yaml", ["parallel.strategy=ddp"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = build_mesh(cfg.parallel, 1, 1, "cpu")
        ddp = build_training(build_model(cfg.model), mesh, cfg.parallel, cfg.train, torch.float32, torch.device("cpu"))
        params = [p for bucket in ddp.buckets for p in bucket.params]
        left_out = ddp.buckets[1].params[1]  # neither first nor last of its block: named by where it is, not a count
        name = ddp.buckets[1].names[1]

        def backward(skip=None):
            sum(p.sum() for p in params if p is not skip).backward()

        ddp.start_micro_batch(0, 1)
        backward()
        ddp.finish_backward()  # every gradient there: the step goes on
        ddp.start_micro_batch(0, 1)
        backward(skip=left_out)
        with pytest.raises(RuntimeError, match=f"^parameter {name} received no gradient in micro-batch 1 of 1: "):
            ddp.finish_backward()
        ddp.start_micro_batch(0, 2)
        backward(skip=left_out)
        with pytest.raises(RuntimeError, match=f"^parameter {name} received no gradient in micro-batch 1 of 2: "):
            ddp.start_micro_batch(1, 2)
        ddp.start_micro_batch(0, 1)
        loss = sum(p.sum() for p in params)
        loss.backward(retain_graph=True)
        names = "|".join(re.escape(n) for bucket in ddp.buckets for n in bucket.names)  # one of ours, by name
        with pytest.raises(RuntimeError, match=rf"^parameter ({names}) received a second gradient in one micro-batch$"):
            loss.backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_ddp_applies_each_update_once_however_often_it_is_issued(graphed):
    """Eager, ddp's step() takes the AdamW step. For a graphed step it computes the clipping factor and leaves the
    update to the next forward (the first step's: an evaluation's forward, bucket by bucket ahead of the blocks) or
    wait_params (the second's); a captured step replays that issue without the host knowing whether an evaluation
    or checkpoint applied it already, and issuing it again changes nothing. Either way two steps match torch's
    AdamW after torch's clipping."""
    import torch
    import torch.distributed as dist

    from flux_train.config import load_config
    from flux_train.model import flow
    from flux_train.model.flux import build_model
    from flux_train.training.distributed import build_mesh
    from flux_train.training.layout import build_training

    cfg = load_config("configs/debug.yaml", ["parallel.strategy=ddp", "train.grad_clip_norm=0.5"])
    t = cfg.train
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = build_mesh(cfg.parallel, 1, 1, "cpu")
        model = build_model(cfg.model)
        ddp = build_training(model, mesh, cfg.parallel, t, torch.float32, torch.device("cpu"), graphed=graphed)
        g = torch.Generator().manual_seed(0)
        start = {n: torch.randn(p.shape, generator=g) for b in ddp.buckets for n, p in zip(b.names, b.params)}
        ddp.assign_weights(start.items())
        ours = {n: p for b in ddp.buckets for n, p in zip(b.names, b.params)}
        ref = {n: torch.nn.Parameter(v.clone()) for n, v in start.items()}
        opt = torch.optim.AdamW(
            ref.values(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay
        )

        m = cfg.model
        inputs = dict(
            img=torch.randn(1, 64, m.in_channels, generator=g),
            img_ids=flow.image_ids(16, 16, "cpu"),
            txt=torch.randn(1, 8, m.joint_attention_dim, generator=g),
            txt_ids=flow.text_ids(8, "cpu"),
            timesteps=torch.rand(1, generator=g),
            y=torch.randn(1, m.pooled_projection_dim, generator=g),
        )

        def unchanged(before):
            return all(torch.equal(p.detach(), before[n]) for n, p in ours.items())

        def matches_reference():
            for name, p in ours.items():
                torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=1e-5, atol=1e-6, msg=name)

        for step in range(2):
            before = {n: p.detach().clone() for n, p in ours.items()}
            ddp.begin_step(t.lr)
            ddp.wait_params()  # the issue a replayed step makes again after the last step's was applied: a no-op
            assert unchanged(before), step
            ddp.start_micro_batch(0, 1)
            sum((p.square() * (i + 1)).sum() for i, p in enumerate(ours.values())).backward()
            ddp.finish_backward()
            ddp.step()
            sum((p.square() * (i + 1)).sum() for i, p in enumerate(ref.values())).backward()
            torch.nn.utils.clip_grad_norm_(ref.values(), t.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            if graphed:
                assert unchanged(before), step  # the update waits for the next forward
                if step == 0:  # an evaluation's forward applies it
                    with torch.no_grad():
                        ddp.model(**inputs)
                else:
                    ddp.wait_params()
            matches_reference()
            ddp.wait_params()  # and again: nothing
            matches_reference()
    finally:
        dist.destroy_process_group()
