package io.github.pysparksafetensors

import java.util
import java.util.Locale

import scala.jdk.CollectionConverters._

import org.apache.spark.sql.SparkSession
import org.apache.spark.sql.connector.catalog.{SupportsRead, SupportsWrite, Table, TableCapability, TableProvider}
import org.apache.spark.sql.connector.expressions.{Expressions, Transform}
import org.apache.spark.sql.connector.read.ScanBuilder
import org.apache.spark.sql.connector.write.{LogicalWriteInfo, WriteBuilder}
import org.apache.spark.sql.sources.DataSourceRegister
import org.apache.spark.sql.types.StructType
import org.apache.spark.sql.util.CaseInsensitiveStringMap

import io.github.pysparksafetensors.read.{ReadPlan, ReaderOptions, SafetensorsScanBuilder}
import io.github.pysparksafetensors.write.{SafetensorsBatchWrite, SafetensorsWriteBuilder, SafetensorsWriteException}

/** The `safetensors` data source on the JVM: the twin of the Python source's reader (views
  * `rows`, `kv`, `tensors`, `files`, the same options, schemas and checks) and writer.
  *
  * The jar registers it under the short name, so with the jar on the classpath
  * `format("safetensors")` resolves here (Spark prefers a JVM source to a Python one of the
  * same name). [[Implementation]] hands a read or a write to the Python source instead when
  * the option or the session's conf asks for it. */
class SafetensorsSource extends TableProvider with DataSourceRegister {
  override def shortName(): String = Implementation.ShortName

  // One provider instance serves one read or write: the Python source keeps state between
  // inferSchema and getTable, so the delegate is made once, when first asked for.
  private var python: Option[TableProvider] = None
  private def delegate(options: util.Map[String, String]): Option[TableProvider] = {
    if (python.isEmpty && Implementation.python(options)) python = Some(Implementation.pythonSource())
    python
  }

  override def inferSchema(options: CaseInsensitiveStringMap): StructType = delegate(options) match {
    case Some(p) => p.inferSchema(options)
    case None => SafetensorsSource.plan(new CaseInsensitiveStringMap(CatalogOptions.of(options))).schema
  }

  override def supportsExternalMetadata(): Boolean = true

  override def getTable(schema: StructType, partitioning: Array[Transform],
      properties: util.Map[String, String]): Table = delegate(properties) match {
    case Some(_) if partitioning.nonEmpty =>
      // Spark would refuse it with "partitioning ... do not match": say what works instead
      throw new SafetensorsWriteException(
        "the Python source cannot write a partitioned dataset (Spark hands a Python data source no " +
          "partition columns): write with implementation=jvm, the shim jar's source, or drop partitionBy")
    case Some(p) => p.getTable(schema, partitioning, properties)
    case None => jvmTable(schema, partitioning, properties)
  }

  private def jvmTable(schema: StructType, partitioning: Array[Transform],
      properties: util.Map[String, String]): Table = {
    val columns = partitioning.toSeq.map { t =>
      if (t.name() != "identity" || t.references().length != 1 || t.references()(0).fieldNames().length != 1)
        throw new SafetensorsWriteException(
          s"a safetensors dataset is partitioned by columns' values (partitionBy, PARTITIONED BY (col)), not by ${t.describe()}")
      t.references()(0).fieldNames()(0)
    }
    new SafetensorsTable(schema, properties, columns)
  }
}

/** Which implementation answers `format("safetensors")` where this jar is on the classpath:
  * the read or write option `implementation`, else the session's conf
  * `spark.pyspark_safetensors.implementation`, else `auto`. `jvm` means this one; `python`
  * hands the read or write to the Python source of the `pyspark-safetensors` package (the
  * one that answers alone where the jar is absent); `auto` means this one unless a path's
  * scheme has no Hadoop `FileSystem` here (`s3://` without a connector for it, fsspec-only
  * protocols), which the Python source reaches through pyarrow and fsspec (on Spark 4.x:
  * Spark 3.5 has no Python data sources). */
object Implementation {
  val ShortName = "safetensors"
  val Conf = "spark.pyspark_safetensors.implementation"
  val OptionName = "implementation"
  val Choices = Seq("auto", "jvm", "python")
  private val PythonProvider = "org.apache.spark.sql.execution.datasources.v2.python.PythonDataSourceV2"

