"""The extraction's output formats: which ones a config asks for, in which order, and what
each refuses before the model runs (no Spark here; the writing itself is checked by
test_extract.py)."""

import inspect

import numpy as np
import pyarrow as pa
import pytest

from pyspark_safetensors.extract import ExtractConfig
from pyspark_safetensors.extract.outputs import (
    ExtractionOutput,
    SafetensorsDatasets,
    outputs_for,
    token_rows,
)
from pyspark_safetensors.interop.zarr.extract_output import ZarrRunOutput
from pyspark_safetensors.spark.tensor_struct import tensor_structs_of_arrays

pytestmark = pytest.mark.unit


def test_the_datasets_are_always_written_and_the_zarr_run_on_request():
    assert outputs_for(ExtractConfig()) == [SafetensorsDatasets(kv_dataset=True)]
    assert outputs_for(ExtractConfig(kv_dataset=False)) == [SafetensorsDatasets(kv_dataset=False)]
    assert outputs_for(ExtractConfig(zarr_run=True)) == [SafetensorsDatasets(), ZarrRunOutput()]


@pytest.mark.parametrize("output", [SafetensorsDatasets(), ZarrRunOutput()])
def test_every_output_has_the_protocol_methods_with_their_signatures(output):
    for name in ("for_config", "target_refusal", "widths_refusal", "stage_writes", "write"):
        wanted = inspect.signature(getattr(ExtractionOutput, name))
        got = inspect.signature(getattr(type(output), name))
        assert list(got.parameters) == list(wanted.parameters), name
    assert isinstance(output.name, str) and output.name
    assert isinstance(output.reads_rows, bool)


def test_only_outputs_written_after_the_stage_read_the_stored_rows():
    assert not SafetensorsDatasets().reads_rows  # its tasks write it during the model stage
    assert SafetensorsDatasets(partition_by_hook=True).reads_rows  # the JVM source, afterwards
    assert ZarrRunOutput().reads_rows


def _sample_rows(seq_lens, first_pos, width=3):
    rng = np.random.default_rng(0)
    acts = [rng.standard_normal((n, width)).astype(np.float16) for n in seq_lens]
    batch = pa.RecordBatch.from_pydict({
        "sample_id": pa.array([10 + i for i in range(len(seq_lens))], pa.int64()),
        "window": pa.array([i % 2 for i in range(len(seq_lens))], pa.int32()),
        "seq_len": pa.array(seq_lens, pa.int32()),
        "first_pos": pa.array(first_pos, pa.int32()),
        "h": tensor_structs_of_arrays(acts, "F16"),
    })  # fmt: skip
    return batch, acts


@pytest.mark.parametrize("start", [0, 1])  # a batch sliced from a larger one, too
def test_token_rows_are_each_samples_tokens_in_order(start):
    batch, acts = _sample_rows([2, 0, 3, 1], [1, 0, 0, 1])
    batch, acts = batch.slice(start), acts[start:]
    rows = token_rows(batch, "h", 3, "F16")
    ids = batch.column("sample_id").to_pylist()
    firsts = batch.column("first_pos").to_pylist()
    windows = batch.column("window").to_pylist()
    want = [
        (ids[i], p + firsts[i], windows[i], a[p].tobytes())
        for i, a in enumerate(acts)
        for p in range(len(a))
    ]
    got = list(zip(
        rows.column("sample_id").to_pylist(), rows.column("token_pos").to_pylist(),
        rows.column("window").to_pylist(), rows.column("activation").field("data").to_pylist(),
        strict=True,
    ))  # fmt: skip
    assert got == want
    assert set(rows.column("activation").field("dtype").to_pylist()) == {"F16"}
    assert rows.column("activation").field("shape").to_pylist() == [[3]] * len(want)
    assert rows.schema.field("token_pos").type == pa.int32()


def test_token_rows_refuse_activations_not_laid_end_to_end():
    batch, _ = _sample_rows([2, 3], [0, 0])
    wrong = batch.set_column(2, "seq_len", pa.array([2, 4], pa.int32()))
    with pytest.raises(Exception, match="5 token rows for 6 tokens"):
        token_rows(wrong, "h", 3, "F16")


def test_the_zarr_run_refuses_an_object_store_and_mixed_widths():
    zarr = ZarrRunOutput()
    assert zarr.target_refusal("/data/acts", local=True) is None
    refusal = zarr.target_refusal("s3://bucket/acts", local=False)
    assert refusal.startswith("zarr_run writes its Zarr stores to a local directory")
    assert "s3://bucket/acts" in refusal
    assert zarr.widths_refusal({"a:input": 384, "b:input": 384}) is None
    assert "one width" in zarr.widths_refusal({"a:input": 384, "b:input": 1536})


def test_the_datasets_take_any_target_and_widths():
    datasets = SafetensorsDatasets()
    assert datasets.target_refusal("s3://bucket/acts", local=False) is None
    assert datasets.widths_refusal({"a:input": 384, "b:input": 1536}) is None
