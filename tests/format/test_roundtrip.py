"""Our bytes against the reference library's, and round trips both ways."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file as np_load_file
from safetensors.torch import load_file, save, save_file

from pyspark_safetensors.format import (
    WRITABLE,
    DuplicateKeyError,
    PackedTensors,
    SafetensorsFile,
    encode_header,
    get_dtype,
    read_header,
    write_packed,
    write_shard,
)

TORCH = {
    "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16,
    "U8": torch.uint8, "I8": torch.int8, "U16": torch.uint16, "I16": torch.int16,
    "U32": torch.uint32, "I32": torch.int32, "U64": torch.uint64, "I64": torch.int64,
}  # fmt: skip


def random_array(rng, name, shape):
    d = get_dtype(name)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * d.itemsize, dtype=np.uint8)
    arr = raw.view(d.numpy).reshape(shape)
    if d.is_float:  # keep NaN payloads out of the comparison; bytes still random otherwise
        with np.errstate(over="ignore", invalid="ignore"):
            arr = np.where(np.isnan(arr.astype(np.float32)), np.zeros((), d.numpy), arr).astype(
                d.numpy
            )
    return arr


def as_torch(arr, name):
    if arr.size == 0:
        return torch.empty(arr.shape, dtype=TORCH[name])
    return (
        torch.from_numpy(arr.reshape(-1).view(np.uint8).copy()).view(TORCH[name]).reshape(arr.shape)
    )


tensor_names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=12,
).filter(lambda s: s != "__metadata__")
specs = st.dictionaries(
    tensor_names,
    st.tuples(st.sampled_from(WRITABLE), st.lists(st.integers(0, 5), max_size=3)),
    min_size=1,
    max_size=6,
)
metadata = st.none() | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=1)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=specs, metadata=metadata, seed=st.integers(0, 2**32 - 1))
def test_bytes_equal_reference_save(tmp_path, specs, metadata, seed):
    rng = np.random.default_rng(seed)
    arrays = {n: random_array(rng, d, tuple(shape)) for n, (d, shape) in specs.items()}
    expected = save({n: as_torch(a, specs[n][0]) for n, a in arrays.items()}, metadata=metadata)
    path = tmp_path / "ours.safetensors"
    write_shard(path, arrays, metadata, fsync=False)
    assert path.read_bytes() == expected


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=specs, metadata=metadata, seed=st.integers(0, 2**32 - 1))
def test_packed_bytes_equal_reference_save(tmp_path, specs, metadata, seed):
    """Tensors packed in groups (some taken out of order from a larger pack) are written
    exactly as the reference library writes them one by one."""
    rng = np.random.default_rng(seed)
    arrays = {n: random_array(rng, d, tuple(shape)) for n, (d, shape) in specs.items()}
    expected = save({n: as_torch(a, specs[n][0]) for n, a in arrays.items()}, metadata=metadata)
    names = list(arrays)
    rng.shuffle(names)
    groups, i = [], 0
    while i < len(names):
        part = names[i : i + int(rng.integers(1, 4))]
        decoy = random_array(rng, "U8", (int(rng.integers(0, 3)),))  # bytes the group skips
        packed = PackedTensors.of([decoy, *[arrays[n] for n in part][::-1]])
        groups.append((part, packed.take(np.arange(len(part), 0, -1))))
        i += len(part)
    path = tmp_path / "packed.safetensors"
    layout = write_packed(path, groups, metadata, fsync=False)
    assert path.read_bytes() == expected
    assert layout.file_size == len(expected) and sorted(layout.names) == sorted(arrays)


def test_packed_rows_of_equal_size_gather_across_buffers(tmp_path):
    """The bulk path: equal-sized rows from several buffers, interleaved by name."""
    rng = np.random.default_rng(0)
    blocks = [rng.random((50, 4)).astype(np.float32) for _ in range(3)]
    groups, expected, order = [], {}, rng.permutation(150)
    for b, rows in enumerate(blocks):
        names = [f"{order[b * 50 + i]:03d}" for i in range(50)]
        flat = rows.reshape(-1).view(np.uint8)
        spec = ((get_dtype("F32"), (4,)),)
        groups.append((names, PackedTensors(flat, np.arange(50) * 16, spec, np.zeros(50, int))))
        expected.update({n: torch.from_numpy(r) for n, r in zip(names, rows, strict=True)})
    write_packed(tmp_path / "p.safetensors", groups, fsync=False)
    assert (tmp_path / "p.safetensors").read_bytes() == save(expected)


def test_packed_mixed_sizes_over_several_write_chunks(tmp_path):
    """Tensors of different sizes and dtypes, more bytes than one gathered chunk (8 MB)."""
    rng = np.random.default_rng(1)
    big = [rng.random(75_000 + i).astype(np.float32) for i in range(30)]
    small = [rng.integers(-9, 9, 50_000 + i).astype(np.int16) for i in range(30)]
    names_big, names_small = (
        [f"k{i:02d}__big" for i in range(30)],
        [f"k{i:02d}__s" for i in range(30)],
    )
    write_packed(
        tmp_path / "m.safetensors",
        [(names_small, PackedTensors.of(small)), (names_big, PackedTensors.of(big))],
        {"k": "v"},
    )
    expected = {
        n: torch.from_numpy(a) for n, a in zip(names_big + names_small, big + small, strict=True)
    }
    assert (tmp_path / "m.safetensors").read_bytes() == save(expected, metadata={"k": "v"})


def test_packed_names_must_be_unique(tmp_path):
    packed = PackedTensors.of([np.zeros(2, np.float32), np.ones(2, np.float32)])
    with pytest.raises(DuplicateKeyError, match="'x'"):
        write_packed(
            tmp_path / "d.safetensors", [(["x"], packed.take([0])), (["x"], packed.take([1]))]
        )
    assert list(tmp_path.iterdir()) == []


def test_multi_key_metadata_is_sorted_and_reference_readable(tmp_path):
    md = {f"k{i}": str(i) for i in (3, 1, 2)}
    path = tmp_path / "m.safetensors"
    write_shard(path, {"a": np.zeros(3, np.float32)}, md)
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8 : 8 + n])
    assert list(header["__metadata__"]) == ["k1", "k2", "k3"]
    with safetensors.safe_open(str(path), "np") as f:
        assert f.metadata() == md


@pytest.mark.parametrize("name", WRITABLE)
def test_we_write_reference_reads(tmp_path, name):
    rng = np.random.default_rng(7)
    arrays = {
        "x": random_array(rng, name, (4, 3)),
        "scalar": random_array(rng, name, ()),
        "empty": random_array(rng, name, (0, 5)),
    }
    path = tmp_path / "w.safetensors"
    write_shard(path, arrays, {"format": "pt"})
    loaded = load_file(path)
    for k, a in arrays.items():
        assert loaded[k].dtype == TORCH[name] and tuple(loaded[k].shape) == a.shape
        assert (
            a.size == 0 or loaded[k].reshape(-1).view(torch.uint8).numpy().tobytes() == a.tobytes()
        )


@pytest.mark.parametrize("name", WRITABLE)
def test_reference_writes_we_read(tmp_path, name):
    rng = np.random.default_rng(8)
    arr = random_array(rng, name, (5, 2))
    path = tmp_path / "r.safetensors"
    save_file(
        {"t": as_torch(arr, name), "u": torch.arange(3, dtype=torch.int64)},
        path,
        metadata={"a": "b"},
    )
    with SafetensorsFile(path) as f:
        view = f.tensor("t")
        assert (f.metadata == {"a": "b"} and f.keys() == ["u", "t"]) or set(f.keys()) == {"t", "u"}
        assert view.dtype == get_dtype(name).numpy and view.tobytes() == arr.tobytes()
        assert not view.flags.writeable and not view.flags.owndata  # a view of the mmap
        np.testing.assert_array_equal(f.tensor("u"), np.arange(3))


def test_reads_every_reference_dtype(tmp_path):
    tensors = {
        "bool": torch.tensor([True, False]),
        "f8e4": torch.zeros(3, dtype=torch.float8_e4m3fn),
        "f8e5": torch.ones(3, dtype=torch.float8_e5m2),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
        "bf16": torch.tensor([1.5], dtype=torch.bfloat16),
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, path)
    with SafetensorsFile(path) as f:
        assert f.tensor("bool").tolist() == [True, False]
        assert f.tensor("f8e5").dtype == ml_dtypes.float8_e5m2 and f.tensor("f8e5").astype(
            np.float32
        ).tolist() == [1, 1, 1]
        assert f.tensor("c64")[0] == 1 + 2j
        assert float(f.tensor("bf16")[0]) == 1.5
    assert {t.name: t.dtype.name for t in read_header(path).tensors} == {
        "bool": "BOOL", "f8e4": "F8_E4M3", "f8e5": "F8_E5M2", "c64": "C64", "bf16": "BF16"
    }  # fmt: skip


def test_numpy_reference_loader_agrees(tmp_path):
    path = tmp_path / "n.safetensors"
    write_shard(path, {"a": np.arange(6, dtype=np.int32).reshape(2, 3)})
    np.testing.assert_array_equal(np_load_file(path)["a"], np.arange(6).reshape(2, 3))


def test_encode_header_alignment_and_padding():
    header, infos = encode_header(
        {"b": (get_dtype("U8"), (3,)), "a": (get_dtype("F64"), (1,)), "c": (get_dtype("F64"), (2,))}
    )
    assert [t.name for t in infos] == ["a", "c", "b"]
    assert len(header) % 8 == 0 and all(t.begin % 8 == 0 for t in infos if t.dtype.name == "F64")


def test_write_is_atomic_on_failure(tmp_path):
    class Boom(np.ndarray):
        pass

    path = tmp_path / "x.safetensors"
    with pytest.raises(TypeError):
        write_shard(path, {"ok": np.zeros(2, np.float32), "bad": np.array(["s"])})
    assert list(tmp_path.iterdir()) == []
