package io.github.pysparksafetensors.read

import java.util.Locale

import scala.jdk.CollectionConverters._

import com.fasterxml.jackson.databind.ObjectMapper
import org.apache.hadoop.conf.Configuration
import org.apache.hadoop.fs.Path
import org.apache.spark.sql.types._
import org.apache.spark.sql.util.CaseInsensitiveStringMap

import io.github.pysparksafetensors.core.{Header, Partitions, SafetensorsReadException, Storage}
import io.github.pysparksafetensors.core
import io.github.pysparksafetensors.write.ManifestDoc

/** The reader's options: the Python `ReaderOptions` table, parsed with the same rules.
  * `rowsGiven`: `rows_per_partition` was set, so its row ranges are the partitions (else
  * the `rows` view packs shards into partitions as Spark packs files). */
final case class ReaderOptions(paths: Seq[String], view: Option[String], tensorFormat: String,
    includeData: Boolean, rowsPerPartition: Int, inferSchema: Boolean, rowsGiven: Boolean)

object ReaderOptions {
  val Views = Seq("rows", "kv", "tensors", "files")
  val Known = Set("path", "paths", "view", "tensor_format", "include_data", "rows_per_partition", "inferschema",
    "implementation")
  /** Storage settings the Python source takes; here the cluster's Hadoop configuration rules. */
  val Storage = Set("endpoint_url", "region", "path_style", "anonymous")
  val DefaultRowsPerPartition = 65536

  /** Whether `key` (lower case) is one of the reader's options, storage ones included. */
  def takes(key: String): Boolean = Known(key) || Storage(key)

  private def fail(msg: String): Nothing = throw new SafetensorsReadException(msg)

  def parse(options: CaseInsensitiveStringMap): ReaderOptions = {
    val given = options.asCaseSensitiveMap().asScala.map { case (k, v) => k.toLowerCase(Locale.ROOT) -> v }.toMap
    given.keys.filterNot(k => Known(k) || Storage(k)).toSeq.sorted.headOption.foreach { k =>
      fail(s"unknown read option '$k'; the reader takes ${(Known - "inferschema" + "inferSchema").toSeq.sorted.mkString(", ")}")
    }
    def choice(name: String, allowed: Seq[String]): Option[String] = given.get(name).map { v =>
      val l = v.trim.toLowerCase(Locale.ROOT)
      if (!allowed.contains(l)) fail(s"option $name='$v' is not one of ${allowed.mkString(", ")}")
      l
    }
    def bool(name: String, default: Boolean): Boolean = given.get(name).map(_.trim.toLowerCase(Locale.ROOT)) match {
      case None => default
      case Some("true" | "1" | "yes") => true
      case Some("false" | "0" | "no") => false
      case Some(v) => fail(s"option $name='$v' is not a boolean (true or false)")
    }
    val rows = given.get("rows_per_partition").map { v =>
      val n = scala.util.Try(v.trim.toInt).getOrElse(fail(s"option rows_per_partition='$v' is not an integer"))
      if (n < 1) fail(s"option rows_per_partition=$n must be at least 1")
      n
    }.getOrElse(DefaultRowsPerPartition)
    // `paths`: a JSON list (Spark's load(p1, p2)) or a comma-separated list (the Scala connector's)
    val paths = given.get("path").filter(_.nonEmpty).toSeq ++ given.get("paths").toSeq.flatMap { v =>
      if (v.trim.startsWith("[")) scala.util.Try(new ObjectMapper().readTree(v).elements().asScala.map(_.asText).toList)
        .getOrElse(fail(s"option paths='$v': expected a JSON list or a comma-separated list of paths"))
      else v.split(",").map(_.trim).filter(_.nonEmpty).toSeq
    }
    if (paths.isEmpty) fail("no path: use .load(path) or .load(path1, path2, ...)")
    ReaderOptions(paths, choice("view", Views), choice("tensor_format", Seq("array", "struct")).getOrElse("array"),
      bool("include_data", default = true), rows, bool("inferschema", default = false),
      given.contains("rows_per_partition"))
  }
}

