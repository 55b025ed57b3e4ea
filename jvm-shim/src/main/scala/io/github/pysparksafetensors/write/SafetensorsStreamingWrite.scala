package io.github.pysparksafetensors.write

import java.util
import java.util.{Locale, UUID}

import scala.jdk.CollectionConverters._

import org.apache.spark.sql.SparkSession
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.connector.write.{DataWriter, LogicalWriteInfo, PhysicalWriteInfo, WriterCommitMessage}
import org.apache.spark.sql.connector.write.streaming.{StreamingDataWriterFactory, StreamingWrite}

/** The streaming sink: `df.writeStream.format("safetensors")` in append mode. Each
  * micro-batch (epoch) is one append of the dataset, committed as a batch write's
  * (`Commit`, or `PartitionedCommit` for partition columns) with the writer's options,
  * and recorded in the manifest's `stream_commits` under the query's id, which Spark keeps
  * in the checkpoint: a batch a restart replays (its commit landed, Spark's commit log
  * did not) finds itself recorded, commits nothing and deletes its shards, so every row
  * lands exactly once. `abort` deletes the batch's files.
  *
  * Each micro-batch is a job of its own (lease, shard names), begun when Spark asks for
  * its writer factory, before its tasks run; batches run one after another. The
  * continuous trigger is refused.
  *
  * @param plan the write as planned at the query's start (its `jobId` unused).
  * @param streamId the option `stream_id`, else the streaming query's id, stable across
  *   restarts from its checkpoint.
  * @param checkpoint the query's checkpoint location (`checkpointKey`), recorded with the
  *   stream's batches: a given `stream_id` is refused under another checkpoint.
  */
final class SafetensorsStreamingWrite private (plan: WriteJob, streamId: String, checkpoint: Option[String])
    extends StreamingWrite {
  // the job of the batch whose tasks run now: set on the driver, read by commit and abort
  @volatile private var current: Option[WriteJob] = None

  override def createStreamingWriterFactory(info: PhysicalWriteInfo): StreamingDataWriterFactory = synchronized {
    // A continuous query asks once and then commits epochs whose tasks overlap: a commit's
    // reclaim would take the next epoch's shards for a dead attempt's.
    if (SparkSession.active.sparkContext.getLocalProperty(SafetensorsStreamingWrite.Continuous) == "true")
      throw new SafetensorsWriteException(
        "a safetensors dataset takes a stream one micro-batch at a time: the continuous trigger is not " +
          "supported; use a micro-batch trigger (processingTime, availableNow)")
    current.foreach(SafetensorsBatchWrite.abortJob) // a batch run again: the earlier run's files go
    val job = plan.copy(jobId = UUID.randomUUID().toString.replace("-", ""))
    Commit.beginJob(job.files, job.jobId)
    current = Some(job)
    new SafetensorsStreamingWriterFactory(job)
  }

  override def commit(epochId: Long, messages: Array[WriterCommitMessage]): Unit = synchronized {
    val job = current.getOrElse(throw new IllegalStateException(s"batch $epochId committed with no writer factory"))
    current = None
    val written = messages.exists {
      case t: TaskCommit => t.shards.nonEmpty
      case t: TaskCommits => t.parts.exists(_.shards.nonEmpty)
      case _ => false
    }
    // A batch without rows publishes nothing: readers see no new commit, and a replay of it
    // has nothing to write twice.
    if (!written) { SafetensorsBatchWrite.abortJob(job); return }
    try SafetensorsBatchWrite.commitJob(job, messages, Replace.Nothing, Some(StreamBatch(streamId, epochId, checkpoint)))
    catch { case e: Throwable => SafetensorsBatchWrite.abortJob(job); throw e }
  }

  override def abort(epochId: Long, messages: Array[WriterCommitMessage]): Unit = synchronized {
    current.foreach(SafetensorsBatchWrite.abortJob)
    current = None
  }
}

