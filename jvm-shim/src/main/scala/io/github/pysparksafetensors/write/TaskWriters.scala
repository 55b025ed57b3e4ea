package io.github.pysparksafetensors.write

import scala.collection.mutable

import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.connector.write.{DataWriter, WriterCommitMessage}

import io.github.pysparksafetensors.core

/** Index rows of one shard: tensor names in file order with dtype, shape and absolute
  * byte offsets [begin, end). */
final case class IndexRows(
    fileName: String, keys: Array[String], dtypes: Array[String], shapes: Array[Array[Int]],
    begins: Array[Long], ends: Array[Long])

/** A column's dtype and per-sample shape (-1: a KV dimension that varies by row). */
final case class ColumnSchema(dtype: String, sampleShape: Seq[Int])

/** One shard a task attempt wrote, not yet listed by any manifest; in KV mode with its
  * tensor keys, for the commit's uniqueness check. */
final case class StagedShard(
    taskId: Int, shardIndex: Int, name: String, samples: Long, bytes: Long,
    crc32c: Option[String], keys: Option[Array[String]])

/** The commit message of one task attempt: its shards, the columns' schema and, when the
  * job writes a tensor index, the index rows of its shards already encoded as parquet; in a
  * partitioned write, those of one partition `dir` (shard names under it). */
final case class TaskCommit(
    attemptId: Long, shards: Seq[StagedShard], schema: Seq[(String, ColumnSchema)], index: Option[Array[Byte]],
    dir: String = "")
  extends WriterCommitMessage

/** The commit message of one task attempt of a partitioned write: one per partition. */
final case class TaskCommits(parts: Seq[TaskCommit]) extends WriterCommitMessage

/** Writes the shards of one task attempt at the dataset root (or in its partition's
  * directory `dir`), under names of its own (`part-{task}-{shard}-{uuid}.safetensors`, the
  * uuid starting with the job's tag), and remembers what it wrote and the columns' schema. */
private[write] final class ShardSink(job: WriteJob, taskId: Int, attemptId: Long, dir: String = "") {
  private val fileUuid = Layout.attemptUuid(job.jobId)
  val started = mutable.ArrayBuffer.empty[String]
  val shards = mutable.ArrayBuffer.empty[StagedShard]
  private val indexRows = mutable.ArrayBuffer.empty[IndexRows]
  private var schema = Seq.empty[(String, ColumnSchema)]
  private val metadata: Map[String, String] = Map(
    "format" -> "pt", "format_version" -> Layout.FormatVersion,
    "writer" -> s"pyspark-safetensors ${Layout.Version}") ++ job.options.metadata

  def write(slots: Seq[TensorSlot], samples: Long, indexed: Boolean): Unit = {
    val layout = ShardFormat.layout(slots, metadata)
    val name = (if (dir.isEmpty) "" else dir + "/") + Layout.shardName(taskId, shards.size, fileUuid)
    started += name
    val crc = if (job.options.checksum == "crc32c") new java.util.zip.CRC32C() else null
    job.files.writeFile(name)(out => ShardFormat.write(layout, out, crc))
    val keys = layout.order.map(_.name)
    if (indexed) indexRows += IndexRows(name, keys, layout.order.map(_.dtype), layout.order.map(_.shape),
      layout.begins.map(_ + layout.dataStart),
      layout.order.indices.map(i => layout.dataStart + layout.begins(i) + layout.order(i).length).toArray)
    shards += StagedShard(taskId, shards.size, name, samples, layout.fileSize,
      Option(crc).map(c => f"${c.getValue}%08x"), if (job.options.mode == "kv") Some(keys) else None)
  }

  /** Record a column's dtype and sample shape with the commit's merge rule. */
  def noteSchema(column: String, dtype: String, sample: Array[Int]): Unit = {
    val col = ColumnSchema(dtype, sample.toSeq)
    if (!schema.exists(_ == (column -> col)))
      schema = Commit.mergeSchemas(Seq(schema, Seq(column -> col)), s"partition $taskId", job.options.mode == "kv")
  }

  /** The task's commit message, once the job's lease shows the job still running. */
  def result(): TaskCommit = {
    // Encoded here, in parallel with the other tasks, so the commit only joins row groups;
    // before the lease check, which stays the attempt's last look at the job.
    val index = if (job.options.generateIndex) Some(IndexFile.bytes(indexRows.toSeq)) else None
    if (!job.files.has(Layout.leaseName(job.jobId)))
      throw new IllegalStateException(
        "the write job ended (aborted or committed without this attempt) before this task " +
          "finished; its shards are deleted")
    TaskCommit(attemptId, shards.toSeq, schema, index, dir)
  }

  def discard(): Unit =
    try job.files.delete(started) catch { case _: java.io.IOException => () }
}

