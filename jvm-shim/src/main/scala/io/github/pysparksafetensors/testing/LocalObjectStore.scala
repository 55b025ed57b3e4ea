package io.github.pysparksafetensors.testing

import java.net.URI

import org.apache.hadoop.fs.{Path, RawLocalFileSystem}

/** A Hadoop `FileSystem` under the scheme `stlocal` that stores files in the local
  * directory of the same path (`stlocal:///tmp/x` is `/tmp/x`) but is not `file`, so the
  * JVM reader and writer take their object-store paths through it: ranged reads instead of
  * memory maps, one stream per file instead of a rename. Like an object store it refuses
  * `rename`, so a writer that renamed on it would fail its test. Registered by a test with
  * `fs.stlocal.impl = io.github.pysparksafetensors.testing.LocalObjectStore`. */
class LocalObjectStore extends RawLocalFileSystem {
  override def getScheme: String = "stlocal"
  override def getUri: URI = URI.create("stlocal:///")
  override def rename(src: Path, dst: Path): Boolean =
    throw new UnsupportedOperationException(s"stlocal is an object store: no rename of $src to $dst")
}
