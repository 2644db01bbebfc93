"""Progress output: one line per iteration off a terminal, tqdm bars on one."""

from __future__ import annotations

import io

from msa_fed.runtime.progress import LineBar, Progress, RunBars, solver_summary, use_bars


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_one_line_per_iteration_with_its_postfix():
    out = io.StringIO()
    bar = LineBar("DC solver", "it", stream=out)
    for value in (0.5, 0.41, 0.4):
        bar.update(1)
        bar.set_postfix_str(f"max_k L_k={value}")
    bar.close()
    bar.close()  # idempotent
    lines = out.getvalue().splitlines()
    assert lines[:3] == [
        "DC solver: iteration 1, max_k L_k=0.5",
        "DC solver: iteration 2, max_k L_k=0.41",
        "DC solver: iteration 3, max_k L_k=0.4",
    ]
    assert lines[3].startswith("DC solver: done after 3 iterations in ") and lines[3].endswith("max_k L_k=0.4")
    assert len(lines) == 4 and "\r" not in out.getvalue()


def test_epochs_without_postfix_and_with_total():
    out = io.StringIO()
    bar = LineBar("domain classifier", "epoch", total=2, stream=out)
    bar.update(1)
    bar.update(1)
    bar.close()
    assert out.getvalue().splitlines()[:2] == ["domain classifier: epoch 1/2", "domain classifier: epoch 2/2"]


def test_style_follows_the_terminal_and_the_override(monkeypatch):
    monkeypatch.delenv("MSA_FED_PROGRESS", raising=False)
    assert use_bars(Tty()) and not use_bars(io.StringIO())
    monkeypatch.setenv("MSA_FED_PROGRESS", "lines")
    assert not use_bars(Tty())
    monkeypatch.setenv("MSA_FED_PROGRESS", "bars")
    assert use_bars(io.StringIO())


def test_progress_writes_lines_when_stderr_is_a_file(monkeypatch, capsys):
    monkeypatch.delenv("MSA_FED_PROGRESS", raising=False)
    p = Progress(verbose=True)
    bar = p.bar("DC solver")
    assert isinstance(bar, LineBar)
    p.note("DC solver: resuming from checkpoint at iteration 3, max_k L_k=0.41")
    assert capsys.readouterr().err == "DC solver: resuming from checkpoint at iteration 3, max_k L_k=0.41\n"
    assert not hasattr(Progress(verbose=False).bar("x"), "n")


def test_resume_message_says_how_many_answered_rounds_it_keeps(tmp_path, capsys, monkeypatch):
    """An interrupted solve resumes from the rounds the sites already answered and says how many it
    keeps; the resumed fit is the uninterrupted one, and a rerun of a finished solve keeps them all."""
    import re

    import numpy as np
    import pytest
    from demo_sites import demo_sites

    import msa_fed
    from msa_fed.runtime import coordinator

    monkeypatch.setenv("MSA_FED_PROGRESS", "lines")
    sites, _ = demo_sites(4, n_labeled=100, n_unlabeled=150, n_test=10)
    real_solve, seen = coordinator.solve_dc, []

    def interrupted_solve(oracle, eta, callback=None, **kw):
        def cb(it, z, value):
            callback(it, z, value)
            seen.append(value)
            if len(seen) == 2:
                raise KeyboardInterrupt

        return real_solve(oracle, eta, callback=cb, **kw)

    monkeypatch.setattr(coordinator, "solve_dc", interrupted_solve)
    with pytest.raises(KeyboardInterrupt):
        msa_fed.fit_dmsa(sites, checkpoint_dir=str(tmp_path), verbose=True)
    monkeypatch.setattr(coordinator, "solve_dc", real_solve)
    capsys.readouterr()
    model = msa_fed.fit_dmsa(sites, checkpoint_dir=str(tmp_path), verbose=True)
    pattern = (
        r"DC solver: resuming from checkpoint: (\d+) rounds the sites answered are kept; "
        r"the sites are asked only the others"
    )
    resumed = [line for line in capsys.readouterr().err.splitlines() if "resuming" in line]
    assert len(resumed) == 1 and (first := re.fullmatch(pattern, resumed[0]))
    assert int(first.group(1)) >= 2  # the two iterations answered before the interrupt
    uninterrupted = msa_fed.fit_dmsa(sites)
    np.testing.assert_allclose(model.z, uninterrupted.z, atol=1e-9)
    msa_fed.fit_dmsa(sites, checkpoint_dir=str(tmp_path), verbose=True)
    resumed = [line for line in capsys.readouterr().err.splitlines() if "resuming" in line]
    assert len(resumed) == 1 and (again := re.fullmatch(pattern, resumed[0]))
    assert int(again.group(1)) > int(first.group(1))  # the finished solve's rounds are all kept


