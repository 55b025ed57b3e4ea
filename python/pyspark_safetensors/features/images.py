"""Image extractions in the feature job: the token layout of an image (CLS, registers,
then the patch grid row-major, as ``extraction.json`` records it), the examples as
images (each with the latent's activation on every token: the heat map), and the
thumbnails of the example images from the extraction's ``images.parquet``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .config import FeaturesError

IMAGES_TABLE = "images.parquet"


@dataclass(frozen=True)
class ImageLayout:
    """The tokens of every image of an extraction, in the model's scan order."""

    rows: int
    cols: int
    n_registers: int
    tokens: int
    """CLS (when the model has one) + registers + rows x cols patches."""

    @property
    def prefix(self) -> int:
        """Tokens before the first patch."""
        return self.tokens - self.rows * self.cols

    def kinds(self) -> list[str]:
        """Each token position's kind: ``cls``, ``register`` or ``patch``."""
        cls = ["cls"] * (self.prefix - self.n_registers)
        return cls + ["register"] * self.n_registers + ["patch"] * (self.rows * self.cols)

    def patch_of(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(patch_row, patch_col)`` of token positions (-1 for CLS and registers)."""
        pos = np.asarray(pos, np.int64)
        patch = pos - self.prefix
        inside = patch >= 0
        return np.where(inside, patch // self.cols, -1), np.where(inside, patch % self.cols, -1)

    def position(self, patch_row: np.ndarray, patch_col: np.ndarray) -> np.ndarray:
        """The token position of patches."""
        return self.prefix + np.asarray(patch_row, np.int64) * self.cols + np.asarray(patch_col)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "cols": self.cols, "n_registers": self.n_registers,
                "tokens": self.tokens, "kinds": self.kinds()}  # fmt: skip


def layout_of(doc: dict, where: str) -> ImageLayout:
    """The layout an image extraction's ``extraction.json`` (``doc``, read at ``where``)
    records: ``patch_grid``, ``n_registers`` and ``n_cls`` (0 for a model without a CLS
    token, such as SigLIP; 1 when absent), or ``tokens_per_image``."""
    try:
        rows, cols = (int(v) for v in doc["patch_grid"])
    except (KeyError, TypeError, ValueError):
        raise FeaturesError(
            f"{where}: an image extraction without patch_grid [rows, cols]"
        ) from None
    n_registers = int(doc.get("n_registers", 0))
    n_cls = int(doc.get("n_cls", 1))
    tokens = int(doc.get("tokens_per_image", n_cls + n_registers + rows * cols))
    if tokens < n_registers + rows * cols or rows < 1 or cols < 1:
        raise FeaturesError(f"{where}: {tokens} tokens per image cannot hold {n_registers} "
                            f"registers and a {rows}x{cols} patch grid")  # fmt: skip
    return ImageLayout(rows, cols, n_registers, tokens)


def check_layout(layout: ImageLayout, ds, where: str) -> None:
    """The dataset's rows agree with the layout: ``token_pos`` below its tokens, and the
    ``patch_row``/``patch_col`` columns (where it has them) those of each position (the
    first shard's first rows are read, in any order)."""
    n = min(ds.counts[0], 4096) if ds.counts else 0
    f = ds.shard(0) if n else None
    pos = np.asarray(f.row_range("token_pos", 0, n)).reshape(-1) if n else np.zeros(0, np.int64)
    bad = bool((pos >= layout.tokens).any() or (pos < 0).any())
    want_row, want_col = layout.patch_of(np.minimum(pos, layout.tokens - 1))
    for name, want in (("patch_row", want_row), ("patch_col", want_col)):
        if n and name in ds.columns:
            bad |= not np.array_equal(np.asarray(f.row_range(name, 0, n)).reshape(-1), want)
    if bad:
        raise FeaturesError(
            f"{where}: its tokens do not follow extraction.json's layout ({layout.prefix} tokens "
            f"before a {layout.rows}x{layout.cols} patch grid, {layout.tokens} in all)"
        )


def image_contexts_table(examples: pa.Table, layout: ImageLayout) -> pa.Table:
    """The contexts table of an image extraction, one row per example (sorted by latent,
    kind and rank): ``image_id``, the example token's ``token_pos``, ``token_kind``,
    ``patch_row``/``patch_col`` (-1 for CLS and registers), and ``acts``: the latent's
    activation on every token of the image, in scan order (``layout.tokens`` of them)."""
    examples = examples.sort_by([(c, "ascending") for c in ("latent", "kind", "rank")])
    pos = examples.column("token_pos").to_numpy().astype(np.int64)
    row, col = layout.patch_of(pos)
    kinds = np.asarray(layout.kinds(), dtype=object)
    return pa.table({
        "latent": examples.column("latent"),
        "kind": examples.column("kind"),
        "rank": examples.column("rank"),
        "value": examples.column("value"),
        "image_id": examples.column("sample_id"),
        "token_pos": examples.column("token_pos"),
        "token_kind": pa.array(kinds[np.minimum(pos, layout.tokens - 1)].tolist(), pa.string()),
        "patch_row": pa.array(row.astype(np.int32)),
        "patch_col": pa.array(col.astype(np.int32)),
        "acts": examples.column("context"),
    })  # fmt: skip


def read_images(location, image_ids, columns=("image_id", "key", "label", "thumbnail")) -> pa.Table:
    """The rows of the extraction's ``images.parquet`` (``location``: its
    ``DatasetLocation``; a file or a directory of parts) of the given images (None: all),
    by a filtered read (row groups whose statistics exclude them are skipped), sorted by
    ``image_id``."""
    path = location.path(IMAGES_TABLE, what="file")
    names = pq.ParquetDataset(path, filesystem=location.fs).schema.names
    wanted = None
    if image_ids is not None:
        wanted = pc.field("image_id").isin(
            pa.array(sorted({int(i) for i in image_ids}), pa.int64())
        )
    table = pq.read_table(path, columns=[c for c in columns if c in names], filesystem=location.fs,
                          filters=wanted)  # fmt: skip
    return table.sort_by("image_id")
