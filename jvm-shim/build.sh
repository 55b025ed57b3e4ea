#!/usr/bin/env bash
# Builds jvm-shim/target/pyspark-safetensors-shim-<version>.jar offline: the Scala 2.13
# compiler and the Spark jars both ship inside the installed pyspark wheel (pyspark/jars),
# so no sbt and no network are needed. The jar carries none of Spark.
#
#   jvm-shim/build.sh [python]     python: the interpreter whose pyspark to use
#                                   (default: the repo's .venv, else python3)
# Rebuilds only when a source or this script changed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
PY=${1:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3

JARS=$("$PY" -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')
[ -d "$JARS" ] || { echo "error: no pyspark/jars under $JARS; install pyspark first" >&2; exit 1; }
VERSION=$(sed -n 's/^ThisBuild \/ version := "\(.*\)"/\1/p' "$ROOT/build.sbt")
JAR=$HERE/target/pyspark-safetensors-shim-$VERSION.jar
SOURCES=$(find "$HERE/src/main/scala" -name '*.scala' | sort)
# Resources go into the jar as they are: the service entry that registers the short name.
RESOURCES=$HERE/src/main/resources

STAMP=$HERE/target/.sources.sha256
want=$(cat $SOURCES $(find "$RESOURCES" -type f | sort) "$0" | sha256sum | cut -d' ' -f1)-$(basename "$(ls "$JARS"/spark-sql_*.jar)")
if [ -f "$JAR" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

echo "building $(basename "$JAR") with the Scala compiler in pyspark/jars" >&2
CLASSES=$HERE/target/classes
rm -rf "$CLASSES" "$HERE"/target/*.jar
mkdir -p "$CLASSES"
# -usejavacp: compile against the same jars the compiler runs from (Spark + Scala library).
java -Xss8m -cp "$JARS/*" scala.tools.nsc.Main -usejavacp -nowarn -deprecation -feature \
  -d "$CLASSES" $SOURCES
# A jar is a zip with a manifest; Python's zipfile writes it where no JDK 'jar' tool exists.
"$PY" - "$CLASSES" "$RESOURCES" "$JAR" <<'PY'
import os, sys, zipfile
classes, resources, jar = sys.argv[1:]
with zipfile.ZipFile(jar + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\r\nCreated-By: pyspark-safetensors jvm-shim/build.sh\r\n\r\n")
    for root in (classes, resources):
        for folder, _, files in sorted(os.walk(root)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                z.write(path, os.path.relpath(path, root))
os.replace(jar + ".tmp", jar)
PY
echo "$want" >"$STAMP"
echo "built $JAR" >&2
