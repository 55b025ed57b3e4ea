package io.github.pysparksafetensors.read

import java.nio.ByteBuffer

import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.expressions.GenericInternalRow
import org.apache.spark.sql.connector.read.PartitionReader
import org.apache.spark.sql.types.StructType
import org.apache.spark.unsafe.types.UTF8String

import io.github.pysparksafetensors.core.{Header, SafetensorsReadException, Storage, TensorInfo}

/** A partition reader over an iterator of rows. */
abstract class IteratorReader extends PartitionReader[InternalRow] {
  protected def rows: Iterator[InternalRow]
  private lazy val it = rows
  private var current: InternalRow = _
  override def next(): Boolean = if (it.hasNext) { current = it.next(); true } else false
  override def get(): InternalRow = current
  override def close(): Unit = ()
}

object Readers {
  /** The header of a dataset shard checked against its manifest entry and schema: every
    * column present with the manifest's dtype and sample shape, `samples_count` rows (batch). */
  def checkedHeader(plan: ReadPlan, source: Int, shard: Int): (Header, String) = {
    val src = plan.sources(source)
    val m = src.manifest.get
    val entry = m.shards(shard)
    val file = src.storage.display(entry.path)
    val header = Header.read(src.storage, entry.path, entry.bytes)
    def fail(msg: String): Nothing = throw new SafetensorsReadException(s"file '$file': $msg")
    if (m.mode != "kv") {
      m.schema.foreach { case (name, col) =>
        val t = header.get(name).getOrElse(fail(s"no tensor '$name', which the dataset schema lists"))
        // -1: a dimension that differs between the partitions of a partitioned dataset
        val shapeFits = t.sampleShape.size == col.sampleShape.size &&
          t.sampleShape.zip(col.sampleShape).forall { case (have, want) => want == -1 || have == want }
        if (t.dtype != col.dtype || !shapeFits)
          fail(s"tensor '$name' is ${t.dtype}${t.shape.mkString("[", ", ", "]")}, the manifest says ${col.dtype}[*, ${col.sampleShape.mkString(", ")}]")
        if (t.rows != entry.samples)
          fail(s"tensor '$name' has ${t.rows} rows, the manifest's samples_count is ${entry.samples}")
      }
    }
    (header, file)
  }

  /** Where the bytes of `tensors` of file `name` lie once read (`Storage.ranges`: only
    * their ranges, coalesced): each tensor's name to its buffer and offset there. */
  def located(storage: Storage, name: String, tensors: Iterable[TensorInfo]): Map[String, (ByteBuffer, Int)] = {
    val ts = tensors.toIndexedSeq
    ts.map(_.name).zip(storage.ranges(name, ts.map(t => (t.begin, t.end)))).toMap
  }

  /** The column `name` of a KV tensor name: the longest `{separator}{column}` suffix wins. */
  def splitKv(name: String, columns: Seq[String], sep: String): Option[(String, String)] =
    columns.filter(c => name.endsWith(sep + c)).sortBy(-_.length).headOption
      .map(c => (name.dropRight(sep.length + c.length), c))
}

/** The `rows` view: only the required columns' row ranges are read; no column, no I/O. */
final class RowsReader(plan: ReadPlan, p: ShardPart, required: StructType) extends IteratorReader {
  override protected def rows: Iterator[InternalRow] = {
    val n = (p.rowStop - p.rowStart).toInt
    if (required.isEmpty) return Iterator.fill(n)(InternalRow.empty)
    val (header, file) = Readers.checkedHeader(plan, p.source, p.shard)
    val src = plan.sources(p.source)
    val shardName = src.manifest.get.shards(p.shard).path
    val struct = plan.options.tensorFormat == "struct"
    val cols: Array[(TensorInfo, ByteBuffer, Int)] = required.fieldNames.map { name =>
      val t = header.get(name).getOrElse(throw new SafetensorsReadException(s"file '$file': no tensor '$name'"))
      val rowBytes = ((t.end - t.begin) / math.max(1L, t.rows)).toInt
      val buf = if (t.shape.isEmpty) src.storage.slice(shardName, t.begin, t.end - t.begin)
        else src.storage.slice(shardName, t.begin + p.rowStart * rowBytes, n.toLong * rowBytes)
      (t, buf, rowBytes)
    }
    Iterator.range(0, n).map { i =>
      val values = new Array[Any](cols.length)
      var c = 0
      while (c < cols.length) {
        val (t, buf, rowBytes) = cols(c)
        val sample = t.sampleShape
        values(c) =
          if (struct) Values.struct(buf, i * rowBytes, rowBytes, sample, t.dtype, s"file '$file': tensor '${t.name}'")
          else Values.nested(buf, i * rowBytes, sample, t.dtype, Values.elemBytes(t))
        c += 1
      }
      new GenericInternalRow(values): InternalRow
    }
  }
}

