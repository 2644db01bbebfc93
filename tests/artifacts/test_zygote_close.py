"""Closing the sandbox's fork helper ends it by end of file on its control socket (it exits 0 on
its own), not by the kill that follows the close's wait: every process that loaded a model (a
registry, a site, a job) closes its helper when it stops."""

from __future__ import annotations

from msa_fed.artifacts import zygote
from msa_fed.artifacts.sandbox import SandboxLimits, sandbox_self_check


def test_closing_the_helper_lets_it_exit_by_itself():
    zygote.shutdown()
    assert sandbox_self_check(SandboxLimits(), "zygote")["modules"] == ["numpy", "onnx"]  # from the helper
    helper = zygote._zygote
    assert helper is not None and helper.proc.poll() is None
    zygote.shutdown()
    assert helper.proc.returncode == 0  # a kill would leave -9
    helper._reader.join(5)
    assert not helper._reader.is_alive()  # the reader thread saw the end too
