"""The Ray runtime on a real local Ray (one per module, one warm set of site actors): the same
model as the local runtime, the privacy audit of a full run, data-parallel SGD with several
workers per site, and fault tolerance (a site killed mid-solve restarts and the run gives the
same z; a site killed for good fails the run naming it; a stopped run resumes from its
checkpoint directory to the same z)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import msa_fed  # noqa: E402
from msa_fed.runtime.ray_actors import ensure_ray  # noqa: E402
from msa_fed.core.domain_classifier import ClassifierConfig, train_domain_classifier  # noqa: E402
from msa_fed.core.features import StandardFeatures  # noqa: E402
from msa_fed.errors import ConfigError, PrivacyError, SiteError  # noqa: E402
from msa_fed.privacy.policy import POLICY_ENV  # noqa: E402
from msa_fed.boundary import messages as m  # noqa: E402
from msa_fed.runtime.config import FitConfig, SolverConfig
from msa_fed.runtime.coordinator import Coordinator  # noqa: E402
from msa_fed.runtime.ray_sites import RaySites, actor_status  # noqa: E402
from inspect_messages import audit  # noqa: E402
import numpy_predictors  # noqa: E402
from numpy_predictors import numpy_sites  # noqa: E402
from problems import make_sites, site_kwargs  # noqa: E402

# the sites' predictors travel to the actors by value, as numpy code (numpy_predictors.py)
ray.cloudpickle.register_pickle_by_value(numpy_predictors)

SGD = {"optimizer": "sgd", "epochs": 4, "batch_size": 16, "lr": 0.05}
DCA = {"objective": "gamma", "method": "dca"}


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    # The warm backend below serves many coordinators, and to its sites they are one job: the
    # sites' own policy (read by the actors from their node's environment, which a local Ray
    # inherits from this process) allows that many domain models per job.
    policy = tmp_path_factory.mktemp("site-policy") / "policy.toml"
    policy.write_text("[budget]\ndomain_models_per_job = 100\ndomain_models_per_day = 1000\n")
    before = os.environ.get(POLICY_ENV)
    os.environ[POLICY_ENV] = str(policy)
    ensure_ray(num_cpus=2)
    yield ray
    ray.shutdown()
    if before is None:
        os.environ.pop(POLICY_ENV, None)
    else:
        os.environ[POLICY_ENV] = before


@pytest.fixture(scope="module")
def sites():
    return numpy_sites(make_sites())


@pytest.fixture(scope="module")
def warm(local_ray, sites):
    """One set of site actors (one per site) serving several coordinators: actor start-up costs
    seconds, and a warm backend is also a feature (a coordinator after another)."""
    backend = RaySites(site_kwargs(sites), max_restarts=2)
    yield backend
    backend.shutdown()


def _coordinator(backend, sites, recorder=None, callback=None, **config):
    return Coordinator(
        backend, [s.predictor for s in sites], FitConfig(**config), recorder=recorder, solver_callback=callback
    ).start()


def _fit(backend, sites, recorder=None, **config):
    return _coordinator(backend, sites, recorder, **config).fit()


def _probe(sites):
    return np.vstack([s.X_unlabeled for s in sites] + [s.X_labeled for s in sites])


def _single_process(sites, options):
    from msa_fed.core.domain_classifier import balanced_shards, polish_maxent, sum_oracle

    ccfg = replace(ClassifierConfig(mu=1e-3), **(options or {}))
    U = [s.X_unlabeled for s in sites]
    model = train_domain_classifier(U, StandardFeatures(), ccfg, random_state=0)
    # the coordinator polishes theta to the public optimum (the sites verify it): so does this one
    oracle = sum_oracle(balanced_shards([model.feature_map.transform(X) for X in U], replace(ccfg, dtype="float64")))
    model.theta_, _ = polish_maxent(oracle, model.theta_, model.n_features_, len(U), ccfg.mu, ccfg.max_iter)
    return model


@pytest.mark.parametrize("options", [None, SGD], ids=["lbfgs", "sgd"])
def test_ray_equals_local(warm, sites, options):
    """Same data and seed: the classifier trained from the site actors' gradient sums and z."""
    rec = m.Recorder()
    ccfg = replace(ClassifierConfig(mu=1e-3), **(options or {}))
    model = _fit(warm, sites, recorder=rec, classifier=ccfg)
    local = msa_fed.fit_dmsa(sites, runtime="local", classifier_options=options)
    np.testing.assert_allclose(model.z, local.z, atol=1e-6)
    np.testing.assert_allclose(model.domain_proba(_probe(sites)), local.domain_proba(_probe(sites)), atol=1e-4)
    np.testing.assert_allclose(
        model.domain_model.predict_proba(_probe(sites)),
        _single_process(sites, options).predict_proba(_probe(sites)),
        atol=1e-4,
    )
    np.testing.assert_allclose(model.qhat, local.qhat, atol=1e-10)
    if options is not None:  # one mini-batch gradient from each site per SGD step
        steps = [
            r for r in rec.records if r[0] == "to_site" and r[2] == "classifier_loss_grad" and r[3].step is not None
        ]
        per_epoch = int(np.ceil(max(len(s.X_unlabeled) for s in sites) / SGD["batch_size"]))
        assert len(steps) == 3 * SGD["epochs"] * per_epoch


