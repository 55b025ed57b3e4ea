package io.github.pysparksafetensors.write

import java.io.{IOException, OutputStream}
import java.nio.file.{Files, StandardCopyOption, StandardOpenOption}
import java.util.UUID

import org.apache.hadoop.conf.Configuration
import org.apache.hadoop.fs.{FileSystem, LocalFileSystem, Path}

/** The files of one dataset directory, on any Hadoop `FileSystem` the cluster is
  * configured for (local paths, hdfs://, and object stores such as s3a:// with their
  * connector on the classpath), with the rules of the Python `DatasetLocation`:
  *
  *  - locally a file is written under a temporary name, fsynced and renamed into place
  *    (the rename is the atomic step); Hadoop's checksum files are not written;
  *  - elsewhere a file is one stream to its final name (an object appears whole or not at
  *    all), never renamed, which object stores cannot do atomically.
  *
  * Serializable: built on the driver from the path and the job's Hadoop configuration,
  * used again in the tasks.
  */
final class DatasetFiles(val uri: String, conf: SerializableConfiguration) extends Serializable {
  @transient private lazy val rootPath = new Path(uri)
  @transient private lazy val fs: FileSystem = rootPath.getFileSystem(conf.value) match {
    case local: LocalFileSystem => local.getRawFileSystem
    case other => other
  }
  @transient lazy val isLocal: Boolean = fs.getUri.getScheme == "file"
  @transient private lazy val localRoot: java.nio.file.Path =
    java.nio.file.Paths.get(fs.makeQualified(rootPath).toUri)

  def path(name: String): Path = new Path(rootPath, name)
  private def local(name: String): java.nio.file.Path = localRoot.resolve(name)

  /** I/O errors re-raised naming the dataset and the file. */
  def naming[T](name: String)(body: => T): T =
    try body
    catch {
      case e: IOException =>
        throw new IOException(s"dataset '$uri', file '$name': ${e.getMessage}", e)
    }

  /** The files of directory `dir` under this one (a partition of a dataset). */
  def sub(dir: String): DatasetFiles = new DatasetFiles(s"${uri.stripSuffix("/")}/$dir", conf)

  def exists(): Boolean = fs.exists(rootPath)
  def has(name: String): Boolean = fs.exists(path(name))
  def makedirs(): Unit = naming(".")(fs.mkdirs(rootPath))

  /** Names directly under the root (files and directories). */
  def list(): Seq[String] =
    if (!fs.exists(rootPath)) Seq.empty else fs.listStatus(rootPath).toSeq.map(_.getPath.getName).sorted

  /** Names of the files under `dir` (recursively; "" for the root), relative to it. */
  def listUnder(dir: String): Seq[String] = {
    val base = if (dir.isEmpty) rootPath else path(dir)
    if (!fs.exists(base)) return Seq.empty
    val prefix = fs.makeQualified(base).toUri.getPath.stripSuffix("/") + "/"
    val it = fs.listFiles(base, true)
    val out = Seq.newBuilder[String]
    while (it.hasNext) out += it.next().getPath.toUri.getPath.stripPrefix(prefix)
    out.result()
  }

  def readBytes(name: String): Array[Byte] = naming(name) {
    val in = fs.open(path(name))
    try in.readAllBytes() finally in.close()
  }

  def isFile(name: String): Boolean = scala.util.Try(fs.getFileStatus(path(name)).isFile).getOrElse(false)

  def size(name: String): Long = fs.getFileStatus(path(name)).getLen

  /** Publish a whole small file in one atomic step (see the class comment). */
  def putBytes(name: String, data: Array[Byte]): Unit = writeFile(name)(_.write(data))

  /** Write a file with `body` (atomically: a temporary name and a rename locally, one
    * stream elsewhere); on failure nothing is left under either name. */
  def writeFile[T](name: String)(body: OutputStream => T): T = naming(name) {
    if (isLocal) {
      val target = local(name)
      Files.createDirectories(target.getParent)
      val tmp = target.resolveSibling(s".${target.getFileName}.${UUID.randomUUID().toString.replace("-", "")}.tmp")
      try {
        val channel = java.nio.channels.FileChannel.open(tmp, StandardOpenOption.CREATE_NEW, StandardOpenOption.WRITE)
        val result =
          try {
            val out = new java.io.BufferedOutputStream(java.nio.channels.Channels.newOutputStream(channel), 1 << 20)
            val r = body(out)
            out.flush()
            channel.force(true)
            r
          } finally channel.close()
        Files.move(tmp, target, StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING)
        result
      } catch {
        case e: Throwable => Files.deleteIfExists(tmp); throw e
      }
    } else {
      val out = fs.create(path(name), true)
      val ok = try { val r = body(out); out.close(); Some(r) } catch { case e: Throwable =>
        try out.close() catch { case _: Throwable => () }
        try fs.delete(path(name), false) catch { case _: Throwable => () }
        throw e
      }
      ok.get
    }
  }

  /** Create `name` only if it does not exist (locally; elsewhere a plain put). */
  def createExclusive(name: String, data: Array[Byte]): Boolean = naming(name) {
    if (!isLocal) { putBytes(name, data); return true }
    try {
      Files.write(local(name), data, StandardOpenOption.CREATE_NEW, StandardOpenOption.WRITE)
      true
    } catch { case _: java.nio.file.FileAlreadyExistsException => false }
  }

  /** Delete files and directories (recursively) by name; missing ones are fine. */
  def delete(names: Iterable[String]): Unit = names.foreach { name =>
    naming(name)(fs.delete(path(name), true))
  }

  /** Remove the directories under the root that hold no file, however deep (those a
    * failed partitioned write made); returns whether any file is under the root. */
  def removeEmptyDirs(): Boolean = {
    def walk(dir: Path): Boolean = {
      val (dirs, files) = fs.listStatus(dir).toSeq.partition(_.isDirectory)
      val held = dirs.map(d => walk(d.getPath)).foldLeft(false)(_ || _) || files.nonEmpty
      if (!held && dir != rootPath) fs.delete(dir, false)
      held
    }
    fs.exists(rootPath) && walk(rootPath)
  }

  /** Remove the directory itself when nothing is under it; returns whether it was. */
  def removeIfEmpty(): Boolean = {
    if (isLocal) {
      try { Files.delete(localRoot); true }
      catch { case _: java.nio.file.NoSuchFileException | _: java.nio.file.DirectoryNotEmptyException => false }
    } else if (!fs.exists(rootPath) || list().nonEmpty) false
    else fs.delete(rootPath, true)
  }
}

/** A Hadoop configuration that travels to the tasks. */
final class SerializableConfiguration(@transient var value: Configuration) extends Serializable {
  private def writeObject(out: java.io.ObjectOutputStream): Unit = {
    out.defaultWriteObject()
    value.write(out)
  }
  private def readObject(in: java.io.ObjectInputStream): Unit = {
    value = new Configuration(false)
    value.readFields(in)
  }
}
