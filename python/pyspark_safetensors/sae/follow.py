"""Training on datasets still being written (``SAEConfig.follow``): the run waits for the
first rows to be committed, reads its widths and initialisation sample from them, and its
loader (``torch.FollowingBatches``) takes the rows of each commit as it lands, until the
``tokens`` budget or until every dataset is ``complete`` and read.

The datasets a run follows are those its ``TrainingSource`` opened: one dataset, or the
row-aligned datasets of a transcoder, crosscoder or cross-layer transcoder, followed as
one over the shards every one of them has committed."""

from __future__ import annotations

import time

from ..format.errors import InvalidArgumentError
from ..torch import FollowingBatches, SafetensorsDataset
from ..torch.loader import AlignedDatasets, MisalignedDatasetsError
from .sources import TrainingSource, open_training_source


def _options(config) -> dict:
    timeout = config.follow_timeout_s or None  # 0: wait for ever
    return {"poll_interval_s": config.follow_poll_s, "timeout_s": timeout}


def open_followed_source(config) -> TrainingSource:
    """The run's ``TrainingSource`` once every dataset it trains on holds a global batch
    (or is complete) and row-aligned ones agree (one may have a commit the others have
    not made yet: opened again after ``follow_poll_s``). Raises ``FollowTimeoutError``
    after ``follow_timeout_s`` without a new row."""
    options = _options(config)
    misaligned_since = None
    while True:
        for path in config.training_datasets:
            FollowingBatches(path, 1, dp_rank=0, dp_size=1, **options).wait_for(config.batch_size)
        try:
            return open_training_source(config)
        except MisalignedDatasetsError:  # a commit of one landed before the others'
            now = time.monotonic()
            misaligned_since = misaligned_since or now
            if options["timeout_s"] is not None and now - misaligned_since > options["timeout_s"]:
                raise
            time.sleep(config.follow_poll_s)


def following_loader(
    source: TrainingSource, config, *, dp_rank: int, dp_size: int, max_samples: int
) -> FollowingBatches:
    """The run's loader over ``source``'s datasets as they grow: this data rank's share of
    each global batch, full batches only, at most ``max_samples`` rows in all."""
    ds = source.dataset
    if isinstance(ds, AlignedDatasets):
        followed = {key: (part.location, column) for key, (part, column) in ds.parts.items()}
    elif isinstance(ds, SafetensorsDataset):
        followed = ds.location
    else:
        raise InvalidArgumentError(
            f"{config.dataset}: follow reads datasets written by pyspark-safetensors, "
            f"not a {type(ds).__name__}"
        )
    return FollowingBatches(
        followed,
        config.batch_size // dp_size,
        columns=source.columns,
        seed=config.seed,
        drop_last=True,
        dp_rank=dp_rank,
        dp_size=dp_size,
        max_samples=max_samples,
        lookahead=True,
        **_options(config),
    )
