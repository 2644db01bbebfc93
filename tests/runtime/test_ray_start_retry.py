"""ensure_ray starts a local Ray again once when Ray's own start-up waits run out (a loaded machine,
or a new head's GCS beside another Ray that never wrote its port file), and only then."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from msa_fed.runtime import ray_actors  # noqa: E402


@pytest.fixture
def fake_init(monkeypatch):
    calls: list[dict] = []
    errors: list[Exception] = []

    def init(**kwargs):
        calls.append(kwargs)
        if errors:
            raise errors.pop(0)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    return calls, errors


@pytest.mark.parametrize(
    "message",
    [
        "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_0a1b",
        "The current node timed out during startup. This could happen because ...",
    ],
)
def test_a_start_that_timed_out_is_tried_again_once(fake_init, message):
    calls, errors = fake_init
    errors.append(RuntimeError(message))
    ray_actors.ensure_ray(num_cpus=2)
    assert len(calls) == 2 and all(c["address"] == "local" and c["num_cpus"] == 2 for c in calls)


def test_a_second_time_out_and_any_other_error_are_raised(fake_init):
    calls, errors = fake_init
    errors.extend([RuntimeError("Timed out waiting for file a"), RuntimeError("Timed out waiting for file b")])
    with pytest.raises(RuntimeError, match="file b"):
        ray_actors.ensure_ray()
    assert len(calls) == ray_actors.RAY_START_ATTEMPTS
    calls.clear()
    errors.append(ValueError("bad argument"))
    with pytest.raises(ValueError):
        ray_actors.ensure_ray()
    assert len(calls) == 1
