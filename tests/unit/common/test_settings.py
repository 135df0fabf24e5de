"""The settings helpers of ``warmup_tools.common.settings`` not covered with the settings classes."""


def test_environ_overrides_puts_back_each_previous_value_and_absence(monkeypatch):
    import os

    from warmup_tools.common.settings import environ_overrides

    monkeypatch.setenv("WARMUP_TEST_SET", "before")
    monkeypatch.delenv("WARMUP_TEST_UNSET", raising=False)
    with environ_overrides({"WARMUP_TEST_SET": "during", "WARMUP_TEST_UNSET": "during"}):
        assert os.environ["WARMUP_TEST_SET"] == os.environ["WARMUP_TEST_UNSET"] == "during"
    assert os.environ["WARMUP_TEST_SET"] == "before" and "WARMUP_TEST_UNSET" not in os.environ
