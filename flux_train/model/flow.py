"""Rectified-flow math of the MLPerf flux1 task (docs/benchmark.md): latents, noising, target, loss, dropout.

Everything that draws random numbers takes an explicit torch.Generator so each data-parallel rank owns its
stream (noise/timesteps and caption dropout on separate generators) and tests can replay it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dataprep.format import EVAL_TIMESTEP_BINS

# streams of random numbers, each seeded per (seed, step, global micro-batch) so that every data-parallel
# rank draws its own numbers, a resumed run draws the same ones, and the draws do not depend on how the
# global batch is split across ranks
STREAM_NOISE, STREAM_DROPOUT, STREAM_EVAL = 0, 1, 2


def seeded_generator(device: torch.device, seed: int, step: int, micro_batch: int, stream: int) -> torch.Generator:
    mixed = np.random.SeedSequence([seed, step, micro_batch, stream]).generate_state(2, dtype=np.uint32)
    return torch.Generator(device=device).manual_seed(int(mixed[0]) << 31 | int(mixed[1]) >> 1)


def sample_latent(
    mean: torch.Tensor, logvar: torch.Tensor, eps: torch.Tensor, shift: float, scale: float
) -> torch.Tensor:
    """x0 = (mean + exp(logvar/2) * eps - shift) * scale, in fp32."""
    z = mean.float() + torch.exp(0.5 * logvar.float()) * eps.float()
    return (z - shift) * scale


def pack(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: 2x2 patches, channel-major within a patch (as the reference)."""
    b, c, h, w = latent.shape
    x = latent.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    b, _, c4 = tokens.shape
    x = tokens.view(b, height // 2, width // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, height, width)


def image_ids(height: int, width: int, device=None) -> torch.Tensor:
    """(0, row, col) for each 2x2 patch of an H x W latent, row-major."""
    rows, cols = height // 2, width // 2
    ids = torch.zeros(rows * cols, 3, device=device)
    ids[:, 1] = torch.arange(rows, device=device).repeat_interleave(cols)
    ids[:, 2] = torch.arange(cols, device=device).repeat(rows)
    return ids


def text_ids(length: int, device=None) -> torch.Tensor:
    return torch.zeros(length, 3, device=device)


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_t = (1 - t) x0 + t noise and the velocity target noise - x0; t broadcasts per sample."""
    tb = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1.0 - tb) * x0 + tb * noise, noise - x0


def mse_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over all elements, in fp32."""
    return torch.mean((pred.float() - target.float()) ** 2)


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over every dim but the batch, in fp32 (the eval metric)."""
    return ((pred.float() - target.float()) ** 2).flatten(1).mean(1)


def eval_timesteps(k: torch.Tensor) -> torch.Tensor:
    """t = k / 8 for the pre-assigned integer bins k in 0..7 (not midpoints)."""
    return k.float() / EVAL_TIMESTEP_BINS


def caption_dropout(
    t5: torch.Tensor,
    clip: torch.Tensor,
    empty_t5: torch.Tensor,
    empty_clip: torch.Tensor,
    prob: float,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """With probability `prob` per sample replace both encodings by the empty-string ones."""
    drop = torch.rand(t5.shape[0], device=t5.device, generator=gen) < prob
    t5 = torch.where(drop.view(-1, 1, 1), empty_t5.to(t5.dtype).expand_as(t5), t5)
    clip = torch.where(drop.view(-1, 1), empty_clip.to(clip.dtype).expand_as(clip), clip)
    return t5, clip, drop


@dataclass
class ModelInputs:
    """The model's keyword arguments (flux_train.model.flux.FluxModel.forward)."""

    img: torch.Tensor
    img_ids: torch.Tensor
    txt: torch.Tensor
    txt_ids: torch.Tensor
    timesteps: torch.Tensor
    y: torch.Tensor

    def as_kwargs(self) -> dict:
        return dict(
            img=self.img, img_ids=self.img_ids, txt=self.txt, txt_ids=self.txt_ids, timesteps=self.timesteps, y=self.y
        )


def build_inputs(
    batch: dict, t: torch.Tensor, gen: torch.Generator, shift: float, scale: float, dtype: torch.dtype
) -> tuple[ModelInputs, torch.Tensor]:
    """Model inputs and velocity target for a batch (dict of t5, clip, mean, logvar) at timesteps t (fp32; the
    noising uses them as they are). Inputs go to the model in the compute dtype, timesteps included, as the
    reference's batch reaches its model; the model forms the timestep embedding's argument in fp32 from them,
    as the reference's forward does (model.time_argument). Position ids stay fp32 for the RoPE tables."""
    mean, logvar = batch["mean"], batch["logvar"]
    _, _, height, width = mean.shape
    eps_latent = torch.randn(mean.shape, device=mean.device, generator=gen)
    x0 = pack(sample_latent(mean, logvar, eps_latent, shift, scale))
    noise = torch.randn(x0.shape, device=x0.device, generator=gen)
    x_t, target = noised(x0, noise, t)
    inputs = ModelInputs(
        img=x_t.to(dtype),
        img_ids=image_ids(height, width, device=mean.device),
        txt=batch["t5"].to(dtype),
        txt_ids=text_ids(batch["t5"].shape[1], device=mean.device),
        timesteps=t.to(dtype),
        y=batch["clip"].to(dtype),
    )
    return inputs, target


def training_inputs(
    batch: dict,
    tcfg,
    step: int,
    global_micro: int,
    empty: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[ModelInputs, torch.Tensor]:
    """One training micro-batch's model inputs and target: caption dropout to the empty encodings (t5, clip), a
    uniform timestep and the noising, each from its own stream seeded by (train.seed, step, micro-batch)."""
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    gen = seeded_generator(device, tcfg.seed, step, global_micro, STREAM_NOISE)
    drop_gen = seeded_generator(device, tcfg.seed, step, global_micro, STREAM_DROPOUT)
    batch["t5"], batch["clip"], _ = caption_dropout(
        batch["t5"], batch["clip"], *empty, tcfg.caption_dropout_prob, drop_gen
    )
    timesteps = torch.rand(batch["t5"].shape[0], device=device, generator=gen)
    return build_inputs(batch, timesteps, gen, tcfg.latent_shift, tcfg.latent_scale, dtype)