def test_a_restarting_solver_numbers_each_runs_iterations_from_one(monkeypatch, capsys):
    monkeypatch.setenv("MSA_FED_PROGRESS", "lines")
    bars = RunBars(Progress(verbose=True), "DC solver")
    for it, value in [(1, 0.3), (2, 0.2), (1, 0.5), (2, 0.25), (3, 0.2), (1, 0.4)]:
        bars.step(it, f"max_k L_k={value}")
    bars.close()
    lines = capsys.readouterr().err.splitlines()
    iterations = [line for line in lines if ": iteration" in line]
    assert iterations == [
        "DC solver: iteration 1, max_k L_k=0.3",
        "DC solver: iteration 2, max_k L_k=0.2",
        "DC solver (run 2): iteration 1, max_k L_k=0.5",
        "DC solver (run 2): iteration 2, max_k L_k=0.25",
        "DC solver (run 2): iteration 3, max_k L_k=0.2",
        "DC solver (run 3): iteration 1, max_k L_k=0.4",
    ]
    ends = [line for line in lines if "done after" in line]
    assert [e.split(" in ")[0] for e in ends] == [
        "DC solver: done after 2 iterations",
        "DC solver (run 2): done after 3 iterations",
        "DC solver (run 3): done after 1 iteration",
    ]
    assert bars.runs == 3


def test_the_solver_summary_says_what_was_minimised_and_counts_evaluations_apart():
    import numpy as np

    from msa_fed.core.dc_solver import DCResult

    res = DCResult(
        z=np.array([0.5, 0.5]),
        gamma=2.5e-4,
        losses=np.array([0.1586, 0.1559]),
        history=[],
        converged=True,
        n_iter=8,
        n_evaluations=65,
        method="slsqp-minmax",
        objective="minmax",
    )
    assert solver_summary(res, "minmax", runs=5) == (
        "DC solver (slsqp-minmax): minimised max_k L_k(z), the worst site's loss, to 0.1586 after 8 iterations "
        "(best of 5 runs); 65 loss evaluations at the sites; converged"
    )
    line = solver_summary(res, "gamma", runs=1)
    assert "minimised Gamma(z), the worst site's loss minus the z-weighted average" in line and "best of" not in line


def test_the_job_summary_describes_max_loss_and_gamma_in_words():
    from types import SimpleNamespace

    import numpy as np

    from msa_fed.jobs.operations import summary_lines

    model = SimpleNamespace(
        site_names=["a", "b"],
        z=np.array([0.4, 0.6]),
        domain_losses=np.array([0.2, 0.19]),
        eta=0.01,
        gamma=0.004,
        info={"solver": {"method": "slsqp-minmax", "objective": "minmax"}},
    )
    lines = summary_lines(model)
    assert "max_k L_k(z) = 0.2000: the worst site's loss (what the solver minimised)" in lines
    gamma = next(line for line in lines if line.startswith("Gamma(z)"))
    assert "worst site's loss lies above the z-weighted average" in gamma and "minimised" not in gamma
    model.info = {"solver": {"method": "newton"}}  # a model stored before the objective was recorded
    assert next(line for line in summary_lines(model) if line.startswith("Gamma(z)")).endswith(
        "(what the solver minimised)"
    )


def test_the_classifier_reports_one_loss_the_objective_its_summary_gives():
    """L-BFGS progress shows the objective it minimises (log loss + L2 penalty), so the last line
    and the summary give the same number."""
    import numpy as np

    from msa_fed.core.config import ClassifierConfig
    from msa_fed.core.domain_classifier import fit_maxent

    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(200, 3)), rng.integers(0, 2, size=200)

    def oracle(theta):  # two-class softmax log loss, weights 1/200 (no regulariser: fit_maxent adds it)
        W = theta.reshape(2, 4)
        logits = X @ W[:, :3].T + W[:, 3]
        logits -= logits.max(1, keepdims=True)
        P = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        loss = -np.mean(np.log(P[np.arange(200), y]))
        G = (P - np.eye(2)[y]) / 200
        return float(loss), np.hstack([G.T @ X, G.sum(0)[:, None]]).reshape(-1)

    seen = []
    _, info = fit_maxent(oracle, 3, 2, ClassifierConfig(mu=0.1), progress=lambda i, obj: seen.append(obj))
    assert len(seen) == info["n_iter"] and all(v is not None for v in seen)
    assert seen[-1] == info["objective"]
