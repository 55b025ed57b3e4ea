"""Our JSON schemas, read from the repo root, agree with the format core and real output."""

import json
import struct

import jsonschema
import numpy as np
import pytest
import torch
from safetensors.torch import save

from pyspark_safetensors.format import DTYPES, WRITABLE, write_shard


@pytest.fixture(scope="module")
def header_schema(repo_root):
    schema = json.loads((repo_root / "safetensors.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


@pytest.fixture(scope="module")
def manifest_schema(repo_root):
    schema = json.loads((repo_root / "manifest-jsonschema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def header_of(blob: bytes) -> dict:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n])


def test_header_schema_lists_exactly_our_dtypes(header_schema):
    assert header_schema["$defs"]["tensor"]["properties"]["dtype"]["enum"] == list(DTYPES)


def test_our_headers_validate_bf16_included(tmp_path, header_schema):
    path = tmp_path / "a.safetensors"
    arrays = {d: np.zeros(2, DTYPES[d].numpy) for d in WRITABLE}
    write_shard(path, arrays, {"k": "v"})
    jsonschema.validate(header_of(path.read_bytes()), header_schema)


def test_reference_headers_validate(header_schema):
    blob = save(
        {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros((), dtype=torch.float8_e4m3fn)}
    )
    jsonschema.validate(header_of(blob), header_schema)


@pytest.mark.parametrize(
    "bad",
    [
        {"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
        {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
        {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}},
        {"__metadata__": {"a": 1}},
    ],
)
def test_header_schema_rejects(header_schema, bad):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, header_schema)


def test_manifest_schema_accepts_the_seed_example(manifest_schema, repo_root):
    example = {
        "format_version": "1.0",
        "safetensors_version": "1.0",
        "total_samples": 1000000,
        "total_bytes": 1024000000,
        "shards": [
            {
                "shard_path": "part-00000-0000-550e8400-e29b-41d4-a716-446655440000.safetensors",
                "samples_count": 1000,
                "bytes": 4096000,
            }
        ],
        "schema": {"tensor_name": {"dtype": "F32", "shape": [1000, 3, 224, 224]}},
    }
    jsonschema.validate(example, manifest_schema)
    escaping = json.loads(json.dumps(example))
    escaping["shards"][0]["shard_path"] = "../x.safetensors"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(escaping, manifest_schema)
