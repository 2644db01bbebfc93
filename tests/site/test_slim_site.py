"""A site needs none of the coordinator's packages: what its process runs never imports torch, Ray,
scikit-learn or scipy (nor skl2onnx, tqdm), so ``pip install .`` alone installs a working site.

Each case runs a real Python process under tests/slim.py's import blocker (the packages behave
as not installed there, and every attempt to import one is logged):

- a site answers every request a job relays to it (info, the domain model: Maxent and KDE,
  Qhat, DC evaluations, the squared-loss bound, the verdict on the combined model), with the
  peers' predictors in the sandbox, the same answers as the in-process site of the same job,
  and imports none of the packages;
- the site's commands start, and a command of the coordinator's side is one line naming the
  extra; ``msa_fed.fit_dmsa`` too; a domain model whose code needs a missing package is refused
  at the site in one line.

tests/federation/test_slim_federation.py runs a whole sealed federated job with every
``site serve`` under the blocker, and a site from a venv made by ``pip install .`` alone.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from slim import blocked, slim_env

from msa_fed.artifacts.predictors import export_sklearn, load_predictor
from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.boundary.proto import boundary_pb2 as pb
from msa_fed.errors import COORDINATOR_INSTALL
from msa_fed.site.methods import SITE_METHODS

#: what a site process answers, the site's own list (join_job is the agent's; ping carries nothing)
REPLAYED = SITE_METHODS - {"join_job", "ping"}
REPLAY = Path(__file__).with_name("slim_replay.py")
NAMES = ("east", "north", "west")


def _sites(task: str, seed: int = 0):
    """Three sites (labelled data, unlabelled sample, ONNX predictor trained on their own data)."""
    from sklearn.linear_model import LinearRegression, LogisticRegression

    from msa_fed.api import SiteData

    rng = np.random.default_rng(seed)
    out, blobs = [], []
    for k, name in enumerate(NAMES):
        c = np.array([[0.0, 2.0], [2.0, 0.0], [-2.0, 0.0]][k])

        def draw(n, c=c):
            X = rng.normal(loc=c, size=(n, 2))
            y = X[:, 0] * X[:, 1]
            return X, (y > 0).astype(np.int64) if task == "classification" else y + 0.1 * rng.normal(size=n)

        Xtr, ytr = draw(300)
        Xl, yl = draw(110 + 10 * k)
        Xu, _ = draw(130 + 10 * k)
        h = (LogisticRegression() if task == "classification" else LinearRegression()).fit(Xtr, ytr)
        blob = export_sklearn(h, n_features=2)
        kind = "probabilities" if task == "classification" else "regression"
        out.append(SiteData(name, Xl, yl, Xu, load_predictor(blob, kind=kind)))
        blobs.append(blob)
    return out, blobs


def _record(folder: Path, method: str, task: str, site: int = 1):
    """Run the job in-process (runtime="local") and write site ``site``'s part of it for
    slim_replay.py; returns the site's recorded answers (as the wire decodes them)."""
    from msa_fed.api import build_config, make_backend
    from msa_fed.runtime.coordinator import Coordinator

    sites, blobs = _sites(task)
    # the squared loss under Gamma with one global bound: the sites are asked for their largest
    # per-point bound (max_bound); a few DC iterations are enough to replay
    solver = {"objective": "gamma", "bound": "global", "max_iter": 3, "n_restarts": 0} if task == "regression" else None
    config = build_config(method, task, solver_options=solver)
    backend = make_backend(sites, config)
    recorder = m.Recorder()
    with Coordinator(backend, [s.predictor for s in sites], config, recorder=recorder) as coordinator:
        coordinator.fit()
        published = backend.workers[site].published()
        worker = backend.workers[site]
        job = {
            "name": worker.name,
            "index": site,
            "n_sources": len(sites),
            "task": task,
            "loss": worker.loss,
            "classes": None if worker.classes is None else worker.classes.tolist(),
            "min_points": config.min_points,
            "sites": list(NAMES),
        }
    name = NAMES[site]
    requests, answers = [], []
    for direction, who, what, msg in recorder.records:
        if who != name or what not in REPLAYED:
            continue
        if direction == "to_site":
            request = wire.to_proto(what, msg, wire.REQUESTS).SerializeToString()
            requests.append([what, base64.b64encode(request).decode()])
        else:
            answers.append(_decoded(wire.to_proto(what, msg, wire.RESPONSES).SerializeToString()))
    job["requests"] = requests
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps(job))
    s = sites[site]
    np.savez(
        folder / "data.npz",
        X_labeled=s.X_labeled,
        y_labeled=s.y_labeled,
        X_unlabeled=s.X_unlabeled,
        **{f"published_{k}": np.asarray(x) for k, x in enumerate(published)},
    )
    for k, blob in enumerate(blobs):
        (folder / f"predictor_{k}.onnx").write_bytes(blob)
    return [r[0] for r in requests], answers


def _decoded(data: bytes):
    return wire.from_proto(pb.SiteResponse.FromString(data), wire.RESPONSES)


