"""The single-process reference: the same encoding and the same state, in one loop over
the dataset's shards with the torch reader (no Spark). The tests and the benchmark compare
the Spark job with it."""

from __future__ import annotations

import numpy as np
import torch

from .config import FeaturesConfig
from .job import FeaturesPlan, load_encoder, new_state, pick_device
from .state import LatentState, token_ids


def reference_state(plan: FeaturesPlan, config: FeaturesConfig) -> LatentState:
    """Every token of ``plan.dataset`` folded into one ``LatentState``, ``batch_tokens``
    at a time."""
    from ..torch import open_dataset

    ds = open_dataset(plan.dataset, storage_options=dict(plan.storage_options) or None)
    device = pick_device(config)
    sae = load_encoder(plan.sae, device, config.threads)
    state = new_state(plan, config)
    for shard in range(len(ds.paths)):
        acts = ds.shard_view(shard, "activation")
        ids = token_ids(*(np.asarray(ds.shard_view(shard, c)).reshape(-1)
                          for c in ("sample_id", "window", "token_pos")))  # fmt: skip
        for start in range(0, len(acts), config.batch_tokens):
            x = torch.from_numpy(np.asarray(acts[start : start + config.batch_tokens], np.float32))
            with torch.inference_mode():
                values, indices = sae.encode(x.to(device))
            state.update(
                values, indices, torch.from_numpy(ids[start : start + config.batch_tokens])
            )
    return state
