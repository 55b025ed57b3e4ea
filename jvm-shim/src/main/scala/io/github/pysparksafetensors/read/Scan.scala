package io.github.pysparksafetensors.read

import org.apache.spark.sql.SparkSession
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.connector.read._
import org.apache.spark.sql.sources.{EqualTo, Filter, In}
import org.apache.spark.sql.types.{LongType, StructField, StructType}
import org.apache.spark.sql.connector.expressions.aggregate.{Aggregation, CountStar}
import org.apache.spark.sql.vectorized.ColumnarBatch

import io.github.pysparksafetensors.core

/** One shard (or a row range of one) of a dataset; `rowStop` exclusive. */
final case class ShardPart(source: Int, shard: Int, rowStart: Long, rowStop: Long) extends InputPartition
/** Consecutive shards (or row ranges) of the `rows` view read by one task, one after another. */
final case class ShardsPart(parts: Seq[ShardPart]) extends InputPartition
/** A group of files, for the `tensors` and `files` views. */
final case class FilesPart(source: Int, files: Seq[Int]) extends InputPartition

/** Equality filters the reader applies itself (Spark applies them again after the scan). */
final case class Wanted(names: Option[Set[String]], dtypes: Option[Set[String]], keys: Option[Set[String]]) {
  def keep(name: String, dtype: String): Boolean = names.forall(_(name)) && dtypes.forall(_(dtype))
}

/** Column pruning (selecting a column reads only its tensors' bytes; selecting none reads
  * no shard, so `count()` is answered from the manifest), equality filters on `name` and
  * `dtype` (tensors view) and on the key (KV view), and partition pruning: a partition
  * whose values fail a filter on partition columns is never opened. */
final class SafetensorsScanBuilder(plan: ReadPlan) extends ScanBuilder
    with SupportsPushDownRequiredColumns with SupportsPushDownFilters with SupportsPushDownAggregates {
  private var required: StructType = plan.schema
  private var countOnly = false
  private var wanted = Wanted(None, None, None)
  private var pushed = Array.empty[Filter]
  private var sources: Seq[Int] = plan.sources.indices

  override def pruneColumns(requiredSchema: StructType): Unit = {
    val keep = requiredSchema.fieldNames.toSet
    required = StructType(plan.schema.fields.filter(f => keep(f.name)))
  }

  override def pushFilters(filters: Array[Filter]): Array[Filter] = {
    val keyCol = plan.sources.head.manifest.flatMap(_.nameCol).getOrElse("key")
    def narrow(old: Option[Set[String]], values: Seq[Any]): Option[Set[String]] = {
      val v = values.collect { case s: String => s }.toSet
      Some(old.map(_ & v).getOrElse(v))
    }
    val used = filters.filter { f =>
      val (column, values) = f match {
        case EqualTo(a, v: String) => (a, Seq(v))
        case In(a, vs) if vs.forall(_.isInstanceOf[String]) => (a, vs.toSeq)
        case _ => ("", Seq.empty)
      }
      if (plan.view == "tensors" && column == "name") { wanted = wanted.copy(names = narrow(wanted.names, values)); true }
      else if (plan.view == "tensors" && column == "dtype") { wanted = wanted.copy(dtypes = narrow(wanted.dtypes, values)); true }
      else if (plan.view == "kv" && column == keyCol) { wanted = wanted.copy(keys = narrow(wanted.keys, values)); true }
      else false
    }
    val partitionColumns = plan.partitionSchema.fieldNames.toSet
    val onPartitions = filters.filter(f => f.references.nonEmpty && f.references.forall(partitionColumns))
    if (onPartitions.nonEmpty) {
      val types = plan.partitionSchema.fields.map(f => f.name -> f.dataType).toMap
      sources = sources.filter { i =>
        val values = plan.sources(i).partition.toMap
        onPartitions.forall(f => core.Partitions.mayMatch(f, values, types))
      }
    }
    pushed = used ++ onPartitions
    filters // Spark evaluates every filter again: a pushed one only narrows what is read
  }

  override def pushedFilters(): Array[Filter] = pushed

  /** `COUNT(*)` of a dataset's rows or keys with no filter: the manifests' `samples_count`. */
  override def pushAggregation(aggregation: Aggregation): Boolean = {
    countOnly = (plan.view == "rows" || plan.view == "kv") && pushed.isEmpty &&
      aggregation.groupByExpressions().isEmpty && aggregation.aggregateExpressions().nonEmpty &&
      aggregation.aggregateExpressions().forall(_.isInstanceOf[CountStar])
    countOnly
  }

  override def supportCompletePushDown(aggregation: Aggregation): Boolean = true

  override def build(): Scan = {
    val read = if (sources.size == plan.sources.size) plan else plan.copy(sources = sources.map(plan.sources))
    if (countOnly) new ManifestCountScan(read.sources.flatMap(_.manifest).map(_.shards.map(_.samples).sum).sum)
    else new SafetensorsScan(read, required, wanted)
  }
}

