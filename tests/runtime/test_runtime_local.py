"""The runtime without Ray: shards split over workers, site data from disk, the privacy minimum,
checkpoints.  The Ray modules run the same classes inside actors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import msa_fed
from msa_fed.core.domain_classifier import ClassifierConfig, MaxentShard, train_domain_classifier
from msa_fed.core.features import StandardFeatures
from msa_fed.errors import ConfigError, PeerFault, PrivacyError
from msa_fed.boundary import messages as m
from msa_fed.runtime.config import FitConfig
from msa_fed.runtime.coordinator import Coordinator
from msa_fed.runtime.local import LocalSites
from msa_fed.site.shards import RowShard, minibatch_indices, split_rows
from msa_fed.site.worker import SiteWorker
from problems import make_sites, site_kwargs

SGD = {"optimizer": "sgd", "epochs": 4, "batch_size": 16, "lr": 0.05}


@pytest.fixture(scope="module")
def sites():
    return make_sites()


def test_split_rows_covers_range_evenly():
    for n, parts in [(0, 1), (10, 3), (84, 4), (5, 7)]:
        blocks = split_rows(n, parts)
        assert len(blocks) == parts
        assert blocks[0][0] == 0 and blocks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(blocks[:-1], blocks[1:]))
        sizes = [b - a for a, b in blocks]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="workers_per_site must be >= 1; got 0"):
        split_rows(10, 0)


def test_row_blocks_add_up_to_the_site_shard():
    """Full-batch and mini-batch answers of w row blocks sum to the whole shard's answer."""
    rng = np.random.default_rng(1)
    Phi = rng.normal(size=(37, 5))
    p, index, seed = 3, 1, 1001
    whole = MaxentShard(Phi, np.full(37, index), np.full(37, 1.0 / (p * 37)), p, seed=seed)
    theta = rng.normal(size=p * 6)
    blocks = [RowShard(Phi[a:b], index, a, 37, p, seed=seed) for a, b in split_rows(37, 4)]
    for step, batch in [(None, 0), (0, 8), (5, 8), (3, 100)]:
        if step is None:
            ref = whole.loss_grad(theta)
            parts = [b.loss_grad(theta) for b in blocks]
        else:
            ref = whole.minibatch_loss_grad(theta, step, batch)
            parts = [b.minibatch_loss_grad(theta, step, batch) for b in blocks]
        np.testing.assert_allclose(sum(x[0] for x in parts), ref[0], rtol=1e-12)
        np.testing.assert_allclose(sum(x[1] for x in parts), ref[1], rtol=1e-10, atol=1e-15)
    # the mirrored mini-batch selection is MaxentShard's (a one-row-per-point probe)
    probe = MaxentShard(np.eye(37), np.full(37, 0), np.ones(37), 2, seed=seed)
    for step in range(3):
        _, g = probe.minibatch_loss_grad(np.zeros(76), step, 8)
        chosen = np.flatnonzero(np.abs(g[:37]) > 0)
        assert sorted(chosen) == sorted(minibatch_indices(seed, step, 37, 8).tolist())
    # one block per site is exactly the single-process computation
    single = RowShard(Phi, index, 0, 37, p, seed=seed)
    assert single.minibatch_loss_grad(theta, 2, 8)[0] == whole.minibatch_loss_grad(theta, 2, 8)[0]


# float64 for L-BFGS: with float32 products its line search ends on function noise ("ABNORMAL",
# theta known to ~3e-5 only), so sums added in another order stop it elsewhere
@pytest.mark.parametrize("options", [{"dtype": "float64"}, SGD], ids=["lbfgs", "sgd"])
def test_workers_per_site_equals_single_process(sites, options):
    """Data-parallel training over 3 workers per site = in-process training on the pooled sample."""
    ccfg = replace(ClassifierConfig(mu=1e-3), **(options or {}))
    ref = train_domain_classifier([s.X_unlabeled for s in sites], StandardFeatures(), ccfg, random_state=0)
    # the coordinator polishes theta to the public optimum (the sites verify it): so does the reference
    from msa_fed.core.domain_classifier import balanced_shards, polish_maxent, sum_oracle

    Phis = [ref.feature_map.transform(s.X_unlabeled) for s in sites]
    oracle = sum_oracle(balanced_shards(Phis, replace(ccfg, dtype="float64")))
    ref.theta_, _ = polish_maxent(oracle, ref.theta_, ref.n_features_, len(sites), ccfg.mu, ccfg.max_iter)
    cfg = FitConfig(classifier=ccfg)
    rec = m.Recorder()
    backend = LocalSites(site_kwargs(sites), workers_per_site=3)
    with Coordinator(backend, [s.predictor for s in sites], cfg, recorder=rec) as c:
        model = c.fit()
    X = np.vstack([s.X_unlabeled for s in sites] + [s.X_labeled for s in sites])
    np.testing.assert_allclose(model.domain_model.predict_proba(X), ref.predict_proba(X), atol=1e-4)
    assert np.abs(model.domain_model.theta_ - ref.theta_).max() < 1e-6
    # the gradients really came from 3 x 3 row holders
    grads = [r for r in rec.records if r[0] == "from_site" and r[2] == "classifier_loss_grad"]
    assert len(grads) % 9 == 0 and len(grads) > 0
    assert sum(r[3].n for r in grads[:9]) == sum(len(s.X_unlabeled) for s in sites)
    single_rec = m.Recorder()
    single = msa_fed.fit_dmsa(sites, classifier_options=options, recorder=single_rec)
    np.testing.assert_allclose(model.z, single.z, atol=1e-6)
    if options is not SGD:
        # one worker per site: L-BFGS runs stacked in the coordinator (no shard at the sites),
        # to the same public optimum as the data-parallel run
        assert not {"setup_shard", "classifier_loss_grad"} & {r[2] for r in single_rec.records}
        assert np.abs(single.domain_model.theta_ - model.domain_model.theta_).max() < 1e-6


