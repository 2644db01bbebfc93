"""The process-local memo of the Maxent check's published part (msa_fed/privacy/memo.py,
msa_fed/privacy/verify.py): the sites of one process verify one model once over the published
samples, and a model that differs in any input of that part is checked again (no stale hit),
refused by every site that should refuse it; each site's own part (mu's range in its policy,
its tolerance) is applied at every call."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from msa_fed.boundary import messages as m
from msa_fed.core.features import feature_map_state
from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.privacy.memo import ProcessMemo, Undigestible, digest
from msa_fed.privacy.verify import PUBLISHED_MEMO, check_maxent
from msa_fed.site.admission import host_content
from msa_fed.site.worker import SiteWorker

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from problems import make_sites, site_kwargs  # noqa: E402
from test_verify import ROOMY, honest, spec_of  # noqa: E402

P = 3


@pytest.fixture(scope="module")
def sites():
    return make_sites(n_labeled=(61, 73, 89), n_unlabeled=(120, 150, 180), random_state=5)


@pytest.fixture(scope="module")
def opt(sites):
    return honest(sites)


@pytest.fixture(scope="module")
def rff(sites):
    return honest(sites, features=("rff", {"n_components": 40}))


@pytest.fixture(autouse=True)
def fresh_memo():
    PUBLISHED_MEMO.clear()
    yield
    PUBLISHED_MEMO.clear()


def workers(sites, policies=None, samples=None):
    """The job's p sites in this process, each given the published samples by its host."""
    out = []
    for k, kw in enumerate(site_kwargs(sites)):
        kw["policy"] = (policies or [ROOMY] * len(sites))[k]
        w = SiteWorker(**kw)
        w.set_published(m.PublishedSamples(tuple(samples or [s.X_unlabeled for s in sites])))
        out.append(w)
    return out


def outcome(worker, spec):
    """'ok', or the rule of the refusal (which must name this site)."""
    try:
        worker.set_domain_model(spec)
    except PrivacyError as exc:
        assert exc.site == worker.name  # each site refuses in its own name
        return exc.rule
    return "ok"


def counts():
    return PUBLISHED_MEMO.hits, PUBLISHED_MEMO.misses


# ---------------------------------------------------------------------- the digest
def test_the_digest_tells_apart_every_difference_of_type_value_and_shape():
    values = [
        None,
        True,
        False,
        1,
        1.0,
        -0.0,
        0.0,
        "1",
        b"1",
        np.int64(1),
        np.float64(1.0),
        np.float32(1.0),
        np.array(1.0),
        np.array([1.0]),
        np.array([[1.0]]),
        np.array([1.0], dtype=">f8"),
        np.array([1], dtype=np.int64),
        (1,),
        [1],
        ((1,),),
        ([1, 2], [3]),
        ([1], [2, 3]),
        {"a": 1},
        {"a": 1.0},
        {"a": (1,)},
        {"b": 1},
        ("a", 1),
        "a1",
        np.zeros((2, 3)),
        np.zeros((3, 2)),
        np.zeros(6),
    ]
    keys = [digest(v) for v in values]
    assert len(set(keys)) == len(values)
    # the same content: the same key (dict order does not matter, a copy is the same array)
    assert digest({"a": 1, "b": 2.0}) == digest({"b": 2.0, "a": 1})
    assert digest(np.arange(6.0).reshape(2, 3)) == digest(np.asfortranarray(np.arange(6.0).reshape(2, 3)))
    assert digest(1, 2) != digest((1, 2)) and digest(1, 2) != digest(12)


@pytest.mark.parametrize(
    "value", [object(), {1: "a"}, np.array([None]), type("S", (str,), {})("x"), type("F", (float,), {})(1.0)]
)
def test_values_the_digest_does_not_encode_are_not_memoised(value):
    with pytest.raises(Undigestible):
        digest(value)
    memo, calls = ProcessMemo(), []
    for _ in range(2):
        assert memo.get((value,), lambda: calls.append(1) or len(calls)) == len(calls)
    assert calls == [1, 1] and memo.hits == 0  # computed every time


