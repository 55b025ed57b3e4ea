"""The texts an extraction reads: the bundled demo corpus (Python's documentation topics
in passages), a directory of text files, a parquet/JSON table, or any Spark DataFrame
with a text column; and their numbering by key.

Only the DataFrame API is used (no RDD, no ``sparkContext``), so every function here
works on a classic Spark session and on a Spark Connect one alike.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa

from ..spark.compat import from_arrow
from .model import ExtractionError

DEMO_PASSAGE_CHARS = 400
MONOTONIC_ID_PARTITION_SHIFT = 33
"""``monotonically_increasing_id()`` is ``partition << 33 | row within the partition``."""


def demo_passages(max_chars: int = DEMO_PASSAGE_CHARS) -> list[tuple[str, str]]:
    """(topic, passage) pairs from Python's own documentation topics
    (``pydoc_data.topics``, about 465k characters, shipped with Python)."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        text = topics[topic]
        for i in range(0, len(text), max_chars):
            chunk = text[i : i + max_chars].strip()
            if chunk:
                out.append((f"{topic}#{i // max_chars}", chunk))
    return out


def text_key(text: str) -> str:
    """A text's key: the sha256 of its UTF-8 bytes (what Spark's ``sha2(text, 256)`` gives)."""
    return hashlib.sha256(text.encode()).hexdigest()


def demo_by_key(max_chars: int = DEMO_PASSAGE_CHARS) -> list[tuple[str, str, str]]:
    """The distinct demo passages as (key, text, source), in the order the extraction
    takes them (by key); a passage found under two topics keeps the first."""
    by_key: dict[str, tuple[str, str]] = {}
    for source, text in demo_passages(max_chars):  # stripped, none blank
        by_key.setdefault(text_key(text), (text, source))
    return [(key, *by_key[key]) for key in sorted(by_key)]


def passages_by_key(skip: int, count: int, max_chars: int = DEMO_PASSAGE_CHARS) -> list[str]:
    """``count`` distinct demo passages after the first ``skip``, in the order the
    extraction takes them (by key): ``skip = texts`` gives held-out ones."""
    return [text for _, text, _ in demo_by_key(max_chars)[skip : skip + count]]


def load_corpus(spark, config, corpus=None):
    """The corpus as a DataFrame ``(key, text, source)``: key = sha256 of the text,
    duplicates and blank texts dropped.

    ``corpus``: a DataFrame holding ``config.text_column`` (and optionally a ``source``
    column, kept as each text's source); when None, ``config.corpus`` names it: "demo", a
    directory of text files (one text per file) or a parquet/JSON table path."""
    from pyspark.sql import functions as F

    if corpus is not None:
        if not (hasattr(corpus, "columns") and hasattr(corpus, "select")):
            raise ExtractionError(
                f"corpus must be a Spark DataFrame with a {config.text_column!r} column, "
                f"got {type(corpus).__name__}"
            )
        if config.text_column not in corpus.columns:
            raise ExtractionError(
                f"corpus DataFrame has no column {config.text_column!r}; it has "
                f"{corpus.columns} (set text_column)"
            )
        source = (
            F.col("source").cast("string")
            if "source" in corpus.columns and config.text_column != "source"
            else F.lit("dataframe")
        )
        df = corpus.select(
            F.col(config.text_column).cast("string").alias("text"), source.alias("source")
        )
    elif config.corpus == "demo":
        rows = list(demo_passages(config.passage_chars))
        df = _arrow_frame(spark, rows, pa.schema([("source", pa.string()), ("text", pa.string())]))
    else:
        df = _corpus_at(spark, Path(config.corpus), config.text_column)
    blank = F.length(F.regexp_replace("text", r"\s+", "")) == 0  # trim() keeps newlines
    df = df.where(F.col("text").isNotNull() & ~blank)
    df = df.withColumn("key", F.sha2("text", 256)).dropDuplicates(["key"])
    return df.select("key", "text", "source")


