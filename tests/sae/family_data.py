"""Row-aligned hook points for the SAE families' tests (test_families, test_distributed):
what an extraction writes for an MLP's input and output and for two layers, from one
sparse code, so a transcoder and a crosscoder have structure to find."""

import numpy as np

from pyspark_safetensors.dataset import write_batch_dataset

D_IN, D_OUT, N_ROWS = 16, 12, 4096


def _write(root, activation, hook, order=None):
    n = len(activation)
    token = np.arange(n) if order is None else order
    write_batch_dataset(
        root,
        {"activation": activation.astype(np.float32),
         "sample_id": (token // 16).astype(np.int64),
         "token_pos": (token % 16).astype(np.int32)},
        rows_per_shard=1024,
        metadata={"hook_point": hook},
    )  # fmt: skip
    return str(root)


def make_family_data(root, seed=0):
    """Hook points sharing one sparse code: ``in`` and ``out`` (an MLP's input and
    output: two dictionaries of the same latents, ``out`` also a linear map of ``in``
    for the skip path) and ``l1`` (a second layer of ``in``'s width for a crosscoder,
    some features absent from it), each with a held-out twin; ``reordered_out`` holds
    ``out``'s rows in another order (its sample_id/token_pos say so)."""
    rng = np.random.default_rng(seed)
    feats = 48
    dict_in = rng.standard_normal((feats, D_IN))
    dict_out = rng.standard_normal((feats, D_OUT))
    dict_l1 = rng.standard_normal((feats, D_IN)) * (rng.random(feats) < 0.7)[:, None]
    linear = 0.3 * rng.standard_normal((D_OUT, D_IN))
    paths = {}
    for split, n in (("train", N_ROWS), ("val", 1024)):
        codes = np.zeros((n, feats))
        cols = np.argsort(rng.random((n, feats)), axis=1)[:, :3]
        np.put_along_axis(codes, cols, rng.uniform(0.5, 2.0, (n, 3)), axis=1)
        x = codes @ dict_in + 0.01 * rng.standard_normal((n, D_IN))
        layers = {"in": (x, "mlp:input"), "out": (codes @ dict_out + x @ linear.T, "mlp:output"),
                  "l1": (codes @ dict_l1 + 0.5, "layers.1")}  # fmt: skip
        for name, (a, hook) in layers.items():
            paths[f"{split}_{name}"] = _write(root / f"{split}_{name}", a, hook)
            paths[f"{split}_{name}_array"] = a
    order = rng.permutation(N_ROWS)
    paths["reordered_out"] = _write(
        root / "reordered_out", paths["train_out_array"][order], "mlp:output", order
    )
    paths["short_out"] = _write(root / "short_out", paths["train_out_array"][:3072], "mlp:output")
    return paths
