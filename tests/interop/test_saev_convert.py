"""saev dump <-> safetensors dataset: lossless, byte-exact round trips to the same hash
directory, the reference safetensors library reading our shards, the CLI, and failures
that leave nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from pyspark_safetensors.cli import main as cli
from pyspark_safetensors.dataset import verify_dataset, write_batch_dataset
from pyspark_safetensors.format import to_bf16
from pyspark_safetensors.interop import ConversionError, convert, detect_source
from pyspark_safetensors.interop.saev import SaevDump, dataset_to_saev, saev_to_dataset


def _files(root):
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("workers", [1, 2])
def test_round_trip_is_byte_exact_in_the_same_hash_directory(tmp_path, small_dump, workers):
    root, acts = small_dump
    # part_bytes of one image (2 x 5 x 3 float32): 7 dataset shards, none across saev shards
    out = saev_to_dataset(
        root.parent, tmp_path / "ds", workers=workers, progress=False, part_bytes=120
    )
    manifest = verify_dataset(out, checksums=True)
    assert manifest.total_samples == 7 * 2 * 5  # n_imgs images, no padding rows
    assert len(manifest.shards) == 7  # one image (120 bytes) per part, parts within shards
    assert manifest.metadata["saev.hash"] == root.name
    assert manifest.metadata["saev.metadata_json"] == (root / "metadata.json").read_text()
    rows = {k: [] for k in ("activation", "image", "layer", "token")}
    for entry in manifest.shards:
        tensors = load_file(out / entry.shard_path)  # the reference library
        for k in rows:
            rows[k].append(tensors[k])
    got = {k: np.concatenate(v) for k, v in rows.items()}
    assert got["activation"].dtype == np.float32
    assert np.array_equal(got["activation"], acts.reshape(-1, 3))
    img, layer, token = np.meshgrid(np.arange(7), [-2, -1], np.arange(5), indexing="ij")
    assert np.array_equal(got["image"], img.ravel())
    assert np.array_equal(got["layer"], layer.ravel())
    assert np.array_equal(got["token"], token.ravel())

    back = dataset_to_saev(out, tmp_path / "dump_to", workers=workers, progress=False)
    assert back == tmp_path / "dump_to" / root.name
    assert _files(back) == _files(root)
    assert sorted(p.name for p in (tmp_path / "dump_to").iterdir()) == [root.name]


def test_cut_last_shard_comes_back_padded_like_saev(tmp_path, saev_real):
    acts = np.random.default_rng(1).standard_normal((5, 1, 4, 2)).astype(np.float32)
    doc = saev_real.metadata([-2], 4, False, 2, 5, 8)
    cut = saev_real.write(tmp_path / "cut", doc, acts, pad=False)
    padded = saev_real.write(tmp_path / "padded", doc, acts)
    ds = convert(cut, tmp_path / "ds", to="safetensors", progress=False)
    back = convert(ds, tmp_path / "back", to="saev", progress=False)
    assert _files(back) == _files(padded) != _files(cut)


def test_dtype_option_casts_with_round_to_nearest_even(tmp_path, small_dump):
    root, acts = small_dump
    out = saev_to_dataset(root, tmp_path / "ds", dtype="BF16", progress=False)
    schema = verify_dataset(out).schema["activation"]
    assert schema.dtype == "BF16"
    from pyspark_safetensors.format import SafetensorsFile

    got = np.concatenate(
        [
            SafetensorsFile(out / e.shard_path).tensor("activation")
            for e in verify_dataset(out).shards
        ]
    )
    assert np.array_equal(got.view(np.uint16), to_bf16(acts.reshape(-1, 3)).view(np.uint16))
    with pytest.raises(ConversionError, match="saev shards are float32"):
        dataset_to_saev(out, tmp_path / "back", dtype="F16", progress=False)
    with pytest.raises(ConversionError, match="--dtype I8"):
        saev_to_dataset(root, tmp_path / "ds2", dtype="I8", progress=False)


def test_cli_convert_and_verify(tmp_path, small_dump, capsys):
    root, _ = small_dump
    assert detect_source(root.parent) == "saev" and detect_source(root) == "saev"
    assert cli(["convert", str(root.parent), str(tmp_path / "ds"), "--to", "safetensors"]) == 0
    assert cli(["convert", str(tmp_path / "ds"), str(tmp_path / "out"), "--to", "saev"]) == 0
    assert _files(tmp_path / "out" / root.name) == _files(root)
    run = subprocess.run(
        [sys.executable, "-m", "pyspark_safetensors.cli", "verify", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "saev dump, 7 images x 2 layer(s)" in run.stdout


def test_failures_exit_2_with_one_line_and_leave_nothing(tmp_path, small_dump, capsys):
    root, _ = small_dump
    (root / "acts000002.bin").unlink()
    capsys.readouterr()
    dst = tmp_path / "new" / "ds"
    assert cli(["convert", str(root), str(dst), "--to", "safetensors"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing shard(s) acts000002.bin" in err
    assert "Traceback" not in err and not (tmp_path / "new").exists()


def test_a_failing_worker_leaves_nothing(tmp_path, small_dump):
    root, _ = small_dump
    ds = saev_to_dataset(root, tmp_path / "ds", progress=False)
    manifest = verify_dataset(ds)
    # the same rows with two images swapped: the writer back must refuse, not misplace them
    cols = {k: [] for k in ("activation", "image", "layer", "token")}
    for e in manifest.shards:
        t = load_file(ds / e.shard_path)
        for k in cols:
            cols[k].append(t[k])
    cols = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.r_[10:20, 0:10, 20:70]
    write_batch_dataset(
        tmp_path / "swapped", {k: v[order] for k, v in cols.items()}, metadata=manifest.metadata
    )
    for workers in (1, 2):
        with pytest.raises(ConversionError, match=r"column 'image' of rows 0:.* does not follow"):
            dataset_to_saev(
                tmp_path / "swapped", tmp_path / "back", workers=workers, progress=False
            )
        assert not (tmp_path / "back").exists()
    plain = tmp_path / "plain"
    write_batch_dataset(plain, {"activation": cols["activation"]})
    with pytest.raises(ConversionError, match=r"no 'saev\.metadata_json'"):
        convert(plain, tmp_path / "back", to="saev", progress=False)
    with pytest.raises(ConversionError, match="already exists and is not empty"):
        saev_to_dataset(root, plain, progress=False)
    assert SaevDump(root).meta.n_imgs == 7
    assert json.loads((root / "metadata.json").read_text())["n_imgs"] == 7


def test_a_dump_still_being_staged_is_not_a_source(tmp_path, small_dump):
    root, _ = small_dump
    staging = tmp_path / "dump_to" / f".{root.name}.staging-0123456789ab"
    staging.parent.mkdir()
    root.rename(staging)
    with pytest.raises(ConversionError, match="not a safetensors dataset"):
        detect_source(tmp_path / "dump_to")
