"""What the embedded local session configures (``spark.session``), without starting it."""

from pyspark_safetensors.spark.session import QUICK_JIT, session_settings

DRIVER, EXECUTOR = "spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"


def test_quick_jit_is_the_drivers_alone_and_given_options_come_after_it():
    settings = session_settings({DRIVER: "-XX:TieredStopAtLevel=4"}, quick_jit=True)
    driver = settings[DRIVER].split()
    # the option given wins: HotSpot takes the last of a repeated flag
    assert driver.index(QUICK_JIT) < driver.index("-XX:TieredStopAtLevel=4")
    assert QUICK_JIT not in settings.get(EXECUTOR, "")
    assert any(o.startswith("-Dlog4j2.configurationFile=") for o in driver)


def test_without_quick_jit_the_driver_keeps_the_jits_default():
    settings = session_settings({"spark.sql.shuffle.partitions": "3"})
    assert QUICK_JIT not in settings.get(DRIVER, "")
    assert settings["spark.sql.shuffle.partitions"] == "3"
