"""The extraction's output formats: which ones a config asks for, in which order, and what
each refuses before the model runs (no Spark here; the writing itself is checked by
test_extract.py)."""

import inspect

import pytest

from pyspark_safetensors.extract import ExtractConfig
from pyspark_safetensors.extract.outputs import (
    ExtractionOutput,
    SafetensorsDatasets,
    outputs_for,
)
from pyspark_safetensors.interop.zarr.extract_output import ZarrRunOutput

pytestmark = pytest.mark.unit


def test_the_datasets_are_always_written_and_the_zarr_run_on_request():
    assert outputs_for(ExtractConfig()) == [SafetensorsDatasets(kv_dataset=True)]
    assert outputs_for(ExtractConfig(kv_dataset=False)) == [SafetensorsDatasets(kv_dataset=False)]
    assert outputs_for(ExtractConfig(zarr_run=True)) == [SafetensorsDatasets(), ZarrRunOutput()]


@pytest.mark.parametrize("output", [SafetensorsDatasets(), ZarrRunOutput()])
def test_every_output_has_the_protocol_methods_with_their_signatures(output):
    for name in ("for_config", "target_refusal", "widths_refusal", "write"):
        wanted = inspect.signature(getattr(ExtractionOutput, name))
        got = inspect.signature(getattr(type(output), name))
        assert list(got.parameters) == list(wanted.parameters), name
    assert isinstance(output.name, str) and output.name


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