def _rounds(model) -> int:
    """The DC rounds each site answered: the solve's and the influence report's re-solves (if asked for)."""
    return model.info["solver"]["n_evaluations"] + (model.info.get("influence") or {}).get("evaluations", 0)


def test_privacy_audit_of_a_full_ray_run(warm, sites):
    rec = m.Recorder()
    model = _fit(warm, sites, recorder=rec)
    n_labeled = {s.name: len(s.y_labeled) for s in sites}
    assert audit(rec.records, n_labeled) == []
    # the recording is complete: every request has its answer, every site took part in every step
    to = [(r[1], r[2]) for r in rec.records if r[0] == "to_site"]
    frm = [(r[1], r[2]) for r in rec.records if r[0] == "from_site"]
    assert sorted(to) == sorted(frm)
    evals = [r for r in rec.records if r[0] == "from_site" and r[2] == "dc_evaluate"]
    assert len(evals) == 3 * _rounds(model)
    assert {r[1] for r in evals} == {"a", "b", "c"}
    assert {
        "info",
        "unlabeled_sample",
        "setup_shard",
        "classifier_loss_grad",
        "set_domain_model",
        "set_qhat",
        "dc_evaluate",
    } <= {r[2] for r in rec.records}
    # and the audit does catch what it looks for
    leak = [
        ("from_site", "b", "dc_evaluate", m.GradSum(loss=0.0, grad=np.zeros(n_labeled["b"]), n=1)),
        ("from_site", "a", "info", m.UnlabeledSample(X=sites[0].y_labeled[:5].astype(np.int64))),
        ("from_site", "c", "info", m.BoundMax(value=object())),
        ("from_site", "c", "info", ("a tuple", sites[2].y_labeled)),
    ]
    assert len(audit(leak, n_labeled)) == 4


def test_too_few_labelled_points_fails_the_run(warm, sites):
    with pytest.raises(PrivacyError, match=r"^site 'a' has 41 labelled points: fewer than min_points=45"):
        _fit(warm, sites, min_points=45)
    assert len(warm.actors) == 3  # a refused run leaves a warm backend usable


def test_a_site_actor_reads_its_policy_from_its_own_node(local_ray, sites):
    """A Ray site actor enforces its node's policy (the file $MSA_FED_SITE_POLICY names in the
    node's environment: this module's local Ray was started with it), and a job that asks for a
    looser one only tightens it.  The node's file says min_points 50 for this run: site a (41
    labelled points) refuses, b (53) would answer."""
    from msa_fed.privacy.policy import SitePolicy

    policy = Path(os.environ[POLICY_ENV])  # the node's file (local_ray), read by each actor it starts
    kept = policy.read_text()
    policy.write_text(kept + "[limits]\nmin_points = 50\n")
    two = sites[:2]  # an actor each, besides the warm ones
    try:
        kw = site_kwargs(two, min_points=1)
        for k in kw:
            k["policy"] = SitePolicy(min_points=1)  # the job tries to loosen: it can only tighten
        with pytest.raises(PrivacyError) as err:
            with Coordinator(
                RaySites(kw, data_channel="off"), [s.predictor for s in two], FitConfig(min_points=1)
            ) as c:
                c.fit()
    finally:
        policy.write_text(kept)
    assert err.value.rule == "min_points" and err.value.site == "a"
    assert "minimum of 50" in str(err.value) and "\n" not in str(err.value)