def test_site_refuses_to_aggregate_below_its_minimum(sites):
    """The site itself enforces its minimum, whatever the coordinator is configured with."""
    kwargs = site_kwargs(sites)
    kwargs[1]["min_points"] = 60  # site 'b' has 53 labelled points
    cfg = FitConfig(min_points=20)
    with pytest.raises(PrivacyError, match=r"site 'b' refuses to aggregate over 53 labelled points.*minimum of 60"):
        with Coordinator(LocalSites(kwargs), [s.predictor for s in sites], cfg) as c:
            c.fit()
    worker = SiteWorker(**kwargs[1])
    with pytest.raises(PrivacyError, match="site 'b'"):
        worker.set_domain_model(m.DomainModelSpec(kind="maxent", n_sources=3))


def test_coordinator_fails_fast_naming_the_small_site(sites):
    with pytest.raises(PrivacyError, match=r"site 'a' has 41 labelled points.*min_points=45") as err:
        msa_fed.fit_dmsa(sites, min_points=45)
    assert "site 'b'" not in str(err.value) and "\n" not in str(err.value)


def _save(path, site):
    np.savez(path, X_labeled=site.X_labeled, y_labeled=site.y_labeled, X_unlabeled=site.X_unlabeled)


def test_site_reads_its_data_from_its_node(tmp_path, monkeypatch, sites):
    kw = site_kwargs(sites)[0]
    (tmp_path / "node").mkdir()
    _save(tmp_path / "node" / "a.npz", sites[0])
    arrays = {k: kw.pop(k) for k in ("X_labeled", "y_labeled", "X_unlabeled")}
    monkeypatch.setenv("MSA_FED_SITE_DATA", str(tmp_path / "node"))
    w = SiteWorker(**kw, data_path="a.npz")
    assert w.X_labeled is None  # read lazily, on the node, at first use
    info = w.info()
    assert (info.n_labeled, info.n_unlabeled) == (41, 60)
    np.testing.assert_array_equal(w.y_labeled, arrays["y_labeled"])
    w2 = SiteWorker(**kw, data_path=tmp_path / "node" / "a.npz")  # an absolute path: read as it is
    assert w2.info().n_unlabeled == 60
    np.testing.assert_array_equal(w2.X_unlabeled, arrays["X_unlabeled"])
    with pytest.raises(ConfigError, match=r"site 'a': data file .*missing.npz' not found on the site's node"):
        SiteWorker(**kw, data_path="missing.npz").info()
    monkeypatch.delenv("MSA_FED_SITE_DATA")
    with pytest.raises(ConfigError, match="relative but MSA_FED_SITE_DATA is not set"):
        SiteWorker(**kw, data_path="a.npz").info()


def test_site_data_file_is_never_unpickled(tmp_path, sites):
    kw = site_kwargs(sites)[0]
    for k in ("X_labeled", "y_labeled", "X_unlabeled"):
        kw.pop(k)
    np.savez(
        tmp_path / "evil.npz",
        X_labeled=np.zeros((30, 4)),
        y_labeled=np.array([object()] * 30, dtype=object),
        X_unlabeled=np.zeros((30, 4)),
    )
    with pytest.raises(ConfigError, match="cannot read data file .*pickle"):
        SiteWorker(**kw, data_path=tmp_path / "evil.npz").info()
    np.savez(tmp_path / "short.npz", X_labeled=np.zeros((30, 4)), X_unlabeled=np.zeros((30, 4)))
    with pytest.raises(ConfigError, match=r"lacks arrays \['y_labeled'\]"):
        SiteWorker(**kw, data_path=tmp_path / "short.npz").info()


