"""Writes through a data source's writer without a Spark job: the driver's and the tasks'
calls made by hand, in the order Spark makes them, so a test can put attempts, commits and
aborts in any order. Shared by the commit and generation tests; ``direct_writer`` drives
either implementation (the JVM one through py4j)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyspark.sql.types import ArrayType, FloatType, LongType, StringType, StructField, StructType

from pyspark_safetensors.spark.compat import from_arrow
from pyspark_safetensors.spark.source import SafetensorsDataSource

SCHEMA = StructType(
    [
        StructField("key", StringType()),
        StructField("id", LongType()),
        StructField("vec", ArrayType(FloatType())),
    ]
)


def batch(start, n):
    """Rows ``start .. start + n - 1``: key ``k{i}``, id ``i``, vec ``[i, i + 0.5]``."""
    ids = np.arange(start, start + n)
    vec = pa.array([[float(i), float(i) + 0.5] for i in ids], pa.list_(pa.float32()))
    keys = pa.array([f"k{i}" for i in ids])
    return pa.record_batch([keys, pa.array(ids), vec], names=["key", "id", "vec"])


def _options(path, options):
    mode = {"batch_size": "4"} if "name_col" not in options else {}
    return {"path": str(path), "columns": "id,vec", **mode, **options}


def writer(path, overwrite=False, **options):
    """The Python source's writer of ``id, vec`` (batches of 4 unless KV options are given)."""
    return SafetensorsDataSource(_options(path, options)).writer(SCHEMA, overwrite)


def files(root):
    """Every file under ``root``, relative, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@dataclass
class Attempt:
    """One task attempt that finished: its commit message and the shards it wrote."""

    message: object
    shards: list[str]


class PythonWriter:
    """The Python source's writer: Spark calls ``write`` once per task attempt."""

    def __init__(self, path, overwrite=False, **options):
        self._writer = writer(path, overwrite, **options)

    def write(self, batches) -> Attempt:
        message = self._writer.write(batches)
        return Attempt(message, [s.final_name for s in message.result.shards])

    def commit(self, attempts) -> None:
        self._writer.commit([a.message for a in attempts])

    def abort(self, attempts) -> None:
        self._writer.abort([a.message for a in attempts])


class JvmWriter:
    """The JVM source's writer, through py4j as Spark's write path calls it: the write
    builder (truncated for an overwrite) plans the job on construction; each ``write`` is
    one task attempt (``DataWriter``: rows, then commit, or abort when anything fails)."""

    def __init__(self, spark, path, overwrite=False, **options):
        self._spark = spark
        jvm = spark._jvm
        given = jvm.java.util.HashMap()
        for k, v in _options(path, options).items():
            given.put(k, str(v))
        info = jvm.org.apache.spark.sql.connector.write.LogicalWriteInfoImpl.apply(
            uuid.uuid4().hex,
            spark._jsparkSession.parseDataType(SCHEMA.json()),
            jvm.org.apache.spark.sql.util.CaseInsensitiveStringMap(given),
            jvm.java.util.Optional.empty(),
            jvm.java.util.Optional.empty(),
        )
        builder = jvm.io.github.pysparksafetensors.write.SafetensorsWriteBuilder(
            info, jvm.java.util.HashMap()
        )
        if overwrite:
            builder = builder.truncate()
        self._batch_write = builder.build().toBatch()
        self._factory = self._batch_write.createBatchWriterFactory(None)
        self._tasks = 0

    def _rows(self, batch):
        df = from_arrow(self._spark, pa.Table.from_batches([batch]))
        return df._jdf.queryExecution().executedPlan().executeCollect()

    def write(self, batches) -> Attempt:
        self._tasks += 1
        task = self._factory.createWriter(0, self._tasks)
        try:
            for b in batches:
                for row in self._rows(b):
                    task.write(row)
            message = task.commit()
        except BaseException:
            task.abort()
            raise
        finally:
            task.close()
        shards = message.shards()
        return Attempt(message, [shards.apply(i).name() for i in range(shards.size())])

    def _messages(self, attempts):
        jvm = self._spark._jvm
        array = self._spark.sparkContext._gateway.new_array(
            jvm.org.apache.spark.sql.connector.write.WriterCommitMessage, len(attempts)
        )
        for i, a in enumerate(attempts):
            array[i] = a.message
        return array

    def commit(self, attempts) -> None:
        self._batch_write.commit(self._messages(attempts))

    def abort(self, attempts) -> None:
        self._batch_write.abort(self._messages(attempts))
