package io.github.pysparksafetensors.write

import java.nio.{ByteBuffer, ByteOrder}

import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.expressions.UnsafeArrayData
import org.apache.spark.sql.catalyst.util.ArrayData
import org.apache.spark.sql.types._

import io.github.pysparksafetensors.TensorCodec

/** How one Spark column becomes a tensor: numeric arrays (nested too), numeric scalars
  * (per-sample shape `[]`) or Tensor Structs `struct<data: binary, shape: array<int>,
  * dtype: string>`. `target` is the dtype written (None: a struct keeps its own). */
final case class ColumnPlan(
    name: String,
    ordinal: Int,
    kind: String,
    depth: Int,
    source: String,
    sourceType: DataType,
    target: Option[String],
    shape: Option[Seq[Int]],
    castHint: String,
    structOrdinals: (Int, Int, Int) = (0, 1, 2)
)

/** A cell that cannot be written; `detail` is the rule it breaks. */
private[write] final class BadCell(val detail: String) extends RuntimeException(detail)

object TensorColumns {
  val Accepted: String =
    "array<float|double|int|long|short|byte> (nested arrays too), a numeric scalar, or a " +
      "Tensor Struct struct<data: binary, shape: array<int>, dtype: string>"

  private def isTensorStruct(t: DataType): Boolean = t match {
    case s: StructType =>
      s.fields.map(_.name).toSet == Set("data", "shape", "dtype") &&
        s("data").dataType == BinaryType && s("dtype").dataType == StringType &&
        (s("shape").dataType match {
          case ArrayType(IntegerType | LongType, _) => true
          case _ => false
        })
    case _ => false
  }

  /** The plan of column `name` of type `t` under `options`, or an error naming it. */
  def plan(name: String, ordinal: Int, t: DataType, options: WriterOptions): ColumnPlan = {
    val shape = options.shapes.get(name)
    val hint =
      if (options.dtype.isDefined && !options.columnDtypes.contains(name))
        s"; the dtype option ${options.dtype.get} applies to every numeric column: give dtypes per " +
          s"""column as JSON instead, e.g. dtype={"$name": "..."}"""
      else ""
    if (isTensorStruct(t)) {
      val s = t.asInstanceOf[StructType]
      val target = options.columnDtypes.get(name).orElse(options.dtype)
      return ColumnPlan(name, ordinal, "struct", 0, "", t, target, shape, hint,
        (s.fieldIndex("data"), s.fieldIndex("shape"), s.fieldIndex("dtype")))
    }
    var depth = 0
    var leaf = t
    while (leaf.isInstanceOf[ArrayType]) { depth += 1; leaf = leaf.asInstanceOf[ArrayType].elementType }
    val source = DTypes.ofSpark(leaf).getOrElse(throw new SafetensorsWriteException(
      s"column '$name' has type ${t.simpleString}, which cannot be written as a tensor; accepted: $Accepted"))
    ColumnPlan(name, ordinal, if (depth > 0) "array" else "scalar", depth, source, leaf,
      Some(options.targetDtype(name, source)), shape, hint)
  }

  /** Appends one cell's tensor to `out` in the plan's dtype; returns (dtype, sample shape).
    * Throws `BadCell` for a null, a ragged array, a bad Tensor Struct or a failed cast. */
  def encode(row: InternalRow, plan: ColumnPlan, out: Bytes): (String, Array[Int]) = {
    val mark = out.size
    try {
      val (dtype, dims) = plan.kind match {
        case "scalar" =>
          if (row.isNullAt(plan.ordinal)) throw new BadCell("null value")
          scalar(row, plan, out)
          (plan.target.get, Array.emptyIntArray)
        case "array" =>
          if (row.isNullAt(plan.ordinal)) throw new BadCell("null array")
          array(row.getArray(plan.ordinal), plan, out)
        case _ => struct(row, plan, out)
      }
      (dtype, fitShape(plan, dims))
    } catch {
      case e: Casts.CastException =>
        out.truncate(mark)
        throw new BadCell(e.getMessage + plan.castHint)
      case e: BadCell =>
        out.truncate(mark)
        throw e
    }
  }

  private def fitShape(plan: ColumnPlan, dims: Array[Int]): Array[Int] = plan.shape match {
    case None => dims
    case Some(s) =>
      val have = dims.foldLeft(1L)(_ * _)
      val want = s.foldLeft(1L)(_ * _)
      if (have != want)
        throw new BadCell(s"$have elements per row do not fit shapes=${s.mkString("[", ", ", "]")} ($want elements)")
      s.toArray
  }

  private def scalar(row: InternalRow, plan: ColumnPlan, out: Bytes): Unit = {
    val t = plan.target.get
    plan.sourceType match {
      case FloatType => Casts.floats(Array(row.getFloat(plan.ordinal)), 1, t, out)
      case DoubleType => Casts.doubles(Array(row.getDouble(plan.ordinal)), 1, t, out)
      case IntegerType => Casts.longs(Array(row.getInt(plan.ordinal).toLong), 1, false, t, out)
      case LongType => Casts.longs(Array(row.getLong(plan.ordinal)), 1, false, t, out)
      case ShortType => Casts.longs(Array(row.getShort(plan.ordinal).toLong), 1, false, t, out)
      case ByteType => Casts.longs(Array(row.getByte(plan.ordinal).toLong), 1, false, t, out)
    }
  }

