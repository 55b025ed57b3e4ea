package io.github.pysparksafetensors.core

import scala.jdk.CollectionConverters._

import com.fasterxml.jackson.databind.ObjectMapper

import io.github.pysparksafetensors.write.{ManifestDoc, SafetensorsWriteException}

/** `dataset_manifest.json` for a read: the writer's `ManifestDoc` model and checks, with the
  * schema's columns in the document's order (the order a read's columns take). */
object Manifest {
  val Name = "dataset_manifest.json"
  private val mapper = new ObjectMapper()

  def load(storage: Storage): ManifestDoc = {
    val where = storage.display(Name)
    val bytes = storage.readBytes(Name)
    val doc =
      try ManifestDoc.parse(bytes, where)
      catch { case e: SafetensorsWriteException => throw new SafetensorsReadException(e.getMessage) }
    val order = mapper.readTree(bytes).get("schema").fieldNames().asScala.toList
    val columns = doc.schema.toMap
    doc.copy(schema = order.map(n => n -> columns(n)))
  }
}