object SafetensorsStreamingWrite {
  /** The options of `writeStream` that are the query's, not the sink's. */
  val QueryOptions: Set[String] = Set("checkpointlocation", "queryname", "asyncprogresstrackingenabled",
    "asyncprogresstrackingcheckpointintervalms")

  /** The local property Spark sets on a continuous query's thread (`StreamExecution`'s
    * `IS_CONTINUOUS_PROCESSING`, the same on every line, its object's package not). */
  val Continuous = "__is_continuous_processing"

  /** The streaming option naming the partition columns, comma-separated: Spark hands a
    * DataSource V2 streaming sink no `partitionBy`. */
  val PartitionColumnsOption = "partition_columns"

  /** The option naming the stream instead of the query's id (the Python sink's too). */
  val StreamIdOption = "stream_id"

  /** A checkpoint location as the manifest records it (the Python sink's `checkpoint_key`):
    * a path without a scheme made absolute, `file:` for a local one, no trailing slash. */
  def checkpointKey(location: String): String = {
    val scheme = "^([A-Za-z][A-Za-z0-9+.-]*):".r.findFirstMatchIn(location).map(_.group(1).toLowerCase(Locale.ROOT))
    scheme match {
      case Some(s) if s.length > 1 && s != "file" => location.replaceAll("/+$", "")
      case Some("file") =>
        "file:" + java.nio.file.Paths.get("/" + location.substring(5).replaceAll("^/+", "")).normalize().toString
      case _ => "file:" + java.nio.file.Paths.get(location).toAbsolutePath.normalize().toString
    }
  }

  def apply(info: LogicalWriteInfo, tableOptions: util.Map[String, String],
      partitionColumns: Seq[String]): SafetensorsStreamingWrite = {
    val given = new util.HashMap[String, String]()
    var named = Seq.empty[String]
    var streamId: Option[String] = None
    var checkpoint: Option[String] = None
    info.options().asCaseSensitiveMap().asScala.foreach { case (k, v) =>
      val key = k.toLowerCase(Locale.ROOT)
      if (key == PartitionColumnsOption) named = v.split(",").map(_.trim).filter(_.nonEmpty).toSeq
      else if (key == StreamIdOption) {
        if (v.trim.isEmpty) throw new SafetensorsWriteException(s"option $StreamIdOption is empty")
        streamId = Some(v)
      } else if (key == "checkpointlocation") checkpoint = Some(checkpointKey(v))
      else if (!QueryOptions(key)) given.put(k, v)
    }
    if (named.nonEmpty && partitionColumns.nonEmpty && named != partitionColumns)
      throw new SafetensorsWriteException(
        s"option $PartitionColumnsOption (${named.mkString(", ")}) differs from the table's partition columns " +
          s"(${partitionColumns.mkString(", ")}); give one of them")
    val stated = SafetensorsBatchWrite.withTableOptions(given, tableOptions, WriterOptions.takes)
    val plan = SafetensorsBatchWrite.plan(info.schema(), stated,
      if (named.nonEmpty) named else partitionColumns, Replace.Nothing)
    // the query's own id is new with each checkpoint: only a given stream id can meet
    // another checkpoint's batches
    streamId.foreach { id =>
      val previous = Commit.previousManifest(plan.files, overwrite = false, s"'${plan.files.uri}/${Layout.Manifest}'")
      Commit.refuseOtherCheckpoint(previous, id, checkpoint, s"dataset '${plan.files.uri}'")
    }
    new SafetensorsStreamingWrite(plan, streamId.getOrElse(info.queryId()), checkpoint)
  }
}

final class SafetensorsStreamingWriterFactory(job: WriteJob) extends StreamingDataWriterFactory {
  override def createWriter(partitionId: Int, taskId: Long, epochId: Long): DataWriter[InternalRow] =
    new SafetensorsDataWriter(job, partitionId, taskId)
}

/** A streaming micro-batch a commit publishes: batch `batch` of stream `id`, written from
  * the query's `checkpoint` when the sink was told it (the Python `StreamBatch`). */
final case class StreamBatch(id: String, batch: Long, checkpoint: Option[String] = None)
