// sbt build of the JVM side (jvm-shim/): the tensor SQL functions and the JVM `safetensors`
// data source, one jar per supported Spark line (jvm-shim/build.sh builds the same jars
// offline with the compiler inside each line's pyspark wheel). Spark is "provided", so a
// jar carries none of it. `sbt package` builds every line; `sbt shim_3_5/package` one.
ThisBuild / organization := "io.github.pyspark-safetensors"
ThisBuild / version := "0.1.0"

// The supported lines: (line, the Spark release built and tested with, its Scala version).
// The same table as SPARK_LINES in python/pyspark_safetensors/spark/shim.py (a test checks).
val sparkLines = Seq(
  ("3.5", "3.5.9", "2.12.18"),
  ("4.0", "4.0.5", "2.13.16"),
  ("4.1", "4.1.4", "2.13.17"),
  ("4.2", "4.2.1", "2.13.18"),
  ("4.3", "4.3.0", "2.13.18")
)

// Every line compiles src/main/scala plus the one folder of what differs on it:
// src/spark-{line} when it exists, else src/spark-{major}.
def shim(line: String): Project = {
  val (_, spark, scala) = sparkLines.find(_._1 == line).get
  val binary = scala.split('.').take(2).mkString(".")
  Project(s"shim_${line.replace('.', '_')}", file("jvm-shim") / "target" / "sbt" / line)
    .settings(
      name := s"pyspark-safetensors-shim-${line}_$binary",
      scalaVersion := scala,
      Compile / unmanagedSourceDirectories := {
        val src = (ThisBuild / baseDirectory).value / "jvm-shim" / "src"
        val exact = src / s"spark-$line"
        Seq(src / "main" / "scala", if (exact.exists) exact else src / s"spark-${line.takeWhile(_ != '.')}")
      },
      Compile / unmanagedResourceDirectories :=
        Seq((ThisBuild / baseDirectory).value / "jvm-shim" / "src" / "main" / "resources"),
      libraryDependencies ++= Seq(
        "org.apache.spark" %% "spark-sql" % spark % Provided,
        "org.apache.spark" %% "spark-catalyst" % spark % Provided
      ),
      scalacOptions ++= Seq("-deprecation", "-feature", "-release", "17"),
      Compile / packageBin / artifactPath := (ThisBuild / baseDirectory).value / "jvm-shim" / "target" /
        s"pyspark-safetensors-shim-${line}_$binary-${version.value}.jar"
    )
}

lazy val shim_3_5 = shim("3.5")
lazy val shim_4_0 = shim("4.0")
lazy val shim_4_1 = shim("4.1")
lazy val shim_4_2 = shim("4.2")
lazy val shim_4_3 = shim("4.3")

lazy val root = (project in file("."))
  .aggregate(shim_3_5, shim_4_0, shim_4_1, shim_4_2, shim_4_3)
  .settings(publish / skip := true)