def test_a_refusal_stores_nothing_and_entries_are_few():
    memo, calls = ProcessMemo(size=2), []

    def refuse():
        calls.append(1)
        raise PrivacyError("rule", "s", "no")

    for _ in range(3):
        with pytest.raises(PrivacyError):
            memo.get(("x",), refuse)
    assert len(calls) == 3 and memo.hits == 0
    for k in range(3):
        memo.get((k,), lambda k=k: k)
    assert memo.get((0,), lambda: "again") == "again"  # the oldest went out


# ---------------------------------------------------------------------- the sites of one process
def test_an_honest_model_is_computed_once_and_every_site_applies_its_own_part(sites, opt):
    ws = workers(sites)
    spec = spec_of(opt, P)
    assert [outcome(w, spec) for w in ws] == ["ok"] * P
    assert counts() == (P - 1, 1)  # the published part once, then hits
    devs = [w.guard.audit.records()[-1]["decisions"]["verify_deviation"] for w in ws]
    # each deviation is what a check without the memo measures (public data only: one value)
    U = [s.X_unlabeled for s in sites]
    PUBLISHED_MEMO.clear()
    direct = check_maxent(opt.theta_, opt.mu, spec.feature_map, U, ROOMY, "x")
    assert counts() == (0, 1) and devs == [direct["verify_deviation"]] * P


@pytest.mark.parametrize("change", ["theta", "intercept", "mu", "map_arrays", "rff_seed", "rff_weights"])
def test_a_model_that_differs_in_any_input_is_checked_again_and_refused_by_every_site(sites, opt, rff, change):
    base = rff if change.startswith("rff") else opt
    ws = workers(sites)
    good = spec_of(base, P)
    assert [outcome(w, good) for w in ws] == ["ok"] * P  # the honest model is now in the memo
    name, params, arrays = good.feature_map
    D = base.n_features_
    if change == "theta":
        theta = base.theta_.copy()
        theta[1] += 0.05
        bad, rule = spec_of(base, P, theta=theta), "verify_optimum"
    elif change == "intercept":
        theta = base.theta_.copy()
        theta[D] += 0.5
        bad, rule = spec_of(base, P, theta=theta), "verify_optimum"
    elif change == "mu":  # the same theta declared with another mu, in every site's range
        bad, rule = spec_of(base, P, mu=base.mu * 3), "verify_optimum"
    elif change == "map_arrays":
        bad_arrays = {**arrays, "mean": arrays["mean"] + np.array([0.5, 0, 0, 0])}
        bad, rule = spec_of(base, P, feature_map=(name, params, bad_arrays)), "verify_feature_map"
    elif change == "rff_seed":
        bad, rule = spec_of(base, P, feature_map=(name, {**params, "random_state": 7}, arrays)), "verify_feature_map"
    else:
        W = arrays["weights"].copy()
        W[:, 0] *= 3.0
        bad, rule = spec_of(base, P, feature_map=(name, params, {**arrays, "weights": W})), "verify_feature_map"
    before = counts()
    # refused: a hit on the honest model's entry would have accepted it
    assert [outcome(w, bad) for w in ws] == [rule] * P
    if rule == "verify_optimum":  # its published part computed once (a new entry), refused by each site's tolerance
        assert counts() == (before[0] + P - 1, before[1] + 1)
    else:  # refused while computing the published part: nothing stored, each site computed and refused
        assert counts() == before
    # and the honest model still passes (its entry answers)
    assert [outcome(w, good) for w in ws] == ["ok"] * P