def _corpus_at(spark, path: Path, text_column: str):
    from pyspark.sql import functions as F

    if not path.exists():
        raise ExtractionError(f"corpus {path} does not exist")
    if path.is_dir() and not any(path.glob("*.parquet")) and not any(path.glob("*.json*")):
        # a directory of text files: one text per file; invalid UTF-8 is an error
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise ExtractionError(f"corpus directory {path} holds no files")
        for f in files:
            try:
                f.read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise ExtractionError(f"corpus file {f} is not valid UTF-8 ({e})") from e
        return spark.read.text([str(f) for f in files], wholetext=True).select(
            F.col("value").alias("text"), F.col("_metadata.file_path").alias("source")
        )
    json_like = ".json" in path.name or any(path.glob("*.json*"))
    table = (spark.read.json if json_like else spark.read.parquet)(str(path))
    if text_column not in table.columns:
        raise ExtractionError(
            f"corpus {path} has no column {text_column!r}; it has {table.columns}"
        )
    return table.select(
        F.col(text_column).cast("string").alias("text"), F.lit(str(path)).alias("source")
    )


def number_texts(texts, partitions: int):
    """``texts`` (``key, text, source``) in ``partitions`` key ranges, each sorted by key,
    with ``sample_id`` = the text's rank by key (0-based), so ids do not depend on
    partitioning. Returns ``(numbered, stored)``: the ids are counted from rows stored
    once (``stored``, persisted; the caller unpersists it), and the extraction reads them
    twice.

    Done like RDD ``zipWithIndex`` but with DataFrame operations only: row ids increasing
    within each sorted range partition, per-partition counts, then offsets."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    ranged = (
        texts.repartitionByRange(partitions, "key")
        .sortWithinPartitions("key")
        .withColumn("_row", F.monotonically_increasing_id())
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    part = F.shiftright(F.col("_row"), MONOTONIC_ID_PARTITION_SHIFT)
    counts = dict(tuple(r) for r in ranged.groupBy(part.alias("p")).count().collect())
    shift, offset = [], 0
    for p, n in sorted(counts.items()):
        shift += [F.lit(p), F.lit(offset - (p << MONOTONIC_ID_PARTITION_SHIFT))]
        offset += n
    if not shift:  # an empty corpus
        return ranged.withColumn("sample_id", F.col("_row")).drop("_row"), ranged
    sample_id = F.col("_row") + F.element_at(F.create_map(*shift), part)
    return ranged.withColumn("sample_id", sample_id.cast("long")).drop("_row"), ranged


def numbered_demo(spark, config, partitions: int):
    """The demo corpus as ``number_texts`` gives it, numbered on the driver, which holds
    it anyway (no numbering jobs: a session's first jobs take seconds): ``key, text, source,
    sample_id`` in ``partitions`` key ranges, each in key order; ``config.max_texts``
    keeps the first by key. Returns the DataFrame."""
    from pyspark.sql import functions as F

    texts = demo_by_key(config.passage_chars)[: config.max_texts or None]
    rows = [(i, key, text, source) for i, (key, text, source) in enumerate(texts)]
    schema = pa.schema(
        [("sample_id", pa.int64())] + [(c, pa.string()) for c in ("key", "text", "source")]
    )
    # the ids' contiguous ranges, one per partition, joined to the texts broadcast (the
    # join keeps each range's order)
    ids = spark.range(0, len(texts), 1, partitions).withColumnRenamed("id", "sample_id")
    numbered = ids.join(F.broadcast(_arrow_frame(spark, rows, schema)), "sample_id")
    return numbered.select("key", "text", "source", "sample_id")


def _arrow_frame(spark, rows: list[tuple], schema: pa.Schema):
    """A DataFrame of the tuples ``rows``, handed to Spark as Arrow. Not as Python rows:
    Spark re-serializes those, whenever the DataFrame is read, in Python workers of their
    own (a daemon and a worker per core, beside the model's)."""
    columns = [pa.array([row[i] for row in rows], field.type) for i, field in enumerate(schema)]
    return from_arrow(spark, pa.Table.from_arrays(columns, schema=schema))


def corpus_sha256(keys) -> str:
    """sha256 of a corpus's sorted text keys: identifies the texts an extraction read when
    they came as a DataFrame (no path to name them)."""
    h = hashlib.sha256()
    for key in sorted(keys):
        h.update(key.encode())
    return h.hexdigest()
