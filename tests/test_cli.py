"""The `shardloader` command line: convert, inspect, verify, index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardloader import Dataset
from shardloader.cli.main import main, subcommand_modules
from tests.fixtures.data import copy_dataset

SCRIPT = str(Path(sys.executable).parent / "shardloader")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_console_script_convert_inspect_verify(image_folder, tmp_path):
    out = tmp_path / "images"
    done = _run("convert", image_folder.path, str(out), "--shard-samples", "5", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["kind"], summary["samples"], summary["shards"]) == ("image-folder", 12, 3)

    done = _run("inspect", str(out), "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["samples"] == 12 and info["shards"] == 3 and info["formats"] == {"arrow": 3}
    assert info["schema"] == {"class": "string", "filename": "string", "image": "binary", "label": "int64",
                              "source_index": "int64"}
    assert info["fingerprint"] == Dataset(out).index.fingerprint

    ds = Dataset(out)
    written = ds.get_many(range(12))  # shuffled by default; source_index recovers the source order
    assert [r["source_index"] for r in written] != list(range(12))
    assert sorted(r["source_index"] for r in written) == list(range(12))
    records = sorted(written, key=lambda r: r["source_index"])
    assert [r["filename"] for r in records] == image_folder.files
    assert [r["label"] for r in records] == [i // 4 for i in range(12)]
    assert [r["class"] for r in records] == [image_folder.classes[i // 4] for i in range(12)]
    for record in records:
        assert record["image"] == (Path(image_folder.path) / record["filename"]).read_bytes()

    with open(out / "shard-00001.arrow", "r+b") as f:
        f.truncate(100)
    done = _run("verify", str(out))
    assert done.returncode == 1
    assert f"BAD  {out}/shard-00001.arrow: 100 bytes but the index records" in done.stdout
    assert "shard-00000" not in done.stdout and "shard-00002" not in done.stdout


def test_console_script_error_exit(tmp_path):
    done = _run("inspect", str(tmp_path))
    assert done.returncode == 1
    assert f"shardloader inspect: error: {tmp_path}/index.json: no index.json found" in done.stderr


def test_subcommands_discovered():
    names = [m.__name__.rsplit(".", 1)[1] for m in subcommand_modules()]
    assert {"convert", "index", "inspect", "verify"} <= set(names)


def test_inspect_text(arrow_dataset, capsys):
    assert main(["inspect", arrow_dataset.path, "--shards"]) == 0
    out = capsys.readouterr().out
    assert "samples      200" in out and "shards       4 (4 arrow)" in out
    assert "vec    array<float32>[3]" in out
    assert "shard-00003.arrow  arrow  8 samples" in out


def test_verify_ok(tar_dataset, capsys):
    assert main(["verify", tar_dataset.path]) == 0
    assert "ok: 3 shards, 150 samples" in capsys.readouterr().out


def test_index_then_convert_parquet_and_tar(parquet_dataset, tar_dataset, tmp_path, capsys):
    root = copy_dataset(tar_dataset, tmp_path / "t")
    for name in os.listdir(root):
        if not name.endswith(".tar"):
            os.remove(os.path.join(root, name))
    assert main(["index", root]) == 0
    assert "3 shards (tar), 150 samples" in capsys.readouterr().out

    assert main(["convert", root, str(tmp_path / "from-tar"), "--no-progress",
                 "--shard-bytes", "20KB"]) == 0
    ds = Dataset(tmp_path / "from-tar")
    assert ds.index.num_shards > 1
    written = ds.get_many(range(150))  # shuffled through a temporary copy: tars are streams
    by_source = sorted(written, key=lambda r: r["source_index"])
    assert [r["source_index"] for r in by_source] == list(range(150))
    assert [{k: v for k, v in r.items() if k not in ("__index__", "source_index")} for r in by_source] == \
        tar_dataset.samples
    assert [r["__key__"] for r in written] != [s["__key__"] for s in tar_dataset.samples]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".shardloader-shuffle-")]

    src = os.path.join(parquet_dataset.path, "part-1.parquet")
    assert main(["convert", src, str(tmp_path / "from-pq"), "--no-progress", "--format", "tar",
                 "--keep-order"]) == 0
    assert "order    source order" in capsys.readouterr().out
    ds = Dataset(tmp_path / "from-pq")
    expected = pq.read_table(src).to_pylist()
    got = ds.get_many(range(50))
    assert [r["data"] for r in got] == [e["data"] for e in expected]
    assert [r["label"] for r in got] == [str(e["label"]).encode() for e in expected]


def test_convert_parquet_keeps_types(tmp_path, capsys):
    import pyarrow as pa

    table = pa.table({"x": pa.array([1, 2, 3], pa.int16()), "y": pa.array([0.5, 1.5, 2.5], pa.float32())})
    pq.write_table(table, tmp_path / "t.parquet")
    assert main(["convert", str(tmp_path / "t.parquet"), str(tmp_path / "out"), "--no-progress",
                 "--seed", "3"]) == 0
    assert "order    shuffled (seed 3; source_index holds the source position)" in capsys.readouterr().out
    ds = Dataset(tmp_path / "out")
    assert dict(ds.index.schema) == {"x": "int16", "y": "float32", "source_index": "int64"}
    rows = sorted(ds.get_many(range(3)), key=lambda r: r["source_index"])
    assert [(r["x"], r["y"]) for r in rows] == [(1, 0.5), (2, 1.5), (3, 2.5)]


def test_convert_refuses_existing_and_reports_skipped(image_folder, tmp_path, capsys):
    src = tmp_path / "src"
    import shutil

    shutil.copytree(image_folder.path, src)
    (src / "cat" / "notes.txt").write_text("not an image")
    assert main(["convert", str(src), str(tmp_path / "o"), "--no-progress"]) == 0
    assert "skipped  1 non-image files: cat/notes.txt" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "o"), "--no-progress"]) == 1
    assert "already holds a dataset" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", "a", "b", "--shard-bytes", "lots"])
    assert exc.value.code == 2
    assert "'lots' is not a size" in capsys.readouterr().err


def _all_subcommand_paths() -> list[list[str]]:
    """Every subcommand, and every action of a subcommand that has actions (`cache verify`)."""
    import argparse

    from shardloader.cli.main import build_parser

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> list[list[str]]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found.append([*prefix, name])
                    found += walk(sub, [*prefix, name])
        return found

    return walk(build_parser(), [])


def test_every_subcommand_has_a_help_description(capsys):
    paths = _all_subcommand_paths()
    assert {"convert", "index", "inspect", "verify", "cache"} <= {p[0] for p in paths}
    assert ["cache", "prune"] in paths
    for path in paths:
        with pytest.raises(SystemExit) as exc:
            main([*path, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        usage, _, rest = out.partition("\n\n")
        assert usage.startswith("usage: shardloader " + " ".join(path)), out
        description = rest.split("\n\n", 1)[0]
        # a description paragraph, not straight into the argument list
        assert not description.startswith(("positional arguments", "options")), (path, out)
        assert len(description.split()) >= 6, (path, description)


def _run_on_tty(*args: str) -> tuple[int, str]:
    """Run the console script with stderr on a pseudo-terminal; (exit status, stderr text)."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24x100 chars
    proc = subprocess.Popen([SCRIPT, *args], stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 120
    poller = select.poll()  # select refuses descriptors past 1024, which a long suite reaches
    poller.register(leader, select.POLLIN)
    try:
        while time.monotonic() < deadline:
            if poller.poll(1000):
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return code, b"".join(chunks).decode(errors="replace")


def test_index_and_verify_show_progress_on_a_terminal_only(tar_dataset, tmp_path):
    root = copy_dataset(tar_dataset, tmp_path / "t")
    for name in os.listdir(root):
        if not name.endswith(".tar"):
            os.remove(os.path.join(root, name))
    code, err = _run_on_tty("index", root)
    assert code == 0 and f"indexing {root}" in err and "3/3" in err
    code, err = _run_on_tty("verify", root)
    assert code == 0 and f"verifying {root}" in err
    code, err = _run_on_tty("verify", root, "--quiet")
    assert code == 0 and "verifying" not in err
    done = _run("verify", root)  # stderr is a pipe: no bar
    assert done.returncode == 0 and done.stderr == ""
    done = _run("index", root)
    assert done.returncode == 0 and done.stderr == ""


def test_existing_output_names_overwrite(image_folder, tmp_path, capsys):
    assert main(["convert", image_folder.path, str(tmp_path / "o"), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["convert", image_folder.path, str(tmp_path / "o"), "--no-progress"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main(["convert", image_folder.path, str(tmp_path / "o"), "--no-progress", "--overwrite"]) == 0


def test_wrong_dataset_root_errors_give_the_command(arrow_dataset, tar_dataset, image_folder,
                                                    tmp_path, capsys):
    index_json = os.path.join(arrow_dataset.path, "index.json")
    for command in ("inspect", "verify"):
        assert main([command, index_json]) == 1
        err = capsys.readouterr().err
        assert f"{index_json}: not a dataset root ({index_json} is the index file itself: " \
               f"pass the folder that holds it, {arrow_dataset.path})" in err

    shard = os.path.join(arrow_dataset.path, "shard-00001.arrow")
    assert main(["inspect", shard]) == 1
    assert f"{shard} is a shard file: pass the dataset folder" in capsys.readouterr().err

    root = copy_dataset(tar_dataset, tmp_path / "t")
    os.remove(os.path.join(root, "index.json"))
    tar = os.path.join(root, "shard-00000.tar")
    assert main(["verify", tar]) == 1
    err = capsys.readouterr().err
    assert f"`shardloader index {root}`" in err and f"`shardloader convert {tar} OUT_DIR`" in err
    assert main(["inspect", root]) == 1
    assert f"run `shardloader index {root}` to index them in place" in capsys.readouterr().err

    with pytest.raises(Exception) as info:
        Dataset(image_folder.path)
    assert f"it holds images: run `shardloader convert {image_folder.path} OUT_DIR`" in str(info.value)

    assert main(["index", index_json]) == 1
    assert f"`shardloader index {arrow_dataset.path}`" in capsys.readouterr().err
    assert main(["index", image_folder.path]) == 1
    assert f"run `shardloader convert {image_folder.path} OUT_DIR`" in capsys.readouterr().err
    assert main(["convert", index_json, str(tmp_path / "x")]) == 1
    assert f"`shardloader convert {arrow_dataset.path} DST`" in capsys.readouterr().err
    assert main(["index", arrow_dataset.path]) == 1
    assert f"already holds a shardloader dataset: `shardloader inspect {arrow_dataset.path}`" in \
        capsys.readouterr().err