def test_a_swapped_peer_sample_is_refused_by_the_site_actor(warm, sites):
    """The Ray host hands its site actors another sample for site c: each actor checks the
    samples against the job content's pins (site/admission.py) and refuses, naming the peer."""
    c = _coordinator(warm, sites)
    c.start()
    samples = [r.X for r in c.call_all("unlabeled_sample", None)]
    bad = [np.array(X, dtype=np.float64) for X in samples]
    bad[2] = bad[2] + 0.5
    try:
        with pytest.raises(ConfigError) as err:
            warm.share_samples(bad)
        assert str(err.value).startswith("site 'a' refuses the published sample of site 'c'")
    finally:
        warm.share_samples(samples)  # the pinned samples are taken: the warm backend stays usable
    assert len(warm.actors) == 3


def test_fit_dmsa_ray_with_more_workers_per_site(local_ray, monkeypatch, caplog):
    """fit_dmsa(runtime="ray") with 2 workers per site (helper actors hold half of each site's
    rows): data-parallel SGD equals single-process SGD, and z equals runtime="local".  On this
    small problem the start-up of the actors is measured against the fit, and the user is told
    (once per process) when it took longer."""
    import msa_fed.api

    monkeypatch.setitem(msa_fed.api._RAY_HINT, "given", False)
    caplog.set_level("WARNING", logger="msa_fed.api")
    sites = numpy_sites(make_sites(n_labeled=(41, 53), n_unlabeled=(60, 72)))
    rec = m.Recorder()
    model = msa_fed.fit_dmsa(
        sites, runtime="ray", classifier_options=SGD, recorder=rec, ray_options={"workers_per_site": 2}
    )
    startup, fit = model.info["ray_startup_s"], model.info["ray_fit_s"]
    assert startup > 0 and fit > 0
    said = [r.getMessage() for r in caplog.records if r.name == "msa_fed.api"]
    if startup > fit:
        assert said == [msa_fed.api.ray_startup_hint(startup, fit)]
        assert said[0].startswith(f"Ray start-up {startup:.1f} s, fit {fit:.2f} s: runtime='local' is faster")
    else:
        assert said == []
    assert msa_fed.api._RAY_HINT["given"] == (startup > fit)
    local = msa_fed.fit_dmsa(sites, runtime="local", classifier_options=SGD)
    np.testing.assert_allclose(model.z, local.z, atol=1e-6)
    np.testing.assert_allclose(
        model.domain_model.predict_proba(_probe(sites)),
        _single_process(sites, SGD).predict_proba(_probe(sites)),
        atol=1e-4,
    )
    answers = [r[3] for r in rec.records if r[0] == "from_site" and r[2] == "classifier_loss_grad"]
    assert len(answers) % 4 == 0
    assert sorted(a.n for a in answers[:4]) == [30, 30, 36, 36]  # halves of 60 and 72 rows
    assert audit(rec.records, {s.name: len(s.y_labeled) for s in sites}) == []


def test_per_round_calls_go_over_the_data_channel(warm, sites, monkeypatch):
    """With the default data channel (mutual TLS) no DC evaluation or SGD step goes through a
    Ray call; "off" sends them through Ray and "plain" over loopback, and all three give the same
    classifier and the same z, bit for bit (the same worker methods compute them)."""
    through_ray = []
    real_call = RaySites._call

    def counting_call(self, e, method, msg):
        through_ray.append(method)
        return real_call(self, e, method, msg)

    monkeypatch.setattr(RaySites, "_call", counting_call)
    ccfg = replace(ClassifierConfig(mu=1e-3), **SGD)
    rec = m.Recorder()
    assert warm.data_channel == "tls"
    tls = _fit(warm, sites, recorder=rec, classifier=ccfg)
    assert warm.channel_status() == {"a": True, "b": True, "c": True}
    assert "dc_evaluate" not in through_ray and "classifier_loss_grad" not in through_ray
    assert audit(rec.records, {s.name: len(s.y_labeled) for s in sites}) == []
    offers = [r[3] for r in rec.records if r[2] == "open_channel" and r[0] == "to_site"]
    assert all(o.mode == "tls" and o.peer_cert.startswith("-----BEGIN CERTIFICATE-----") for o in offers)
    results = {"tls": tls}
    try:
        for mode in ("off", "plain"):
            warm.set_data_channel(mode)
            through_ray.clear()
            results[mode] = _fit(warm, sites, classifier=ccfg)
            n_evals = _rounds(results[mode])
            assert through_ray.count("dc_evaluate") == (3 * n_evals if mode == "off" else 0)
    finally:
        warm.set_data_channel("tls")
    for mode in ("off", "plain"):
        assert results[mode].z.tobytes() == tls.z.tobytes()
        assert results[mode].domain_model.theta_.tobytes() == tls.domain_model.theta_.tobytes()


