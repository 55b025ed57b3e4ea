package io.github.pysparksafetensors

import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.analysis.TypeCheckResult
import org.apache.spark.sql.catalyst.analysis.TypeCheckResult.{TypeCheckFailure, TypeCheckSuccess}
import org.apache.spark.sql.catalyst.expressions._
import org.apache.spark.sql.catalyst.expressions.codegen._
import org.apache.spark.sql.catalyst.expressions.codegen.Block._
import org.apache.spark.sql.catalyst.util.ArrayData
import org.apache.spark.sql.types._
import org.apache.spark.unsafe.types.UTF8String

/** The Tensor Struct type these functions produce and accept. */
object TensorStruct {
  val dataType: StructType = StructType(
    Seq(
      StructField("data", BinaryType, nullable = false),
      StructField("shape", ArrayType(IntegerType, containsNull = false), nullable = false),
      StructField("dtype", StringType, nullable = false)
    )
  )

  /** Field ordinals (data, shape, dtype) and whether shape holds longs, if `t` is a
    * Tensor Struct: fields named data: binary, shape: array<int|long>, dtype: string. */
  def layout(t: DataType): Option[(Int, Int, Int, Boolean)] = t match {
    case s: StructType if s.fieldNames.toSet == Set("data", "shape", "dtype") =>
      val shapeType = s("shape").dataType
      val shapeOk = shapeType match {
        case ArrayType(IntegerType | LongType, _) => true
        case _ => false
      }
      if (s("data").dataType == BinaryType && s("dtype").dataType == StringType && shapeOk)
        Some((s.fieldIndex("data"), s.fieldIndex("shape"), s.fieldIndex("dtype"),
          isLongArray(shapeType)))
      else None
    case _ => None
  }

  def isLongArray(t: DataType): Boolean = t match {
    case ArrayType(LongType, _) => true
    case _ => false
  }

  def describe: String = "a Tensor Struct struct<data: binary, shape: array<int>, dtype: string>"

  val codec: String = TensorCodec.getClass.getName.stripSuffix("$")
}

/** `arr_to_st(array, shape, dtype)`: a numeric array as a Tensor Struct of `dtype` with
  * `shape` (whose element count must match). */
case class ArrToSt(array: Expression, shape: Expression, dtype: Expression)
    extends TernaryExpression with NullIntolerantExpression {

  override def prettyName: String = "arr_to_st"
  override def first: Expression = array
  override def second: Expression = shape
  override def third: Expression = dtype
  override def dataType: DataType = TensorStruct.dataType
  // A null literal array (NullType) reads as array<float>: its rows are all null anyway.
  private def arrayType: ArrayType = array.dataType match {
    case a: ArrayType => a
    case _ => ArrayType(FloatType, containsNull = false)
  }
  private lazy val elementKind: Int = ElementKind.of(arrayType.elementType).getOrElse(ElementKind.Float)
  private def shapeIsLong: Boolean = TensorStruct.isLongArray(shape.dataType)

  override def checkInputDataTypes(): TypeCheckResult = (array.dataType, shape.dataType, dtype.dataType) match {
    case (a: ArrayType, _, _) if ElementKind.of(a.elementType).isEmpty =>
      TypeCheckFailure(s"arr_to_st: the array is ${a.simpleString}; accepted: array<float|double|int|long|short|byte> " +
        "(cast it, e.g. cast(x as array<double>); a literal like 1.5 is a decimal, 1.5D a double)")
    case (_: ArrayType | NullType, ArrayType(IntegerType | LongType, _) | NullType, StringType | NullType) =>
      if (dtype.foldable) {
        try {
          Option(dtype.eval()).foreach(name => TensorCodec.dtype(prettyName, name.toString))
          TypeCheckSuccess
        } catch { case e: TensorFunctionException => TypeCheckFailure(e.getMessage) }
      } else TypeCheckSuccess
    case (a, s, d) =>
      TypeCheckFailure(s"arr_to_st(array, shape, dtype) takes a numeric array, an array<int> shape and a " +
        s"string dtype; got ${a.simpleString}, ${s.simpleString}, ${d.simpleString}")
  }

  override protected def nullSafeEval(a: Any, s: Any, d: Any): Any =
    TensorCodec.encode(prettyName, a.asInstanceOf[ArrayData], elementKind, arrayType.containsNull,
      s.asInstanceOf[ArrayData], shapeIsLong, d.asInstanceOf[UTF8String])

  override protected def doGenCode(ctx: CodegenContext, ev: ExprCode): ExprCode =
    defineCodeGen(ctx, ev, (a, s, d) =>
      s"""${TensorStruct.codec}.encode("$prettyName", $a, $elementKind, ${arrayType.containsNull}, $s, $shapeIsLong, $d)""")

  override protected def withNewChildrenInternal(a: Expression, s: Expression, d: Expression): ArrToSt =
    copy(array = a, shape = s, dtype = d)
}

