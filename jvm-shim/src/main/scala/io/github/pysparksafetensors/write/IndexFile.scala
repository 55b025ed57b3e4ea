package io.github.pysparksafetensors.write

import java.io.{ByteArrayInputStream, ByteArrayOutputStream}

import scala.collection.mutable

import org.apache.hadoop.conf.Configuration
import org.apache.parquet.example.data.Group
import org.apache.parquet.example.data.simple.SimpleGroupFactory
import org.apache.parquet.hadoop.ParquetReader
import org.apache.parquet.hadoop.example.{ExampleParquetWriter, GroupReadSupport}
import org.apache.parquet.hadoop.metadata.CompressionCodecName
import org.apache.parquet.io.{DelegatingPositionOutputStream, DelegatingSeekableInputStream, InputFile, OutputFile, PositionOutputStream, SeekableInputStream}
import org.apache.parquet.schema.MessageTypeParser

/** `_tensor_index.parquet`: one row per tensor, the columns of the Python `INDEX_SCHEMA`
  * (the spec's `tensor_key, file_name, shape, dtype` plus absolute offsets `begin, end`),
  * written and read with parquet-hadoop's example object model (no Arrow on the JVM). */
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

  /** The parquet file of `rows`, as bytes (it is put twice: under its commit's name and
    * as `_tensor_index.parquet`). */
  def bytes(rows: Seq[IndexRows]): Array[Byte] = {
    val sink = new ByteArrayOutputStream()
    val file = new OutputFile {
      private def stream(): PositionOutputStream = new DelegatingPositionOutputStream(sink) {
        override def getPos: Long = sink.size().toLong
      }
      override def create(blockSizeHint: Long): PositionOutputStream = stream()
      override def createOrOverwrite(blockSizeHint: Long): PositionOutputStream = stream()
      override def supportsBlockSize(): Boolean = false
      override def defaultBlockSize(): Long = 0L
    }
    val writer = ExampleParquetWriter.builder(file).withType(Schema)
      .withConf(new Configuration(false)).withCompressionCodec(CompressionCodecName.SNAPPY).build()
    val groups = new SimpleGroupFactory(Schema)
    try {
      for (r <- rows; i <- r.keys.indices) {
        val g = groups.newGroup()
        g.append("tensor_key", r.keys(i)).append("file_name", r.fileName)
        val shape = g.addGroup("shape")
        r.shapes(i).foreach(d => shape.addGroup("list").append("element", d))
        g.append("dtype", r.dtypes(i)).append("begin", r.begins(i)).append("end", r.ends(i))
        writer.write(g)
      }
    } finally writer.close()
    sink.toByteArray
  }

  /** The rows of an index file's bytes, grouped by shard file. */
  def read(data: Array[Byte], where: String): Seq[IndexRows] = {
    val file = new InputFile {
      override def getLength: Long = data.length.toLong
      override def newStream(): SeekableInputStream = {
        val in = new ByteArrayInputStream(data) { def at: Int = pos; def to(p: Int): Unit = pos = p }
        new DelegatingSeekableInputStream(in) {
          override def getPos: Long = in.at.toLong
          override def seek(p: Long): Unit = in.to(p.toInt)
        }
      }
    }
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
