"""The command line of `python -m dataprep`: its parser, and the encoder flags `python -m flux_train.sample` shares.
Nothing here imports torch or the encoders, so `--help` and a bad flag are answered before they load."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dataprep.format import DataprepError, Shape

EXIT_BAD_INPUT = DataprepError.exit_code


def _shape(text: str) -> Shape:
    try:
        return Shape.parse(text)
    except DataprepError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Parser(argparse.ArgumentParser):
    """The argument parser of every command, dataprep's and flux_train's (flux_train.errors re-exports it): a bad
    flag is one line naming it (argparse's own error prints the usage block first), exit 2. Subcommands' parsers
    are of this class too (argparse's default)."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def existing_path(text: str) -> Path:
    """argparse type: a file or folder that is there, checked before anything heavy loads."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return Path(text)


WEIGHTS_FOLDER = (
    "give the local folder of the weights (nothing downloads), e.g. FLUX.1-schnell's vae/, text_encoder_2/ (T5) or "
    "text_encoder/ (CLIP)"
)


def weights_folder(text: str) -> Path:
    """argparse type of the encoder flags: a folder, checked before torch and the encoders load (seconds)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a folder; {WEIGHTS_FOLDER}")
    return Path(text)


def add_encoder_arguments(p: argparse.ArgumentParser, vae: bool = False) -> None:
    """--t5/--clip and their tokenizers, --device, --dtype; with `vae`, --vae first."""
    if vae:
        p.add_argument(
            "--vae", type=weights_folder, required=True, help="local folder of the Flux VAE (FLUX.1-schnell: vae/)"
        )
    p.add_argument(
        "--t5",
        type=weights_folder,
        required=True,
        help="local folder of the T5-v1.1-XXL encoder weights (FLUX.1-schnell: text_encoder_2/)",
    )
    p.add_argument(
        "--t5-tokenizer", type=weights_folder, help="its tokenizer folder (default: --t5; FLUX.1-schnell: tokenizer_2/)"
    )
    p.add_argument(
        "--clip",
        type=weights_folder,
        required=True,
        help="local folder of the CLIP-L text encoder (FLUX.1-schnell: text_encoder/)",
    )
    p.add_argument(
        "--clip-tokenizer",
        type=weights_folder,
        help="its tokenizer folder (default: --clip; FLUX.1-schnell: tokenizer/)",
    )
    p.add_argument("--device", default="auto", help="auto (GPU if visible), cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="compute dtype (default: bfloat16 on a GPU, float32 on the CPU)",
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples-per-shard", type=int, default=10_000, help="samples per tar shard (default 10000)")
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip bad input samples (counted, listed in the summary and in .dataprep/<split>/skipped.tsv) "
        "instead of stopping at the first one",
    )


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m dataprep",
        description="Prepare the flux1 energon dataset "
        "(the format: dataprep/format.py): convert or encode, empty-encodings, prepare, "
        "verify; fixture writes a tiny one.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser(
        "convert",
        help="MLCommons preprocessed HF datasets (Arrow) -> train/ and val/ shards",
        description="Convert the MLCommons preprocessed sets (save_to_disk folders) into energon "
        "shards. Resumable: rerun the same command after a crash. Val keys continue after train's.",
    )
    c.add_argument("--train", type=Path, help="cc12m_preprocessed folder (save_to_disk)")
    c.add_argument("--val", type=Path, help="coco_preprocessed folder (save_to_disk, with a timestep column)")
    c.add_argument("--out", type=Path, required=True, help="dataset root to write train/ and val/ into")
    c.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="worker processes")
    c.add_argument("--shape", type=_shape, default=Shape(), help="expected L,H,W of every sample (default 256,32,32)")
    _common(c)

    e = sub.add_parser(
        "encode",
        help="raw image-caption pairs -> the same shards (VAE, T5, CLIP)",
        description="Encode raw pairs with the reference's encoders from local weights. Train: "
        "resize shorter side to 256 + centre crop; val: straight to 256x256, timestep = row mod 8.",
    )
    e.add_argument(
        "--split",
        choices=("train", "val"),
        required=True,
        help="which split to write: train (crop, no timestep) or val (squash, timestep = row mod 8)",
    )
    e.add_argument("--wds", nargs="+", help="webdataset shards with jpg/png/webp + txt (paths, globs, {a..b})")
    e.add_argument("--images", type=Path, help="image folder (with --captions)")
    e.add_argument("--captions", type=Path, help="TSV with a header: file_name, caption (optional id/image_id)")
    e.add_argument("--out", type=Path, required=True, help="dataset root")
    add_encoder_arguments(e, vae=True)
    e.add_argument("--batch-size", type=int, default=32, help="images and captions per encoder call (default 32)")
    e.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1), help="image decoding threads")
    e.add_argument("--resize", choices=("crop", "squash"), help="default: crop for train, squash for val")
    _common(e)

    m = sub.add_parser(
        "empty-encodings",
        help="t5_empty.npy / clip_empty.npy from the same encoders",
        description="Encode the empty caption into <out>/empty_encodings/ (float16, as the reference).",
    )
    m.add_argument("--out", type=Path, required=True, help="dataset root")
    add_encoder_arguments(m)

    r = sub.add_parser(
        "prepare",
        help="energon metadata (.nv-meta, CrudeWebdataset), no prompts, and the dataset's sample shape and counts",
        description="Index the shards for energon and record what the dataset holds (sample shape "
        "L,H,W from each split's first sample, samples and shards per split) in "
        ".nv-meta/flux_dataset.yaml, which verify and the trainer check against.",
    )
    r.add_argument("root", type=Path, help="dataset root (holding train/ and val/)")
    r.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="indexing processes")

    v = sub.add_parser(
        "verify",
        help="open through energon and check every sample; non-zero exit on defects",
        description="Open the dataset through energon as the trainer does and check every sample; exit 1 and each "
        "defect named, if there are any.",
    )
    v.add_argument("root", type=Path, help="dataset root (holding .nv-meta/, train/, val/, empty_encodings/)")
    v.add_argument(
        "--shape",
        type=_shape,
        help="assert that the samples are L,H,W, e.g. 256,32,32 (default: "
        "check them against the shape the dataset records)",
    )
    v.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="energon loader worker processes (0: read in this process)",
    )

    f = sub.add_parser(
        "fixture",
        help="a tiny dataset in the same format, for tests and debug runs",
        description="Write a tiny random dataset in the real on-disk format, for tests and debug runs.",
    )
    f.add_argument("--out", type=Path, required=True, help="dataset root to write")
    f.add_argument("--train", type=int, default=16, help="train samples")
    f.add_argument("--val", type=int, default=16, help="val samples (copies of train arrays, own keys)")
    f.add_argument("--shape", type=_shape, default=Shape(16, 8, 8), help="L,H,W (default 16,8,8)")
    f.add_argument("--samples-per-shard", type=int, default=8, help="samples per tar shard (default 8)")
    f.add_argument("--seed", type=int, default=0, help="seed of the random samples")
    f.add_argument(
        "--arrow",
        action="store_true",
        help="write the MLCommons HF (Arrow) input form instead: <out>/train and <out>/val for `convert`",
    )
    return p
