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


def test_checkpoint_logs_go_through_the_file_system_api_on_every_known_line():
    from pyspark_safetensors.spark.session import CHECKPOINT_MANAGER, checkpoint_manager

    old = "org.apache.spark.sql.execution.streaming.FileSystemBasedCheckpointFileManager"
    new = "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
    assert checkpoint_manager("3.5.9") == {CHECKPOINT_MANAGER: old}
    assert checkpoint_manager("4.0.5") == {CHECKPOINT_MANAGER: old}
    assert checkpoint_manager("4.1.0.dev1") == {CHECKPOINT_MANAGER: new}
    assert checkpoint_manager("4.3.0") == {CHECKPOINT_MANAGER: new}
    assert checkpoint_manager("3.4.1") == {}
    # a manager the user names wins
    assert session_settings({CHECKPOINT_MANAGER: "x.Y"})[CHECKPOINT_MANAGER] == "x.Y"


def test_the_checkpoint_manager_class_exists_in_this_sparks_jars(spark):
    """The class named for the installed line loads (a wrong name fails every stream)."""
    import pyspark

    from pyspark_safetensors.spark.session import CHECKPOINT_MANAGER, checkpoint_manager

    name = checkpoint_manager(pyspark.__version__)[CHECKPOINT_MANAGER]
    assert spark.conf.get(CHECKPOINT_MANAGER) == name
    spark.sparkContext._jvm.java.lang.Class.forName(name)