/** One loaded path: a dataset (its manifest) or plain safetensors files with their sizes;
  * or one partition of a partitioned dataset, with its columns' values (None: null). */
final case class Source(storage: Storage, manifest: Option[ManifestDoc], files: Seq[String], sizes: Seq[Long],
    partition: Seq[(String, Option[String])] = Nil)

/** What a read resolved to on the driver: sources checked, the view and its schema (a
  * partitioned dataset's partition columns last, `partitionSchema`). */
final case class ReadPlan(options: ReaderOptions, sources: Seq[Source], view: String, schema: StructType,
    partitionSchema: StructType = new StructType())

object ReadPlan {
  val Manifest = "dataset_manifest.json"
  val TensorStruct: StructType = StructType(Seq(
    StructField("data", BinaryType), StructField("shape", ArrayType(IntegerType)), StructField("dtype", StringType)))

  /** The Spark element type a stored dtype is read as (the Python reader's `READ_TYPES`). */
  def elementType(dtype: String): DataType = dtype match {
    case "F16" | "BF16" | "F32" => FloatType
    case "F64" => DoubleType
    case "I8" => ByteType
    case "U8" | "I16" => ShortType
    case "U16" | "I32" => IntegerType
    case "U32" | "I64" | "U64" => LongType
    case "BOOL" => BooleanType
    case other => throw new SafetensorsReadException(
      s"dtype $other has no Spark element type; read it with view=tensors or tensor_format=struct")
  }