def _same(a, b, where: str) -> None:
    """a and b hold the same values (floats to 1e-9 relative); ``incarnation`` (a random id per
    site process) is not compared."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
        for f in dataclasses.fields(a):
            if f.name != "incarnation":
                _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, (np.ndarray, float, np.floating)):
        np.testing.assert_allclose(np.asarray(b, dtype=float), np.asarray(a, dtype=float), rtol=1e-9, err_msg=where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def replay(folder: Path, python: str, env: dict) -> dict:
    """slim_replay.py on ``folder`` with ``python`` and ``env``; its answers.json."""
    done = subprocess.run([python, str(REPLAY), str(folder)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / "answers.json").read_text())


def check_replayed(folder: Path, methods, expected, got: dict) -> None:
    """The replayed site answered every request as the in-process site did, holding none of the
    coordinator's packages."""
    assert got["coordinator_modules"] == []
    assert len(got["answers"]) == len(expected) == len(methods)
    for i, (method, want, answer) in enumerate(zip(methods, expected, got["answers"])):
        _same(want, _decoded(base64.b64decode(answer)), f"answer {i} ({method})")


@pytest.mark.filterwarnings("ignore:DC solver")  # the squared loss's 3 iterations do not converge
@pytest.mark.parametrize(
    "method, task",
    [("dmsa", "classification"), ("gmsa", "classification"), ("dmsa", "regression")],
    ids=["maxent", "kde", "squared-loss"],
)
def test_a_site_answers_every_relayed_request_without_the_coordinator_packages(tmp_path, method, task):
    methods, expected = _record(tmp_path / "job", method, task)
    # every kind of request a site process answers for this job is in the replay
    assert set(methods) == REPLAYED - ({"max_bound"} if task == "classification" else set())
    assert methods.count("dc_evaluate") >= 2
    job = json.loads((tmp_path / "job" / "job.json").read_text())
    spec = next(
        wire.from_proto(pb.SiteRequest.FromString(base64.b64decode(b)), wire.REQUESTS)[1]
        for what, b in job["requests"]
        if what == "set_domain_model"
    )
    assert spec.kind == ("kde" if method == "gmsa" else "maxent")
    env = slim_env(tmp_path / "blocker")
    got = replay(tmp_path / "job", sys.executable, env)
    assert blocked(tmp_path / "blocker") == []
    check_replayed(tmp_path / "job", methods, expected, got)


def _run(args, env, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_blocker_makes_the_coordinator_packages_unimportable(tmp_path):
    env = slim_env(tmp_path / "blocker")
    done = _run([sys.executable, "-c", "import sklearn.linear_model"], env, tmp_path)
    assert done.returncode == 1 and "No module named 'sklearn" in done.stderr
    assert [line.split()[1] for line in blocked(tmp_path / "blocker")] == ["sklearn"]


def test_the_site_commands_start_and_a_coordinator_command_names_the_extra(tmp_path):
    env = slim_env(tmp_path / "blocker")
    cli = [sys.executable, "-m", "msa_fed.cli"]
    for args in (["--help"], ["site", "--help"], ["site", "serve", "--help"], ["registry", "--help"]):
        done = _run(cli + args, env, tmp_path)
        assert done.returncode == 0, (args, done.stderr[-2000:])
    assert _run(cli + ["site", "keygen", "--out", "site.key"], env, tmp_path).returncode == 0
    assert _run(cli + ["job", "keygen", "--out", "job.key"], env, tmp_path).returncode == 0
    assert (tmp_path / "site.key.pub").is_file() and (tmp_path / "job.key.pub").is_file()
    assert blocked(tmp_path / "blocker") == []
    # the coordinator's side: one line naming the package and the extra, no traceback
    done = _run(cli + ["experiment", "synthetic"], env, tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: msa-fed experiment needs the coordinator extra (sklearn is not installed): {COORDINATOR_INSTALL}"
    ]


def _slim_python(code: str, tmp_path) -> str:
    """``python -c CODE`` in the slim install's environment (the import blocker in
    ``tmp_path/blocker``), which must exit 0; its output, stripped."""
    done = _run([sys.executable, "-c", code], slim_env(tmp_path / "blocker"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_fit_dmsa_without_the_extra_is_one_line_naming_it(tmp_path):
    code = (
        "import msa_fed\ntry:\n    msa_fed.fit_dmsa([])\n"
        "except ImportError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    assert _slim_python(code, tmp_path) == (
        f"MissingExtra msa_fed.fit_dmsa needs the coordinator extra (scipy is not installed): {COORDINATOR_INSTALL}"
    )


def test_a_domain_model_whose_code_needs_a_missing_package_is_refused_in_one_line(tmp_path):
    """A kind of domain model whose module imports torch (here: the CNN experiment's module, named
    as a kind) cannot be built at a site without it: one refusal naming the package, which the
    site's agent returns to the job as the site's error line (a MsaFedError)."""
    code = (
        "from msa_fed.boundary import messages as m\n"
        "from msa_fed.core import domain_models\n"
        "from msa_fed.errors import MsaFedError\n"
        "from msa_fed.site.gate import build_domain_model\n"
        "domain_models.KINDS['cnn'] = ('msa_fed.experiments.cnn', 'CNNFeatures')\n"
        "try:\n    build_domain_model(m.DomainModelSpec(kind='cnn', n_sources=2))\n"
        "except MsaFedError as exc:\n    print(exc)\n"
    )
    assert _slim_python(code, tmp_path) == (
        f"a 'cnn' domain model at this site needs the coordinator extra (torch is not installed): {COORDINATOR_INSTALL}"
    )
    assert [line.split()[1] for line in blocked(tmp_path / "blocker")] == ["torch"]
