"""`convert` of image-class folders: torchvision's ImageFolder rule (sorted folder names are
the classes, labels 0..C-1 in that order, its file order), empty class folders refused unless
allowed, and empty or undecodable images named at convert time with nothing written."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardloader import Dataset
from shardloader.cli.main import main
from shardloader.errors import ShardloaderError
from shardloader.ingest.convert import class_files, convert, find_classes
from tests.fixtures.data import _jpeg, _png


def _tree(root, files: dict[str, bytes]) -> None:
    for relative, data in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@pytest.fixture()
def rng():
    return np.random.default_rng(9)


def test_labels_follow_sorted_folder_names_and_torchvision_file_order(tmp_path, rng):
    src = tmp_path / "src"
    files = {
        "b/2.jpg": _jpeg(rng, 8, 8),
        "b/10.JPG": _jpeg(rng, 9, 8),
        "a/z.png": _png(rng, 8, 9),
        "a/sub/b.jpg": _jpeg(rng, 8, 10),
        "a/sub/deeper/a.webp": b"",  # replaced below by a real WebP
        "C/x.jpeg": _jpeg(rng, 10, 8),
        ".extra/y.jpg": _jpeg(rng, 8, 12),  # torchvision counts hidden folders as classes too
        "a/readme.md": b"notes",
        "top.txt": b"not a class",
    }
    from io import BytesIO

    from PIL import Image

    buf = BytesIO()
    Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).save(buf, format="WEBP")
    files["a/sub/deeper/a.webp"] = buf.getvalue()
    _tree(src, files)
    assert find_classes(str(src)) == [".extra", "C", "a", "b"]
    assert class_files(str(src), "a") == (["a/z.png", "a/sub/b.jpg", "a/sub/deeper/a.webp"], ["a/readme.md"])

    summary = convert(src, tmp_path / "out", progress=False, shuffle=False)
    assert summary["skipped"] == ["top.txt", "a/readme.md"]
    records = Dataset(tmp_path / "out").get_many(range(summary["samples"]))
    expected = [(".extra/y.jpg", 0, ".extra"), ("C/x.jpeg", 1, "C"), ("a/z.png", 2, "a"),
                ("a/sub/b.jpg", 2, "a"), ("a/sub/deeper/a.webp", 2, "a"),
                ("b/10.JPG", 3, "b"), ("b/2.jpg", 3, "b")]
    assert [(r["filename"], r["label"], r["class"]) for r in records] == expected
    for record in records:
        assert record["image"] == (src / record["filename"]).read_bytes()


def test_empty_class_folder_is_an_error_unless_allowed(tmp_path, rng, capsys):
    src = tmp_path / "src"
    _tree(src, {"ant/1.jpg": _jpeg(rng, 8, 8), "cow/notes.txt": b"x", "eel/1.jpg": _jpeg(rng, 8, 8)})
    (src / "bee").mkdir()
    with pytest.raises(ShardloaderError) as info:
        convert(src, tmp_path / "out", progress=False)
    message = str(info.value)
    assert f"'{src / 'bee'}', '{src / 'cow'}' hold no images" in message
    assert "--allow-empty" in message
    assert not (tmp_path / "out" / "index.json").exists()

    assert main(["convert", str(src), str(tmp_path / "cli"), "--no-progress"]) == 1
    assert f"'{src / 'bee'}'" in capsys.readouterr().err

    assert main(["convert", str(src), str(tmp_path / "cli"), "--no-progress", "--allow-empty"]) == 0
    records = Dataset(tmp_path / "cli").get_many(range(2))
    assert [(r["class"], r["label"]) for r in records] == [("ant", 0), ("eel", 3)]  # bee, cow unused


def test_empty_and_undecodable_images_named_at_convert_time(tmp_path, rng):
    src = tmp_path / "src"
    good = _jpeg(rng, 16, 16)
    png = _png(rng, 8, 8)
    _tree(src, {
        "cat/ok.jpg": good,
        "cat/empty.jpg": b"",
        "cat/text.png": b"this is not an image at all",
        "dog/cut.png": png[: len(png) // 2],
        "dog/badheader.jpg": b"\xff\xd8\xff" + b"\x00" * 40,
        "dog/ok.png": png,
    })
    with pytest.raises(ShardloaderError) as info:
        convert(src, tmp_path / "out", progress=False, shard_samples=1)
    message = str(info.value)
    assert "4 image file(s) cannot be decoded" in message and "nothing was written" in message
    assert f"{src / 'cat/empty.jpg'}: the file is empty" in message
    assert f"{src / 'cat/text.png'}: not a readable image" in message
    assert f"{src / 'dog/cut.png'}: not a readable image" in message
    assert f"{src / 'dog/badheader.jpg'}: not a readable JPEG" in message
    assert "ok.jpg" not in message and "ok.png" not in message
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_no_class_folders(tmp_path):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
    with pytest.raises(ShardloaderError, match=r"no class folders found \(expected .*/<class>/<image>"):
        convert(tmp_path / "flat", tmp_path / "out", progress=False)