  def plan(options: CaseInsensitiveStringMap, conf: Configuration): ReadPlan = {
    val o = ReaderOptions.parse(options)
    val resolved = o.paths.map(resolve(_, conf))
    val sources = resolved.map(_.head)
    val views = sources.map(defaultView(_, o))
    val partitions = resolved.zip(views).map { case (s, v) => if (v == "rows" || v == "kv") partitionSchema(s) else new StructType() }
    val schemas = sources.zip(views).zip(partitions).map { case ((s, v), p) => StructType(schema(s, v, o).fields ++ p.fields) }
    sources.indices.drop(1).foreach { i =>
      if (views(i) != views(0) || schemas(i) != schemas(0))
        throw new SafetensorsReadException(
          s"the loaded paths cannot be read as one DataFrame: ${disagreement(o.paths(0), o.paths(i),
            (views(0), schemas(0)), (views(i), schemas(i)))}. Load paths of one schema together, " +
            "or load them one by one and combine the DataFrames (unionByName)")
    }
    ReadPlan(o, resolved.flatten, views.head, schemas.head, partitions.head)
  }

  /** The partition columns of a partitioned dataset's sources, typed from all their values. */
  private def partitionSchema(sources: Seq[Source]): StructType =
    StructType(sources.head.partition.map(_._1).zipWithIndex.map { case (c, i) =>
      StructField(c, Partitions.inferType(sources.map(_.partition(i)._2)))
    })

  /** Why two loaded paths differ, worded as the Python reader words it. */
  private def disagreement(first: String, other: String, a: (String, StructType), b: (String, StructType)): String = {
    def names(s: StructType) = s.fieldNames.map(n => s"'$n'").mkString("[", ", ", "]")
    if (a._1 != b._1) s"'$first' is read as view=${a._1}, '$other' as view=${b._1}"
    else a._2.fields.zip(b._2.fields).collectFirst {
      case (fa, fb) if fa.name != fb.name => s"column '${fa.name}' of '$first' is '${fb.name}' in '$other'"
      case (fa, fb) if fa.dataType != fb.dataType =>
        s"column '${fa.name}' is ${fa.dataType.simpleString} in '$first' and ${fb.dataType.simpleString} in '$other'"
    }.getOrElse(s"'$first' has columns ${names(a._2)}, '$other' has ${names(b._2)}")
  }

  /** The plan reading `given` (a schema the user gave): each column one of the data's, of
    * the same type (nullability aside). */
  def withSchema(planned: ReadPlan, given: StructType): ReadPlan = {
    // Tensor Struct columns named after tensors, on plain files read by default: the
    // Scala connector's read model, the files view
    val plan =
      if (planned.view == "tensors" && planned.options.view.isEmpty && namesTensors(given, planned.schema))
        planned.copy(view = "files", schema = schema(planned.sources.head, "files", planned.options))
      else planned
    val inferred = plan.schema
    val missing = given.fieldNames.filterNot(inferred.fieldNames.contains)
    def names(ns: Seq[String]) = ns.map(n => s"'$n'").mkString("[", ", ", "]")
    if (missing.nonEmpty) throw new SafetensorsReadException(
      s"schema names column(s) ${names(missing.toSeq)} that '${plan.options.paths.head}' does not have; it has ${names(inferred.fieldNames.toSeq)}")
    given.fields.foreach { f =>
      val have = inferred(f.name).dataType
      if (f.dataType.simpleString != have.simpleString) throw new SafetensorsReadException(
        s"column '${f.name}': the given schema says ${f.dataType.simpleString}, the data is ${have.simpleString}")
    }
    plan.copy(schema = StructType(given.fields.map(f => inferred(f.name))))
  }

  private def namesTensors(given: StructType, tensorsView: StructType): Boolean =
    given.nonEmpty && given.fields.forall { f =>
      !tensorsView.fieldNames.contains(f.name) && f.dataType.simpleString == TensorStruct.simpleString
    }

  /** A dataset directory or its manifest, a `.safetensors` file, a directory or a glob; a
    * partitioned dataset as one source per partition. */
  def resolve(path: String, conf: Configuration): Seq[Source] = {
    val dir = if (path.endsWith("/" + Manifest)) path.dropRight(Manifest.length + 1) else path
    val storage = Storage(dir, conf)
    val st = storage.rootStatus()
    if (st.exists(_.isDirectory)) {
      storage.status(Manifest) match {
        case Some(m) if m.isFile => dataset(storage)
        case _ =>
          val files = storage.list().filter(_.endsWith(".safetensors"))
          if (files.isEmpty) {
            if (storage.exists("_temporary"))
              throw new SafetensorsReadException(s"dataset '$dir': no $Manifest, only files of a write that never committed; write it again")
            throw new SafetensorsReadException(s"'$dir': no $Manifest and no .safetensors file")
          }
          Seq(plainFiles(storage, files))
      }
    } else if (st.exists(_.isFile)) {
      val p = new Path(path)
      if (!p.getName.endsWith(".safetensors"))
        throw new SafetensorsReadException(
          s"'$path' is a file but neither a .safetensors file nor a dataset's $Manifest: give a " +
            "dataset directory, a .safetensors file, or a directory or glob of them")
      Seq(plainFiles(Storage(Option(p.getParent).map(_.toString).getOrElse("."), conf), Seq(p.getName)))
    } else {
      val p = new Path(path)
      val matches = Option(p.getFileSystem(conf).globStatus(p)).toSeq.flatten.filter(_.isFile)
        .map(_.getPath).filter(_.getName.endsWith(".safetensors"))
      if (matches.isEmpty || matches.map(_.getParent.toString).distinct.size != 1)
        throw new SafetensorsReadException(s"'$path': no such file or directory")
      val given = path.substring(0, math.max(0, path.lastIndexOf('/')))
      val root = if (given.nonEmpty && !given.exists("*?[{".contains(_))) given else matches.head.getParent.toString
      Seq(plainFiles(Storage(root, conf), matches.map(_.getName).sorted))
    }
  }

  private def plainFiles(storage: Storage, files: Seq[String]): Source = {
    val sizes = files.map { f =>
      val st = storage.status(f).filter(_.isFile)
        .getOrElse(throw new SafetensorsReadException(s"file '${storage.display(f)}': not a regular file"))
      Header.read(storage, f, st.getLen) // a broken file is refused here, not in a task
      st.getLen
    }
    Source(storage, None, files, sizes)
  }

  private def dataset(storage: Storage): Seq[Source] = {
    val manifest = core.Manifest.load(storage)
    manifest.shards.foreach { s =>
      val st = storage.status(s.path).getOrElse(throw new SafetensorsReadException(
        s"dataset '${storage.root}': ${s.path} is missing (listed in the manifest)"))
      if (!st.isFile) throw new SafetensorsReadException(
        s"dataset '${storage.root}': ${s.path} is not a regular file")
      if (st.getLen != s.bytes) throw new SafetensorsReadException(
        s"dataset '${storage.root}': size differs from the manifest: ${s.path} (${st.getLen} bytes, the manifest says ${s.bytes})")
    }
    val columns = manifest.partitionColumns
    if (columns.isEmpty) return Seq(Source(storage, Some(manifest), manifest.shards.map(_.path), manifest.shards.map(_.bytes)))
    // one source per partition directory, its shards' paths relative to it
    val byDir = manifest.shards.groupBy(s => Partitions.prefix(s.path)).toSeq.sortBy(_._1)
    if (byDir.isEmpty)
      return Seq(Source(storage, Some(manifest.copy(partitionColumns = Nil)), Nil, Nil, columns.map(_ -> None)))
    byDir.map { case (dir, shards) =>
      val own = shards.map(s => s.copy(path = s.path.substring(dir.length + 1)))
      Source(storage.sub(dir), Some(manifest.copy(shards = own, partitionColumns = Nil)), own.map(_.path),
        own.map(_.bytes), columns.zip(Partitions.values(dir + "/x", columns).get))
    }
  }

  def defaultView(source: Source, o: ReaderOptions): String = source.manifest match {
    case None =>
      if (o.view.exists(v => v != "tensors" && v != "files"))
        throw new SafetensorsReadException(
          s"view='${o.view.get}' needs a dataset directory with $Manifest; plain files support view=tensors or view=files")
      o.view.getOrElse(if (o.inferSchema) "files" else "tensors")
    case Some(m) =>
      val modeView = if (m.mode == "kv") "kv" else "rows"
      o.view match {
        case None => modeView
        case Some(v) if v == modeView || v == "tensors" || v == "files" => v
        case Some(v) => throw new SafetensorsReadException(
          s"view='$v' does not fit a ${m.mode}-mode dataset; use view=$modeView, tensors or files")
      }
  }

  def columnType(dtype: String, rank: Int, tensorFormat: String): DataType =
    if (tensorFormat == "struct") TensorStruct
    else (0 until rank).foldLeft(elementType(dtype))((t, _) => ArrayType(t))

  def schema(source: Source, view: String, o: ReaderOptions): StructType = view match {
    case "tensors" =>
      val base = Seq(StructField("file", StringType), StructField("name", StringType),
        StructField("dtype", StringType), StructField("shape", ArrayType(LongType)))
      StructType(if (o.includeData) base :+ StructField("data", TensorStruct) else base)
    case "files" =>
      val names = source.manifest match {
        case Some(m) if m.mode != "kv" && m.schema.nonEmpty => m.schema.map(_._1)
        case _ => source.files.zip(source.sizes).flatMap { case (f, n) => Header.read(source.storage, f, n).tensors.map(_.name) }
      }
      StructType(names.distinct.sorted.map(StructField(_, TensorStruct)))
    case _ =>
      val m = source.manifest.get
      val columns = if (m.schema.nonEmpty || m.shards.isEmpty) m.schema.map { case (n, c) => n -> (c.dtype, c.sampleShape.size) }
        else Header.read(source.storage, source.files.head, source.sizes.head).tensors.map(t => t.name -> (t.dtype, t.shape.length - 1))
      val key = if (view == "kv") Seq(StructField(m.nameCol.getOrElse("key"), StringType)) else Seq.empty
      StructType(key ++ columns.map { case (n, (dtype, rank)) => StructField(n, columnType(dtype, rank, o.tensorFormat)) })
  }
}