def test_a_site_the_channel_cannot_reach_is_served_through_ray(warm, sites, monkeypatch, caplog):
    """A site whose channel cannot be opened (say, a firewall) answers through Ray: same z, a
    warning naming the site, and no new connect attempt on every round (back-off)."""
    from msa_fed.runtime import ray_sites

    warm.set_data_channel("tls")
    real_client, opened = ray_sites.ChannelClient, []

    def client(address, *args, **kwargs):
        opened.append(address.port)
        if len(opened) == 2:  # the second site's channel (site order a, b, c)
            raise ConnectionRefusedError("connection refused (test)")
        return real_client(address, *args, **kwargs)

    through_ray = []
    real_call = RaySites._call
    monkeypatch.setattr(ray_sites, "ChannelClient", client)
    # the back-off outlasts the fit however loaded the machine (at 5 s a slow fit retried b's
    # channel, which this test's client then let open)
    monkeypatch.setattr(ray_sites, "CHANNEL_RETRY_S", 3600.0)
    monkeypatch.setattr(
        RaySites,
        "_call",
        lambda self, e, method, msg: through_ray.append((e.name, method)) or real_call(self, e, method, msg),
    )
    try:
        with caplog.at_level("WARNING", logger="msa_fed.runtime.ray_sites"):
            model = _fit(warm, sites)
        assert warm.channel_status() == {"a": True, "b": False, "c": True}
        evals = [name for name, method in through_ray if method == "dc_evaluate"]
        assert set(evals) == {"b"} and len(evals) == _rounds(model)
        assert len(opened) == 3  # one failed attempt, then the back-off pause
        assert any("cannot open the data channel to b" in r.getMessage() for r in caplog.records)
        np.testing.assert_allclose(model.z, msa_fed.fit_dmsa(sites).z, atol=1e-6)
    finally:
        warm.set_data_channel("tls")


# ---------------------------------------------------------------------------- faults
def test_the_own_loss_guarantee_reaches_the_site_actors(warm, sites):
    """solver guarantee through Ray (before the tests below kill the module's actors): each site
    actor answers the own-loss request before the solve (one harm request more per site), and the
    outcome is the local run's."""
    rec = m.Recorder()
    model = _fit(warm, sites, recorder=rec, solver=SolverConfig(guarantee=0.0))
    asked = [r for r in rec.records if r[0] == "to_site" and r[2] == "harm"]
    assert len(asked) == 2 * len(sites) and {r[1] for r in asked} == {"a", "b", "c"}
    assert np.asarray(asked[0][3].z).shape == (1, len(sites))
    local = msa_fed.fit_dmsa(sites, runtime="local", solver_options={"guarantee": 0.0})
    assert model.guarantee["status"] == local.guarantee["status"] == "infeasible"
    np.testing.assert_allclose(model.guarantee["own"], local.guarantee["own"], rtol=1e-9)
    np.testing.assert_allclose(model.z, local.z, atol=1e-6)