def test_every_site_method_answers_a_boundary_message(sites):
    from msa_fed.privacy.policy import SitePolicy

    kw = site_kwargs(sites)
    kw[2]["policy"] = SitePolicy(verify_domain_models=False)  # theta = 0 is not the optimum
    w = SiteWorker(**kw[2])
    fmap = StandardFeatures().fit(np.vstack([s.X_unlabeled for s in sites]))
    from msa_fed.core.features import feature_map_state

    answers = [
        w.info(),
        w.unlabeled_sample(),
        w.ping(),
        w.setup_shard(m.ShardSetup(feature_map=feature_map_state(fmap), custom_feature_map=None, n_sources=3)),
        w.classifier_loss_grad(m.ThetaRequest(theta=np.zeros(15))),
        w.set_published(m.PublishedSamples(tuple(s.X_unlabeled for s in sites))),
    ]
    spec = m.DomainModelSpec(kind="maxent", n_sources=3, feature_map=feature_map_state(fmap), theta=np.zeros(15))
    answers.append(w.set_domain_model(spec))
    answers.append(w.set_qhat(m.QhatBroadcast(qhat=np.full(3, 1 / 3), eta=0.01)))
    answers.append(w.dc_evaluate(m.DCRequest(z=np.full(3, 1 / 3), eta=0.01, what=("L", "dL"))))
    answers.append(w.max_bound())
    answers.append(w.harm(m.HarmRequest(z=np.full((1, 3), 1 / 3), eta=0.01)))
    answers.append(w.open_channel(m.ChannelOffer(mode="plain")))
    w._channel_server.close()
    assert all(isinstance(a, m.RESPONSE_TYPES) for a in answers)
    public = {n for n in dir(SiteWorker) if not n.startswith("_") and callable(getattr(SiteWorker, n))}
    assert public == {
        "info",
        "unlabeled_sample",
        "unlabeled_rows",
        "ping",
        "setup_shard",
        "classifier_loss_grad",
        "set_published",
        "set_domain_model",
        "set_qhat",
        "dc_evaluate",
        "max_bound",
        "harm",
        "open_channel",
        "handle",  # the one entry point of every host, answering the methods above only
    }


def test_messages_round_trip_through_their_compact_form(sites):
    """Messages pickle (as Ray ships them) with small arrays packed as bytes; they come back equal."""
    import pickle

    from msa_fed.core.dc_terms import DCSums
    from msa_fed.core.features import feature_map_state

    fmap = StandardFeatures().fit(sites[0].X_unlabeled)
    msgs = [
        m.DCRequest(z=np.full(3, 1 / 3), eta=0.01, what=("L", "dL"), global_bound=2.0),
        m.DCPartial(DCSums(L=np.arange(3.0), dL=np.eye(3), n=41)),
        m.DomainModelSpec(kind="maxent", n_sources=3, feature_map=feature_map_state(fmap), theta=np.ones(15)),
        m.UnlabeledSample(X=np.random.default_rng(0).normal(size=(5000, 4))),  # large: left to Ray
        m.SiteInfo("a", 4, 41, 60, "classification", np.array([0, 1])),
        m.Ack("x", "node"),
    ]
    for msg in msgs:
        back = pickle.loads(pickle.dumps(msg))
        assert type(back) is type(msg)
        got, want = back.arrays(), msg.arrays()
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    assert pickle.loads(pickle.dumps(msgs[0])).what == ("L", "dL")
    assert pickle.loads(pickle.dumps(msgs[2])).feature_map[0] == "standard"
    assert pickle.loads(pickle.dumps(msgs[1])).sums.n == 41
    assert len(pickle.dumps(msgs[1])) < 600  # compact: no per-array pickle machinery
    assert SiteWorker(**site_kwargs(sites)[0]).ping().node_id == ""  # no Ray here


def test_backends_implement_the_protocol_and_never_call_the_coordinator(sites):
    """Both backends expose the methods of runtime.backend.Backend, and none of their code
    refers to a coordinator: what they need (recorder, set-up log) is given at start."""
    import ast
    import inspect

    from msa_fed.runtime import local, ray_actors, ray_sites
    from msa_fed.runtime.backend import Backend
    from msa_fed.runtime.ray_sites import RaySites as Ray  # built, never started: no Ray here

    assert isinstance(LocalSites(site_kwargs(sites)), Backend)
    assert isinstance(Ray(site_kwargs(sites)), Backend)
    for module in (local, ray_sites, ray_actors):
        tree = ast.parse(inspect.getsource(module))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
        assert not {"coordinator", "replay_setup", "Coordinator"} & names, module.__name__
    with pytest.raises(ValueError, match=r"RaySites: unknown key\(s\) \['bogus'\]"):
        Ray(site_kwargs(sites), bogus=1)
    with pytest.raises(ValueError, match="RaySites: max_restarts must be an integer >= 0; got -1"):
        Ray(site_kwargs(sites), max_restarts=-1)