def test_other_published_samples_are_checked_again(sites, opt):
    """A host that gives the sites other samples (here: one point of the third site's moved) than
    the ones the model was fitted on, with a job content that pins them: every site given those
    samples refuses the model, although the same model over the true samples is in the memo.
    Without the matching pin the sites refuse the samples themselves, naming the peer."""
    ws = workers(sites)
    spec = spec_of(opt, P)
    assert [outcome(w, spec) for w in ws] == ["ok"] * P
    moved = [s.X_unlabeled.copy() for s in sites]
    moved[2][0] += 40.0
    kw = site_kwargs(sites)
    with pytest.raises(ConfigError, match=f"published sample of site {sites[2].name!r}"):
        SiteWorker(**{**kw[0], "policy": ROOMY}).set_published(m.PublishedSamples(tuple(moved)))
    # the first two sites given the moved samples under a content pinning them (their own are
    # unchanged, so their own pins hold)
    content = host_content("test", [s.name for s in sites], moved, task="classification", loss="cross_entropy")
    victims = []
    for k in (0, 1):
        w = SiteWorker(**{**kw[k], "policy": ROOMY, "content": content})
        w.set_published(m.PublishedSamples(tuple(moved)))
        victims.append(w)
    before = counts()
    assert [outcome(w, spec) for w in victims] == ["verify_feature_map"] * 2
    assert counts()[0] == before[0]


def test_arrays_changed_in_place_are_checked_again(sites, opt):
    """The memo keys the content, not the object: theta or a sample changed in place after a
    site verified it is verified again."""
    U = [s.X_unlabeled.copy() for s in sites]
    theta = opt.theta_.copy()
    state = feature_map_state(opt.feature_map)
    check_maxent(theta, opt.mu, state, U, ROOMY, "a")
    theta[2] += 0.05
    with pytest.raises(PrivacyError) as info:
        check_maxent(theta, opt.mu, state, U, ROOMY, "b")
    assert (info.value.rule, info.value.site) == ("verify_optimum", "b")
    theta[2] -= 0.05
    check_maxent(theta, opt.mu, state, U, ROOMY, "c")  # the same content again: accepted
    U[1][3] += 40.0
    with pytest.raises(PrivacyError) as info:
        check_maxent(theta, opt.mu, state, U, ROOMY, "d")
    assert (info.value.rule, info.value.site) == ("verify_feature_map", "d")


def test_each_site_applies_its_own_policy_after_a_hit(sites, opt):
    """mu's range and the tolerance are the site's own: a site with a tighter policy refuses the
    model its peers accepted from the memo's entry."""
    spec = spec_of(opt, P)
    tight = replace(ROOMY, verify_tolerance=1e-12)
    narrow = replace(ROOMY, mu_min=opt.mu * 2, mu_max=1.0)
    ws = workers(sites, policies=[ROOMY, tight, narrow])
    assert [outcome(w, spec) for w in ws] == ["ok", "verify_optimum", "verify_mu"]
    assert counts()[0] >= 1  # the tight site's refusal came after a hit


def test_a_site_with_far_labelled_points_decides_as_its_peers_after_a_hit(sites, opt):
    """The deviation is the published part's: a site whose labelled points lie far out measures
    and decides what its peers do, from the memo's entry (its points are capped where it computes
    with them: tests/privacy/test_verify_outlier.py)."""
    spec = spec_of(opt, P, theta=opt.theta_ + 1e-6)
    ws = workers(sites)
    far = site_kwargs(sites)[0]
    far.update(policy=ROOMY, X_labeled=np.vstack([sites[0].X_labeled[1:], [[1e6, 0, 0, 0]]]))
    ws.append(SiteWorker(**far))
    ws[-1].set_published(m.PublishedSamples(tuple(s.X_unlabeled for s in sites)))
    assert [outcome(w, spec) for w in ws] == ["ok"] * (P + 1)
    devs = {w.guard.audit.records()[-1]["decisions"]["verify_deviation"] for w in ws}
    assert len(devs) == 1 and counts() == (P, 1)