def test_site_killed_mid_solve_restarts_and_the_run_continues(warm, sites):
    if not warm.actors:  # run on its own: the actors start with a first coordinator
        _fit(warm, sites)
    before = ray.get(warm.actors[1].ping.remote()).incarnation
    killed = []

    def kill_b(it, z, gamma):
        if it == 2 and not killed:
            ray.kill(warm.actors[1], no_restart=False)
            killed.append(it)

    model = _coordinator(warm, sites, callback=kill_b).fit()
    assert killed == [2]
    after = ray.get(warm.actors[1].ping.remote()).incarnation
    assert after != before  # a new worker process answered the rest of the solve
    assert actor_status(warm.actors[1])[0] == "ALIVE"
    np.testing.assert_allclose(model.z, msa_fed.fit_dmsa(sites).z, atol=1e-6)
    # the round that met the dead channel went through Ray; a later one reopens the channel (the
    # solve may end before a later round tries, or, on a loaded machine, the restarted actor may
    # not answer the first reopen and the back-off pause runs past the short solve: then the
    # next fit's first round reopens it)
    if not warm.channel_status()["b"]:
        warm.sites[1].channel_retry_at = 0.0
        _fit(warm, sites)
    assert warm.channel_status() == {"a": True, "b": True, "c": True}


def test_stopped_run_resumes_from_its_checkpoint(warm, sites, tmp_path):
    class Stop(Exception):
        pass

    def stop_after_2(it, z, gamma):
        if it == 2:
            raise Stop

    with pytest.raises(Stop):
        _coordinator(warm, sites, callback=stop_after_2, solver=SolverConfig(**DCA), checkpoint_dir=str(tmp_path)).fit()
    state = json.loads((tmp_path / "dc_state.json").read_text())
    assert state["iteration"] == 2 and "theta" in state and not state.get("done")
    assert len(state["answers"]) >= 2  # the rounds the sites answered before the stop are kept
    resumed = _fit(warm, sites, solver=SolverConfig(**DCA), checkpoint_dir=str(tmp_path))
    full = msa_fed.fit_dmsa(sites, solver_options=DCA)  # uninterrupted, in-process
    assert resumed.info["classifier"]["resumed"] is True
    # the resumed solve retraces the whole path, the kept rounds answered from the checkpoint
    assert resumed.info["solver"]["n_iter"] == full.info["solver"]["n_iter"]
    np.testing.assert_allclose(resumed.z, full.z, atol=1e-6)
    assert abs(resumed.gamma - full.gamma) <= 1e-9
    assert json.loads((tmp_path / "dc_state.json").read_text())["done"] is True


def test_site_killed_for_good_fails_the_run_naming_it(warm, sites):
    """Last in the module: it leaves the warm backend with a dead site."""

    def kill_c(it, z, gamma):
        # at the first iterate: the solve asks at least one more round after it (it ends in
        # three iterates on these sites, and may stop before evaluating a converged next point)
        if it == 1:
            ray.kill(warm.actors[2], no_restart=True)
            # ray.kill only asks the GCS: on a loaded machine the actor could answer the
            # solve's last rounds before it is gone; wait until it is (the next round meets it)
            deadline = time.monotonic() + 60
            while actor_status(warm.actors[2])[0] != "DEAD" and time.monotonic() < deadline:
                time.sleep(0.05)

    with pytest.raises(
        SiteError, match=r"^site 'c': the site's actor died and will not be restarted: .*ray.kill"
    ) as err:
        _coordinator(warm, sites, callback=kill_c).fit()
    assert err.value.site == "c"
    assert actor_status(warm.actors[2])[0] == "DEAD"


def test_the_checkout_as_a_jobs_working_dir_leaves_its_git_history_out(local_ray):
    """`ray job submit --working-dir .` (cluster/README.md) uploads the checkout: its .rayignore
    leaves the git history out (and Ray leaves out what .gitignore lists), the code goes.  A
    second driver on this module's Ray with the checkout as its job's working directory lists
    what its task finds there."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    driver = (
        "import json, os, sys, ray\n"
        "ray.init(address=sys.argv[1], runtime_env={'working_dir': sys.argv[2]}, log_to_driver=False)\n"
        "print(json.dumps(ray.get(ray.remote(num_cpus=0)(lambda: sorted(os.listdir('.'))).remote())))\n"
    )
    gcs = ray.get_runtime_context().gcs_address
    out = subprocess.run(
        [sys.executable, "-c", driver, gcs, repo], capture_output=True, text=True, timeout=300, cwd=repo
    )
    assert out.returncode == 0, out.stderr[-3000:]
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"msa_fed", "cluster", "pyproject.toml", ".rayignore"} <= set(names), names
    assert ".git" not in names and ".venv" not in names, names
