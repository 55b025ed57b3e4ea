"""Images as an extraction corpus: files under a directory, object-store prefix or glob
(Spark's ``binaryFile`` source, recursive), a parquet table with an image-bytes column, or
a DataFrame (Spark's ``image`` source, a table of bytes, a ``binaryFile`` read); their
check, stable order and numbering.

Every image is read once by a check pass (``check_fn``: PIL reads the whole file; an
unreadable or truncated one gets its error) where it lies, before any shuffle; the checked
rows are kept, a duplicate key is refused, and the readable images get dense ids
(``image_id``: the rank by key, the key being the id column or else the path) before the
model stage, and the output's partitions are contiguous image_id ranges that an output may
ask to fall on multiples of a number. DataFrame API only: classic and Spark Connect sessions alike.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pyarrow as pa

from ..spark.compat import to_arrow
from .corpus import MONOTONIC_ID_PARTITION_SHIFT
from .model import ExtractionError

IMAGE_COLUMNS = ("label", "width", "height", "thumbnail")
"""What an image's sample row has beside ``SCALAR_COLUMNS`` (``source`` is its path)."""
CHECKED_SCHEMA = (
    "key string, path string, label string, content binary, width int, height int, error string"
)
"""The check pass's rows: an unreadable image keeps its error and loses its bytes."""
IMAGE_SOURCE_FIELDS = {"origin", "height", "width", "nChannels", "mode", "data"}
"""The struct of Spark's ``image`` source (raw pixels, BGR(A) channel order)."""
_GLOB = re.compile(r"[*?\[{]")


def load_images(spark, config, images=None):
    """The image corpus as a DataFrame ``key, path, label, content`` (and, from Spark's
    ``image`` source, ``raw_height, raw_width, raw_channels``: ``content`` then holds raw
    BGR pixels). ``images``: a DataFrame; when None, ``config.images`` names a parquet
    table or files."""
    from pyspark.sql import functions as F

    if images is not None:
        if not (hasattr(images, "columns") and hasattr(images, "select")):
            raise ExtractionError(f"images must be a Spark DataFrame, got {type(images).__name__}")
        return _from_frame(images, config, "dataframe")
    spec = config.images
    if _is_table(spec):
        return _from_frame(spark.read.parquet(spec), config, spec)
    if "://" not in spec and not _GLOB.search(spec) and not Path(spec).exists():
        raise ExtractionError(f"images {spec} does not exist")
    files = spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(spec)
    root = _root_uri(spec)
    rel = F.when(
        F.col("path").startswith(root + "/"), F.expr(f"substring(path, {len(root) + 2})")
    ).otherwise(F.col("path"))
    key = F.col(config.id_column) if config.id_column else rel
    # the ImageFolder layout: an image's folder below the root is its label
    folder = F.regexp_extract(rel, r"^([^/]+)/", 1)
    label = F.when(folder != "", folder)
    return files.select(
        key.cast("string").alias("key"), F.col("path"), label.alias("label"),
        F.col("content"),
    )  # fmt: skip


def _is_table(spec: str) -> bool:
    """A parquet table: a ``.parquet`` path, or a local directory of parquet parts."""
    if spec.rstrip("/").endswith(".parquet"):
        return True
    path = Path(spec)
    if "://" in spec or not path.is_dir():
        return False
    top = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(("_", "."))]
    return bool(top) and all(p.suffix == ".parquet" for p in top)


def _root_uri(spec: str) -> str:
    """The directory the files' keys are relative to, spelt as Spark spells the paths it
    lists (``file:/abs/dir`` for a local one): the path up to its first glob."""
    head = spec
    if _GLOB.search(spec):
        head = spec[: _GLOB.search(spec).start()].rpartition("/")[0]
    head = head.rstrip("/")
    if "://" in head:
        return head
    return "file:" + os.path.abspath(head)