/** The `kv` view: one row per key of a shard, keys sorted; pushed key filters skip the rest. */
final class KvReader(plan: ReadPlan, p: ShardPart, required: StructType, wanted: Wanted) extends IteratorReader {
  override protected def rows: Iterator[InternalRow] = {
    val src = plan.sources(p.source)
    val m = src.manifest.get
    val (header, file) = Readers.checkedHeader(plan, p.source, p.shard)
    val keyCol = m.nameCol.getOrElse("key")
    val sep = m.kvSeparator.getOrElse("__")
    val columns = m.schema.map(_._1)
    val byKey = scala.collection.mutable.HashMap.empty[String, scala.collection.mutable.HashMap[String, TensorInfo]]
    header.tensors.foreach { t =>
      val (key, col) = Readers.splitKv(t.name, columns, sep).getOrElse(throw new SafetensorsReadException(
        s"file '$file': tensor '${t.name}' is not '<key>$sep<column>' for a column of the dataset"))
      if (wanted.keys.forall(_(key))) byKey.getOrElseUpdate(key, scala.collection.mutable.HashMap.empty)(col) = t
    }
    val dataCols = required.fieldNames.filter(_ != keyCol)
    val at = Readers.located(src.storage, m.shards(p.shard).path, byKey.values.flatMap(cols => dataCols.flatMap(cols.get)))
    val struct = plan.options.tensorFormat == "struct"
    byKey.keys.toSeq.sorted.iterator.map { key =>
      val values = required.fieldNames.map { name =>
        if (name == keyCol) UTF8String.fromString(key)
        else {
          val t = byKey(key).getOrElse(name, throw new SafetensorsReadException(s"file '$file': key '$key' has no tensor for column '$name'"))
          val (buf, off) = at(t.name)
          if (struct) Values.struct(buf, off, (t.end - t.begin).toInt, t.shape.toSeq, t.dtype, s"tensor '${t.name}'")
          else Values.nested(buf, off, t.shape.toSeq, t.dtype, Values.elemBytes(t))
        }
      }
      new GenericInternalRow(values.toArray[Any]): InternalRow
    }
  }
}

/** The `tensors` view: one row per tensor; without `data` only headers are read. */
final class TensorsReader(plan: ReadPlan, p: FilesPart, required: StructType, wanted: Wanted) extends IteratorReader {
  override protected def rows: Iterator[InternalRow] = {
    val src = plan.sources(p.source)
    p.files.iterator.flatMap { f =>
      val (name, size) = (src.files(f), src.sizes(f))
      val shown = UTF8String.fromString(src.storage.display(name))
      val tensors = Header.read(src.storage, name, size).tensors.filter(t => wanted.keep(t.name, t.dtype))
      val at = if (required.fieldNames.contains("data")) Readers.located(src.storage, name, tensors) else Map.empty[String, (ByteBuffer, Int)]
      tensors.iterator.map { t =>
        val values = required.fieldNames.map {
          case "file" => shown
          case "name" => UTF8String.fromString(t.name)
          case "dtype" => UTF8String.fromString(t.dtype)
          case "shape" => Values.longs(t.shape.toSeq)
          case "data" => val (buf, off) = at(t.name)
            Values.struct(buf, off, (t.end - t.begin).toInt, t.shape.toSeq, t.dtype, s"tensor '${t.name}'")
        }
        new GenericInternalRow(values.toArray[Any]): InternalRow
      }
    }
  }
}

/** The `files` view: one row per file, each column that file's tensor of that name (null
  * where the file has none), a dataset's shards checked against the manifest first. */
final class FilesReader(plan: ReadPlan, p: FilesPart, required: StructType) extends IteratorReader {
  override protected def rows: Iterator[InternalRow] = {
    val src = plan.sources(p.source)
    p.files.iterator.map { f =>
      val (name, size) = (src.files(f), src.sizes(f))
      val header = if (src.manifest.isDefined) Readers.checkedHeader(plan, p.source, f)._1 else Header.read(src.storage, name, size)
      val at = Readers.located(src.storage, name, required.fieldNames.flatMap(header.get))
      val values = required.fieldNames.map { col =>
        header.get(col).map { t => val (buf, off) = at(t.name)
          Values.struct(buf, off, (t.end - t.begin).toInt, t.shape.toSeq, t.dtype,
            s"file '${src.storage.display(name)}': tensor '${t.name}'")
        }.orNull
      }
      new GenericInternalRow(values.toArray[Any]): InternalRow
    }
  }
}
