package io.github.pysparksafetensors.write

import java.util.UUID

/** Names inside a dataset directory, as the Python `dataset/layout.py` gives them. */
object Layout {
  /** The project's version: shards name their writer `pyspark-safetensors {Version}`. */
  val Version = "0.1.0"
  val FormatVersion = "1.0"
  val SafetensorsVersion = "1.0"
  val Manifest = "dataset_manifest.json"
  /** The spec's index: a directory of parquet parts, as Spark writes one (a root path
    * whose name starts with `_` is read by `spark.read.parquet` only as a directory). */
  val Index = "_tensor_index.parquet"
  val IndexPart = s"$Index/part-00000.parquet"
  val Success = "_SUCCESS"
  val Staging = "_temporary"
  val JobLeaseSuffix = ".job"
  val Lock = "_commit.lock"
  val ShardName = """^part-(\d{5,})-(\d{4,})-([0-9a-f-]{36})\.safetensors$""".r
  val IndexName = """^_tensor_index(-[0-9a-f]{32})?\.parquet$""".r

  def shardName(taskId: Int, shardIndex: Int, fileUuid: String): String =
    f"part-$taskId%05d-$shardIndex%04d-$fileUuid.safetensors"

  /** A file uuid for one task attempt of job `jobId` (32 hex digits): the first 16 are
    * the job's, so a commit knows which job left a shard; the rest are new per attempt. */
  def attemptUuid(jobId: String): String = {
    val tail = UUID.randomUUID().toString.replace("-", "")
    s"${jobId.substring(0, 8)}-${jobId.substring(8, 12)}-${jobId.substring(12, 16)}-${tail.substring(0, 4)}-${tail.substring(4, 16)}"
  }

  /** The 16-digit job tag of a shard name written by `attemptUuid`, if it is one. */
  def jobOf(name: String): Option[String] = name match {
    case ShardName(_, _, u) => Some(u.replace("-", "").substring(0, 16))
    case _ => None
  }

  def jobTag(jobId: String): String = jobId.substring(0, 16)
  def leaseName(jobId: String): String = s"$Staging/$jobId$JobLeaseSuffix"
  def indexName(commitId: String): String = s"_tensor_index-$commitId.parquet"
  def kvTensorName(key: String, column: String, separator: String): String = key + separator + column

  /** Refuse KV columns whose `{separator}{column}` ends another's: their tensor names
    * could not be told apart. */
  def checkKvColumns(columns: Seq[String], separator: String): Unit =
    for (a <- columns; b <- columns if a != b && (separator + a).endsWith(separator + b))
      throw new SafetensorsWriteException(
        s"KV columns '$b' and '$a' cannot be told apart in tensor names '<key>$separator<column>' " +
          s"(a key ending in '${a.substring(0, a.length - b.length)}'... is ambiguous); rename one " +
          "of them or choose another kv_separator")
}
