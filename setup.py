"""Build hook: the wheel carries the Spark defaults and log4j2 settings of ``conf/`` and,
the shim jars ``jvm-shim/build.sh`` has built (one per Spark line), as package data under
``pyspark_safetensors/spark/resources/`` (found with ``importlib.resources``); the optional
C cast kernel (the package falls back to numpy without a compiler). Everything else is
declared in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
RESOURCES = ["conf/spark-defaults.conf", "conf/log4j2.properties"]
SHIM_JARS = "jvm-shim/target/pyspark-safetensors-shim-*.jar"


class build_py_with_resources(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads conf/ and jvm-shim/ in place
            return
        dest = Path(self.build_lib, "pyspark_safetensors", "spark", "resources")
        dest.mkdir(parents=True, exist_ok=True)
        for path in [*(ROOT / p for p in RESOURCES), *sorted(ROOT.glob(SHIM_JARS))]:
            shutil.copy2(path, dest / path.name)


FASTCAST = Extension(
    "pyspark_safetensors.format._fastcast",
    sources=["python/pyspark_safetensors/format/_fastcast.c"],
    extra_compile_args=["-O3"],
    optional=True,
)

setup(cmdclass={"build_py": build_py_with_resources}, ext_modules=[FASTCAST])
