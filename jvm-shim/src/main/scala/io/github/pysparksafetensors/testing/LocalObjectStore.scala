package io.github.pysparksafetensors.testing

import java.net.URI

import org.apache.hadoop.fs.RawLocalFileSystem

/** A Hadoop `FileSystem` under the scheme `stlocal` that stores files in the local
  * directory of the same path (`stlocal:///tmp/x` is `/tmp/x`) but is not `file`, so the
  * JVM reader and writer take their object-store paths through it: ranged reads instead of
  * memory maps, one stream per file instead of a rename. Registered by a test with
  * `fs.stlocal.impl = io.github.pysparksafetensors.testing.LocalObjectStore`. */
class LocalObjectStore extends RawLocalFileSystem {
  override def getScheme: String = "stlocal"
  override def getUri: URI = URI.create("stlocal:///")
}
