package io.github.pysparksafetensors.write

import java.util
import java.util.UUID

import scala.jdk.CollectionConverters._

import org.apache.spark.sql.SparkSession
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.connector.write._
import org.apache.spark.sql.connector.write.streaming.StreamingWrite
import org.apache.spark.sql.sources.{AlwaysTrue, Filter}
import org.apache.spark.sql.types.{DataType, StringType, StructType}

import io.github.pysparksafetensors.CatalogOptions
import io.github.pysparksafetensors.core.Partitions

/** What the tasks of one write job need: options, column plans, the dataset's files, the
  * job id (its lease and the tag in every shard name) and whether the job made the
  * dataset's directory (a failed first write then removes it). */
final case class WriteJob(
    options: WriterOptions,
    plans: Array[ColumnPlan],
    keyOrdinal: Int,
    files: DatasetFiles,
    jobId: String,
    madeDirectory: Boolean,
    partitioning: PartitionLayout = PartitionLayout.Unpartitioned)

/** The partition columns of a write (`partitionBy`), their ordinals and types in its rows. */
final case class PartitionLayout(columns: Seq[String], ordinals: Array[Int], types: Array[DataType])

object PartitionLayout {
  val Unpartitioned: PartitionLayout = PartitionLayout(Nil, Array.empty, Array.empty)
}

/** Which partitions of a partitioned dataset a write replaces. */
sealed trait Replace
object Replace {
  /** An append: none. */
  case object Nothing extends Replace
  /** An overwrite (`truncate`): all of them, the dataset. */
  case object All extends Replace
  /** A dynamic overwrite (`partitionOverwriteMode=dynamic`): those the write has rows for. */
  case object Written extends Replace
  /** `INSERT OVERWRITE … PARTITION (col = v)`: those whose values pass every filter. */
  final case class Matching(filters: Seq[Filter]) extends Replace
}

/** The writer side of the JVM `safetensors` source: `df.write.format("safetensors")`
  * with `mode("append")`, `mode("overwrite")` (a truncate: the whole dataset is replaced
  * at the commit point) or `mode("errorifexists")`/`mode("ignore")` (which Spark resolves
  * before the write). The twin of the Python writer: the same options (`WriterOptions`),
  * shards byte for byte, manifest, index and commit protocol.
  *
  * @param info Spark's description of the write: options (with `path`), schema, query id.
  * @param tableOptions the options the table was made with, for those the write lacks:
  *   Spark 3.5 hands an `INSERT` into a temporary view `USING safetensors OPTIONS (path …)`
  *   the view's options only there.
  * @param partitionColumns the table's partition columns (`partitionBy`, `PARTITIONED BY`).
  */
class SafetensorsWriteBuilder(info: LogicalWriteInfo, tableOptions: util.Map[String, String],
    partitionColumns: Seq[String])
    extends WriteBuilder with SupportsTruncate with SupportsOverwrite with SupportsDynamicOverwrite {
  /** An unpartitioned write (what a caller outside Spark's planner builds). */
  def this(info: LogicalWriteInfo, tableOptions: util.Map[String, String]) = this(info, tableOptions, Nil)

  private var replace: Replace = Replace.Nothing

  /** An overwrite of the whole dataset, or with `partitionOverwriteMode=dynamic` (the
    * write's option, else the session's `spark.sql.sources.partitionOverwriteMode`) of the
    * partitions written: Spark calls this for `save()` in either mode, so the writer reads
    * the mode itself. */
  override def truncate(): WriteBuilder = {
    val mode = info.options().asCaseSensitiveMap().asScala.collectFirst {
      case (k, v) if k.equalsIgnoreCase(SafetensorsBatchWrite.PartitionOverwriteMode) => v
    }.getOrElse(SparkSession.active.conf.get("spark.sql.sources.partitionOverwriteMode", "static"))
    replace = if (mode.trim.equalsIgnoreCase("dynamic")) Replace.Written else Replace.All
    this
  }

  override def overwriteDynamicPartitions(): WriteBuilder = { replace = Replace.Written; this }

  override def overwrite(filters: Array[Filter]): WriteBuilder = {
    if (filters.forall(_.isInstanceOf[AlwaysTrue])) return truncate()
    val other = filters.flatMap(_.references).filterNot(c => partitionColumns.exists(_.equalsIgnoreCase(c)))
    if (partitionColumns.isEmpty || other.nonEmpty)
      throw new SafetensorsWriteException(
        if (partitionColumns.isEmpty) "a safetensors dataset without partitions cannot be overwritten by a condition; overwrite the whole dataset"
        else s"an overwrite by a condition may name partition columns only (${partitionColumns.mkString(", ")}), not ${other.distinct.mkString(", ")}")
    replace = Replace.Matching(filters.toSeq)
    this
  }

  override def build(): Write = new Write {
    override def description(): String = "safetensors"
    override def toBatch: BatchWrite = SafetensorsBatchWrite(info, tableOptions, partitionColumns, replace)
    override def toStreaming: StreamingWrite = {
      // Spark asks a streaming sink to truncate for outputMode("complete") (and refuses
      // "update" itself, this builder not being SupportsStreamingUpdateAsAppend)
      if (replace != Replace.Nothing)
        throw new SafetensorsWriteException(
          "a streaming write to a safetensors dataset appends each micro-batch as one commit: " +
            "outputMode('complete') would rewrite the dataset at every batch; use outputMode('append') " +
            "(aggregations need a watermark), or write each batch yourself with foreachBatch")
      SafetensorsStreamingWrite(info, tableOptions, partitionColumns)
    }
  }
}