def test_setup_log_keeps_the_latest_message_per_method_in_order():
    from msa_fed.runtime.backend import SetupLog

    log = SetupLog()
    log.add("setup_shard", 1)
    log.add("set_domain_model", 2)
    log.add("set_qhat", 3)
    log.add("set_domain_model", 4)
    assert log.entries() == [("setup_shard", 1), ("set_qhat", 3), ("set_domain_model", 4)]
    assert log.get("set_qhat") == 3 and log.get("missing") is None
    log.clear()
    assert log.entries() == []


def test_checkpoint_file_belongs_to_one_problem(tmp_path):
    from msa_fed.runtime.checkpoint import FILE_NAME, Checkpoint

    ck = Checkpoint(tmp_path / "new")
    assert ck.bind("aaaa") == {}
    ck.update(theta=[1.0, 2.0])
    ck.update(z=[0.5, 0.5], iteration=3)
    assert not (tmp_path / "new" / (FILE_NAME + ".tmp")).exists()
    again = Checkpoint(tmp_path / "new")
    assert again.bind("aaaa") == {"theta": [1.0, 2.0], "z": [0.5, 0.5], "iteration": 3}
    assert Checkpoint(tmp_path / "new").bind("bbbb") == {}  # another problem's state is ignored
    (tmp_path / "new" / FILE_NAME).write_text("{not json")
    with pytest.raises(ConfigError, match=r"checkpoint .*dc_state.json' is unreadable"):
        Checkpoint(tmp_path / "new").bind("aaaa")
    off = Checkpoint(None)
    assert off.bind("aaaa") == {} and off.update(z=[1.0]) is None and not off.enabled


def test_local_run_resumes_from_its_checkpoint(sites, tmp_path):
    first = msa_fed.fit_dmsa(sites, checkpoint_dir=tmp_path)
    assert "resumed" not in first.info["classifier"]
    again = msa_fed.fit_dmsa(sites, checkpoint_dir=tmp_path)
    assert again.info["classifier"] == {"resumed": True}
    np.testing.assert_allclose(again.domain_model.theta_, first.domain_model.theta_, rtol=0, atol=0)
    np.testing.assert_allclose(again.z, first.z, atol=1e-9)


@pytest.mark.parametrize("method", ["dmsa", "gmsa"])
def test_domain_models_cross_as_their_own_state(sites, method):
    """The coordinator's message carries a domain model as its get_state; the site rebuilds it
    with from_state and computes the same Q(k | x)."""
    fit = msa_fed.fit_dmsa if method == "dmsa" else msa_fed.fit_gmsa
    dm = fit(sites).domain_model
    spec = m.domain_model_spec(dm, len(sites))
    assert spec.kind == type(dm).kind
    back = m.domain_model_from_spec(spec)
    assert type(back) is type(dm)
    X = np.vstack([s.X_labeled for s in sites])
    np.testing.assert_array_equal(back.predict_proba(X), dm.predict_proba(X))
    with pytest.raises(ValueError, match="unknown domain model kind 'tree'"):
        m.domain_model_from_spec(m.DomainModelSpec(kind="tree", n_sources=3))


