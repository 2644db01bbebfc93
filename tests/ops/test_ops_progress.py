"""Progress output: one line per iteration off a terminal, tqdm bars on one."""

from __future__ import annotations

import io

from msa_fed.runtime.progress import LineBar, Progress, use_bars


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


def test_resume_message_names_the_value_it_prints(tmp_path, capsys, monkeypatch):
    """An interrupted solve resumes printing the solver's objective (max_k L_k by default) under that
    name; a finished one prints Gamma under the name Gamma."""
    import pytest
    from sklearn.linear_model import LogisticRegression

    import msa_fed
    from msa_fed.experiments.demo_data import SITES, make_federation
    from msa_fed.runtime import coordinator

    monkeypatch.setenv("MSA_FED_PROGRESS", "lines")
    fed = make_federation(n_labeled=100, n_unlabeled=150, n_test=10, random_state=4)
    sites = [
        msa_fed.SiteData(
            n,
            fed[n]["X_labeled"],
            fed[n]["y_labeled"],
            fed[n]["X_unlabeled"],
            LogisticRegression().fit(fed[n]["X_train"], fed[n]["y_train"]),
        )
        for n in SITES
    ]
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
    resumed = [line for line in capsys.readouterr().err.splitlines() if "resuming" in line]
    assert resumed == [f"DC solver: resuming from checkpoint at iteration 2, max_k L_k={seen[1]:.3g}"]
    msa_fed.fit_dmsa(sites, checkpoint_dir=str(tmp_path), verbose=True)
    resumed = [line for line in capsys.readouterr().err.splitlines() if "resuming" in line]
    assert len(resumed) == 1 and resumed[0].endswith(f"Gamma={model.gamma:.3g}")
