"""The report's section on refusals and approvals (msa_fed.jobs.report): one row per site, what
the job kept of each site's refusals (request, rule, the site's words, how often, when) and of
its operator's approval; a site's words are another party's text and are escaped.  The same
section on a real federated job's model: tests/federation/test_federated_job.py."""

from __future__ import annotations

from msa_fed.jobs.report import _consortium_html
from msa_fed.runtime.federated import MAX_DETAIL_CHARS, FederatedSites


def _kept(refusals):
    """What FederatedSites keeps of refusals seen in that order (its _note_refusal)."""
    backend = FederatedSites.__new__(FederatedSites)  # its record only: no relay, no Ray
    backend.refusals, backend.approvals = [], []
    for site, method, rule, detail in refusals:
        backend._note_refusal(site, method, rule, detail)
    return backend


def test_refusals_are_kept_once_per_site_request_and_rule_with_counts_and_times():
    backend = _kept(
        [
            ("a", "join_job", "accept_jobs", "job 'j': it serves only approved jobs"),
            ("a", "join_job", "accept_jobs", "job 'j': it serves only approved jobs"),
            ("b", "harm", "budget", "the request: the site's budget is spent\n" + "x" * 1000),
        ]
    )
    backend.approvals.append({"site": "a", "by": "the operator of site a", "waited_since": 0.0, "admitted_at": 60.0})
    kept = backend.consortium()
    assert [(r["site"], r["request"], r["rule"], r["count"]) for r in kept["refusals"]] == [
        ("a", "join_job", "accept_jobs", 2),
        ("b", "harm", "budget", 1),
    ]
    assert kept["refusals"][0]["first"] <= kept["refusals"][0]["last"]
    detail = kept["refusals"][1]["detail"]
    assert "\n" not in detail and len(detail) == MAX_DETAIL_CHARS  # one short line
    page = _consortium_html(kept, ["a", "b", "c"])
    assert (
        "<tr><td>a</td><td>admitted by the operator of site a at 1970-01-01 00:01:00 UTC (the job waited from "
        "1970-01-01 00:00:00 UTC)</td><td>join_job (rule accept_jobs): job &#x27;j&#x27;: it serves only approved "
        "jobs; 2 time(s)"
    ) in page
    assert "<td>b</td><td>none needed</td><td>harm (rule budget): " in page
    assert "<tr><td>c</td><td>none needed</td><td>none</td></tr>" in page
    assert "2 kind(s) of refusal and 1 approval(s)" in page


def test_a_sites_words_are_escaped_and_an_older_model_says_it_kept_none():
    hostile = _kept([("a", "harm", "<b>rule</b>", "<script>alert(1)</script>")]).consortium()
    page = _consortium_html(hostile, ["a"])
    assert "<script>" not in page and "<b>" not in page and "&lt;script&gt;" in page
    assert "not recorded" in _consortium_html(None, ["a"])
    # a malformed record (not a list of dicts) gives rows of "none", never an error
    assert "<td>a</td><td>none needed</td><td>none</td>" in _consortium_html({"refusals": "x", "approvals": [1]}, ["a"])
