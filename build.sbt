// sbt build of the JVM side (jvm-shim/): Spark SQL functions for tensors, registered
// through spark.sql.extensions. Versions match the pyspark the project installs (its
// jars are in pyspark/jars); Spark is "provided", so the jar carries none of it.
ThisBuild / scalaVersion := "2.13.18"
ThisBuild / organization := "io.github.pyspark-safetensors"
ThisBuild / version := "0.1.0"

val sparkVersion = "4.3.0"

lazy val shim = (project in file("jvm-shim"))
  .settings(
    name := "pyspark-safetensors-shim",
    Compile / scalaSource := baseDirectory.value / "src" / "main" / "scala",
    libraryDependencies ++= Seq(
      "org.apache.spark" %% "spark-sql" % sparkVersion % Provided,
      "org.apache.spark" %% "spark-catalyst" % sparkVersion % Provided
    ),
    scalacOptions ++= Seq("-deprecation", "-feature", "-release", "17"),
    Compile / packageBin / artifactPath := baseDirectory.value / "target" / s"${name.value}-${version.value}.jar"
  )
