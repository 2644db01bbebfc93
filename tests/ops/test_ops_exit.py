"""A command that loaded a predictor ends without waiting for the sandbox's helper process."""

from __future__ import annotations

from msa_fed.artifacts import zygote
from msa_fed.artifacts.sandbox import sandbox_self_check


def test_the_sandbox_helper_exits_by_itself_when_its_caller_closes():
    assert sandbox_self_check(start="zygote")["fds"] is not None  # a load through the helper
    helper = zygote._zygote
    assert helper is not None and helper.proc.poll() is None
    zygote.shutdown()
    # 0: the helper saw its control socket close and returned; a kill (the 5 s fallback) is -9
    assert helper.proc.returncode == 0
