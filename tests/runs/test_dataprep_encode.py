"""`encode` and `empty-encodings` with tiny random-weight VAE/T5/CLIP (tests/support/tiny_models.py, no downloads):
the documented shapes and dtypes, the encoders' outputs stored bit for bit, bad inputs (the resize rules:
tests/unit/test_dataprep_encode.py)."""

import io
import tarfile

import numpy as np
import torch
from PIL import Image
from tiny_models import WORDS, encoder_flags

from dataprep import images
from dataprep.__main__ import main
from dataprep.format import decode_bf16
from dataprep.prepare import prepare


def image_bytes(size, fmt, seed):
    array = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def cc12m_shard(path):
    """A webdataset shard as CC12M ships: KEY.jpg/png + KEY.txt; sample 2's image is broken, 3's caption empty."""
    samples = [
        ("s0", "jpg", image_bytes((300, 200), "JPEG", 0), "a red cat"),
        ("s1", "png", image_bytes((200, 340), "PNG", 1), "a dog on the blue"),
        ("s2", "jpg", b"not an image", "a cat"),
        ("s3", "png", image_bytes((256, 256), "PNG", 3), "  "),
        ("s4", "png", image_bytes((512, 300), "PNG", 4), "green dog"),
    ]
    with tarfile.open(path, "w") as tar:
        for key, ext, data, caption in samples:
            for name, payload in ((f"{key}.{ext}", data), (f"{key}.txt", caption.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return path


def coco_folder(root):
    (root / "images").mkdir(parents=True)
    rows = ["id\tfile_name\tcaption"]
    for i, size in enumerate([(640, 480), (300, 500), (256, 256)]):
        (root / "images" / f"COCO_{i}.jpg").write_bytes(image_bytes(size, "JPEG", 10 + i))
        rows.append(f"{100 + i}\tCOCO_{i}.jpg\ta photo of the {WORDS[3 + i]}")
    (root / "captions.tsv").write_text("\n".join(rows) + "\n")
    return root / "images", root / "captions.tsv"


def members(tar_path):
    with tarfile.open(tar_path) as t:
        return {m.name: t.extractfile(m).read() for m in t}


def test_encode_writes_documented_shapes_from_the_encoders_and_verify_accepts_it(tiny_models, tmp_path, capsys):
    out = tmp_path / "ds"
    shard = cc12m_shard(tmp_path / "cc12m-000.tar")
    train = [
        "encode",
        "--split",
        "train",
        "--wds",
        str(shard),
        "--out",
        str(out),
        *encoder_flags(tiny_models, tiny_models / "vae"),
        "--batch-size",
        "2",
    ]
    assert main(train) == 2  # the broken image stops it, named (bad input: exit 2)
    assert "cc12m-000.tar:s2 (row 2): undecodable image" in capsys.readouterr().err
    assert main([*train, "--skip-bad"]) == 0
    printed = capsys.readouterr().out
    assert "skipped inputs  2" in printed and "row 3 's3': empty caption" in printed

    image_dir, tsv = coco_folder(tmp_path / "coco")
    assert (
        main(
            [
                "encode",
                "--split",
                "val",
                "--images",
                str(image_dir),
                "--captions",
                str(tsv),
                "--out",
                str(out),
                *encoder_flags(tiny_models, tiny_models / "vae"),
            ]
        )
        == 0
    )
    assert main(["empty-encodings", "--out", str(out), *encoder_flags(tiny_models)]) == 0
    prepare(out, workers=1, quiet=True)
    capsys.readouterr()
    assert main(["verify", str(out), "--workers", "0"]) == 0, capsys.readouterr().out  # full size 256,32,32

    train_members = members(out / "train" / "shard_000000.tar")
    assert sorted({name.split(".")[0] for name in train_members}) == ["00000000", "00000001", "00000004"]
    val_members = members(out / "val" / "shard_000000.tar")
    assert sorted({name.split(".")[0] for name in val_members}) == ["00000005", "00000006", "00000007"]
    assert val_members["00000006.json"] == b'{"key": "101", "timestep": 1}'  # k = row mod 8

    # val row 1 recomputed by hand: squash to 256x256, VAE posterior; T5 hidden states over 256 tokens; CLIP pooled
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    tok = AutoTokenizer.from_pretrained(tiny_models / "tokenizer")
    image = images.to_tensor(images.resize_squash(Image.open(image_dir / "COCO_1.jpg").convert("RGB")))[None]
    posterior = AutoencoderKL.from_pretrained(tiny_models / "vae").encode(image).latent_dist
    caption = ["a photo of the dog"]
    t5_ids = tok(caption, max_length=256, padding="max_length", truncation=True, return_tensors="pt").input_ids
    clip_ids = tok(caption, max_length=77, padding="max_length", truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = {
            "mean": posterior.mean[0],
            "logvar": posterior.logvar[0],
            "t5": T5EncoderModel.from_pretrained(tiny_models / "t5")(input_ids=t5_ids).last_hidden_state[0],
            "clip": CLIPTextModel.from_pretrained(tiny_models / "clip")(input_ids=clip_ids).pooler_output[0],
        }
    shapes = {"t5": (256, 4096), "clip": (768,), "mean": (16, 32, 32), "logvar": (16, 32, 32)}
    for part, shape in shapes.items():
        stored = decode_bf16(val_members[f"00000006.{part}.bytes"])
        assert stored.dtype == torch.bfloat16 and tuple(stored.shape) == shape
        torch.testing.assert_close(stored.float(), expected[part].float(), atol=2e-2, rtol=1e-2)

    t5_empty, clip_empty = (np.load(out / "empty_encodings" / name) for name in ("t5_empty.npy", "clip_empty.npy"))
    assert t5_empty.dtype == clip_empty.dtype == np.float16
    assert t5_empty.shape == (1, 256, 4096) and clip_empty.shape == (1, 768)


def test_wrong_encoder_weights_stop_before_a_wrong_dataset(tiny_models, tmp_path, capsys):
    from transformers import T5Config, T5EncoderModel

    T5EncoderModel(
        T5Config(vocab_size=16, d_model=64, d_kv=8, d_ff=16, num_layers=1, num_heads=2, decoder_start_token_id=0)
    ).save_pretrained(tmp_path / "t5-base-like")
    image_dir, tsv = coco_folder(tmp_path / "coco")
    args = encoder_flags(tiny_models, tiny_models / "vae")
    args[args.index("--t5") + 1] = str(tmp_path / "t5-base-like")
    rc = main(
        [
            "encode",
            "--split",
            "train",
            "--images",
            str(image_dir),
            "--captions",
            str(tsv),
            "--out",
            str(tmp_path / "ds"),
            *args,
        ]
    )
    assert rc == 2
    assert "the encoders produced t5: shape [256, 64], expected [256, 4096]" in capsys.readouterr().err
    assert not list((tmp_path / "ds" / "train").glob("*.tar*"))