  /** A (nested) array: its dims (every level rectangular) and its leaves, cast. */
  private def array(top: ArrayData, plan: ColumnPlan, out: Bytes): (String, Array[Int]) = {
    val dims = new Array[Int](plan.depth)
    var level = Seq(top)
    var d = 0
    while (d < plan.depth - 1) {
      dims(d) = level.head.numElements()
      val next = Seq.newBuilder[ArrayData]
      var lengths = Set.empty[Int]
      for (a <- level) {
        var i = 0
        val n = a.numElements()
        while (i < n) {
          if (a.isNullAt(i)) throw new BadCell("null inner array")
          val inner = a.getArray(i)
          lengths += inner.numElements()
          next += inner
          i += 1
        }
      }
      level = next.result()
      if (lengths.size > 1) throw new BadCell(s"ragged arrays inside one row: inner lengths ${lengths.toSeq.sorted.mkString("[", ", ", "]")}")
      d += 1
    }
    dims(plan.depth - 1) = if (level.isEmpty) 0 else level.head.numElements()
    level.foreach(leaves(_, plan, out))
    (plan.target.get, dims)
  }

  private def leaves(a: ArrayData, plan: ColumnPlan, out: Bytes): Unit = {
    val n = a.numElements()
    val t = plan.target.get
    val elementType = plan.sourceType
    var i = 0
    while (i < n) {
      if (a.isNullAt(i)) throw new BadCell("null element inside an array; tensors cannot hold nulls")
      i += 1
    }
    a match {
      // Same dtype, Spark's own little-endian layout: one copy of the element bytes.
      case u: UnsafeArrayData if t == plan.source && ByteOrder.nativeOrder() == ByteOrder.LITTLE_ENDIAN =>
        out.putMemory(u.getBaseObject,
          u.getBaseOffset + UnsafeArrayData.calculateHeaderPortionInBytes(n), n * DTypes.Size(t))
      case _ => elementType match {
        case FloatType => Casts.floats(a.toFloatArray(), n, t, out)
        case DoubleType => Casts.doubles(a.toDoubleArray(), n, t, out)
        case IntegerType => Casts.longs(a.toIntArray().map(_.toLong), n, false, t, out)
        case LongType => Casts.longs(a.toLongArray(), n, false, t, out)
        case ShortType => Casts.longs(a.toShortArray().map(_.toLong), n, false, t, out)
        case ByteType => Casts.longs(a.toByteArray().map(_.toLong), n, false, t, out)
      }
    }
  }

  /** A Tensor Struct, checked (known dtype, bytes matching the shape), in the plan's dtype
    * or its own. */
  private def struct(row: InternalRow, plan: ColumnPlan, out: Bytes): (String, Array[Int]) = {
    if (row.isNullAt(plan.ordinal)) throw new BadCell("null Tensor Struct")
    val (dOrd, sOrd, tOrd) = plan.structOrdinals
    val s = row.getStruct(plan.ordinal, 3)
    for ((ord, what) <- Seq(dOrd -> "data", sOrd -> "shape", tOrd -> "dtype"))
      if (s.isNullAt(ord)) throw new BadCell(s"null $what in a Tensor Struct")
    val dtypeName = s.getUTF8String(tOrd).toString
    val source = TensorCodec.Writable.find(_.name == dtypeName).map(_.name).getOrElse(
      throw new BadCell(s"unknown dtype '$dtypeName' in a Tensor Struct; valid dtypes: ${DTypes.Writable.mkString(", ")}"))
    val shapeData = s.getArray(sOrd)
    val longShape = plan.sourceType.asInstanceOf[StructType].fields(sOrd).dataType ==
      ArrayType(LongType, true) || plan.sourceType.asInstanceOf[StructType].fields(sOrd).dataType == ArrayType(LongType, false)
    val dims = (0 until shapeData.numElements()).map { i =>
      if (shapeData.isNullAt(i)) throw new BadCell("null dimension in a Tensor Struct shape")
      val v = if (longShape) shapeData.getLong(i) else shapeData.getInt(i).toLong
      if (v < 0) throw new BadCell("negative dimension in a Tensor Struct shape")
      if (v > Int.MaxValue) throw new BadCell(s"dimension $v in a Tensor Struct shape exceeds ${Int.MaxValue}")
      v.toInt
    }.toArray
    val data = s.getBinary(dOrd)
    val numel = dims.foldLeft(BigInt(1))(_ * _)
    val need = numel * DTypes.Size(source)
    if (BigInt(data.length) != need)
      throw new BadCell(s"Tensor Struct data has ${data.length} bytes, shape ${dims.mkString("[", ", ", "]")} of $source needs $need")
    val target = plan.target.getOrElse(source)
    if (target == source) out.putBytes(data, 0, data.length)
    else castBytes(data, numel.toInt, source, target, out)
    (target, dims)
  }

  private def castBytes(data: Array[Byte], n: Int, source: String, target: String, out: Bytes): Unit = {
    val b = ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN)
    source match {
      case "F32" | "F16" | "BF16" =>
        val f = Array.tabulate(n) { i =>
          source match {
            case "F32" => b.getFloat(4 * i)
            case "F16" => TensorCodec.halfToFloat(b.getShort(2 * i) & 0xffff)
            case _ => TensorCodec.bfloat16ToFloat(b.getShort(2 * i) & 0xffff)
          }
        }
        Casts.floats(f, n, target, out)
      case "F64" => Casts.doubles(Array.tabulate(n)(i => b.getDouble(8 * i)), n, target, out)
      case _ =>
        val l = Array.tabulate(n) { i =>
          (source: @unchecked) match {
            case "U8" => (b.get(i) & 0xff).toLong
            case "I8" => b.get(i).toLong
            case "U16" => (b.getShort(2 * i) & 0xffff).toLong
            case "I16" => b.getShort(2 * i).toLong
            case "U32" => b.getInt(4 * i) & 0xffffffffL
            case "I32" => b.getInt(4 * i).toLong
            case "U64" | "I64" => b.getLong(8 * i)
          }
        }
        Casts.longs(l, n, source == "U64", target, out)
    }
  }
}
