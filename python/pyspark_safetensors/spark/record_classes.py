"""The program ``class_archive.build`` runs to write the class archive: a local session,
configured as every later one is, runs the jobs of a typical run, and its JVM writes the
classes it loaded to the archive as it exits.

    python -m pyspark_safetensors.spark.record_classes PATH

A program of its own, not a function of ``class_archive``: it needs ``session.local_session``,
and the session needs ``class_archive`` (its driver maps the archive)."""

from __future__ import annotations

import os
import sys
import tempfile

from .class_archive import recording_options
from .register import register
from .session import local_session


def record(out: str) -> None:
    """Run the jobs of a typical session in a driver that writes its classes to ``out``
    when it exits; returns once the JVM has exited (the archive written)."""
    from pyspark import SparkContext

    spark = local_session("local[2]", **{"spark.driver.extraJavaOptions": recording_options(out)})
    with tempfile.TemporaryDirectory(prefix="class-archive-") as work:
        typical_jobs(spark, work)
    process = SparkContext._gateway.proc
    spark.stop()
    # The driver exits when its stdin closes, and writes the archive as it does.
    process.stdin.close()
    process.wait()
    if process.returncode != 0 or not os.path.isfile(out):
        raise RuntimeError(f"the JVM wrote no class archive (exit code {process.returncode})")


def typical_jobs(spark, work: str) -> None:
    """SQL with a shuffle, Arrow to and from Python workers, parquet, and this package's
    sources (the Python one, and the JVM one where the shim jar is loaded)."""
    spark.range(1000).selectExpr("id % 7 AS k", "id").groupBy("k").count().collect()

    def identity(batches):
        yield from batches

    frame = spark.range(64).selectExpr("id", "array(cast(id AS float), 1.0f) AS activation")
    frame.mapInArrow(identity, frame.schema).toArrow()
    frame.write.mode("overwrite").parquet(f"{work}/parquet")
    spark.read.parquet(f"{work}/parquet").count()
    answers = register(spark)
    implementations = {answers, "python"} if answers == "jvm" else {"python"}
    for implementation in sorted(implementations):
        target = f"{work}/{implementation}"
        (frame.write.format("safetensors").option("implementation", implementation)
         .option("batch_size", 16).mode("overwrite").save(target))  # fmt: skip
        spark.read.format("safetensors").option("implementation", implementation).load(
            target
        ).collect()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pyspark_safetensors.spark.record_classes PATH")
    record(sys.argv[1])
