package io.github.pysparksafetensors.testing

import java.net.URI

import org.apache.hadoop.fs.{FSDataOutputStream, Path, RawLocalFileSystem}
import org.apache.hadoop.util.Progressable

/** A Hadoop `FileSystem` under the scheme `stlocal` that stores files in the local
  * directory of the same path (`stlocal:///data/x` is `/data/x`) but is not `file`, so the
  * JVM reader and writer take their object-store paths through it: ranged reads instead of
  * memory maps, one stream per file instead of a rename. Like an object store it refuses
  * `rename`, so a writer that renamed on it would fail its test. Registered by a test with
  * `fs.stlocal.impl = io.github.pysparksafetensors.testing.LocalObjectStore`.
  *
  * With `fs.stlocal.halt-on-create = NAME` the process halts (exit status 137, as if
  * SIGKILLed) when it starts to create a file of that name: a driver killed at that point
  * of a commit. */
class LocalObjectStore extends RawLocalFileSystem {
  override def getScheme: String = "stlocal"
  override def getUri: URI = URI.create("stlocal:///")
  override def rename(src: Path, dst: Path): Boolean =
    throw new UnsupportedOperationException(s"stlocal is an object store: no rename of $src to $dst")

  override def create(f: Path, overwrite: Boolean, bufferSize: Int, replication: Short, blockSize: Long,
      progress: Progressable): FSDataOutputStream = {
    if (Option(getConf.get("fs.stlocal.halt-on-create")).contains(f.getName)) {
      System.err.println(s"stlocal: halting the process as it creates $f")
      Runtime.getRuntime.halt(137)
    }
    super.create(f, overwrite, bufferSize, replication, blockSize, progress)
  }
}