def _from_frame(frame, config, where: str):
    """``load_images``' columns from a table or DataFrame of images."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType, StructType

    column = config.image_column
    if (
        column not in frame.columns
        and config.image_column == "image"
        and "content" in frame.columns
    ):
        column = "content"  # a binaryFile read
    if column not in frame.columns:
        raise ExtractionError(
            f"images {where} has no column {column!r}; it has {frame.columns} (set image_column)"
        )
    for name in (config.label_column, config.id_column):
        if name and name not in frame.columns:
            raise ExtractionError(f"images {where} has no column {name!r}; it has {frame.columns}")
    kind = frame.schema[column].dataType
    label = F.col(config.label_column).cast("string") if config.label_column else F.lit(None)
    if isinstance(kind, StructType) and set(kind.fieldNames()) >= IMAGE_SOURCE_FIELDS:
        path = F.col(f"{column}.origin")
        raw = [F.col(f"{column}.height").alias("raw_height"),
               F.col(f"{column}.width").alias("raw_width"),
               F.col(f"{column}.nChannels").alias("raw_channels")]  # fmt: skip
        content = F.col(f"{column}.data")
    elif isinstance(kind, BinaryType):
        path = F.col("path").cast("string") if "path" in frame.columns else None
        raw, content = [], F.col(column)
    else:
        raise ExtractionError(
            f"images {where}: column {column!r} is {kind.simpleString()}, neither image bytes "
            "(binary) nor the struct of Spark's image source"
        )
    if config.id_column:
        key = F.col(config.id_column).cast("string")
    elif path is not None:
        key = path
    else:
        raise ExtractionError(
            f"images {where} has no path column: give id_column, which orders and names the images"
        )
    path = key if path is None else path
    return frame.select(
        key.alias("key"), path.alias("path"), label.cast("string").alias("label"),
        content.alias("content"), *raw,
    )  # fmt: skip


def check_fn():
    """The check pass (``mapInArrow``, ``CHECKED_SCHEMA``): each image read whole by PIL
    for its size; an unreadable one's error kept (its bytes dropped). Raw pixels from
    Spark's image source become PNG bytes here, so the model stage decodes one kind."""

    def check(batches):
        import pyarrow.compute as pc

        from .vision import check_image

        for batch in batches:
            keys = batch.column("key").to_pylist()
            contents = batch.column("content")  # read one image at a time, not all copied
            raw = "raw_channels" in batch.schema.names
            shapes = (
                zip(*(batch.column(f"raw_{n}").to_pylist() for n in ("height", "width", "channels")),
                    strict=True)
                if raw else None
            )  # fmt: skip
            sizes, errors, pngs = [], [], []
            for i, key in enumerate(keys):
                width = height = error = png = None
                shape = next(shapes) if raw else None
                try:
                    if key is None:
                        raise ValueError("no key (a null id or path)")
                    content = contents[i].as_py()
                    if content is None:
                        raise ValueError("no image bytes (null)")
                    if raw:
                        content = png = _png_of_raw(content, *shape)
                    width, height = check_image(content)
                except Exception as e:  # every decoder error: reported by path, never raised here
                    error = _error_text(e)
                sizes.append((width, height))
                errors.append(error)
                pngs.append(png if error is None else None)
            ok = pa.array([e is None for e in errors])
            content = (
                pa.array(pngs, pa.binary()) if raw
                else pc.if_else(ok, contents.cast(pa.binary()), pa.scalar(None, pa.binary()))
            )  # fmt: skip
            # (cast: a session may hand Arrow's large string and binary types)
            text = [batch.column(n).cast(pa.string()) for n in ("key", "path", "label")]
            yield pa.RecordBatch.from_arrays(
                [
                    *text, content,
                    pa.array([w for w, _ in sizes], pa.int32()),
                    pa.array([h for _, h in sizes], pa.int32()),
                    pa.array(errors, pa.string()),
                ],
                schema=_CHECKED_ARROW,
            )  # fmt: skip

    return check


def _error_text(e: Exception) -> str:
    """An image's error as one line (PIL's "cannot identify" names an object address)."""
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):
        return "UnidentifiedImageError: not an image format PIL reads"
    return f"{type(e).__name__}: {e}"


_CHECKED_ARROW = pa.schema([
    ("key", pa.string()), ("path", pa.string()), ("label", pa.string()),
    ("content", pa.binary()), ("width", pa.int32()), ("height", pa.int32()),
    ("error", pa.string()),
])  # fmt: skip


