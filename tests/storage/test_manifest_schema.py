"""Manifests are checked at run time against the shipped ``manifest-jsonschema.json``
(the same file the conformance tests read), with messages naming the field."""

from __future__ import annotations

import copy
import json
import re
from importlib import resources

import pytest

from pyspark_safetensors.dataset import Manifest, ManifestError

pytestmark = pytest.mark.unit

GOOD = {
    "format_version": "1.0",
    "safetensors_version": "1.0",
    "total_samples": 3,
    "total_bytes": 100,
    "shards": [{"shard_path": "part-00000-0000-a.safetensors", "samples_count": 3, "bytes": 100}],
    "schema": {"x": {"dtype": "F32", "shape": [3, 2]}},
}


def test_the_shipped_schema_is_the_repository_one(repo_root):
    shipped = resources.files("pyspark_safetensors.dataset") / "manifest-jsonschema.json"
    assert json.loads(shipped.read_text()) == json.loads(
        (repo_root / "manifest-jsonschema.json").read_text()
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("total_bytes"), "missing required field 'total_bytes'"),
        (lambda d: d.update(format_version="2.0"), "format_version '2.0' is not supported"),
        (lambda d: d["shards"][0].pop("bytes"), "missing required field 'shards[0].bytes'"),
        (lambda d: d["shards"][0].update(bytes=-1), "shards[0].bytes: -1 is less than"),
        (
            lambda d: d["shards"][0].update(shard_path="../x.safetensors"),
            "must be a relative name inside the dataset",
        ),
        (lambda d: d["schema"]["x"].update(dtype="F128"), "schema.x.dtype: 'F128' is not one of"),
        (lambda d: d.update(commit_id=5), "commit_id: 5 is not of type 'string'"),
        (lambda d: d["shards"].append(dict(d["shards"][0])), "a second time"),
        (lambda d: d.update(total_samples=4), "disagree with the sum over shards"),
    ],
)
def test_a_bad_manifest_is_refused_naming_the_field(change, message):
    doc = copy.deepcopy(GOOD)
    change(doc)
    with pytest.raises(ManifestError, match=f"^'m': .*{re.escape(message)}"):
        Manifest.from_json(doc, "'m'")


def test_a_good_manifest_round_trips():
    manifest = Manifest.from_json(GOOD, "'m'")
    assert manifest.schema["x"].sample_shape == (2,) and manifest.total_samples == 3
    assert Manifest.from_json(manifest.to_json(), "'m'") == manifest
    with pytest.raises(ManifestError, match="not a JSON object"):
        Manifest.from_json([GOOD], "'m'")