# ---------------------------------------------------------------------- frozen arrays
def test_a_frozen_array_cannot_be_written_and_is_digested_once():
    """frozen(): a read-only copy whose memory is a bytes object (numpy refuses to make it
    writeable again); its bytes are hashed once per array object, and the digest still tells
    apart every difference of content, shape and dtype."""
    from msa_fed.privacy import memo

    X = np.random.default_rng(0).normal(size=(50, 3))
    F = memo.frozen(X)
    assert memo.is_frozen(F) and memo.frozen(F) is F and np.array_equal(F, X)
    with pytest.raises(ValueError):
        F.flags.writeable = True
    with pytest.raises(ValueError):
        F[0, 0] = 1.0
    seen = []
    real = memo._bytes_sha256

    def counted(a):
        seen.append(a)
        return real(a)

    import unittest.mock

    with unittest.mock.patch.object(memo, "_bytes_sha256", counted):
        keys = {digest(F, 1) for _ in range(3)}
        assert len(keys) == 1 and len(seen) == 1  # one hash of the bytes, three digests
        Y = X.copy()
        Y[7, 2] = np.nextafter(Y[7, 2], np.inf)  # one unit in the last place
        others = [memo.frozen(Y), memo.frozen(X.reshape(3, 50)), memo.frozen(X, np.float32), memo.frozen(X)]
        assert len({digest(F, 1), *(digest(o, 1) for o in others)}) == 4  # a fresh copy of X: same key
        # an array that is merely read-only (its memory writable elsewhere) is hashed at every use
        W = X.copy()
        view = W.view()
        view.flags.writeable = False
        assert not memo.is_frozen(view)
        assert not memo.is_frozen(np.frombuffer(bytearray(X.tobytes())))  # a bytearray can be written
        n = len(seen)
        before = digest(view)
        W[0, 0] += 1.0
        assert digest(view) != before and len(seen) == n


def test_frozen_values_follow_the_array_object():
    """frozen_value: once per frozen array and name; recomputed for another object of the same
    content, for a non-frozen array at every call, and forgotten with the array."""
    import gc

    from msa_fed.privacy import memo

    calls = []

    def total(a):
        calls.append(1)
        return float(a.sum())

    F = memo.frozen(np.arange(12.0).reshape(3, 4))
    assert memo.frozen_value(F, "t", total) == memo.frozen_value(F, "t", total) == 66.0
    assert len(calls) == 1
    G = memo.frozen(np.arange(12.0).reshape(3, 4))
    memo.frozen_value(G, "t", total)
    assert len(calls) == 2
    plain = np.arange(12.0)
    memo.frozen_value(plain, "t", total)
    memo.frozen_value(plain, "t", total)
    assert len(calls) == 4
    key = id(F)
    assert key in memo._FROZEN
    del F
    gc.collect()
    assert key not in memo._FROZEN


def test_in_process_sites_hash_each_published_sample_once(sites, monkeypatch):
    """A local fit: the coordinator freezes the published samples, so its p sites check them
    against the job's pins and verify the model with them hashing each sample once, not p times."""
    from msa_fed import fit_dmsa
    from msa_fed.privacy import memo
    from msa_fed.site import admission

    hashed = {"pins": 0, "memo": 0}
    pins, raw = admission._sample_sha256, memo._bytes_sha256

    def count(name, f):
        def wrapped(a):
            hashed[name] += 1
            return f(a)

        return wrapped

    monkeypatch.setattr(admission, "_sample_sha256", count("pins", pins))
    monkeypatch.setattr(memo, "_bytes_sha256", count("memo", raw))
    model = fit_dmsa(sites)
    assert np.isclose(model.z.sum(), 1.0)
    # the pins: each frozen sample once, and each site's own (unfrozen) sample once per check
    # (the job content's pins, computed by the API, add one per site)
    assert hashed["pins"] <= 3 * P, hashed
    assert hashed["memo"] <= P, hashed  # every site's memo key reuses the samples' digests