/** Plans the write on the driver (options, column types, the append check), leases the
  * job, and commits or aborts it. */
final class SafetensorsBatchWrite private (job: WriteJob, replace: Replace) extends BatchWrite {
  override def createBatchWriterFactory(physical: PhysicalWriteInfo): DataWriterFactory =
    new SafetensorsWriterFactory(job)

  override def commit(messages: Array[WriterCommitMessage]): Unit =
    try SafetensorsBatchWrite.commitJob(job, messages, replace, None)
    catch { case e: Throwable => abort(messages); throw e }

  override def abort(messages: Array[WriterCommitMessage]): Unit = SafetensorsBatchWrite.abortJob(job)
}

object SafetensorsBatchWrite {
  /** The manifest fields a job's commit takes from its options. */
  def template(job: WriteJob): ManifestDoc = {
    val o = job.options
    ManifestDoc(Seq.empty, Seq.empty, o.mode, o.batchSize, o.nameCol,
      if (o.mode == "kv") Some(o.kvSeparator) else None, None, None, None, None, o.metadata,
      s"pyspark-safetensors ${Layout.Version} (JVM)", None, partitionColumns = job.partitioning.columns)
  }

  /** Commit the shards the tasks' `messages` report, as `Commit` (or `PartitionedCommit`)
    * does; `stream`: a streaming micro-batch. */
  def commitJob(job: WriteJob, messages: Array[WriterCommitMessage], replace: Replace,
      stream: Option[StreamBatch]): ManifestDoc = {
    val results = messages.toSeq.flatMap {
      case t: TaskCommit => Seq(t)
      case t: TaskCommits => t.parts
      case _ => Nil
    }
    val o = job.options
    if (job.partitioning.columns.nonEmpty) PartitionedCommit.commit(job.files, job.jobId, results, template(job),
      replace, o.generateIndex, uniqueKeys = o.mode == "kv", keepPrevious = o.keepPreviousGeneration, stream = stream)
    else Commit.commit(job.files, job.jobId, results, template(job), replace != Replace.Nothing, o.generateIndex,
      uniqueKeys = o.mode == "kv", keepPrevious = o.keepPreviousGeneration, stream = stream)
  }

  /** Delete what the job wrote (its lease, its unlisted shards), and the dataset's
    * directory when the job made it and it is left empty. */
  def abortJob(job: WriteJob): Unit = {
    if (job.partitioning.columns.nonEmpty) PartitionedCommit.abort(job.files, job.jobId)
    else Commit.abort(job.files, job.jobId)
    if (job.madeDirectory) job.files.removeIfEmpty()
  }

  /** The write's options plus those of the table it writes to that it does not give
    * (keys compared without case) and that `keep` accepts, as `CatalogOptions.of` makes
    * them source options (a table made by CTAS stores write options a scan does not take). */
  def withTableOptions(given: util.Map[String, String], table: util.Map[String, String],
      keep: String => Boolean): util.Map[String, String] = {
    val write = CatalogOptions.of(given)
    val have = write.keySet.asScala.map(_.toLowerCase(java.util.Locale.ROOT))
    val merged = new util.HashMap[String, String](write)
    CatalogOptions.of(table).asScala.foreach { case (k, v) =>
      val key = k.toLowerCase(java.util.Locale.ROOT)
      if (!have(key) && keep(key)) merged.put(k, v)
    }
    merged
  }

