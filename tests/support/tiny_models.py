"""Tiny random-weight VAE, T5 and CLIP in local folders as users pass them (vae/, t5/, clip/, tokenizer/ - one
word-level tokenizer for both), with the real models' interface dims (T5 4096, CLIP 768, 16 latent channels, the
VAE's 8x downsampling and Flux's latent scaling and shift factors). Built from configs: nothing downloads."""

from pathlib import Path

import torch

WORDS = "a photo of cat dog red blue green on the".split()


def encoder_flags(models: Path, vae: Path | None = None) -> list[str]:
    """The command-line flags naming the tiny encoders (and a VAE folder, where given), on the CPU."""
    flags = ["--vae", str(vae)] if vae else []
    for name, folder in (
        ("--t5", "t5"),
        ("--t5-tokenizer", "tokenizer"),
        ("--clip", "clip"),
        ("--clip-tokenizer", "tokenizer"),
    ):
        flags += [name, str(models / folder)]
    return [*flags, "--device", "cpu"]


def write_tiny_models(root: Path) -> Path:
    from diffusers import AutoencoderKL
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers import models as tok_models
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "<s>": 3} | {w: i + 4 for i, w in enumerate(WORDS)}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", bos_token="<s>"
    ).save_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    T5EncoderModel(
        T5Config(
            vocab_size=len(vocab),
            d_model=4096,
            d_kv=8,
            d_ff=16,
            num_layers=1,
            num_heads=2,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).save_pretrained(root / "t5")
    CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(vocab),
            hidden_size=768,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            pad_token_id=0,
            bos_token_id=3,
            eos_token_id=1,
        )
    ).save_pretrained(root / "clip")
    AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    ).save_pretrained(root / "vae")
    return root
