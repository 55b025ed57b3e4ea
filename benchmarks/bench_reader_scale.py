"""The Python source's reads as the data grows: 200,000, 1,000,000 and 4,000,000 rows of
256 float32 (205 MB to 4.1 GB), each read into Spark's ``noop`` sink and counted, beside
the floor of Spark's Python data source API and Spark's parquet reader, all in one
session (local[2]), cases of one size taken in turn, median of ``REPEAT``.

The floor is ``bench_reader``'s: a Python source that yields the Python source's own
first Arrow batch of the read again and again, as many rows as the read, one partition
per core. Every size's data is random float32 written once by Spark as parquet and read
back from it by the Python source's writer into a batch dataset of 10,000-row shards.
Run by name (``python -m benchmarks reader_scale``): the largest size writes 8 GB and
takes minutes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.bench_reader import FLOOR, SHARD_ROWS, _first_batch, _floor_source
from benchmarks.bench_writer import DIM, PYTHON_SOURCE, _python_source
from benchmarks.common import interleaved_medians, table

SIZES = (200_000, 1_000_000, 4_000_000)
REPEAT = 3
CHUNK_ROWS = 100_000
"""Rows generated per numpy draw when the input parquet is made."""


def _write_datasets(spark, rows: int, out: Path) -> None:
    """``out/pq`` (Spark's parquet) and ``out/st`` (a batch dataset) of the same ``rows``
    random rows, generated in chunks with numpy and handed to Spark as parquet."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    raw = out / "raw"
    raw.mkdir(parents=True)
    for i, a in enumerate(range(0, rows, CHUNK_ROWS)):
        n = min(CHUNK_ROWS, rows - a)
        values = pa.array(rng.random(n * DIM, dtype=np.float32))
        lists = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * DIM), values)
        pq.write_table(pa.table({"activation": lists}), raw / f"part-{i:05d}.parquet")
    spark.read.parquet(str(raw)).write.mode("overwrite").parquet(str(out / "pq"))
    shutil.rmtree(raw)
    spark.read.parquet(str(out / "pq")).write.format(PYTHON_SOURCE).option(
        "batch_size", SHARD_ROWS
    ).mode("overwrite").save(str(out / "st"))


def _cases(spark, out: Path) -> dict:
    def noop(frame):
        return lambda: frame().write.format("noop").mode("overwrite").save()

    st = str(out / "st")
    parquet = lambda: spark.read.parquet(str(out / "pq"))  # noqa: E731
    ours = lambda **o: spark.read.format(PYTHON_SOURCE).options(**o).load(st)  # noqa: E731
    batch, schema, rows = _first_batch(st, out)
    floor = {
        "path": str(batch),
        "schema": schema,
        "rows": str(rows),
        "partitions": str(spark.sparkContext.defaultParallelism),
    }
    floor_read = lambda: spark.read.format(FLOOR).options(**floor).load()  # noqa: E731
    return {
        "rows → noop | parquet": noop(parquet),
        "rows → noop | floor": noop(floor_read),
        "rows → noop | python": noop(ours),
        "count() | parquet": lambda: parquet().count(),
        "count() | floor": lambda: floor_read().count(),
        "count() | python": lambda: ours().count(),
        "count() | python, view=index": lambda: ours(view="index").count(),
    }


def _rows(rows: int, seconds: dict[str, float]) -> list[list[str]]:
    mb = rows * DIM * 4 / 1e6
    out = []
    for name, s in seconds.items():
        op, reader = name.split(" | ")
        floor, base = seconds[f"{op} | floor"], seconds[f"{op} | parquet"]
        out.append(
            [
                f"{rows:,}",
                op,
                reader,
                f"{s:.2f}",
                f"{mb / s:.0f}",
                f"{floor / s:.2f}x" if reader not in ("floor", "parquet") else "",
                f"{base / s:.2f}x",
            ]
        )
    return out


def run(sizes=SIZES, repeat: int = REPEAT) -> str:
    from pyspark_safetensors.spark.session import local_session

    spark = local_session("local[2]", **{"spark.ui.showConsoleProgress": "false"})
    spark.dataSource.register(_python_source())
    spark.dataSource.register(_floor_source())
    lines = []
    try:
        for rows in sizes:
            out = Path(tempfile.mkdtemp(prefix="bench-reader-scale-"))
            try:
                _write_datasets(spark, rows, out)
                seconds = interleaved_medians(_cases(spark, out), repeat=repeat, settle=os.sync)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            lines += _rows(rows, seconds)
    finally:
        spark.stop()
    return (
        "## Spark reader at scale: 200,000 to 4,000,000 × 256 float32 rows\n\n"
        f"One session, local[2], warm page cache; the cases of one size in turn, median of "
        f"{repeat}; MB/s of the float32 activations. Batch datasets of {SHARD_ROWS:,}-row "
        "shards. *floor*: a Python data source yielding a ready-made Arrow batch of the "
        "same schema, one partition per core (`vs floor`: the floor's seconds over the "
        "reader's). `count()` of a Python source reads every column (Spark gives Python "
        "sources no column pruning); `view=index` gives the same rows without the tensors, "
        "from the manifest.\n\n"
        + table(["rows", "operation", "reader", "seconds", "MB/s", "vs floor", "vs parquet"], lines)
    )


if __name__ == "__main__":
    print(run())