  /** The chosen implementation's name, checked: `auto`, `jvm` or `python`. */
  def chosen(options: util.Map[String, String]): String = {
    val given = option(options, OptionName).map((s"option $OptionName", _))
      .getOrElse((Conf, SparkSession.active.conf.get(Conf, "auto")))
    val value = given._2.trim.toLowerCase(Locale.ROOT)
    if (!Choices.contains(value))
      throw new IllegalArgumentException(s"${given._1}='${given._2}' is not one of ${Choices.mkString(", ")}")
    value
  }

  /** Whether the Python source takes this read or write. */
  def python(options: util.Map[String, String]): Boolean = chosen(options) match {
    case "python" => true
    case "jvm" => false
    case _ => SparkLine.HasPythonDataSources && !paths(options).forall(hasHadoopFileSystem)
  }

  // A catalog write (saveAsTable) hands the options as table properties, `option.`-prefixed.
  private def option(options: util.Map[String, String], name: String): Option[String] =
    options.asScala.collectFirst {
      case (k, v) if k.equalsIgnoreCase(name) || k.equalsIgnoreCase(s"option.$name") => v
    }

  /** The paths of a read or write: `path`, and `paths` as a JSON list or comma-separated. */
  private def paths(options: util.Map[String, String]): Seq[String] =
    option(options, "path").toSeq ++ option(options, "paths").toSeq.flatMap { v =>
      if (v.trim.startsWith("["))
        scala.util.Try(new com.fasterxml.jackson.databind.ObjectMapper().readTree(v).elements().asScala
          .map(_.asText).toList).getOrElse(Nil)
      else v.split(",").map(_.trim).filter(_.nonEmpty).toSeq
    }

  private def hasHadoopFileSystem(path: String): Boolean = {
    val scheme = scala.util.Try(new org.apache.hadoop.fs.Path(path).toUri.getScheme).getOrElse(null)
    scheme == null || scala.util.Try(org.apache.hadoop.fs.FileSystem.getFileSystemClass(
      scheme, SparkSession.active.sessionState.newHadoopConf())).isSuccess
  }

  /** Spark's provider for the Python source registered as `safetensors`, or an error saying
    * how to make it available. Built by reflection: the class is internal to Spark. */
  def pythonSource(): TableProvider = {
    if (!SparkLine.HasPythonDataSources)
      throw new IllegalArgumentException(
        s"implementation=python, but Spark ${org.apache.spark.SPARK_VERSION} has no Python data sources: " +
          "use implementation=jvm (what auto picks here)")
    val registered = scala.util.Try(
      SparkLine.pythonSourceRegistered(SparkSession.active, ShortName)).getOrElse(false)
    if (!registered)
      throw new IllegalArgumentException(
        s"implementation=python, but no Python data source '$ShortName' is registered in this " +
          "session: install pyspark-safetensors where the driver's Python runs, or call " +
          "pyspark_safetensors.register(spark)")
    val provider = Class.forName(PythonProvider).getDeclaredConstructor().newInstance().asInstanceOf[TableProvider]
    provider.getClass.getMethod("setShortName", classOf[String]).invoke(provider, ShortName)
    provider
  }
}

/** What Spark's catalogs hand a provider besides the options a user gave: the table's
  * location (`location`, or `path` when the session catalog loads a table), its reserved
  * properties (`TableCatalog.PROP_*`), and the statement's `OPTIONS (...)` prefixed
  * `option.` where they were stored as table properties (CTAS). */
object CatalogOptions {
  val Reserved: Set[String] =
    Set("provider", "owner", "location", "comment", "external", "is_managed_location", "collation")

  /** `given` as source options: `option.`-prefixed keys unprefixed, the location as `path`
    * when no path is given, the catalog's reserved properties dropped. */
  def of(given: util.Map[String, String]): util.Map[String, String] = {
    val entries = given.asScala.toSeq
    val lower = (k: String) => k.toLowerCase(Locale.ROOT)
    val plain = entries.filterNot(e => Reserved(lower(e._1)) || lower(e._1).startsWith("option."))
    val have = plain.map(e => lower(e._1)).toSet
    val prefixed = entries.collect {
      case (k, v) if lower(k).startsWith("option.") && !have(lower(k).stripPrefix("option.")) =>
        k.substring("option.".length) -> v
    }
    val location = entries.collectFirst { case (k, v) if lower(k) == "location" && v.nonEmpty => v }
      .filter(_ => !have("path") && !prefixed.exists(e => lower(e._1) == "path")).map("path" -> _)
    val out = new util.HashMap[String, String]()
    (plain ++ prefixed ++ location).foreach { case (k, v) => out.put(k, v) }
    out
  }
}

