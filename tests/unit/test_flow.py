import numpy as np
import pytest
import torch

from flux_train.model import flow
from flux_train.training.optim import lr_at


def test_loss_matches_float64_formula():
    g = torch.Generator().manual_seed(0)
    b, c, h, w = 3, 16, 4, 6
    mean = torch.randn(b, c, h, w, generator=g).to(torch.bfloat16)
    logvar = (torch.randn(b, c, h, w, generator=g) - 3).to(torch.bfloat16)
    eps1 = torch.randn(b, c, h, w, generator=g)
    noise_img = torch.randn(b, c, h, w, generator=g)
    t = torch.rand(b, generator=g)
    pred_img = torch.randn(b, c, h, w, generator=g)

    x0 = flow.pack(flow.sample_latent(mean, logvar, eps1, 0.1159, 0.3611))
    x_t, target = flow.noised(x0, flow.pack(noise_img), t)
    loss = flow.mse_loss(flow.pack(pred_img), target)

    # the same in float64 numpy, straight from docs/benchmark.md ("Training step") on the unpacked layout
    m, lv, e1, n, tt, p = (x.double().numpy() for x in (mean.float(), logvar.float(), eps1, noise_img, t, pred_img))
    z = m + np.exp(0.5 * lv) * e1
    x0_ref = (z - 0.1159) * 0.3611
    xt_ref = (1 - tt[:, None, None, None]) * x0_ref + tt[:, None, None, None] * n
    target_ref = n - x0_ref
    assert loss.item() == pytest.approx(np.mean((p - target_ref) ** 2), rel=1e-5)
    assert np.allclose(flow.unpack(x_t, h, w).double().numpy(), xt_ref, atol=1e-5)


def test_pack_is_2x2_patches_channel_major():
    x = torch.arange(1 * 2 * 4 * 4).float().view(1, 2, 4, 4)
    packed = flow.pack(x)
    assert packed.shape == (1, 4, 8)
    # first patch (row 0, col 0): channel 0's 2x2 then channel 1's 2x2
    assert packed[0, 0].tolist() == [0, 1, 4, 5, 16, 17, 20, 21]
    assert torch.equal(flow.unpack(packed, 4, 4), x)


def test_position_ids():
    ids = flow.image_ids(4, 6)
    assert ids.shape == (6, 3) and torch.all(ids[:, 0] == 0)
    assert ids[:, 1].tolist() == [0, 0, 0, 1, 1, 1] and ids[:, 2].tolist() == [0, 1, 2, 0, 1, 2]
    assert torch.all(flow.text_ids(5) == 0)


def test_eval_timesteps_are_k_over_8():
    assert flow.eval_timesteps(torch.arange(8)).tolist() == [k / 8 for k in range(8)]


def test_caption_dropout_rate_and_replaces_both():
    n, length = 20_000, 3
    t5 = torch.ones(n, length, 8)
    clip = torch.ones(n, 4)
    empty_t5, empty_clip = torch.zeros(1, length, 8), torch.zeros(1, 4)
    gen = torch.Generator().manual_seed(3)
    t5_out, clip_out, drop = flow.caption_dropout(t5, clip, empty_t5, empty_clip, 0.1, gen)
    assert drop.float().mean().item() == pytest.approx(0.1, abs=0.007)  # ~3.3 sigma at n=20000
    t5_dropped = (t5_out == 0).flatten(1).all(1)
    clip_dropped = (clip_out == 0).all(1)
    assert torch.equal(t5_dropped, drop) and torch.equal(clip_dropped, drop)
    assert torch.all(t5_out[~drop] == 1) and torch.all(clip_out[~drop] == 1)


def test_seeded_generators_differ_by_rank_stream_and_step_but_replay():
    dev = torch.device("cpu")

    def draw(*key):
        return torch.rand(4, generator=flow.seeded_generator(dev, *key)).tolist()

    assert draw(1, 5, 0, flow.STREAM_NOISE) == draw(1, 5, 0, flow.STREAM_NOISE)
    variants = [draw(1, 5, 1, 0), draw(1, 6, 0, 0), draw(1, 5, 0, 1), draw(2, 5, 0, 0)]
    assert all(v != draw(1, 5, 0, 0) for v in variants)


def test_lr_schedule_warmup_then_hold():
    lr, warmup = 2e-4, 1600
    assert lr_at(0, lr, warmup) == pytest.approx(lr / 1600)
    assert lr_at(10, lr, warmup) == pytest.approx(lr * 11 / 1600)
    assert lr_at(warmup - 1, lr, warmup) == pytest.approx(lr)
    assert lr_at(warmup, lr, warmup) == lr
    assert lr_at(50_000, lr, warmup) == lr
    assert lr_at(0, 2.5e-4, 0) == 2.5e-4  # no warm-up (GBS 2048 recipe)