def test_the_registry_client_imports_no_server():
    """The registry client takes its address helpers from control/transport/address.py."""
    import ast
    from pathlib import Path

    root = Path(msa_fed.__file__).parent

    def imports(rel):
        tree = ast.parse((root / rel).read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "msa_fed.control.server" not in imports("control/registry/client.py")
    assert "msa_fed.control.transport.address" in imports("control/registry/client.py")


class _CountingSite(SiteWorker):
    """A site that counts, on its side, every DC round it is asked, and stops answering (its
    process killed) once ``stop_after`` rounds have been asked of all sites together."""

    asked: dict = {}
    stop_after: int | None = None

    def handle(self, method, msg):
        if method in ("dc_evaluate", "max_bound"):
            total = sum(type(self).asked.values())
            if self.stop_after is not None and total >= self.stop_after:
                from msa_fed.errors import SiteError

                raise SiteError(self.name, "killed")
            type(self).asked[(self.name, method)] = type(self).asked.get((self.name, method), 0) + 1
        return super().handle(method, msg)


def _counted_fit(sites, ckpt, stop_after=None):
    _CountingSite.asked = {}
    _CountingSite.stop_after = stop_after
    cfg = FitConfig(min_points=20, checkpoint_dir=None if ckpt is None else str(ckpt))
    with Coordinator(LocalSites(site_kwargs(sites), worker_cls=_CountingSite), [s.predictor for s in sites], cfg) as c:
        model = c.fit()
    return model, dict(_CountingSite.asked)


def test_a_resumed_run_asks_the_sites_only_the_rounds_they_have_not_answered(sites, tmp_path):
    """A site dies mid-solve; the job is run again with the same checkpoint_dir: the sites are
    asked (counted at the sites) only the DC rounds they had not answered, the solve ends where
    an uninterrupted run ends, and a third run asks them nothing."""
    from msa_fed.errors import SiteError

    whole, asked_whole = _counted_fit(sites, tmp_path / "whole")  # each distinct round asked once
    per_site = {n for n, _ in asked_whole}
    rounds = sum(v for (n, meth), v in asked_whole.items() if n == sites[0].name)
    assert len(per_site) == len(sites) and rounds >= 6, asked_whole

    cut = (rounds // 2) * len(sites) + 1  # the first site answered round k+1, the others did not
    with pytest.raises(SiteError, match="killed"):
        _counted_fit(sites, tmp_path, stop_after=cut)
    before = dict(_CountingSite.asked)
    assert sum(before.values()) == cut
    resumed, after = _counted_fit(sites, tmp_path)
    np.testing.assert_array_equal(resumed.z, whole.z)
    for name in per_site:  # each site: the rounds it answered before the kill, plus the rest, once
        for meth in ("dc_evaluate", "max_bound"):
            key = (name, meth)
            assert before.get(key, 0) + after.get(key, 0) >= asked_whole.get(key, 0)
    asked_again = sum(after.values())
    # every round answered by all sites before the kill is not asked again (one round was cut:
    # only the first site answered it, and it is asked again of every site)
    assert asked_again == sum(asked_whole.values()) - (cut - 1), (asked_whole, before, after)
    again, third = _counted_fit(sites, tmp_path)
    assert third == {} and np.array_equal(again.z, whole.z)
    plain, _ = _counted_fit(sites, None)  # without a checkpoint_dir: the same solve
    np.testing.assert_array_equal(plain.z, whole.z)


def test_kept_answers_answer_a_batch_from_the_checkpoint_and_ask_only_the_rest(tmp_path):
    """The influence analysis asks rows in batches: rows answered before come from the
    checkpoint (bit for bit, after a restart of the process: a new Checkpoint on the same
    folder), the others go in one batched request."""
    from msa_fed.core.dc_terms import DCSums
    from msa_fed.runtime.checkpoint import Checkpoint, KeptAnswers

    class Oracle:
        n_sources = 3

        def __init__(self):
            self.batches: list[int] = []

        def evaluate(self, z, eta, what, global_bound=None):
            z = np.asarray(z, dtype=np.float64)
            return DCSums(L=np.sin(z * 7.1) / 3.0, dL=np.outer(z, z) * np.pi, n=5)

        def evaluate_batch(self, zs, eta, what, global_bound=None):
            self.batches.append(len(zs))
            return [self.evaluate(z, eta, what, global_bound) for z in zs]

        def max_bound(self):
            return 2.0 / 3.0

    zs = np.random.default_rng(1).dirichlet(np.ones(3), size=4)
    ck = Checkpoint(tmp_path)
    ck.bind("problem")
    first = KeptAnswers(Oracle(), ck, b"qhat")
    a = first.evaluate_batch(zs[:2], 0.1, ("L", "dL"))
    assert first.oracle.batches == [2] and first.max_bound() == 2.0 / 3.0
    again = Checkpoint(tmp_path)
    again.bind("problem")
    second = KeptAnswers(Oracle(), again, b"qhat")
    b = second.evaluate_batch(zs, 0.1, ("L", "dL"))
    assert second.oracle.batches == [2] and second.kept == 2  # only the two rows not answered before
    for x, y in zip(a, b[:2]):
        assert np.array_equal(x.L, y.L) and np.array_equal(x.dL, y.dL) and x.n == y.n == 5
    assert second.max_bound() == 2.0 / 3.0 and second.asked == 1
    other = Checkpoint(tmp_path)
    other.bind("problem")
    assert KeptAnswers(Oracle(), other, b"another qhat").evaluate(zs[0], 0.1, ("L", "dL")) is not None
    assert len(other.state["answers"]) == 6  # another Qhat: another problem, asked again


class _Counted:
    """A predictor shared by the sites that counts its calls; ``most``: its first call on more rows
    than that raises; ``nan_above``: NaN probabilities for rows whose first input is above it."""

    def __init__(self, h, most=None, nan_above=None):
        self.h, self.most, self.nan_above, self.calls = h, most, nan_above, 0

    @property
    def classes_(self):
        return self.h.classes_

    def predict_proba(self, X):
        self.calls += 1
        if self.most is not None and X.shape[0] > self.most:
            self.most = None
            raise RuntimeError("too many rows")
        P = self.h.predict_proba(X)
        if self.nan_above is not None:
            P[X[:, 0] > self.nan_above] = np.nan
        return P


def _fit_outputs(sites, stack, wrap):
    predictors = [wrap(k, s.predictor) for k, s in enumerate(sites)]
    kwargs = [dict(kw, predictors=predictors) for kw in site_kwargs(sites)]
    backend = LocalSites(kwargs, stack_predictors=stack)
    with Coordinator(backend, predictors, FitConfig()) as c:
        model = c.fit()
        H = [w._outputs().copy() for w in backend.workers]
    return model, H, sum(h.calls for h in predictors)


def test_predictors_stacked_over_the_sites_give_each_site_its_own_numbers(sites):
    """In the local runtime each predictor is called once over every site's rows stacked and each
    site handed its slice: each site's outputs H, and so z, the losses and the predictions, are
    bit for bit those of each site calling every predictor itself, with p calls instead of p^2; a
    predictor whose stacked call fails is called by each site itself, with the same result."""
    p = len(sites)
    ref, H_ref, calls_ref = _fit_outputs(sites, False, lambda k, h: _Counted(h))
    got, H, calls = _fit_outputs(sites, True, lambda k, h: _Counted(h))
    assert calls == calls_ref - p * (p - 1)
    for a, b in zip(H, H_ref):
        assert np.array_equal(a, b)
    assert np.array_equal(got.z, ref.z)
    assert np.array_equal(got.domain_losses, ref.domain_losses)
    X = np.vstack([s.X_labeled for s in sites])
    assert np.array_equal(got.predict_proba(X), ref.predict_proba(X))
    most = max(len(s.X_labeled) + len(s.X_unlabeled) for s in sites)
    one, H_one, calls_one = _fit_outputs(sites, True, lambda k, h: _Counted(h, most=most) if k == 1 else _Counted(h))
    assert calls_one == calls + 1 + (p - 1)  # predictor 1: the stacked call failed, then each site's own
    for a, b in zip(H_one, H_ref):
        assert np.array_equal(a, b)
    assert np.array_equal(one.z, ref.z)


class _Skewed(_Counted):
    """Probabilities that break one of the site's checks on rows whose first input is above
    ``above``: scaled (rows not summing to 1) or shifted below 0."""

    def __init__(self, h, above, how):
        super().__init__(h)
        self.above, self.how = above, how

    def predict_proba(self, X):
        P = np.array(super().predict_proba(X), dtype=np.float64)
        bad = X[:, 0] > self.above
        if self.how == "scaled":
            P[bad] *= 1.25
        else:
            P[bad] -= 0.5
        return P


@pytest.mark.parametrize("how", ["nan", "scaled", "shifted"])
def test_a_peer_predictor_that_fails_a_site_s_check_is_blamed_as_before(sites, how):
    """A peer's predictor with NaN outputs on some rows, or probabilities that do not sum to 1 (or
    fall below 0) there: the stacked run and the stacked check of the handed answers refuse them
    with the same error, naming the same predictor and site with the same words, as each site
    calling it itself."""

    def wrap(k, h):
        if k != 2:
            return _Counted(h)
        return _Counted(h, nan_above=3.0) if how == "nan" else _Skewed(h, 3.0, how)

    errors = []
    for stack in (False, True):
        with pytest.raises((ConfigError, PeerFault)) as err:
            _fit_outputs(sites, stack, wrap)
        errors.append((type(err.value), str(err.value)))
    assert errors[0] == errors[1]
    assert "'#2''s predictor" in errors[0][1] and "site 'a''s labelled points" in errors[0][1]


def test_the_sites_check_the_handed_answers_together_with_the_same_numbers(sites, monkeypatch):
    """Each site checks the host's answers of the predictors in one stacked pass: it takes that
    path for every predictor, and its outputs H, z and the predictions are bit for bit those of
    each site calling every predictor itself."""
    from msa_fed.site.worker import SiteWorker

    taken = []
    real = SiteWorker._handed_columns

    def spy(self, *args):
        done = real(self, *args)
        taken.append(len(done))
        return done

    ref, H_ref, _ = _fit_outputs(sites, False, lambda k, h: _Counted(h))
    assert not taken  # nothing handed without the stacked calls
    monkeypatch.setattr(SiteWorker, "_handed_columns", spy)
    got, H, _ = _fit_outputs(sites, True, lambda k, h: _Counted(h))
    assert taken == [len(sites)] * len(sites)
    for a, b in zip(H, H_ref):
        assert np.array_equal(a, b)
    assert np.array_equal(got.z, ref.z)
    X = np.vstack([s.X_labeled for s in sites])
    assert np.array_equal(got.predict_proba(X), ref.predict_proba(X))


class _TogetherSites(LocalSites):
    """LocalSites with the federated backend's ``call_all_then`` (two requests to each site in
    one round, answered in turn): the coordinator then sends the solver's first request with
    set_qhat.  Records each use."""

    used: list = []

    def call_all_then(self, method, msgs, then, then_msgs):
        type(self).used.append((method, then, [np.array(x.z) for x in then_msgs]))
        first = self.call_all(method, msgs)
        return first, self.call_all(then, then_msgs)


def _together_fit(sites, **cfg):
    _CountingSite.asked, _CountingSite.stop_after, _TogetherSites.used = {}, None, []
    from msa_fed.core.config import SolverConfig

    z0 = cfg.pop("z0", None)
    config = FitConfig(min_points=20, solver=SolverConfig(objective="minmax", z0=z0), **cfg)
    backend = _TogetherSites(site_kwargs(sites), worker_cls=_CountingSite)
    with Coordinator(backend, [s.predictor for s in sites], config) as c:
        model = c.fit()
    return model, dict(_CountingSite.asked), list(_TogetherSites.used)


def test_the_solvers_first_request_rides_with_set_qhat_and_is_asked_once(sites, tmp_path):
    """A backend that carries two requests per site in one round gets set_qhat and the solver's
    first DC request (the uniform z) together; z is the same, bit for bit, as the run that asks
    it on its own, and each site answered exactly the solver's evaluations (none asked twice or
    in vain).  Where the first request is not known in advance (a checkpoint, a given start) the
    set-up goes alone and nothing is asked ahead."""
    plain, asked_plain = _counted_fit(sites, None)
    model, asked, used = _together_fit(sites)
    np.testing.assert_array_equal(model.z, plain.z)
    assert len(used) == 1 and used[0][:2] == ("set_qhat", "dc_evaluate")
    assert all(np.array_equal(z, np.full(len(sites), 1 / len(sites))) for z in used[0][2])
    n = model.info["solver"]["n_evaluations"]
    assert asked == asked_plain == {(s.name, "dc_evaluate"): n for s in sites}
    start = tuple(np.arange(1.0, len(sites) + 1) / np.arange(1.0, len(sites) + 1).sum())
    for cfg in ({"checkpoint_dir": str(tmp_path / "ckpt")}, {"z0": start}):
        other, asked_other, used_other = _together_fit(sites, **cfg)
        assert used_other == [], cfg
        assert asked_other == {(s.name, "dc_evaluate"): other.info["solver"]["n_evaluations"] for s in sites}


def test_answers_asked_ahead_serve_only_the_same_request_and_are_checked(sites):
    """The oracle's answers asked ahead (prime) answer only the very request they were asked for,
    once; another request drops them (the sites are asked); a site's answer asked ahead passes the
    same plausibility check as any (a forged one is refused, naming the site)."""
    from msa_fed.runtime.plausibility import ImplausibleAnswer

    backend = LocalSites(site_kwargs(sites), worker_cls=_CountingSite)
    _CountingSite.asked, _CountingSite.stop_after = {}, None
    with Coordinator(backend, [s.predictor for s in sites], FitConfig(min_points=20)) as c:
        from msa_fed.runtime.progress import Progress

        _, oracle = c.prepare_dc(c.train_domain_model(Progress(False)))
        p = len(sites)
        a = m.DCRequest(z=np.full(p, 1 / p), eta=0.01, what=("L", "dL"))
        b = np.arange(1.0, p + 1) / np.arange(1.0, p + 1).sum()
        ahead = backend.call_all("dc_evaluate", [a] * p)
        asked = sum(_CountingSite.asked.values())
        oracle.prime(a, ahead)
        got_b = oracle.evaluate(b, 0.01, ("L", "dL"))  # another request: asked of the sites
        assert sum(_CountingSite.asked.values()) == asked + p
        got_a = oracle.evaluate(a.z, 0.01, ("L", "dL"))  # dropped by then: asked again
        assert sum(_CountingSite.asked.values()) == asked + 2 * p
        oracle.prime(a, ahead)
        again = oracle.evaluate(a.z.copy(), 0.01, ("L", "dL"))  # the same request: no one asked
        assert sum(_CountingSite.asked.values()) == asked + 2 * p
        np.testing.assert_array_equal(again.L, got_a.L) and np.testing.assert_array_equal(again.dL, got_a.dL)
        assert not np.array_equal(got_b.L, got_a.L)
        forged = list(ahead)
        forged[1] = m.DCPartial(sums=replace(ahead[1].sums, L=-np.abs(ahead[1].sums.L) - 1.0))
        oracle.prime(a, forged)
        with pytest.raises(ImplausibleAnswer, match=sites[1].name):
            oracle.evaluate(a.z, 0.01, ("L", "dL"))


def _fit_with(sites, predictors, stack):
    """A local fit with these predictors; the model and each site's outputs H."""
    kwargs = [dict(kw, predictors=predictors) for kw in site_kwargs(sites)]
    backend = LocalSites(kwargs, stack_predictors=stack)
    with Coordinator(backend, predictors, FitConfig()) as c:
        model = c.fit()
        H = [w._outputs().copy() for w in backend.workers]
    return model, H


def test_binary_logistic_models_are_evaluated_as_their_predict_proba_does(sites, monkeypatch):
    """The sites' predictors are scikit-learn logistic regressions of two classes: the host computes
    their second column itself over every site's rows (no call's validation, no stacked (n, 2)
    array; checked against the model's own call, bit for bit) and hands it to the sites, which
    check it in one pass per predictor.  That path is taken for every predictor at every site,
    and each site's outputs H, z, the losses and the predictions are bit for bit those of each
    site calling every predictor itself."""
    from msa_fed.runtime import local

    p = len(sites)
    predictors = [s.predictor for s in sites]
    computed, paired = [], []
    real_positive, real_pairs = local.binary_logistic_positive, SiteWorker._handed_pairs

    def positive(h, X, out):
        computed.append(real_positive(h, X, out))
        return computed[-1]

    def pairs(*args):
        done = real_pairs(*args)
        paired.append(len(done))
        return done

    ref, H_ref = _fit_with(sites, predictors, False)
    assert not computed and not paired
    monkeypatch.setattr(local, "binary_logistic_positive", positive)
    monkeypatch.setattr(SiteWorker, "_handed_pairs", staticmethod(pairs))
    got, H = _fit_with(sites, predictors, True)
    assert computed == [True] * p and paired == [p] * p
    for a, b in zip(H, H_ref):
        assert np.array_equal(a, b)
    assert np.array_equal(got.z, ref.z)
    assert np.array_equal(got.domain_losses, ref.domain_losses)
    X = np.vstack([np.vstack([s.X_labeled, s.X_unlabeled]) for s in sites])
    assert np.array_equal(got.predict_proba(X), ref.predict_proba(X))
    # against the models' own calls on every stacked row, not only the rows the host compares
    for h in predictors:
        out = np.empty(X.shape[0])
        assert real_positive(h, X, out)
        own = h.predict_proba(X)
        assert np.array_equal(own[:, 1], out) and np.array_equal(own[:, 0], 1 - out)


def test_a_model_that_is_not_a_plain_binary_logistic_regression_is_called(sites, monkeypatch):
    """A subclass (its own predict_proba), a model with a method of its own replaced, one fitted
    with feature names, one of three classes, other inputs and a model whose own call no longer
    computes what the host would (another version's arithmetic): the host does not compute them
    but calls them, each once over the stacked rows, and the sites' numbers are their calls'."""
    from sklearn.linear_model import LogisticRegression

    from msa_fed.runtime import local

    class Shifted(LogisticRegression):
        calls = 0

        def predict_proba(self, X):
            Shifted.calls += 1
            P = super().predict_proba(X)
            return np.stack([P[:, 0] * 0.5, 1 - P[:, 0] * 0.5], axis=1)

    rng = np.random.default_rng(3)
    X, y = rng.normal(size=(60, 3)), rng.integers(0, 2, 60)
    plain = LogisticRegression().fit(X, y)
    assert local._binary_logistic(plain, 3) and not local._binary_logistic(plain, 4)
    assert not local._binary_logistic(Shifted().fit(X, y), 3)
    replaced = LogisticRegression().fit(X, y)
    replaced.predict_proba = lambda rows: np.full((len(rows), 2), 0.5)
    assert not local._binary_logistic(replaced, 3)
    assert not local._binary_logistic(LogisticRegression().fit(X, rng.integers(0, 3, 60)), 3)
    named = LogisticRegression().fit(X, y)
    named.feature_names_in_ = np.array(["a", "b", "c"], dtype=object)
    assert not local._binary_logistic(named, 3)
    single = LogisticRegression().fit(X, y)
    single.coef_ = single.coef_.astype(np.float32)
    assert not local._binary_logistic(single, 3)

    # the subclass: called once over the stacked rows, each site's H its answers' label column
    shifted = [Shifted(C=1.0).fit(s.X_labeled, s.y_labeled) for s in sites]
    Shifted.calls = 0
    _, H = _fit_with(sites, shifted, True)
    assert Shifted.calls == len(sites)
    ref_calls = Shifted.calls
    _, H_ref = _fit_with(sites, shifted, False)
    assert Shifted.calls - ref_calls == len(sites) ** 2  # (each site calls each predictor itself)
    for a, b in zip(H, H_ref):
        assert np.array_equal(a, b)

    # a model whose own predict_proba computes otherwise: found on the rows compared, then called
    predictors = [s.predictor for s in sites]
    ref, H_ref = _fit_with(sites, predictors, False)
    real = LogisticRegression.predict_proba
    calls = []

    def other(self, rows):
        calls.append(len(rows))
        P = real(self, rows)
        P[:, 1] = np.nextafter(P[:, 1], 2.0)  # one unit in the last place off the host's
        P[:, 0] = 1 - P[:, 1]
        return P

    monkeypatch.setattr(LogisticRegression, "predict_proba", other)
    got, H = _fit_with(sites, predictors, True)
    stacked_rows = sum(len(s.X_labeled) + len(s.X_unlabeled) for s in sites)
    assert calls.count(local.CHECK_ROWS) == len(sites) and calls.count(stacked_rows) == len(sites)
    monkeypatch.setattr(LogisticRegression, "predict_proba", real)
    for site, h_cols, h_ref in zip(sites, H, H_ref):
        assert not np.array_equal(h_cols, h_ref)  # the numbers of the calls made, not the host's own
        rows = np.arange(len(site.y_labeled))
        for k, h in enumerate(predictors):
            P = other(h, site.X_labeled)
            assert np.array_equal(h_cols[:, k], P[rows, np.searchsorted(h.classes_, site.y_labeled)])
