"""A read is planned once per query: ``schema()`` resolves the paths, ``reader()`` reuses
that plan on the pickled copy Spark hands it, unless a manifest changed meanwhile."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

pytest.importorskip("pyspark.sql.datasource", reason="this Spark has no Python data sources")


from pyspark_safetensors.dataset import write_batch_dataset
from pyspark_safetensors.spark.source import SafetensorsDataSource

pytestmark = pytest.mark.unit


def test_schema_and_reader_share_one_plan_until_the_manifest_changes(tmp_path):
    out = tmp_path / "ds"
    write_batch_dataset(out, {"x": np.arange(6, dtype=np.float32).reshape(3, 2)})
    source = SafetensorsDataSource({"path": str(out)})
    schema = source.schema()
    planned = source._plan
    # Spark pickles the instance after schema() and calls reader() on the copy
    copy = pickle.loads(pickle.dumps(source))
    reader = copy.reader(schema)
    assert reader.sources[0].manifest == planned.sources[0].manifest
    assert copy._plan.sources[0].manifest is not None and copy._plan is not planned
    assert pickle.loads(pickle.dumps(copy))._plan.schema == schema
    first = copy._plan
    copy.reader(schema)
    assert copy._plan is first  # unchanged dataset: no new listing
    # the dataset is replaced: the next reader() plans again and sees the new shards
    for f in out.iterdir():
        f.unlink()
    write_batch_dataset(out, {"x": np.ones((5, 2), np.float32)})
    reader = copy.reader(schema)
    assert copy._plan is not first
    assert reader.sources[0].manifest.total_samples == 5
