"""An SAE's activations on an extraction as delphi's latent cache: the files read back with
the reference ``safetensors`` library in delphi's layout (split names, dtypes, shared
tokens, config), every non-zero activation equal to an independent dense encoding of the
dataset's rows at the extraction's positions, each sequence's tokens the tokenizer's; and,
where eai-delphi imports, its own ``LatentDataset`` reads the cache back."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.numpy import load_file

from conftest import HOOK, LATENTS
from pyspark_safetensors.features import FeaturesError
from pyspark_safetensors.features.delphi import DelphiConfig, export_delphi, split_bounds

pytestmark = pytest.mark.spark

# delphi's CacheConfig fields (eai-delphi 0.1.3, delphi/config.py) and the key its loader reads
CACHE_CONFIG_KEYS = {"dataset_repo", "dataset_split", "dataset_name", "dataset_column",
                     "batch_size", "cache_ctx_len", "n_tokens", "n_splits", "model_name"}  # fmt: skip


@pytest.fixture(scope="module")
def cache(extraction, sae_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("delphi") / "latents"
    summary = export_delphi(DelphiConfig(extraction=str(extraction), sae=str(sae_file),
                                         out=str(out), n_splits=3, device="cpu"))  # fmt: skip
    return out, summary


def _reference(extraction, sae_file):
    """{(sequence, position, latent): activation} from the whole dataset encoded at once."""
    from pyspark_safetensors.sae.ecosystem import load_sae_model
    from pyspark_safetensors.torch import open_dataset

    doc = json.loads((extraction / "extraction.json").read_text())
    ds = open_dataset(extraction / doc["hooks"][HOOK]["dataset"])
    rows = [ds[i] for i in range(len(ds))]
    x = torch.stack([torch.as_tensor(r["activation"]).float() for r in rows])
    with torch.inference_mode():
        values, indices = load_sae_model(sae_file).encode(x)
    samples = pq.read_table(extraction / "samples.parquet").to_pylist()
    seq = {(s["sample_id"], s["window"]): i
           for i, s in enumerate(sorted(samples, key=lambda s: (s["sample_id"], s["window"])))}  # fmt: skip
    want = {}
    for r, vals, idx in zip(rows, values.tolist(), indices.tolist(), strict=True):
        for v, j in zip(vals, idx, strict=True):
            if abs(v) > 1e-5:
                want[(seq[(int(r["sample_id"]), int(r["window"]))], int(r["token_pos"]), j)] = v
    return want, samples, seq


def test_the_cache_in_delphis_layout(cache, extraction, sae_file):
    out, summary = cache
    module = HOOK.split(":")[0]
    assert summary["module"] == module
    bounds = split_bounds(LATENTS, 3)
    assert bounds == [(0, 31), (32, 63), (64, 95)]  # linspace(0, 96, 4), end inclusive
    assert sorted(p.name for p in (out / module).iterdir()) == sorted(
        [f"{a}_{b}.safetensors" for a, b in bounds] + ["config.json"]
    )
    config = json.loads((out / module / "config.json").read_text())
    assert set(config) >= CACHE_CONFIG_KEYS and config["n_splits"] == 3
    want, samples, seq = _reference(extraction, sae_file)
    got, tokens = {}, None
    for a, b in bounds:
        f = load_file(out / module / f"{a}_{b}.safetensors")
        assert set(f) == {"locations", "activations", "tokens"}
        assert f["locations"].dtype == np.uint16 and f["locations"].shape[1] == 3
        assert f["activations"].dtype == np.float16
        assert len(f["activations"]) == len(f["locations"])
        assert f["locations"][:, 2].max() <= b - a
        if tokens is None:
            tokens = f["tokens"]
        np.testing.assert_array_equal(f["tokens"], tokens)
        for (s, p, j), v in zip(f["locations"].tolist(), f["activations"].tolist(), strict=True):
            got[(s, p, j + a)] = v
    assert got.keys() == want.keys() and len(got) == summary["activations"] > 0
    keys = sorted(want)
    np.testing.assert_allclose([got[k] for k in keys], np.float16([want[k] for k in keys]),
                               rtol=2e-3, atol=1e-4)  # fmt: skip
    # the tokens: each sequence the tokenizer's ids of its window, padded after
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config["model_name"], local_files_only=True)
    assert tokens.shape == (len(samples), summary["ctx_len"])
    texts = {json.loads(line)["sample_id"]: json.loads(line)["text"]
             for line in (extraction / "texts.jsonl").read_text().splitlines()}  # fmt: skip
    for s in samples:
        row, n = seq[(s["sample_id"], s["window"])], s["first_pos"] + s["seq_len"]
        if s["window"] == 0:
            ids = tokenizer(texts[s["sample_id"]], truncation=True, max_length=40)["input_ids"]
            assert tokens[row, :n].tolist() == ids
        assert (tokens[row, n:] == config["pad_token_id"]).all()
    # every activation sits on a token of its sequence
    assert all(seq_len_ok(samples, seq, s, p) for s, p, _ in got)


def seq_len_ok(samples, seq, row, pos):
    by_row = {seq[(s["sample_id"], s["window"])]: s for s in samples}
    s = by_row[row]
    return s["first_pos"] <= pos < s["first_pos"] + s["seq_len"]


def test_refusals(extraction, sae_file, tmp_path):
    with pytest.raises(FeaturesError, match="n_splits"):
        DelphiConfig(extraction="a", sae="b", out="c", n_splits=0)
    with pytest.raises(FeaturesError, match="module"):
        DelphiConfig(extraction="a", sae="b", out="c", module="a/b")
    with pytest.raises(FeaturesError, match="no extraction"):
        export_delphi(
            DelphiConfig(extraction=str(tmp_path), sae=str(sae_file), out=str(tmp_path / "o"))
        )


def test_delphis_own_loader_reads_the_cache(cache):
    pytest.importorskip("delphi.latents", reason="eai-delphi is not installed (an optional peer)")
    from delphi.config import ConstructorConfig, SamplerConfig
    from delphi.latents import LatentDataset
    from transformers import AutoTokenizer

    out, summary = cache
    module = summary["module"]
    config = json.loads((out / module / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(config["model_name"], local_files_only=True)
    dataset = LatentDataset(str(out), SamplerConfig(n_examples_train=2, n_examples_test=2),
                            ConstructorConfig(min_examples=1, n_non_activating=2, example_ctx_len=8),
                            tokenizer=tokenizer, modules=[module])  # fmt: skip
    most = {}
    for a, b in split_bounds(LATENTS, 3):
        f = load_file(out / module / f"{a}_{b}.safetensors")
        for j, v in zip(f["locations"][:, 2].tolist(), f["activations"].tolist(), strict=True):
            most[j + a] = max(most.get(j + a, -np.inf), v)
    records = [r for r in dataset if r is not None]
    assert records and len(records) == len(most)
    for r in records:
        assert r.latent.module_name == module
        assert r.max_activation == pytest.approx(most[r.latent.latent_index])