/** One partition of a write: rows in, shards out, one `TaskCommit` back; in a partitioned
  * write, one sink and row writer per partition directory its rows fall in (rows arrive in
  * any order: Spark does not sort them for a V2 write). */
private[write] final class SafetensorsDataWriter(job: WriteJob, taskId: Int, attemptId: Long)
    extends DataWriter[InternalRow] {
  private val writers = mutable.LinkedHashMap.empty[String, (ShardSink, RowWriter)]
  private var last: (String, (ShardSink, RowWriter)) = _
  private var finished = false

  private def writerFor(dir: String): (ShardSink, RowWriter) = {
    if (last != null && last._1 == dir) return last._2
    val w = writers.getOrElseUpdate(dir, {
      val sink = new ShardSink(job, taskId, attemptId, dir)
      (sink, if (job.options.mode == "kv") new KVModeWriter(job, sink) else new BatchModeWriter(job, sink))
    })
    last = (dir, w)
    w
  }

  override def write(row: InternalRow): Unit = {
    val p = job.partitioning
    writerFor(if (p.columns.isEmpty) "" else core.Partitions.dir(row, p.columns, p.ordinals, p.types))._2.add(row)
  }

  override def commit(): WriterCommitMessage = {
    if (writers.isEmpty) writerFor("")
    writers.values.foreach(_._2.finish())
    finished = true
    if (job.partitioning.columns.isEmpty) writers("")._1.result()
    else TaskCommits(writers.values.map(_._1.result()).toSeq)
  }

  override def abort(): Unit = {
    writers.values.foreach(_._1.discard())
    if (job.madeDirectory) try job.files.removeIfEmpty() catch { case _: java.io.IOException => () }
  }

  override def close(): Unit = if (!finished) abort()
}

private[write] trait RowWriter {
  def add(row: InternalRow): Unit
  def finish(): Unit

  protected def columnError(column: String, where: String, detail: String): Nothing =
    throw new SafetensorsWriteException(s"column '$column'$where: $detail")
}

/** Every `batch_size` rows of a partition become one shard, one tensor per column. */
private[write] final class BatchModeWriter(job: WriteJob, sink: ShardSink) extends RowWriter {
  private val o = job.options
  private val batch = o.batchSize.get
  private val plans = job.plans
  private var buffers = plans.map(_ => new Bytes(1 << 20))
  private var samples: Array[Array[Int]] = plans.map(_ => null: Array[Int]).toArray
  private var dtypes = plans.map(_ => "").toArray
  private var pending = 0
  private var rowsSeen = 0L

  def add(row: InternalRow): Unit = {
    var c = 0
    while (c < plans.length) {
      val p = plans(c)
      val (dtype, sample) =
        try TensorColumns.encode(row, p, buffers(c))
        catch { case e: BadCell => columnError(p.name, s" (row $rowsSeen of this partition)", e.detail) }
      if (samples(c) == null) {
        samples(c) = sample; dtypes(c) = dtype
        sink.noteSchema(p.name, dtype, sample)
      } else if (!java.util.Arrays.equals(samples(c), sample) || dtypes(c) != dtype)
        columnError(p.name, s" (row $rowsSeen of this partition)",
          s"ragged arrays: shape ${sample.mkString("[", ", ", "]")} where " +
            s"${samples(c).mkString("[", ", ", "]")} was expected; every row must have the same shape in batch mode")
      c += 1
    }
    rowsSeen += 1
    pending += 1
    if (pending == batch) emit(batch)
  }

  private def emit(rows: Int): Unit = {
    val slots = plans.indices.map { c =>
      TensorSlot(plans(c).name, dtypes(c), rows +: samples(c), buffers(c), 0, buffers(c).size)
    }
    sink.write(slots, rows, o.generateIndex)
    buffers.foreach(_.truncate(0))
    pending = 0
  }

  def finish(): Unit = if (pending > 0) o.tailStrategy match {
    case "write" => emit(pending)
    case "pad" =>
      plans.indices.foreach { c =>
        val rowBytes = buffers(c).size / pending
        buffers(c).zeros(rowBytes.toLong * (batch - pending))
      }
      emit(batch)
    case _ => // "drop": the incomplete last batch is discarded
  }
}