/** `COUNT(*)` answered from the manifests: one partition, one row, no shard opened. */
final class ManifestCountScan(total: Long) extends Scan with Batch {
  override def readSchema(): StructType = StructType(Seq(StructField("count(*)", LongType, nullable = false)))
  override def description(): String = s"safetensors count(*) = $total from the manifest"
  override def toBatch: Batch = this
  override def planInputPartitions(): Array[InputPartition] = Array(FilesPart(0, Seq.empty))
  override def createReaderFactory(): PartitionReaderFactory = new CountReaderFactory(total)
}

final class CountReaderFactory(total: Long) extends PartitionReaderFactory {
  override def createReader(partition: InputPartition): PartitionReader[InternalRow] = new IteratorReader {
    override protected def rows: Iterator[InternalRow] = Iterator.single(InternalRow(total))
  }
}

final class SafetensorsScan(plan: ReadPlan, required: StructType, wanted: Wanted) extends Scan with Batch {
  override def readSchema(): StructType = required
  override def description(): String =
    s"safetensors view=${plan.view} ${plan.options.paths.mkString(", ")} columns=${required.fieldNames.mkString(",")}"
  override def toBatch: Batch = this

  /** Rows by `rows_per_partition` within each shard and a KV shard whole, as the Python
    * reader splits them; files packed as Spark's file sources pack them (see `packFiles`),
    * and so are the `rows` view's shards and row ranges unless `rows_per_partition` is
    * given: a task per 10,000-row shard spends more time scheduled than reading it. */
  override def planInputPartitions(): Array[InputPartition] = {
    val step = plan.options.rowsPerPartition.toLong
    val readsData = if (plan.view == "files") required.nonEmpty else required.fieldNames.contains("data")
    val parts = plan.sources.zipWithIndex.flatMap { case (source, i) =>
      if (plan.view == "tensors" || plan.view == "files") {
        val bytes = if (readsData) source.sizes else source.sizes.map(_ => 0L)
        SafetensorsScan.packFiles(bytes).map(g => FilesPart(i, g): InputPartition)
      } else {
        val shards = source.manifest.get.shards
        val ranges = shards.zipWithIndex.flatMap { case (entry, shard) =>
          if (plan.view == "kv" || entry.samples <= step) Seq(ShardPart(i, shard, 0, entry.samples))
          else (0L until entry.samples by step).map(a => ShardPart(i, shard, a, math.min(a + step, entry.samples)))
        }
        if (plan.view != "rows" || plan.options.rowsGiven) ranges
        else {
          // a range's share of its shard's bytes (none when no column is read)
          val bytes = ranges.map { p =>
            val e = shards(p.shard)
            if (required.isEmpty) 0L else (e.bytes.toDouble * (p.rowStop - p.rowStart) / math.max(1L, e.samples)).toLong
          }
          SafetensorsScan.packFiles(bytes).map(g => ShardsPart(g.map(ranges)): InputPartition)
        }
      }
    }
    parts.toArray
  }

  override def createReaderFactory(): PartitionReaderFactory = new SafetensorsReaderFactory(plan, required, wanted)
}

object SafetensorsScan {
  /** Consecutive files in partitions of about `spark.sql.files.maxPartitionBytes`, each file
    * counted `spark.sql.files.openCostInBytes` more than the bytes it reads, and no larger
    * than spreads them over `spark.sql.files.minPartitionNum` (default: the cores), as
    * Spark's file sources pack theirs: a task per file would spend more time scheduled than
    * copying a small file. */
  def packFiles(bytes: Seq[Long]): Seq[Seq[Int]] = {
    val spark = SparkSession.active
    val conf = spark.sessionState.conf
    val open = conf.filesOpenCostInBytes
    val cores = conf.filesMinPartitionNum.getOrElse(spark.sparkContext.defaultParallelism)
    val target = math.min(conf.filesMaxPartitionBytes, math.max(open, bytes.map(_ + open).sum / math.max(1, cores)))
    val groups = Seq.newBuilder[Seq[Int]]
    var current = Vector.empty[Int]
    var filled = 0L
    bytes.zipWithIndex.foreach { case (b, f) =>
      if (current.nonEmpty && filled + b + open > target) { groups += current; current = Vector.empty; filled = 0L }
      current :+= f
      filled += b + open
    }
    if (current.nonEmpty) groups += current
    groups.result()
  }
}

/** The readers of a scan's partitions. The columns read from shards are `required` less
  * the partition columns, whose values each partition's reader adds (`WithPartitionValues`). */