object SafetensorsSource {
  def plan(options: CaseInsensitiveStringMap): ReadPlan =
    ReadPlan.plan(options, SparkSession.active.sessionState.newHadoopConfWithOptions(
      options.asCaseSensitiveMap().asScala.toMap))
}

/** A dataset (or safetensors files) as a table: batch reads, appends, overwrite by truncation,
  * streaming appends (`SafetensorsStreamingWrite`).
  * A read plans itself from the scan's options, completed by the table's (a catalog table's
  * path arrives only among its properties); a schema given by the user names some of the
  * data's columns with their types. A catalog table's schema (all the data's columns, in
  * order) is the data's own: a CTAS with `dtype` stores the query's types, the dataset
  * holds the cast ones. (A catalog hands its tables' properties with the `provider`; a
  * `save()` and a `load()` bring only options.) */
final class SafetensorsTable(tableSchema: StructType, properties: util.Map[String, String],
    partitionColumns: Seq[String] = Nil)
    extends Table with SupportsRead with SupportsWrite {
  override def name(): String = "safetensors"

  /** The partition columns a write was given (`partitionBy`) or a catalog table has. */
  override def partitioning(): Array[Transform] = partitionColumns.map(c => Expressions.identity(c): Transform).toArray

  private def plan(options: util.Map[String, String]): ReadPlan = SafetensorsSource.plan(
    new CaseInsensitiveStringMap(SafetensorsBatchWrite.withTableOptions(options, properties, ReaderOptions.takes)))

  private def has(key: String): Boolean = properties.keySet.asScala.exists(_.equalsIgnoreCase(key))

  /** A catalog table's dataset as it stands, planned once for the schema and the scan. */
  private lazy val stored: Option[ReadPlan] =
    if (!has("provider")) None else scala.util.Try(plan(new util.HashMap[String, String]())).toOption

  private lazy val readSchema: StructType =
    stored.map(_.schema).filter(_.fieldNames.toSeq == tableSchema.fieldNames.toSeq).getOrElse(tableSchema)

  override def schema(): StructType = readSchema

  /** What `DESCRIBE` and `SHOW CREATE TABLE` show of a catalog table: provider, location,
    * whether it is external (the catalog hands an external table's `location` besides its
    * `path`, a managed one's `path` only), and the options it was made with
    * (`option.`-prefixed). */
  override def properties(): util.Map[String, String] = catalogProperties

  private lazy val catalogProperties: util.Map[String, String] = {
    val out = new util.HashMap[String, String]()
    val options = CatalogOptions.of(properties).asScala
    options.foreach { case (k, v) => if (!k.equalsIgnoreCase("path")) out.put(s"option.$k", v) }
    options.collectFirst { case (k, v) if k.equalsIgnoreCase("path") => v }.foreach { path =>
      out.put("provider", Implementation.ShortName)
      out.put("location", path)
      if (has("location")) out.put("external", "true")
    }
    out
  }
  override def capabilities(): util.Set[TableCapability] =
    util.EnumSet.of(TableCapability.BATCH_READ, TableCapability.BATCH_WRITE, TableCapability.TRUNCATE,
      TableCapability.OVERWRITE_BY_FILTER, TableCapability.OVERWRITE_DYNAMIC, TableCapability.STREAMING_WRITE)

  override def newScanBuilder(options: CaseInsensitiveStringMap): ScanBuilder = {
    val planned = stored.filter(_ => options.isEmpty).getOrElse(plan(options.asCaseSensitiveMap()))
    new SafetensorsScanBuilder(if (planned.schema.catalogString == readSchema.catalogString) planned
      else ReadPlan.withSchema(planned, readSchema))
  }

  override def newWriteBuilder(info: LogicalWriteInfo): WriteBuilder =
    new SafetensorsWriteBuilder(info, properties, partitionColumns)
}