  /** `given` completed from the manifest of the dataset the write goes to, for a write that
    * states neither mode (a plain `INSERT INTO` a catalog table brings no options): its
    * `batch_size`, or its `name_col` and `kv_separator`, and each written column's dtype
    * unless `dtype` is given. A write that states its mode is checked against the dataset
    * at the commit's append check, as `save()` is. */
  def withDatasetSettings(given: util.Map[String, String], files: DatasetFiles,
      columns: Seq[String]): util.Map[String, String] = {
    val keys = given.keySet.asScala.map(_.toLowerCase(java.util.Locale.ROOT))
    if (keys("batch_size") || keys("name_col") || !files.has(Layout.Manifest)) return given
    val manifest = scala.util.Try(ManifestDoc.parse(files.readBytes(Layout.Manifest), "")).getOrElse(return given)
    val out = new util.HashMap[String, String](given)
    manifest.batchSize.foreach(b => out.put("batch_size", b.toString))
    manifest.nameCol.foreach { key =>
      out.put("name_col", key)
      if (!keys("kv_separator")) manifest.kvSeparator.foreach(out.put("kv_separator", _))
    }
    val dtypes = manifest.schema.filter(c => columns.contains(c._1))
    if (!keys("dtype") && dtypes.nonEmpty) {
      val doc = ManifestDoc.mapper.createObjectNode()
      dtypes.foreach { case (name, col) => doc.put(name, col.dtype) }
      out.put("dtype", ManifestDoc.mapper.writeValueAsString(doc))
    }
    out
  }

  /** The option naming the overwrite mode of a partitioned write, as Spark's file sources take it. */
  val PartitionOverwriteMode = "partitionOverwriteMode"

  def apply(info: LogicalWriteInfo, tableOptions: util.Map[String, String], partitionColumns: Seq[String],
      replace: Replace): SafetensorsBatchWrite = {
    val job = plan(info.schema(), withTableOptions(info.options().asCaseSensitiveMap(), tableOptions, WriterOptions.takes),
      partitionColumns, replace)
    Commit.beginJob(job.files, job.jobId)
    new SafetensorsBatchWrite(job,
      if (job.partitioning.columns.isEmpty && replace != Replace.Nothing) Replace.All else replace)
  }

  /** The write planned on the driver, before any task: options parsed (completed from the
    * dataset's manifest), partition columns and column plans checked, an append checked
    * against the dataset; `jobId` a new one, not yet leased. */
  def plan(schema: StructType, stated: util.Map[String, String], partitionColumns: Seq[String],
      replace: Replace): WriteJob = {
    stated.keySet.asScala.filter(_.equalsIgnoreCase(PartitionOverwriteMode)).toSeq.foreach(stated.remove)
    val hadoop = SparkSession.active.sessionState.newHadoopConfWithOptions(
      stated.asScala.toMap ++ WriterOptions.storageConf(stated))
    val conf = new SerializableConfiguration(hadoop)
    val path = stated.asScala.collectFirst { case (k, v) if k.equalsIgnoreCase("path") && v.nonEmpty => v }
    val given = path.fold(stated)(p => withDatasetSettings(stated, new DatasetFiles(p, conf), schema.fieldNames.toSeq))
    val options = WriterOptions.parse(given)
    val files = new DatasetFiles(options.path, conf)
    val partitioning = partitionLayout(schema, options,
      if (partitionColumns.nonEmpty || replace == Replace.All) partitionColumns else datasetPartitions(files, schema))
    val plans = planColumns(schema, options, partitioning.columns)
    val jobId = UUID.randomUUID().toString.replace("-", "")
    val keyOrdinal = options.nameCol.map(schema.fieldIndex).getOrElse(-1)
    val job = WriteJob(options, plans.toArray, keyOrdinal, files, jobId, madeDirectory = !files.exists(), partitioning)
    if (replace != Replace.All) checkAppend(job, replace == Replace.Nothing)
    job
  }

  /** A partitioned dataset's partition columns, for an append that names none (a plain
    * `save()` or `INSERT`), when the DataFrame has them all. */
  private def datasetPartitions(files: DatasetFiles, schema: StructType): Seq[String] =
    if (!files.has(Layout.Manifest)) Nil
    else scala.util.Try(ManifestDoc.parse(files.readBytes(Layout.Manifest), "").partitionColumns)
      .getOrElse(Nil) match {
        case cols if cols.forall(schema.fieldNames.contains) => cols
        case _ => Nil
      }

