"""The feature tables compared with tolerance where float32 encodes may differ.

The SAE encodes float32 chunks whose boundaries follow Spark's Arrow batches in the job
and the shards in the reference loop: a matmul of another batch shape may differ in the
last bits, so activation values agree to float32 rounding while counts, histograms, the
chosen examples and their positions agree exactly (sums are float64)."""

from __future__ import annotations

import numpy as np

KEYS = ["latent", "kind", "rank", "value", "sample_id", "window", "token_pos"]
CLOSE = {"rtol": 1e-5, "atol": 1e-6}


def assert_latents_match(got, want) -> None:
    """Two ``latents`` tables (pandas, sorted by latent): exact but for max and mean."""
    for column in ("latent", "count", "dead", "dense"):
        assert got[column].tolist() == want[column].tolist(), column
    assert [list(h) for h in got["hist"]] == [list(h) for h in want["hist"]]
    for column in ("max", "mean"):
        assert np.allclose(got[column], want[column], **CLOSE), column


def assert_examples_match(got, want) -> None:
    """Two example tables (pandas, ``KEYS`` columns): the same examples in the same order,
    their values to float32 rounding."""
    order = ["latent", "kind", "rank"]
    got = got[KEYS].sort_values(order).reset_index(drop=True)
    want = want[KEYS].sort_values(order).reset_index(drop=True)
    assert got.drop(columns="value").equals(want.drop(columns="value"))
    assert np.allclose(got["value"], want["value"], **CLOSE)
