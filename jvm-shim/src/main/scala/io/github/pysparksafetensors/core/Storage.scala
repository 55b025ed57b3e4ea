package io.github.pysparksafetensors.core

import java.io.IOException
import java.nio.{ByteBuffer, ByteOrder}
import java.nio.channels.FileChannel
import java.nio.file.StandardOpenOption

import org.apache.hadoop.conf.Configuration
import org.apache.hadoop.fs.{FileStatus, FileSystem, LocalFileSystem, Path}

/** A read failure naming the file and the rule it breaks. */
class SafetensorsReadException(message: String) extends IllegalArgumentException(message)

/** A Hadoop `Configuration` that travels to the tasks. */
final class HadoopConf(@transient var value: Configuration) extends Serializable {
  private def writeObject(out: java.io.ObjectOutputStream): Unit = {
    out.defaultWriteObject(); value.write(out)
  }
  private def readObject(in: java.io.ObjectInputStream): Unit = {
    in.defaultReadObject(); value = new Configuration(false); value.readFields(in)
  }
}

/** One directory of files on any Hadoop `FileSystem` (local paths, hdfs://, object stores
  * such as s3a:// with their connector on the classpath), read the way the Python
  * `DatasetLocation` reads: local files memory-mapped, remote ones by ranged reads of only
  * the bytes asked for. `root` is the directory as the user gave it; `display` joins it. */
final class Storage(val root: String, conf: HadoopConf) extends Serializable {
  @transient private lazy val rootPath = new Path(root)
  @transient lazy val fs: FileSystem = rootPath.getFileSystem(conf.value) match {
    case local: LocalFileSystem => local.getRawFileSystem
    case other => other
  }
  @transient lazy val isLocal: Boolean = fs.getUri.getScheme == "file"

  def path(name: String): Path = new Path(rootPath, name)
  def display(name: String): String = if (root.endsWith("/")) root + name else s"$root/$name"

  /** I/O errors re-raised naming the file. */
  def naming[T](name: String)(body: => T): T =
    try body
    catch {
      case e: SafetensorsReadException => throw e
      case e: IOException => throw new SafetensorsReadException(s"file '${display(name)}': ${e.getMessage}")
    }

  /** The directory `dir` under this one (a partition of a dataset). */
  def sub(dir: String): Storage = new Storage(display(dir), conf)

  def exists(name: String): Boolean = fs.exists(path(name))
  def status(name: String): Option[FileStatus] =
    try Some(fs.getFileStatus(path(name))) catch { case _: java.io.FileNotFoundException => None }
  def rootStatus(): Option[FileStatus] =
    try Some(fs.getFileStatus(rootPath)) catch { case _: java.io.FileNotFoundException => None }

  /** Names of the regular files directly under the root. */
  def list(): Seq[String] = naming(".")(fs.listStatus(rootPath).toSeq.filter(_.isFile).map(_.getPath.getName).sorted)

  def readBytes(name: String): Array[Byte] = naming(name) {
    val len = fs.getFileStatus(path(name)).getLen
    readRange(name, 0, len)
  }

  /** `length` bytes at `offset` of `name` (one ranged read on object stores). */
  def readRange(name: String, offset: Long, length: Long): Array[Byte] = naming(name) {
    if (length > Storage.MaxRead)
      throw new SafetensorsReadException(s"file '${display(name)}': a range of $length bytes is over 2 GiB; split the read")
    val out = new Array[Byte](length.toInt)
    val in = fs.open(path(name))
    try in.readFully(offset, out) finally in.close()
    out
  }

  /** The bytes `[offset, offset + length)` of `name` as a little-endian buffer: a read-only
    * memory map for local files (no copy), a ranged read elsewhere. */
  def slice(name: String, offset: Long, length: Long): ByteBuffer = naming(name) {
    if (length > Storage.MaxRead)
      throw new SafetensorsReadException(s"file '${display(name)}': a range of $length bytes is over 2 GiB, more than a Spark value holds")
    val buf =
      if (isLocal && length > 0) {
        val file = java.nio.file.Paths.get(fs.makeQualified(path(name)).toUri)
        val ch = FileChannel.open(file, StandardOpenOption.READ)
        try ch.map(FileChannel.MapMode.READ_ONLY, offset, length) finally ch.close()
      } else ByteBuffer.wrap(readRange(name, offset, length))
    buf.order(ByteOrder.LITTLE_ENDIAN)
  }

  /** The byte ranges `spans` (begin, end) of `name` in as few reads as the rules allow, each
    * returned as its buffer and the range's offset in it, in the order given. Ranges closer
    * than `Storage.CoalesceBytes` share a ranged read (locally any gap: a memory map pages
    * in only what is touched), and no read spans over 2 GiB, so a tensor of a file of any
    * size is read and a filter that keeps a few tensors fetches only theirs. */
  def ranges(name: String, spans: IndexedSeq[(Long, Long)]): IndexedSeq[(ByteBuffer, Int)] = {
    val gap = if (isLocal) Long.MaxValue else Storage.CoalesceBytes
    val order = spans.indices.sortBy(i => spans(i)._1)
    val out = new Array[(ByteBuffer, Int)](spans.length)
    var i = 0
    while (i < order.length) {
      val start = spans(order(i))._1
      var end = spans(order(i))._2
      var j = i + 1
      while (j < order.length && spans(order(j))._1 - end <= gap &&
          math.max(end, spans(order(j))._2) - start <= Storage.MaxRead) {
        end = math.max(end, spans(order(j))._2); j += 1
      }
      val buf = slice(name, start, end - start)
      (i until j).foreach(k => out(order(k)) = (buf, (spans(order(k))._1 - start).toInt))
      i = j
    }
    out.toIndexedSeq
  }
}

object Storage {
  /** The largest single read: a Java array or buffer holds under 2^31 bytes. */
  val MaxRead: Long = Int.MaxValue - 16
  /** Remote ranges closer than this share one read (the Python reader's READ_COALESCING_BYTES). */
  val CoalesceBytes: Long = 1L << 20
  def apply(root: String, conf: Configuration): Storage = new Storage(root, new HadoopConf(conf))
}
