"""Images from a trained model: diffusers' FluxPipeline with the Flux.1-schnell sampler (4 Euler steps, no
guidance), from local weights only.

    W=/models/FLUX.1-schnell
    python -m flux_train.sample --checkpoint runs/flux/checkpoints --prompts prompts.txt --out grid.png \\
        --vae $W/vae --t5 $W/text_encoder_2 --t5-tokenizer $W/tokenizer_2 \\
        --clip $W/text_encoder --clip-tokenizer $W/tokenizer

The prompts are encoded as the training data was (dataprep.encoders: T5 over 256 tokens, CLIP pooled), then the
checkpoint's weights go into a diffusers FluxTransformer2DModel (flux_train.model.diffusers_adapter). The trainer uses the
same Sampler for `eval.sample_prompts`, a grid per eval in the run folder: training imports nothing from tools, so
the modules that start a run (the train command, the cluster worker) hand it `Sampler.for_run`
(flux_train.training.pictures). Importing this module is light (torch, Pillow): diffusers and the text encoders load
only when a Sampler is made.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from PIL import Image

from dataprep.encoders import ImageEncoder, TextEncoders, device_and_dtype
from dataprep.extras import require
from dataprep.format import IMAGE_SIZE, DataprepError
from flux_train.cli import sample_parser
from flux_train.config import Config, ModelConfig, TrainConfig, load_config
from flux_train.errors import UserError, output_file, reports_user_errors, write_output
from flux_train.model.diffusers_adapter import diffusers_config, quiet_diffusers, to_diffusers

STEPS = 4  # Flux.1-schnell's sampler: 4 steps, guidance-distilled (no classifier-free guidance)
# FLUX.1-schnell's scheduler_config.json: Euler over the flow, no resolution-dependent shift
SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=False,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


@dataclass(frozen=True)
class Weights:
    """Local folders of the frozen models."""

    vae: Path
    t5: Path
    t5_tokenizer: Path
    clip: Path
    clip_tokenizer: Path

    @classmethod
    def in_pipeline_folder(cls, root: str | Path) -> "Weights":
        """A FLUX.1-schnell folder's vae/, text_encoder_2/ + tokenizer_2/ (T5), text_encoder/ + tokenizer/ (CLIP)."""
        root = Path(root)
        return cls(
            root / "vae", root / "text_encoder_2", root / "tokenizer_2", root / "text_encoder", root / "tokenizer"
        )


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per non-empty line."""
    try:
        prompts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise UserError(f"prompts file {path}: {exc.strerror}") from None
    if not prompts:
        raise UserError(f"prompts file {path}: no prompts in it (one per line)")
    return prompts


def image_grid(images: list[Image.Image], columns: int) -> Image.Image:
    """Row-major grid of equal-size images."""
    width, height = images[0].size
    rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * width, (i // columns) * height))
    return grid


def on_device_while_running(block: torch.nn.Module, device: torch.device) -> None:
    """`block`'s weights stay where they are (the CPU) and go to `device` only for its forward: a grid drawn beside
    a training run holds one block's weights on the GPU, not the model's (flux-schnell: 24 GB in bf16), for a copy
    of the model's weights to the GPU per denoising step."""
    params = list(block.parameters())
    kept = [p.data for p in params]

    def onload(module, args):
        for p in params:
            p.data = p.data.to(device)

    def offload(module, args, output):
        for p, data in zip(params, kept):
            p.data = data

    block.register_forward_pre_hook(onload)
    block.register_forward_hook(offload)


