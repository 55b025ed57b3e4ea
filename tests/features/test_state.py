"""The per-latent state without Spark: merging the states of any split of the tokens
gives the state of all of them (statistics, top-N with ties, random examples and their
context windows)."""

import numpy as np
import pytest
import torch

from pyspark_safetensors.features import FeaturesConfig, FeaturesError
from pyspark_safetensors.features.merge import examples_table, latents_table
from pyspark_safetensors.features.state import (
    LatentState,
    histogram_edges,
    keep_first,
    split_ids,
    token_ids,
)

N_LATENTS, K, MARGIN = 12, 3, 2


def codes(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand(tokens, K, generator=gen) * 4
    values[values < 0.6] = 0  # some entries do not fire
    values[::7] = 2.0  # exact ties across tokens
    indices = torch.stack([torch.randperm(N_LATENTS, generator=gen)[:K] for _ in range(tokens)])
    ids = torch.from_numpy(token_ids(np.arange(tokens) // 30, np.zeros(tokens, np.int64),
                                     np.arange(tokens) % 30))  # fmt: skip
    return values, indices, ids


def state():
    edges = torch.from_numpy(histogram_edges(8, 0.01, 10.0))
    return LatentState(N_LATENTS, top_n=5, per_bin=2, edges=edges, seed=3, window=2 * MARGIN + 1)


def windows(values, indices, ids, start):
    """``contexts(rows, latents)`` of the batch starting at token ``start``, read from the
    whole code: the latent's activation on the tokens +-MARGIN around each row."""

    def contexts(rows, latents):
        out = torch.zeros(len(rows), 2 * MARGIN + 1)
        for i, (row, latent) in enumerate(zip(rows.tolist(), latents.tolist(), strict=True)):
            for o in range(-MARGIN, MARGIN + 1):
                j = start + row + o
                if 0 <= j < len(ids) and ids[j] == ids[start + row] + o:
                    out[i, o + MARGIN] = values[j][indices[j] == latent].sum()
        return out

    return contexts


def update(s, values, indices, ids, start, stop):
    s.update(values[start:stop], indices[start:stop], ids[start:stop],
             windows(values, indices, ids, start))  # fmt: skip


def test_split_and_merge_equals_one_pass():
    values, indices, ids = codes(600, 0)
    whole = state()
    for s in range(0, 600, 50):
        update(whole, values, indices, ids, s, s + 50)
    parts = [state(), state(), state()]
    for i, s in enumerate(range(0, 600, 37)):  # another batching, interleaved parts
        update(parts[i % 3], values, indices, ids, s, s + 37)
    merged = parts[0]
    merged.merge(parts[1])
    merged.merge(parts[2])
    config = FeaturesConfig(top_n=5, samples_per_band=2, hist_bins=8, hist_min=0.01, hist_max=10.0)
    assert latents_table(merged, config).equals(latents_table(whole, config))
    examples = examples_table(merged, config)
    assert examples.equals(examples_table(whole, config))  # the windows too
    windows = np.array(examples.column("context").to_pylist())
    center = windows[:, MARGIN]
    assert center.tolist() == examples.column("value").to_pylist()
    assert (windows[:, [0, 1, 3, 4]] > 0).any()  # neighbours fire too


def test_top_n_is_the_largest_with_ties_by_token():
    values, indices, ids = codes(400, 1)
    s = state()
    s.update(values, indices, ids)
    config = FeaturesConfig(top_n=5, samples_per_band=0)
    top = examples_table(s, config).to_pandas()
    fired = values > 0
    for latent in range(N_LATENTS):
        mask = (indices == latent) & fired
        vals = values[mask].numpy()
        tok = ids.unsqueeze(1).expand_as(values)[mask].numpy()
        order = np.lexsort((tok, -vals))[:5]
        got = top[top.latent == latent].sort_values("rank")
        assert got.value.tolist() == vals[order].astype(np.float32).tolist()
        sample_id, _, pos = split_ids(tok[order])
        assert got.sample_id.tolist() == sample_id.tolist()
        assert got.token_pos.tolist() == pos.tolist()


def test_keep_first_per_group():
    group = torch.tensor([1, 0, 1, 1, 0, 2])
    key = torch.tensor([5, 1, 3, 3, 0, 9])
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    kept = sorted(keep_first(group, key, ids, 2).tolist())
    assert kept == [1, 2, 3, 4, 5]  # group 1 keeps keys 3, 3 (ids 12, 13), drops 5


@pytest.mark.parametrize(
    "bad", [{"top_n": 0}, {"top_n": -3}, {"bands": (0.5, 0.25)}, {"hist_min": 0.0}]
)
def test_bad_settings_are_one_line_errors(bad):
    with pytest.raises(FeaturesError) as e:
        FeaturesConfig(**bad)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    assert next(iter(bad)) in str(e.value)