/** One tensor per row and non-key column, named `{key}{kv_separator}{column}`; shards
  * roll over at `target_shard_size_mb` (a row larger than that gets a shard of its own). */
private[write] final class KVModeWriter(job: WriteJob, sink: ShardSink) extends RowWriter {
  private val o = job.options
  private val plans = job.plans
  private val keyOrdinal = job.keyOrdinal
  private val limit = o.targetShardSizeMb.toLong * 1000000L
  private val buffers = plans.map(_ => new Bytes(1 << 20))
  /** Rows of the open shard: key, then per column (dtype, shape, start, length). */
  private val rows = mutable.ArrayBuffer.empty[(String, Array[TensorSlot])]
  private val position = mutable.HashMap.empty[String, Int]
  private val live = mutable.BitSet.empty
  private var currentBytes = 0L
  private var liveRows = 0L

  def add(row: InternalRow): Unit = {
    if (row.isNullAt(keyOrdinal))
      throw new SafetensorsWriteException(
        s"key column '${o.nameCol.get}' holds a null key; every row needs a key")
    val key = row.getUTF8String(keyOrdinal).toString
    val marks = buffers.map(_.size)
    val slots = plans.indices.map { c =>
      val p = plans(c)
      val start = buffers(c).size
      val (dtype, shape) =
        try TensorColumns.encode(row, p, buffers(c))
        catch { case e: BadCell => columnError(p.name, s" (key '$key')", e.detail) }
      TensorSlot(Layout.kvTensorName(key, p.name, o.kvSeparator), dtype, shape, buffers(c), start,
        buffers(c).size - start)
    }.toArray
    slots.indices.foreach(c => sink.noteSchema(plans(c).name, slots(c).dtype, slots(c).shape))
    val size = slots.map(_.length.toLong).sum
    position.get(key) match {
      case Some(old) =>
        if (o.duplicatesStrategy == "fail")
          throw new SafetensorsWriteException(
            s"duplicate key '$key' in column '${o.nameCol.get}' (duplicatesStrategy=fail; use lastWin to keep the last row)")
        live -= old
        currentBytes -= rows(old)._2.map(_.length.toLong).sum
        liveRows -= 1
      case None =>
        if (rows.nonEmpty && currentBytes + size > limit) {
          // The row goes to the next shard: move its bytes out of the sealed buffers.
          val moved = slots.indices.map(c => java.util.Arrays.copyOfRange(buffers(c).array, marks(c), buffers(c).size))
          buffers.indices.foreach(c => buffers(c).truncate(marks(c)))
          seal()
          slots.indices.foreach { c =>
            buffers(c).putBytes(moved(c), 0, moved(c).length)
            slots(c) = slots(c).copy(start = 0)
          }
        }
    }
    position(key) = rows.size
    live += rows.size
    rows += key -> slots
    currentBytes += size
    liveRows += 1
  }

  private def seal(): Unit = {
    val slots = live.toSeq.flatMap(i => rows(i)._2.toSeq)
    sink.write(slots, liveRows, indexed = job.options.generateIndex)
    rows.clear(); position.clear(); live.clear()
    buffers.foreach(_.truncate(0))
    currentBytes = 0; liveRows = 0
  }

  def finish(): Unit = if (rows.nonEmpty) seal()
}