def _png_of_raw(data: bytes, height: int, width: int, channels: int) -> bytes:
    """PNG bytes of an image from Spark's ``image`` source (OpenCV's BGR(A) order)."""
    import numpy as np

    from .vision import png_of_pixels

    pixels = np.frombuffer(data, np.uint8).reshape(height, width, channels)
    # grey to RGB; BGR(A) to RGB
    pixels = np.repeat(pixels, 3, axis=2) if channels == 1 else pixels[:, :, [2, 1, 0]]
    return png_of_pixels(np.ascontiguousarray(pixels))


def number_images(images, config, partitions: int):
    """``images`` (``load_images``' columns) checked and numbered: returns ``(numbered,
    stored, bad, count)``. ``numbered``: ``image_id, key, path, label, content, width, height``
    of the readable images, ``image_id`` their rank by key, in ``partitions`` contiguous
    ranges each in order; ``stored``: the readable rows in that order, persisted once (the
    caller unpersists them); ``bad``: the unreadable images' ``key, path, error`` (Arrow);
    ``count``: the readable images.
    A duplicate key is an error; ``config.max_texts`` keeps the first images by key."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    if config.max_texts:
        images = images.orderBy("key").limit(config.max_texts)
    # checked where the images lie (a file source's ~32 small files per task merged into a
    # task per core) and kept; the readable ones then sorted by key and kept in turn: the
    # range shuffle's sampling reads the kept rows, not every file again (10,000 PNGs:
    # 4.4 -> 1.9 s), and ids are counted on the rows the model stage reads (a range
    # partitioning sampled twice may cut elsewhere)
    checked = (
        images.coalesce(partitions)
        .mapInArrow(check_fn(), CHECKED_SCHEMA)
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    good = None
    try:
        bad = to_arrow(checked.where(F.col("error").isNotNull()).select("key", "path", "error"))
        repeated = to_arrow(
            checked.where(F.col("key").isNotNull()).groupBy("key").count()
            .where(F.col("count") > 1).select("key").orderBy("key")
        )  # fmt: skip
        if repeated.num_rows:
            raise ExtractionError(
                f"{repeated.num_rows} image key(s) appear more than once, e.g. "
                f"{repeated.column('key')[0].as_py()!r}: keys (the id column, else the paths) "
                "must be unique"
            )
        good = (
            checked.where(F.col("error").isNull()).drop("error")
            .repartitionByRange(partitions, "key").sortWithinPartitions("key")
            .persist(StorageLevel.MEMORY_AND_DISK)
        )  # fmt: skip
        # ids as number_texts gives them: rank within the range, plus the ranges before
        rows = good.withColumn("_row", F.monotonically_increasing_id())
        part = F.shiftright(F.col("_row"), MONOTONIC_ID_PARTITION_SHIFT)
        counts = dict(tuple(r) for r in rows.groupBy(part.alias("p")).count().collect())
        shift, offset = [], 0
        for p, n in sorted(counts.items()):
            shift += [F.lit(p), F.lit(offset - (p << MONOTONIC_ID_PARTITION_SHIFT))]
            offset += n
        # no readable image: no ids (the job says so after reporting the unreadable ones)
        offsets = F.element_at(F.create_map(*shift), part) if shift else F.lit(None)
        image_id = (F.col("_row") + offsets).cast("long")
        numbered = rows.withColumn("image_id", image_id).select(
            "image_id", "key", "path", "label", "content", "width", "height"
        )
        return numbered, good, bad, offset
    except BaseException:
        if good is not None:
            good.unpersist()
        raise
    finally:
        checked.unpersist()


def aligned_partitions(numbered, multiple: int, partitions: int, n_images: int):
    """``numbered`` in contiguous image_id ranges whose boundaries fall on multiples of
    ``multiple`` (an output's shards of ``multiple`` images each: a range partitioning
    by ``image_id // multiple``, so no block of ``multiple`` is split), each in order."""
    from pyspark.sql import functions as F

    if multiple <= 1:
        return numbered
    blocks = math.ceil(n_images / multiple)
    block = F.floor(F.col("image_id") / F.lit(multiple))
    return numbered.repartitionByRange(min(partitions, blocks), block).sortWithinPartitions(
        "image_id"
    )
