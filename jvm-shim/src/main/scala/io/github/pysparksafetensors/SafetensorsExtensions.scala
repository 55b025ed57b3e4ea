package io.github.pysparksafetensors

import org.apache.spark.sql.SparkSessionExtensions
import org.apache.spark.sql.catalyst.FunctionIdentifier
import org.apache.spark.sql.catalyst.expressions.{CreateArray, Expression, ExpressionInfo, Size}

/** Registers the tensor SQL functions; enable with
  * `spark.sql.extensions=io.github.pysparksafetensors.SafetensorsExtensions`.
  *
  * Functions only: no data source is registered (a JVM source named `safetensors` would
  * shadow the Python one).
  */
class SafetensorsExtensions extends (SparkSessionExtensions => Unit) {
  import SafetensorsExtensions._

  override def apply(extensions: SparkSessionExtensions): Unit =
    functions.foreach { case (name, usage, builder) =>
      extensions.injectFunction(
        (FunctionIdentifier(name), new ExpressionInfo(classOf[SafetensorsExtensions].getName, null, name, usage, ""),
          builder)
      )
    }
}

object SafetensorsExtensions {
  private val elementTypes = Map(
    "float" -> ElementKind.Float, "double" -> ElementKind.Double, "int" -> ElementKind.Int,
    "long" -> ElementKind.Long, "short" -> ElementKind.Short, "byte" -> ElementKind.Byte
  )

  private def arity(name: String, args: Seq[Expression], allowed: Int*): Unit =
    if (!allowed.contains(args.length))
      TensorCodec.fail(s"$name takes ${allowed.mkString(" or ")} arguments, got ${args.length}")

  private def elementKind(arg: Expression): Int = {
    val value = if (arg.foldable) Option(arg.eval()).map(_.toString.trim.toLowerCase) else None
    value.flatMap(elementTypes.get).getOrElse(
      TensorCodec.fail(s"st_to_array: the element type must be one of ${elementTypes.keys.mkString(", ")} " +
        s"given as a literal, got ${arg.sql}")
    )
  }

  val functions: Seq[(String, String, Seq[Expression] => Expression)] = Seq(
    ("arr_to_st",
      "_FUNC_(array, shape, dtype) - the numeric array as a Tensor Struct of dtype (F16, F32, F64, BF16, " +
        "U8, I8, U16, I16, U32, I32, U64, I64) with shape; _FUNC_(array, dtype) keeps it 1-D.",
      args => {
        arity("arr_to_st", args, 2, 3)
        if (args.length == 3) ArrToSt(args(0), args(1), args(2))
        else ArrToSt(args(0), CreateArray(Seq(Size(args(0)))), args(1))
      }),
    ("st_to_array",
      "_FUNC_(struct[, type]) - a Tensor Struct's values as a flat array of type " +
        "(float by default; double, int, long, short, byte).",
      args => {
        arity("st_to_array", args, 1, 2)
        StToArray(args(0), if (args.length == 2) elementKind(args(1)) else ElementKind.Float)
      }),
    ("st_shape", "_FUNC_(struct) - a Tensor Struct's shape.",
      args => { arity("st_shape", args, 1); StShape(args(0)) }),
    ("st_dtype", "_FUNC_(struct) - a Tensor Struct's dtype.",
      args => { arity("st_dtype", args, 1); StDType(args(0)) }),
    ("st_numel", "_FUNC_(struct) - a Tensor Struct's element count (product of its shape).",
      args => { arity("st_numel", args, 1); StNumel(args(0)) })
  )
}
