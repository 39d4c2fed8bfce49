"""The one rule both modes follow for the requests a dying worker was running."""

from __future__ import annotations

from diffbatch.crash_reruns import failed_again, rerun_groups


def test_running_requests_are_re_run_in_halves() -> None:
    assert rerun_groups(["a", "b", "c"], crashed_before=False) == [["a"], ["b", "c"]]
    assert rerun_groups(["a", "b"], crashed_before=True) == [["a"], ["b"]]
    assert rerun_groups(["a"], crashed_before=False) == [["a"]]


def test_a_request_alone_that_crashed_before_fails_naming_why() -> None:
    assert rerun_groups(["a"], crashed_before=True) is None
    error = failed_again("worker process died (killed by SIGKILL)")
    assert "again when it was re-run on its own" in error.message
    assert error.status_code == 500 and "SIGKILL" in error.message
