"""The frozen encoders of the reference, from local paths only: Flux VAE (diffusers AutoencoderKL) posterior
mean/logvar, T5 last hidden state (padded/truncated to 256 tokens), CLIP pooled output (77 tokens). The flags that
name them are dataprep.cli's (add_encoder_arguments)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch

from dataprep.cli import WEIGHTS_FOLDER
from dataprep.extras import require
from dataprep.format import DataprepError

T5_TOKENS, CLIP_TOKENS = 256, 77


def device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    device = pick_device(args.device)
    return device, getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise DataprepError(f"--device {choice}: no GPU visible; use --device cpu")
    return torch.device(choice)


def _load(kind: str, path: Path, loader):
    if not Path(path).is_dir():
        raise DataprepError(f"--{kind} {path}: not a folder; {WEIGHTS_FOLDER}")
    try:
        return loader(str(path))
    except (OSError, ValueError) as exc:
        raise DataprepError(f"--{kind} {path}: cannot load ({exc})") from None


class TextEncoders:
    def __init__(
        self,
        t5: Path,
        clip: Path,
        t5_tokenizer: Optional[Path],
        clip_tokenizer: Optional[Path],
        device: torch.device,
        dtype: torch.dtype,
    ):
        require("transformers", "the T5 and CLIP text encoders (dataprep encode, empty-encodings, flux_train.sample)")
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        def model(cls):
            return lambda p: cls.from_pretrained(p, local_files_only=True, dtype=dtype).to(device).eval()

        def tokenizer(p):
            return AutoTokenizer.from_pretrained(p, local_files_only=True)

        self.t5 = _load("t5", t5, model(T5EncoderModel))
        self.clip = _load("clip", clip, model(CLIPTextModel))
        self.t5_tok = _load("t5-tokenizer", t5_tokenizer or t5, tokenizer)
        self.clip_tok = _load("clip-tokenizer", clip_tokenizer or clip, tokenizer)
        self.device = device

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TextEncoders":
        return cls(args.t5, args.clip, args.t5_tokenizer, args.clip_tokenizer, *device_and_dtype(args))

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """T5 [B, 256, 4096] and CLIP pooled [B, 768], bf16 on the CPU. No attention mask (as the reference)."""

        def ids(tok, length):
            return tok(
                captions, max_length=length, padding="max_length", truncation=True, return_tensors="pt"
            ).input_ids.to(self.device)

        t5 = self.t5(input_ids=ids(self.t5_tok, T5_TOKENS)).last_hidden_state
        clip = self.clip(input_ids=ids(self.clip_tok, CLIP_TOKENS)).pooler_output
        return t5.to(torch.bfloat16).cpu(), clip.to(torch.bfloat16).cpu()


class ImageEncoder:
    def __init__(self, vae: Path, device: torch.device, dtype: torch.dtype):
        from diffusers import AutoencoderKL

        # diffusers decorates ModelMixin.to with functools.wraps(nn.Module.to): typeshed's _Wrapped binds no self
        self.vae = _load(
            "vae",
            vae,
            lambda p: (
                AutoencoderKL.from_pretrained(p, local_files_only=True, torch_dtype=dtype)
                .to(device)  # pyright: ignore[reportArgumentType] - wraps, above
                .eval()
            ),
        )
        self.device, self.dtype = device, dtype

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, 3, 256, 256] in [-1, 1] -> posterior mean, logvar [B, 16, 32, 32], bf16 on the CPU."""
        # encode is typed as either return_dict's result; by default (True) an AutoencoderKLOutput
        posterior = self.vae.encode(images.to(self.device, self.dtype)).latent_dist  # pyright: ignore[reportAttributeAccessIssue] - above
        return posterior.mean.to(torch.bfloat16).cpu(), posterior.logvar.to(torch.bfloat16).cpu()
