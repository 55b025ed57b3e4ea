"""Synthetic datasets written by Spark (``evaluation/job.py``): each row's truth gives back
its sample, each partition's rows are those its (seed, partition) generator draws whatever
the shards, the trainer's reader and the metrics read the dataset, and a row over
``max_active`` fails the job with nothing published."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyspark_safetensors.evaluation import (
    HierarchyConfig,
    SyntheticDataConfig,
    SyntheticModelConfig,
    evaluate_ground_truth,
    ground_truth_batches,
    synthetic_datasets,
    write_synthetic_dataset,
)
from pyspark_safetensors.evaluation.groundtruth import dense_truth
from pyspark_safetensors.evaluation.job import draw_rows
from pyspark_safetensors.evaluation.synthetic import SyntheticModel
from pyspark_safetensors.torch import open_dataset

pytestmark = pytest.mark.spark

CONFIG = SyntheticModelConfig(
    num_features=200, hidden_dim=24,
    hierarchy=HierarchyConfig(total_root_nodes=8, branching_factor=3, max_depth=1,
                              mutually_exclusive_portion=0.5),
)  # fmt: skip


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    return synthetic_datasets(spark, CONFIG, root, train_rows=2500, eval_rows=600,
                              rows_per_partition=1000, rows_per_shard=512)  # fmt: skip


def read_all(path) -> dict[str, np.ndarray]:
    ds = open_dataset(path)
    columns = {name: [] for name in ds.columns}
    for i in range(len(ds)):
        for name, value in ds[i].items():
            columns[name].append(np.asarray(value))
    return {name: np.stack(v) for name, v in columns.items()}


def test_each_row_is_its_truth_through_the_dictionary(data):
    model = SyntheticModel.load(data["model"])
    rows = read_all(data["train"])
    assert sorted(rows["row"].tolist()) == list(range(2500))
    truth = dense_truth(torch.from_numpy(rows["feature_indices"]).long(),
                        torch.from_numpy(rows["feature_values"]), 200)  # fmt: skip
    assert torch.allclose(model.hidden(truth), torch.from_numpy(rows["activation"]), atol=1e-5)
    # indices ascend, then the padding; a child fires only with its parent
    idx = rows["feature_indices"]
    active = idx >= 0
    assert (np.diff(active.astype(int), axis=1) <= 0).all()
    assert (np.where(active[:, 1:], np.diff(idx, axis=1), 1) > 0).all()
    children = np.flatnonzero(model.parent_of >= 0)
    fires = truth.numpy() > 0
    assert not (fires[:, children] & ~fires[:, model.parent_of[children]]).any()
    meta = open_dataset(data["train"]).metadata
    assert (
        SyntheticModelConfig.from_dict(__import__("json").loads(meta["synthetic_model"])) == CONFIG
    )
    assert meta["synthetic_seed"] == "0" and int(meta["max_active"]) == idx.shape[1]


def test_a_partition_holds_what_its_generator_draws_whatever_the_shards(spark, data, tmp_path):
    model = SyntheticModel.load(data["model"])
    width = int(open_dataset(data["train"]).metadata["max_active"])
    rows = read_all(data["train"])
    order = np.argsort(rows["row"])
    (direct,) = list(draw_rows(model, 0, 1, 1000, 2000, width))
    assert np.array_equal(rows["activation"][order][1000:2000], direct["activation"])
    assert np.array_equal(rows["feature_indices"][order][1000:2000], direct["feature_indices"])
    # the same dataset in other shards: the same rows
    again = SyntheticDataConfig(data["model"], str(tmp_path / "again"), 2500,
                                rows_per_partition=1000, rows_per_shard=300, max_active=width)  # fmt: skip
    write_synthetic_dataset(spark, again)
    other = read_all(again.output)
    assert np.array_equal(other["activation"][np.argsort(other["row"])], rows["activation"][order])
    # the evaluation set is another seed's
    assert not np.array_equal(read_all(data["eval"])["activation"][:10], direct["activation"][:10])


def test_the_metrics_read_the_dataset(data):
    model = SyntheticModel.load(data["model"])
    from pyspark_safetensors.sae import TopKSAE

    sae = TopKSAE(24, 64, 4, seed=1)  # seed 0 would draw the model's first 64 directions
    m = evaluate_ground_truth(sae, model.feature_vectors, ground_truth_batches(data["eval"], batch=256),
                              parent_of=model.parent_of)  # fmt: skip
    assert m.samples == 600 and 0 < m.mcc < 1 and m.sae_l0 <= 4


def test_a_row_over_max_active_fails_the_job_and_publishes_nothing(spark, data, tmp_path):
    out = tmp_path / "narrow"
    config = SyntheticDataConfig(data["model"], str(out), 500, rows_per_partition=250, max_active=1)
    with pytest.raises(Exception, match="max_active=1"):
        write_synthetic_dataset(spark, config)
    assert not (out / "dataset_manifest.json").exists()
