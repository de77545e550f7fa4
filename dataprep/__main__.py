"""`python -m dataprep <subcommand>`: see `python -m dataprep --help` and each subcommand's --help."""

from __future__ import annotations

import contextlib
import glob
import sys
from pathlib import Path

import braceexpand

from dataprep.cli import parser
from dataprep.folder_lock import FolderLockError, lock_folder
from dataprep.format import DataprepError


def _tars(patterns: list[str]) -> list[Path]:
    """Shard arguments: paths, globs or brace patterns (shards/{00000..00099}.tar), in the given order."""
    out = []
    for pattern in patterns:
        for expanded in braceexpand.braceexpand(pattern):
            out += sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
    return [Path(p) for p in out]


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
            print(f"== fixture\n  wrote {', '.join(map(str, paths.values()))} (MLCommons' layout)")
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