  private def partitionLayout(schema: StructType, o: WriterOptions, columns: Seq[String]): PartitionLayout = {
    def fail(msg: String): Nothing = throw new SafetensorsWriteException(msg)
    val names = schema.fieldNames.toSeq
    columns.foreach { c =>
      if (!names.contains(c)) fail(s"partition column '$c' is not a column; columns: ${names.mkString("['", "', '", "']")}")
      if (o.nameCol.contains(c)) fail(s"partition column '$c' is the key column (name_col); partition by another column")
      if (!Partitions.supported(schema(c).dataType))
        fail(s"partition column '$c' has type ${schema(c).dataType.simpleString}; a partition column must be a " +
          "string, an integer, a boolean or a date (its value names a directory)")
    }
    if (columns.distinct.size != columns.size) fail(s"partitionBy names a column twice: ${columns.mkString(", ")}")
    PartitionLayout(columns, columns.map(schema.fieldIndex).toArray, columns.map(schema(_).dataType).toArray)
  }

  private def planColumns(schema: StructType, o: WriterOptions, partitionColumns: Seq[String]): Seq[ColumnPlan] = {
    val all = schema.fieldNames.toSeq
    val names = all.filterNot(partitionColumns.contains)
    def fail(msg: String): Nothing = throw new SafetensorsWriteException(msg)
    val unknown = (o.columns.getOrElse(Nil) ++ o.shapes.keys ++ o.columnDtypes.keys).filterNot(names.contains)
    if (unknown.nonEmpty)
      fail(s"option names column(s) ${unknown.mkString("['", "', '", "']")} that the DataFrame lacks" +
        (if (unknown.exists(partitionColumns.contains)) " as tensor columns (a partition column is written as its directory)" else "") +
        s"; its columns: ${all.mkString("['", "', '", "']")}")
    o.nameCol.foreach { key =>
      if (!names.contains(key)) fail(s"name_col '$key' is not a column; columns: ${names.mkString("['", "', '", "']")}")
      if (schema(key).dataType != StringType)
        fail(s"name_col '$key' has type ${schema(key).dataType.simpleString}; the key column must be a string")
    }
    val wanted = o.columns.getOrElse(names.filterNot(n => o.nameCol.contains(n)))
    o.nameCol.filter(wanted.contains).foreach(k =>
      fail(s"columns lists the key column '$k'; it is written as part of each tensor name"))
    if (wanted.isEmpty) fail("no tensor columns to write")
    if (o.nameCol.isDefined) Layout.checkKvColumns(wanted, o.kvSeparator)
    wanted.map(n => TensorColumns.plan(n, schema.fieldIndex(n), schema(n).dataType, o))
  }

  /** Refuse, before any task runs, an append the dataset cannot take: what the
    * DataFrame's types tell is checked with the commit's rule (`Commit.checkAppend`). */
  private def checkAppend(job: WriteJob, append: Boolean): Unit = {
    val files = job.files
    if (!files.has(Layout.Manifest)) return
    val previous = ManifestDoc.parse(files.readBytes(Layout.Manifest), s"'${files.uri}/${Layout.Manifest}'")
    if (append) Commit.refuseComplete(previous, s"dataset '${files.uri}'")
    val o = job.options
    val known = job.plans.toSeq.map { p =>
      val prev = previous.schema.find(_._1 == p.name).map(_._2)
      val dtype = p.target.orElse(prev.map(_.dtype)).getOrElse("")
      val sample: Seq[Int] =
        if (p.shape.isDefined || p.kind == "scalar") p.shape.getOrElse(Nil)
        else prev.filter(c => p.kind == "struct" || c.sampleShape.size == p.depth).map(_.sampleShape)
          .getOrElse(Seq.fill(p.depth)(-1))
      p.name -> ColumnSchema(dtype, sample)
    }
    val template = ManifestDoc(Seq.empty, Seq.empty, o.mode, o.batchSize, o.nameCol,
      if (o.mode == "kv") Some(o.kvSeparator) else None, None, None, None, None, o.metadata, "", None,
      partitionColumns = job.partitioning.columns)
    // a partition's sample shapes are checked at the commit, against the partition's own
    val varying = if (job.partitioning.columns.nonEmpty) Some(true) else None
    Commit.checkAppend(previous, template, Some(known), s"dataset '${files.uri}'", varying)
  }
}

final class SafetensorsWriterFactory(job: WriteJob) extends DataWriterFactory {
  override def createWriter(partitionId: Int, taskId: Long): DataWriter[InternalRow] =
    new SafetensorsDataWriter(job, partitionId, taskId)
}
