package io.github.pysparksafetensors.write

import java.io.{ByteArrayInputStream, ByteArrayOutputStream}

import scala.collection.mutable

import org.apache.hadoop.conf.Configuration
import org.apache.parquet.example.data.Group
import org.apache.parquet.hadoop.api.WriteSupport
import org.apache.parquet.hadoop.example.GroupReadSupport
import org.apache.parquet.hadoop.{ParquetFileWriter, ParquetReader, ParquetWriter}
import org.apache.parquet.io.api.{Binary, RecordConsumer}
import org.apache.parquet.hadoop.metadata.CompressionCodecName
import org.apache.parquet.io.{DelegatingPositionOutputStream, DelegatingSeekableInputStream, InputFile, OutputFile, PositionOutputStream, SeekableInputStream}
import org.apache.parquet.schema.MessageTypeParser

/** `_tensor_index.parquet`: one row per tensor, the columns of the Python `INDEX_SCHEMA`
  * (the spec's `tensor_key, file_name, shape, dtype` plus absolute offsets `begin, end`),
  * written with parquet-hadoop's record consumer and read with its example object model
  * (no Arrow on the JVM). */
private[write] object IndexFile {
  val Schema = MessageTypeParser.parseMessageType(
    """message schema {
      |  optional binary tensor_key (STRING);
      |  optional binary file_name (STRING);
      |  optional group shape (LIST) { repeated group list { optional int32 element; } }
      |  optional binary dtype (STRING);
      |  optional int64 begin;
      |  optional int64 end;
      |}""".stripMargin)

  /** One index row: tensor `i` of `rows`. */
  private final case class Row(rows: IndexRows, i: Int)

  /** Writes index rows straight to parquet's record consumer (no object per field). */
  private final class RowWriteSupport extends WriteSupport[Row] {
    private var out: RecordConsumer = _
    override def init(conf: Configuration): WriteSupport.WriteContext =
      new WriteSupport.WriteContext(Schema, new java.util.HashMap[String, String]())
    override def prepareForWrite(consumer: RecordConsumer): Unit = out = consumer
    private def text(field: String, index: Int, value: String): Unit = {
      out.startField(field, index); out.addBinary(Binary.fromString(value)); out.endField(field, index)
    }
    private def long(field: String, index: Int, value: Long): Unit = {
      out.startField(field, index); out.addLong(value); out.endField(field, index)
    }
    override def write(row: Row): Unit = {
      val r = row.rows
      val i = row.i
      out.startMessage()
      text("tensor_key", 0, r.keys(i))
      text("file_name", 1, r.fileName)
      out.startField("shape", 2)
      out.startGroup()
      val dims = r.shapes(i)
      if (dims.nonEmpty) {
        out.startField("list", 0)
        dims.foreach { d =>
          out.startGroup(); out.startField("element", 0); out.addInteger(d); out.endField("element", 0); out.endGroup()
        }
        out.endField("list", 0)
      }
      out.endGroup()
      out.endField("shape", 2)
      text("dtype", 3, r.dtypes(i))
      long("begin", 4, r.begins(i))
      long("end", 5, r.ends(i))
      out.endMessage()
    }
  }

  private final class RowWriterBuilder(file: OutputFile) extends ParquetWriter.Builder[Row, RowWriterBuilder](file) {
    override def self(): RowWriterBuilder = this
    override def getWriteSupport(conf: Configuration): WriteSupport[Row] = new RowWriteSupport
  }

  /** A parquet file of `rows`, as bytes: each task encodes its own shards' rows, the commit
    * joins the tasks' files with [[merge]]. Keys are unique, so only `file_name` and `dtype`
    * are dictionary-encoded, as the Python writer does. */
  def bytes(rows: Seq[IndexRows]): Array[Byte] = {
    val sink = new ByteArrayOutputStream()
    val writer = new RowWriterBuilder(outputTo(sink)).withConf(new Configuration(false))
      .withCompressionCodec(CompressionCodecName.SNAPPY).withDictionaryEncoding(false)
      .withDictionaryEncoding("file_name", true).withDictionaryEncoding("dtype", true).build()
    try for (r <- rows; i <- r.keys.indices) writer.write(Row(r, i))
    finally writer.close()
    sink.toByteArray
  }

  /** One index file holding the rows of `parts` (files from [[bytes]]) in order. Row groups
    * are copied as they are, not decoded: the commit's share of the index is this copy, the
    * encoding having run in the tasks, side by side. */
  def merge(parts: Seq[Array[Byte]]): Array[Byte] = parts match {
    case Seq(one) => one
    case _ =>
      val sink = new ByteArrayOutputStream(parts.map(_.length).sum + 4096)
      // Deprecated in parquet-hadoop 1.17, but also in the older releases clusters ship.
      val writer = new ParquetFileWriter(outputTo(sink), Schema, ParquetFileWriter.Mode.CREATE,
        ParquetWriter.DEFAULT_BLOCK_SIZE.toLong, ParquetWriter.MAX_PADDING_SIZE_DEFAULT)
      writer.start()
      parts.foreach(part => writer.appendFile(inputFrom(part)))
      writer.end(new java.util.HashMap[String, String]())
      sink.toByteArray
  }

  private def outputTo(sink: ByteArrayOutputStream): OutputFile = new OutputFile {
    private def stream(): PositionOutputStream = new DelegatingPositionOutputStream(sink) {
      override def getPos: Long = sink.size().toLong
    }
    override def create(blockSizeHint: Long): PositionOutputStream = stream()
    override def createOrOverwrite(blockSizeHint: Long): PositionOutputStream = stream()
    override def supportsBlockSize(): Boolean = false
    override def defaultBlockSize(): Long = 0L
  }

  private def inputFrom(data: Array[Byte]): InputFile = new InputFile {
    override def getLength: Long = data.length.toLong
    override def newStream(): SeekableInputStream = {
      val in = new ByteArrayInputStream(data) { def at: Int = pos; def to(p: Int): Unit = pos = p }
      new DelegatingSeekableInputStream(in) {
        override def getPos: Long = in.at.toLong
        override def seek(p: Long): Unit = in.to(p.toInt)
      }
    }
  }

  /** The rows of an index file's bytes, grouped by shard file. */
  def read(data: Array[Byte], where: String): Seq[IndexRows] = {
    val file = inputFrom(data)
    val reader = new ParquetReader.Builder[Group](file) {
      override def getReadSupport() = new GroupReadSupport()
    }.withConf(new Configuration(false)).build()
    val byFile = mutable.LinkedHashMap.empty[String, mutable.ArrayBuffer[(String, String, Array[Int], Long, Long)]]
    try {
      var g: Group = reader.read()
      while (g != null) {
        val shape = g.getGroup("shape", 0)
        val dims = Array.tabulate(shape.getFieldRepetitionCount(0))(i => shape.getGroup(0, i).getInteger(0, 0))
        byFile.getOrElseUpdate(g.getString("file_name", 0), mutable.ArrayBuffer.empty) +=
          ((g.getString("tensor_key", 0), g.getString("dtype", 0), dims, g.getLong("begin", 0), g.getLong("end", 0)))
        g = reader.read()
      }
    } catch {
      case e: RuntimeException => throw new SafetensorsWriteException(s"$where: unreadable tensor index (${e.getMessage})")
    } finally reader.close()
    byFile.toSeq.map { case (f, rs) =>
      IndexRows(f, rs.map(_._1).toArray, rs.map(_._2).toArray, rs.map(_._3).toArray, rs.map(_._4).toArray, rs.map(_._5).toArray)
    }
  }
}
