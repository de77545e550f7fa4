"""`python -m dataprep <subcommand>`: see `python -m dataprep --help` and each subcommand's --help."""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import sys
from pathlib import Path

import braceexpand

from dataprep.encoders import add_encoder_arguments
from dataprep.folder_lock import FolderLockError, lock_folder
from dataprep.format import DataprepError, Shape

EXIT_BAD_INPUT = DataprepError.exit_code


def _shape(text: str) -> Shape:
    try:
        return Shape.parse(text)
    except DataprepError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Parser(argparse.ArgumentParser):
    """A bad flag is one line naming it, exit 2, as in flux_train's commands (flux_train.errors.Parser: dataprep
    cannot import it, flux_train imports dataprep.format). Subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def _tars(patterns: list[str]) -> list[Path]:
    """Shard arguments: paths, globs or brace patterns (shards/{00000..00099}.tar), in the given order."""
    out = []
    for pattern in patterns:
        for expanded in braceexpand.braceexpand(pattern):
            out += sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
    return [Path(p) for p in out]


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
    e.add_argument("--vae", type=Path, required=True, help="local folder of the Flux VAE (FLUX.1-schnell: vae/)")
    add_encoder_arguments(e)
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


def run(args) -> int:
    if args.command == "convert":
        from dataprep.convert import convert

        convert(args.out, args.train, args.val, args.samples_per_shard, args.shape, args.workers, args.skip_bad)
    elif args.command == "encode":
        from dataprep.encode import EncodeJob, FolderInput, WdsInput, encode
        from dataprep.encoders import ImageEncoder, TextEncoders, device_and_dtype

        if bool(args.wds) == bool(args.images or args.captions):
            raise DataprepError("encode: give either --wds SHARDS or --images DIR --captions TSV")
        source = WdsInput(_tars(args.wds)) if args.wds else FolderInput(args.images, args.captions)
        text = TextEncoders.from_args(args)
        image = ImageEncoder(args.vae, *device_and_dtype(args))
        resize = args.resize or ("crop" if args.split == "train" else "squash")
        settings = {
            "input": [str(p) for p in getattr(source, "tars", [])] or [str(args.images), str(args.captions)],
            "models": [str(args.vae), str(args.t5), str(args.clip)],
        }
        encode(
            source,
            EncodeJob(
                args.out, args.split, args.samples_per_shard, args.batch_size, args.threads, args.skip_bad, resize
            ),
            text,
            image,
            settings,
        )
    elif args.command == "empty-encodings":
        from dataprep.encoders import TextEncoders
        from dataprep.format import write_empty_encodings

        t5, clip = TextEncoders.from_args(args)([""])
        write_empty_encodings(args.out / "empty_encodings", t5, clip)
        print(
            f"== empty-encodings\n  wrote {args.out / 'empty_encodings'}: t5_empty.npy {list(t5.shape)}, "
            f"clip_empty.npy {list(clip.shape)} (float16)"
        )
    elif args.command == "prepare":
        from dataprep.prepare import prepare

        prepare(args.root, args.workers)
    elif args.command == "verify":
        from dataprep.verify import verify

        return 1 if verify(args.root, args.shape, args.workers).defects else 0
    elif args.command == "fixture":
        from dataprep.fixture import FixtureSpec, write_arrow, write_fixture

        spec = FixtureSpec(
            args.train,
            args.val,
            args.shape.text_len,
            args.shape.height,
            args.shape.width,
            args.seed,
            args.samples_per_shard,
        )
        if args.arrow:
            paths = write_arrow(args.out, spec)
            print(f"== fixture\n  wrote {' and '.join(map(str, paths.values()))} (MLCommons HF layout)")
        else:
            write_fixture(args.out, spec)
            print(f"== fixture\n  wrote {args.out} ({args.train} train, {args.val} val samples, shape {args.shape})")
    return 0


# the subcommands that write a folder, and the argument naming it; verify only reads (a read-only mount is fine)
WRITES = {"convert": "--out", "encode": "--out", "empty-encodings": "--out", "fixture": "--out", "prepare": "root"}


def hold_output(args):
    """The lock on the folder this subcommand writes, as a context (none for verify): a second process writing the
    same folder is refused instead of interleaving its shards with ours."""
    flag = WRITES.get(args.command)
    if flag is None:
        return contextlib.nullcontext()
    folder = args.root if flag == "root" else args.out
    if flag == "root" and not folder.is_dir():
        raise DataprepError(f"{folder}: no such folder; give the dataset root (holding train/ and val/)")
    try:
        return lock_folder(folder, flag)
    except FolderLockError as exc:
        raise DataprepError(str(exc)) from None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        with hold_output(args):
            return run(args)
    except DataprepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
