"""A saev dump as a map-style torch dataset over any view, with the interface of
``torch.SafetensorsDataset`` that ``ShuffledBatches`` / ``ActivationLoader`` use, so the
same shuffled, rank- and worker-split, resumable batches (and the SAE trainer) serve
saev dumps and our datasets alike. Imports torch."""

from __future__ import annotations

import os

import numpy as np
import torch

from ...dataset import ColumnSchema, Manifest, ShardEntry
from .dump import SaevDump
from .protocol import View, shard_file

COLUMNS = ("activation", "image", "layer", "token", "patch")


class SaevDataset(torch.utils.data.Dataset):
    """Rows of one view of a dump (protocol §5.1): ``ds[i]`` is ``{"activation": [d_vit],
    "image", "layer", "token", "patch": scalar int64}`` (``patch`` is -1 for the CLS
    token). One "shard" per saev shard, of ``imgs_in_shard x stride_img`` rows; reads are
    gathers from read-only memmaps.

        ds = open_saev("shards", patches="image", layer=-2)
        loader = ActivationLoader(ds, batch_size=4096, columns=["activation"])
    """

    mode = "batch"

    def __init__(self, dump: SaevDump, patches: str = "image", layer: int | str = "all"):
        self.dump = dump
        self.view = View(dump.meta, patches, layer)
        meta = dump.meta
        self.counts = [self.view.shard_rows(s) for s in range(meta.n_shards)]
        self.starts = np.cumsum([0, *self.counts])[:-1].tolist()
        schema = {
            "activation": ColumnSchema("F32", (meta.n_imgs_per_shard, meta.d_vit), (meta.d_vit,)),
            **{c: ColumnSchema("I64", (meta.n_imgs_per_shard,), ()) for c in COLUMNS[1:]},
        }
        shards = tuple(
            ShardEntry(shard_file(s), n, meta.imgs_in_shard(s) * meta.img_nbytes, first)
            for s, (n, first) in enumerate(zip(self.counts, self.starts, strict=True))
        )
        self.manifest = Manifest(
            shards,
            schema,
            mode="batch",
            metadata={
                "source_format": "saev",
                "hook_point": f"{meta.vit_ckpt} layer {layer} {patches} tokens",
                "saev.hash": dump.path.name,
            },
        )

    @property
    def columns(self) -> list[str]:
        return list(COLUMNS)

    @property
    def metadata(self) -> dict[str, str]:
        return self.manifest.metadata

    def __len__(self) -> int:
        return len(self.view)

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, row in shard) of view row ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a view of {len(self)}")
        img_rows = self.dump.meta.n_imgs_per_shard * self.view.stride_img
        return divmod(index, img_rows)

    def read_rows(self, shard: int, column: str, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of ``shard`` for ``column`` (a copy)."""
        index = self.starts[shard] + np.asarray(rows, dtype=np.int64)
        if column == "activation":
            return self.dump.gather(*self.view.locate(index))
        if column not in COLUMNS:
            raise KeyError(f"no column {column!r}; a saev view has {list(COLUMNS)}")
        return self.view.coordinates(index)[column]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        shard, row = self.locate(int(index))
        rows = np.array([row])
        out = {}
        for c in COLUMNS:
            values = self.read_rows(shard, c, rows)
            out[c] = torch.from_numpy(values.reshape(values.shape[1:]))
        return out


def open_saev(
    path: str | os.PathLike, *, patches: str = "image", layer: int | str = "all"
) -> SaevDataset:
    """Open a saev dump (hash directory or its ``dump_to``) as a dataset over one view:
    ``patches`` in ``cls``/``image``/``all``, ``layer`` a recorded ViT layer or ``all``."""
    return SaevDataset(SaevDump(path), patches, layer)