final class SafetensorsReaderFactory(plan: ReadPlan, required: StructType, wanted: Wanted) extends PartitionReaderFactory {
  private val fromShards = StructType(required.fields.filterNot(f => plan.partitionSchema.fieldNames.contains(f.name)))
  private val addsValues = fromShards.size != required.size
  private val columnar = fromShards.nonEmpty && Columnar.supports(plan, fromShards)
  override def supportColumnarReads(partition: InputPartition): Boolean = columnar

  private def values(p: ShardPart): org.apache.spark.sql.catalyst.InternalRow =
    core.Partitions.row(plan.sources(p.source).partition.map(_._2), plan.partitionSchema)

  private def columnarReader(p: ShardPart): PartitionReader[ColumnarBatch] = {
    val reader = new RowsColumnarReader(plan, p, fromShards)
    if (addsValues) new WithPartitionValues.Batches(reader, required, fromShards, plan.partitionSchema, values(p)) else reader
  }
  private def rowReader(p: ShardPart): PartitionReader[InternalRow] = {
    val reader = if (plan.view == "rows") new RowsReader(plan, p, fromShards) else new KvReader(plan, p, fromShards, wanted)
    if (addsValues) new WithPartitionValues.Rows(reader, required, fromShards, plan.partitionSchema, values(p)) else reader
  }

  override def createColumnarReader(partition: InputPartition): PartitionReader[ColumnarBatch] = partition match {
    case g: ShardsPart => new ChainedReader(g.parts.iterator.map(columnarReader))
    case p: ShardPart => columnarReader(p)
  }
  override def createReader(partition: InputPartition): PartitionReader[InternalRow] = partition match {
    case g: ShardsPart => new ChainedReader(g.parts.iterator.map(rowReader))
    case p: ShardPart => rowReader(p)
    case p: FilesPart if plan.view == "files" => new FilesReader(plan, p, required)
    case p: FilesPart => new TensorsReader(plan, p, required, wanted)
  }
}

/** A partition's values added to the rows (or batches) read from its shards, each column
  * where `required` puts it. */
object WithPartitionValues {
  import org.apache.spark.sql.catalyst.expressions.GenericInternalRow
  import org.apache.spark.sql.execution.vectorized.{ColumnVectorUtils, ConstantColumnVector}
  import org.apache.spark.sql.vectorized.ColumnVector

  /** For each required column: (is a partition column, its ordinal in the shard columns or
    * in the partition columns). */
  private def slots(required: StructType, fromShards: StructType, partitions: StructType): Array[(Boolean, Int)] =
    required.fields.map { f =>
      if (fromShards.fieldNames.contains(f.name)) (false, fromShards.fieldIndex(f.name))
      else (true, partitions.fieldIndex(f.name))
    }

  final class Rows(inner: PartitionReader[InternalRow], required: StructType, fromShards: StructType,
      partitions: StructType, values: InternalRow) extends PartitionReader[InternalRow] {
    private val at = slots(required, fromShards, partitions)
    private val out = new GenericInternalRow(required.size)
    // the partition's values, set once: only the shards' columns change from row to row
    at.indices.foreach { i =>
      if (at(i)._1) out.update(i, values.get(at(i)._2, partitions(at(i)._2).dataType))
    }
    override def next(): Boolean = inner.next()
    override def get(): InternalRow = {
      val row = inner.get()
      var i = 0
      while (i < at.length) {
        if (!at(i)._1) out.update(i, row.get(at(i)._2, required(i).dataType))
        i += 1
      }
      out
    }
    override def close(): Unit = inner.close()
  }

  final class Batches(inner: PartitionReader[ColumnarBatch], required: StructType, fromShards: StructType,
      partitions: StructType, values: InternalRow) extends PartitionReader[ColumnarBatch] {
    private val at = slots(required, fromShards, partitions)
    private val constants: Map[Int, ConstantColumnVector] = at.toSeq.filter(_._1).map { case (_, o) =>
      val v = new ConstantColumnVector(Columnar.BatchRows, partitions(o).dataType)
      ColumnVectorUtils.populate(v, values, o)
      o -> v
    }.toMap
    override def next(): Boolean = inner.next()
    override def get(): ColumnarBatch = {
      val batch = inner.get()
      val columns = at.map { case (part, o) => if (part) constants(o): ColumnVector else batch.column(o) }
      new ColumnarBatch(columns, batch.numRows())
    }
    override def close(): Unit = { inner.close(); constants.values.foreach(_.close()) }
  }
}

/** The readers of a partition's parts, one after another (each opened when reached and
  * closed when done). */
final class ChainedReader[T](readers: Iterator[PartitionReader[T]]) extends PartitionReader[T] {
  private var current: PartitionReader[T] = _
  override def next(): Boolean = {
    while (current == null || !current.next()) {
      if (current != null) { current.close(); current = null }
      if (!readers.hasNext) return false
      current = readers.next()
    }
    true
  }
  override def get(): T = current.get()
  override def close(): Unit = if (current != null) { current.close(); current = null }
}
