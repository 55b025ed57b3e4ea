package io.github.pysparksafetensors.write

import java.util
import java.util.UUID

import scala.jdk.CollectionConverters._

import org.apache.spark.sql.SparkSession
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.connector.write._
import org.apache.spark.sql.sources.{AlwaysTrue, Filter}
import org.apache.spark.sql.types.{StringType, StructType}

import io.github.pysparksafetensors.CatalogOptions

/** What the tasks of one write job need: options, column plans, the dataset's files, the
  * job id (its lease and the tag in every shard name) and whether the job made the
  * dataset's directory (a failed first write then removes it). */
final case class WriteJob(
    options: WriterOptions,
    plans: Array[ColumnPlan],
    keyOrdinal: Int,
    files: DatasetFiles,
    jobId: String,
    madeDirectory: Boolean)

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
  */
class SafetensorsWriteBuilder(info: LogicalWriteInfo, tableOptions: util.Map[String, String])
    extends WriteBuilder with SupportsTruncate with SupportsOverwrite {
  private var overwrite = false

  override def truncate(): WriteBuilder = { overwrite = true; this }

  override def overwrite(filters: Array[Filter]): WriteBuilder = {
    if (!filters.forall(_.isInstanceOf[AlwaysTrue]))
      throw new SafetensorsWriteException(
        "a safetensors dataset has no partitions to overwrite by a condition; overwrite the whole dataset")
    overwrite = true
    this
  }

  override def build(): Write = new Write {
    override def description(): String = "safetensors"
    override def toBatch: BatchWrite = SafetensorsBatchWrite(info, tableOptions, overwrite)
  }
}

/** Plans the write on the driver (options, column types, the append check), leases the
  * job, and commits or aborts it. */
final class SafetensorsBatchWrite private (job: WriteJob, overwrite: Boolean) extends BatchWrite {
  override def createBatchWriterFactory(physical: PhysicalWriteInfo): DataWriterFactory =
    new SafetensorsWriterFactory(job)

  private def template: ManifestDoc = {
    val o = job.options
    ManifestDoc(Seq.empty, Seq.empty, o.mode, o.batchSize, o.nameCol,
      if (o.mode == "kv") Some(o.kvSeparator) else None, None, None, None, None, o.metadata,
      s"pyspark-safetensors ${Layout.Version} (JVM)", None)
  }

  override def commit(messages: Array[WriterCommitMessage]): Unit = {
    val results = messages.toSeq.collect { case t: TaskCommit => t }
    try Commit.commit(job.files, job.jobId, results, template, overwrite, job.options.generateIndex,
      uniqueKeys = job.options.mode == "kv", keepPrevious = job.options.keepPreviousGeneration)
    catch { case e: Throwable => abort(messages); throw e }
  }

  override def abort(messages: Array[WriterCommitMessage]): Unit = {
    Commit.abort(job.files, job.jobId)
    if (job.madeDirectory) job.files.removeIfEmpty()
  }
}

object SafetensorsBatchWrite {
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

  def apply(info: LogicalWriteInfo, tableOptions: util.Map[String, String], overwrite: Boolean): SafetensorsBatchWrite = {
    val schema = info.schema()
    val stated = withTableOptions(info.options().asCaseSensitiveMap(), tableOptions, WriterOptions.takes)
    val hadoop = SparkSession.active.sessionState.newHadoopConfWithOptions(
      stated.asScala.toMap ++ WriterOptions.storageConf(stated))
    val conf = new SerializableConfiguration(hadoop)
    val path = stated.asScala.collectFirst { case (k, v) if k.equalsIgnoreCase("path") && v.nonEmpty => v }
    val given = path.fold(stated)(p => withDatasetSettings(stated, new DatasetFiles(p, conf), schema.fieldNames.toSeq))
    val options = WriterOptions.parse(given)
    val plans = planColumns(schema, options)
    val files = new DatasetFiles(options.path, conf)
    val jobId = UUID.randomUUID().toString.replace("-", "")
    val keyOrdinal = options.nameCol.map(schema.fieldIndex).getOrElse(-1)
    val job = WriteJob(options, plans.toArray, keyOrdinal, files, jobId, madeDirectory = !files.exists())
    if (!overwrite) checkAppend(job)
    Commit.beginJob(files, jobId)
    new SafetensorsBatchWrite(job, overwrite)
  }

  private def planColumns(schema: StructType, o: WriterOptions): Seq[ColumnPlan] = {
    val names = schema.fieldNames.toSeq
    def fail(msg: String): Nothing = throw new SafetensorsWriteException(msg)
    val unknown = (o.columns.getOrElse(Nil) ++ o.shapes.keys ++ o.columnDtypes.keys).filterNot(names.contains)
    if (unknown.nonEmpty)
      fail(s"option names column(s) ${unknown.mkString("['", "', '", "']")} that the DataFrame lacks; its columns: ${names.mkString("['", "', '", "']")}")
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
  private def checkAppend(job: WriteJob): Unit = {
    val files = job.files
    if (!files.has(Layout.Manifest)) return
    val previous = ManifestDoc.parse(files.readBytes(Layout.Manifest), s"'${files.uri}/${Layout.Manifest}'")
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
      if (o.mode == "kv") Some(o.kvSeparator) else None, None, None, None, None, o.metadata, "", None)
    Commit.checkAppend(previous, template, Some(known), s"dataset '${files.uri}'")
  }
}

final class SafetensorsWriterFactory(job: WriteJob) extends DataWriterFactory {
  override def createWriter(partitionId: Int, taskId: Long): DataWriter[InternalRow] =
    new SafetensorsDataWriter(job, partitionId, taskId)
}