/** A unary function of a Tensor Struct. Serializable itself: Java serialization needs a
  * no-argument constructor in the first superclass that is not. */
abstract class TensorStructFunction extends UnaryExpression with Serializable {
  protected lazy val (dataOrd, shapeOrd, dtypeOrd, shapeIsLong) = TensorStruct.layout(child.dataType).get

  override def checkInputDataTypes(): TypeCheckResult =
    if (TensorStruct.layout(child.dataType).isDefined) TypeCheckSuccess
    else TypeCheckFailure(s"$prettyName: the argument is ${child.dataType.simpleString}; expected ${TensorStruct.describe}")

  protected def layoutArgs: String = s"$dataOrd, $shapeOrd, $dtypeOrd, $shapeIsLong"
}

/** `st_to_array(struct [, type])`: a Tensor Struct's values as a flat array of `type`
  * (float by default; double, int, long, short or byte). */
case class StToArray(child: Expression, elementKind: Int) extends TensorStructFunction
    with NullIntolerantExpression {
  override def prettyName: String = "st_to_array"
  override def dataType: DataType = ArrayType(ElementKind.dataType(elementKind), containsNull = false)

  override protected def nullSafeEval(s: Any): Any =
    TensorCodec.decode(prettyName, s.asInstanceOf[InternalRow], dataOrd, shapeOrd, dtypeOrd,
      shapeIsLong, elementKind)

  override protected def doGenCode(ctx: CodegenContext, ev: ExprCode): ExprCode =
    defineCodeGen(ctx, ev, s => s"""${TensorStruct.codec}.decode("$prettyName", $s, $layoutArgs, $elementKind)""")

  override protected def withNewChildInternal(c: Expression): StToArray = copy(child = c)
}

/** `st_numel(struct)`: the number of elements (the product of the shape), checked against
  * the data's length. */
case class StNumel(child: Expression) extends TensorStructFunction with NullIntolerantExpression {
  override def prettyName: String = "st_numel"
  override def dataType: DataType = LongType

  override protected def nullSafeEval(s: Any): Any =
    TensorCodec.numelOf(prettyName, s.asInstanceOf[InternalRow], dataOrd, shapeOrd, dtypeOrd, shapeIsLong)

  override protected def doGenCode(ctx: CodegenContext, ev: ExprCode): ExprCode =
    defineCodeGen(ctx, ev, s => s"""${TensorStruct.codec}.numelOf("$prettyName", $s, $layoutArgs)""")

  override protected def withNewChildInternal(c: Expression): StNumel = copy(child = c)
}

/** A field of a Tensor Struct (`st_shape`, `st_dtype`); null when the struct or the field is. */
abstract class TensorStructField extends TensorStructFunction {
  protected def field: String
  private def ordinal: Int = child.dataType.asInstanceOf[StructType].fieldIndex(field)
  override def dataType: DataType = child.dataType.asInstanceOf[StructType](field).dataType
  override def nullable: Boolean = true

  override protected def nullSafeEval(s: Any): Any = {
    val row = s.asInstanceOf[InternalRow]
    if (row.isNullAt(ordinal)) null else row.get(ordinal, dataType)
  }

  override protected def doGenCode(ctx: CodegenContext, ev: ExprCode): ExprCode = {
    val struct = child.genCode(ctx)
    val javaType = CodeGenerator.javaType(dataType)
    ev.copy(code = code"""
      ${struct.code}
      boolean ${ev.isNull} = ${struct.isNull} || ${struct.value}.isNullAt($ordinal);
      $javaType ${ev.value} = ${CodeGenerator.defaultValue(dataType)};
      if (!${ev.isNull}) {
        ${ev.value} = ${CodeGenerator.getValue(struct.value, dataType, ordinal.toString)};
      }""")
  }
}

case class StShape(child: Expression) extends TensorStructField {
  override protected def field: String = "shape"
  override def prettyName: String = "st_shape"
  override protected def withNewChildInternal(c: Expression): StShape = copy(child = c)
}

case class StDType(child: Expression) extends TensorStructField {
  override protected def field: String = "dtype"
  override def prettyName: String = "st_dtype"
  override protected def withNewChildInternal(c: Expression): StDType = copy(child = c)
}