class Sampler:
    """The pipeline's frozen parts, made once: the VAE and the prompts' encodings (the text encoders run once and
    are freed). Each `grid` call puts a model's weights into a fresh diffusers transformer, its blocks on the CPU,
    each on the device only while it runs, and samples every prompt."""

    def __init__(
        self,
        weights: Weights,
        prompts: list[str],
        model: ModelConfig,
        train: TrainConfig,
        device: torch.device,
        dtype: torch.dtype,
    ):
        quiet_diffusers()
        try:
            text = TextEncoders(weights.t5, weights.clip, weights.t5_tokenizer, weights.clip_tokenizer, device, dtype)
            self.vae = ImageEncoder(weights.vae, device, dtype).vae
        except DataprepError as exc:  # a folder that holds no such model, named
            raise UserError(str(exc)) from None
        self.t5, self.clip = (e.to(device, dtype) for e in text(prompts))
        del text
        # the pipeline decodes latents / scaling_factor + shift_factor: the inverse of the training's
        # (z - latent_shift) * latent_scale only with the Flux VAE's factors
        factors = (self.vae.config.get("scaling_factor"), self.vae.config.get("shift_factor"))
        if factors != (train.latent_scale, train.latent_shift):
            raise UserError(
                f"the VAE in {weights.vae} has scaling_factor {factors[0]}, shift_factor {factors[1]}; "
                f"the model was trained with train.latent_scale {train.latent_scale}, latent_shift "
                f"{train.latent_shift}: give FLUX.1-schnell's vae/"
            )
        self.model, self.device, self.dtype = model, device, dtype

    @classmethod
    def for_run(cls, cfg: Config, device: torch.device, dtype: torch.dtype) -> "Sampler":
        """The trainer's: eval.sample_prompts with the models of eval.sample_weights."""
        # the trainer builds a sampler only with sample_prompts, which validate() lets through only with sample_weights
        assert cfg.eval.sample_prompts and cfg.eval.sample_weights
        return cls(
            Weights.in_pipeline_folder(cfg.eval.sample_weights),
            read_prompts(cfg.eval.sample_prompts),
            cfg.model,
            cfg.train,
            device,
            dtype,
        )

    @torch.no_grad()
    def grid(
        self, state: dict[str, torch.Tensor], size: int = IMAGE_SIZE, seed: int = 0, columns: int = 0
    ) -> Image.Image:
        """One image per prompt from `state` (our layout), `size` pixels square, in a grid of `columns`
        (default: about square)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
        from diffusers.pipelines.flux.pipeline_output import FluxPipelineOutput

        with torch.device("meta"):
            transformer = FluxTransformer2DModel(**diffusers_config(self.model))
        in_blocks = ("transformer_blocks.", "single_transformer_blocks.")
        weights = {  # the blocks' on the CPU, the rest (embedders, final layer: 0.5 % of the model) on the device
            k: v.to("cpu" if k.startswith(in_blocks) else self.device, self.dtype)
            for k, v in to_diffusers(state, self.model).items()
        }
        transformer.load_state_dict(weights, assign=True, strict=True)
        for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
            on_device_while_running(block, self.device)
        # no text encoders or tokenizers: the prompts come encoded (prompt_embeds); diffusers' types want them all
        no_text = cast(Any, None)
        scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
        pipe = FluxPipeline(scheduler, self.vae, no_text, no_text, no_text, no_text, transformer.eval())
        pipe.set_progress_bar_config(disable=True)
        out = pipe(
            # diffusers types the embeddings torch.FloatTensor (float32's legacy class): any float tensor goes
            prompt_embeds=cast(torch.FloatTensor, self.t5),
            pooled_prompt_embeds=cast(torch.FloatTensor, self.clip),
            num_inference_steps=STEPS,
            guidance_scale=0.0,
            height=size,
            width=size,
            generator=torch.Generator().manual_seed(seed),
        )
        # return_dict=True and output_type="pil", the defaults: a FluxPipelineOutput of PIL images
        assert isinstance(out, FluxPipelineOutput) and isinstance(out.images, list)
        images = out.images
        return image_grid(images, columns or math.ceil(math.sqrt(len(images))))


def run_config_file(checkpoint: Path) -> Path:
    """The config.yaml of the run a checkpoint belongs to: in the checkpoint's folder or up to three above it
    (<out_dir>/checkpoints/step_XXXXXXXX by default)."""
    for folder in [checkpoint, *checkpoint.resolve().parents][:4]:
        if (folder / "config.yaml").is_file():
            return folder / "config.yaml"
    raise UserError(
        f"no config.yaml in {checkpoint} or the folders above it; pass --config with the run's "
        f"config.yaml (it names the model flavor)"
    )


@reports_user_errors
def main(argv=None) -> int:
    from flux_train.tools.export import check_new_folder, find_checkpoint, read_weights, write_export

    args = sample_parser().parse_args(argv)
    output_file(args.out, "--out")  # the outputs' paths, before minutes of work
    if args.exported:
        check_new_folder(args.exported, "--exported")
    try:  # first: without it nothing else is worth checking (the encoders themselves load last)
        require("transformers", "python -m flux_train.sample (its T5 and CLIP text encoders)")
    except DataprepError as exc:
        raise UserError(str(exc)) from None
    if args.size <= 0 or args.size % 16:
        raise UserError(f"--size {args.size}: must be a positive multiple of 16 (VAE 8x, then 2x2 patches)")
    checkpoint = find_checkpoint(args.checkpoint)
    cfg = load_config(args.config or run_config_file(checkpoint))
    prompts = read_prompts(args.prompts)
    weights = Weights(args.vae, args.t5, args.t5_tokenizer or args.t5, args.clip, args.clip_tokenizer or args.clip)
    try:
        device, dtype = device_and_dtype(args)
    except DataprepError as exc:  # --device cuda without a GPU
        raise UserError(str(exc)) from None
    sampler = Sampler(weights, prompts, cfg.model, cfg.train, device, dtype)
    state = read_weights(cfg, checkpoint)
    if args.exported:
        write_export(state, cfg.model, args.exported, "--exported")
    grid = sampler.grid(state, args.size, args.seed, args.columns)
    write_output(args.out, "--out", lambda path: grid.save(path, format="PNG"))
    print(
        f"wrote {args.out}: {len(prompts)} images of {args.size}x{args.size} from {checkpoint} (grid "
        f"{grid.width}x{grid.height}, {STEPS} steps, seed {args.seed})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
