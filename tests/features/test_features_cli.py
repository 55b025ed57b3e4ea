"""``pyspark-safetensors features``: bad inputs exit with code 2 and one line naming them,
before any Spark session starts."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--hook", "encoder.layer.9:output"], "encoder.layer.9:output"),
        (["--sae", "missing.safetensors"], "missing.safetensors"),
    ],
)
def test_bad_inputs_exit_2_with_one_line(tmp_path, make_sae, args, needle):
    extraction = tmp_path / "acts"
    extraction.mkdir()
    (extraction / "extraction.json").write_text(
        '{"hooks": {"encoder.layer.0:output": {"dataset": "activations/x", "width": 384}},'
        ' "config": {"max_length": 32}}'
    )
    for table in ("samples.parquet", "texts.jsonl"):
        (extraction / table).write_text("")
    sae = make_sae(tmp_path / "sae.safetensors")
    base = ["--extraction", str(extraction), "--sae", str(sae), "--out", str(tmp_path / "o")]
    result = subprocess.run(
        [sys.executable, "-m", "pyspark_safetensors.cli", "features", *base, *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
