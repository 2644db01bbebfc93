"""The federated runtime: site processes hold the labelled data; Ray actors stand in for them.

In the federated topology each site runs its own process (``msa-fed site serve``) that dials
out to the registry; the registry relays the job's requests on that connection.  In the
coordinator's Ray cluster one actor per site stands for it
(:class:`msa_fed.site.published.PublishedSample`): it holds
the site's *published* unlabelled sample (downloaded from the registry and pinned to the sha256
the registry recorded, by whoever builds this backend), and the actors train the Maxent domain
classifier data-parallel among themselves; on published samples of at most
:data:`STACKED_VALUES` values the coordinator trains it itself on the samples it holds (one
stacked L-BFGS, as the local runtime does) and the actors never start.  Every request that
needs labelled data (joining the job, Qhat partial sums, DC evaluations, the squared-loss
bound) goes through the relay to the
site process, which answers with aggregates only (:data:`RELAY_METHODS`).  No labelled point
ever reaches the cluster.

:class:`FederatedSites` is a coordinator backend with the same surface as
:class:`msa_fed.runtime.local.LocalSites` and :class:`msa_fed.runtime.ray_sites.RaySites`:
(:class:`msa_fed.runtime.backend.Backend`): ``start(recorder, setup_log) -> list[SiteInfo]``,
``call_one(i, method, msg, replay=True)``, ``call_all(method, msgs)``, ``call_shards(method,
msg)``, ``shutdown()``.  It never calls back into the coordinator: every crossing goes to the
recorder, and a site (or stand-in actor) that lost its state is given the set-up messages of the
:class:`msa_fed.runtime.backend.SetupLog` again.

The relay is given as an object (the runtime layer has no gRPC client of its own; the one used by
jobs is :class:`msa_fed.federation.relay_client.RelayClient`) with

- ``open_job(job_id, sites) -> list[str]`` (the sites connected now),
- ``call(job_id, calls, timeout_s) -> list``: ``calls`` are (site, method, message); each result
  is the decoded response message, a :class:`msa_fed.boundary.wire.RemoteError` (the site's own
  refusal or failure; a ``PrivacyError`` keeps its rule and site) or a :class:`SiteUnreachable`
  (the registry could not get an answer),
- ``close_job(job_id)``.

Liveness: a site the registry cannot reach (disconnected, silent, too slow) is retried until
``site_timeout_s`` has passed since its first failure, then the run fails with a
:class:`SiteError` naming it; with ``checkpoint_dir`` set the job resumes where it stopped once
the site is back.  A site process that restarted within that time has lost the job's state: it
answers ``SiteStateLost`` and this backend replays the job's setup to it (join, domain model,
Qhat) and carries on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.core.config import MIN_POINTS
from msa_fed.errors import ConfigError, PeerFault, PrivacyError, SiteError
from msa_fed.runtime.backend import NullRecorder, SetupLog
from msa_fed.runtime.ray_actors import _cpu_share
from msa_fed.runtime.ray_sites import RaySites
from msa_fed.site.methods import SITE_METHODS
from msa_fed.site.published import PublishedSample, SiteStateLost

log = logging.getLogger(__name__)

#: what the site process answers, through the relay (everything that touches labelled data)
RELAY_METHODS = SITE_METHODS  # the site's own allowlist (msa_fed/site/methods.py)
#: what the stand-in actors answer (the published unlabelled sample only)
ACTOR_METHODS = frozenset({"unlabeled_sample", "unlabeled_rows", "setup_shard", "classifier_loss_grad"})
#: a site's setup, replayed in this order after it restarted
_SITE_SETUP = ("set_domain_model", "set_qhat")
#: statuses of the relay that mean "not reachable now" (retried until site_timeout_s)
TRANSIENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "ALREADY_EXISTS"})
RETRY_PAUSE_S = 0.5
#: how often a job waiting for a site's approval asks again (seconds)
APPROVAL_POLL_S = 2.0
#: a site that lost the job's state again right after it was replayed this often fails the run
MAX_REJOINS = 3
#: the least time the stand-in actors get to start and to answer a call (seconds), whatever the
#: job's site_timeout_s
STAND_IN_START_S = 120.0
#: the largest published samples (values summed over the sites, 32 MB in float64) on which the
#: coordinator trains the L-BFGS domain classifier itself, in one stacked fit (as the local
#: runtime does), rather than data-parallel among the stand-in actors: it holds these samples
#: already, and each of the actors' L-BFGS steps is a round trip to all of them
STACKED_VALUES = 4_000_000
#: the one response type each relayed method may return
ANSWER_TYPES = {
    "join_job": m.SiteInfo,
    "info": m.SiteInfo,
    "set_domain_model": m.QhatPartial,
    "set_qhat": m.Ack,
    "dc_evaluate": m.DCPartial,
    "max_bound": m.BoundMax,
    "harm": m.HarmAnswer,
    "ping": m.Ack,
}
_REMOTE_ERRORS = {"PrivacyError": PrivacyError, "ConfigError": ConfigError}
#: the longest refusal detail of a site that the job's record keeps
MAX_DETAIL_CHARS = 300


@dataclass(frozen=True)
class SiteUnreachable:
    """The relay's answer for a site it could not get a response from: a gRPC status name
    (UNAVAILABLE, DEADLINE_EXCEEDED, PERMISSION_DENIED, ...) and the registry's one-line detail."""

    status: str
    detail: str


class _StandIns(RaySites):
    """The stand-in actors: anywhere in the coordinator's cluster (no ``site:<name>`` pinning:
    they hold only published material, and take no site policy: they have nothing it guards)."""

    site_host_kwargs: dict = {}

    def _placement(self, ray) -> list[dict]:
        free = ray.available_resources().get("CPU", 0.0)
        share = 0.5 * free / max(1, len(self.names) * self.workers_per_site)
        cpus = self.num_cpus if self.num_cpus is not None else _cpu_share(share)
        return [
            dict(max_restarts=self.max_restarts, max_task_retries=self.max_restarts, num_cpus=cpus) for _ in self.names
        ]


class _ActorSetupLog(SetupLog):
    """The stand-in actors' view of the run's set-up log: only what they answer (the classifier
    shard set-up); the sites' own set-up (domain model, Qhat) goes to the site processes."""

    def __init__(self, log: SetupLog):
        super().__init__()
        self.log = log

    def add(self, method: str, msg) -> None:
        self.log.add(method, msg)

    def get(self, method: str):
        return self.log.get(method) if method in ACTOR_METHODS else None

    def entries(self) -> list:
        return [(mm, x) for mm, x in self.log.entries() if mm in ACTOR_METHODS]

    def clear(self) -> None:
        self.log.clear()


class FederatedSites:
    """Coordinator backend of the federated topology (see the module docstring).

    names : the job's sites, in order.
    relay : the relay client (``open_job``, ``call``, ``close_job``).
    samples : each site's published unlabelled sample (m_k, d), as downloaded from the registry.
    job_id : the job's id at the relay (the sites see it, and may have to approve it).
    predictor_sha256 : the sha256 of each site's published predictor, in site order.
    task, loss, classes, min_points : as in :class:`msa_fed.site.worker.SiteWorker`.
    site_timeout_s : how long a site may stay unreachable before the run fails naming it.
    approval_wait_s : how long :meth:`start` waits for the sites in approve mode to admit the job
        (asking again every :data:`APPROVAL_POLL_S`; ``echo`` tells the operator what to run).
    owns_relay : the backend closes the relay client when it shuts down (a job's own client).
    workers_per_site, num_cpus, address, data_channel, init_kwargs, max_restarts : of the
        stand-in actors (:class:`msa_fed.runtime.ray_sites.RaySites`).
    classifier_in_process : whether the coordinator trains an L-BFGS domain classifier itself on
        the stacked published samples (:attr:`trains_in_process`); None (the default): where the
        samples hold at most :data:`STACKED_VALUES` values and ``workers_per_site`` is 1.  The
        stand-in actors start only when a call needs them (not at all for such a job).
    """

    def __init__(
        self,
        names,
        relay,
        samples,
        *,
        job_id: str,
        predictor_sha256,
        task: str = "classification",
        loss: str = "cross_entropy",
        classes=None,
        min_points: int = MIN_POINTS,
        site_timeout_s: float = 60.0,
        workers_per_site: int = 1,
        num_cpus: float | None = None,
        address: str | None = None,
        data_channel: str = "tls",
        init_kwargs: dict | None = None,
        max_restarts: int = 3,
        approval_wait_s: float = 0.0,
        echo=print,
        owns_relay: bool = False,
        classifier_in_process: bool | None = None,
    ):
        self.names = [str(n) for n in names]
        if len(samples) != len(self.names) or len(predictor_sha256) != len(self.names):
            raise ValueError("samples and predictor_sha256 need one entry per site")
        if not (site_timeout_s > 0):
            raise ValueError(f"site_timeout_s must be > 0; got {site_timeout_s!r}")
        self.relay = relay
        self.samples = [np.asarray(X, dtype=np.float64) for X in samples]
        self.job_id = str(job_id)
        self.site_timeout_s = float(site_timeout_s)
        self.join = [
            m.JobSetup(
                job_id=self.job_id,
                sites=tuple(self.names),
                index=i,
                predictor_sha256=tuple(predictor_sha256),
                task=task,
                loss=loss,
                classes=None if classes is None else np.asarray(classes),
                min_points=int(min_points),
            )
            for i in range(len(self.names))
        ]
        self.stand_ins = _StandIns(
            [
                dict(name=n, index=i, X_unlabeled=X, min_points=int(min_points))
                for i, (n, X) in enumerate(zip(self.names, self.samples))
            ],
            worker_cls=PublishedSample,
            workers_per_site=workers_per_site,
            num_cpus=num_cpus,
            address=address,
            data_channel=data_channel,
            init_kwargs=init_kwargs,
            max_restarts=max_restarts,
            # placing and starting the stand-ins, and their calls on the published samples, are
            # this machine's work, not a site's answer: on a loaded node a worker process alone
            # can take longer than a short site timeout (a job failed naming a site whose
            # stand-in's setup_shard took over 60 s at load 30 on two cores)
            retry_timeout_s=max(self.site_timeout_s, STAND_IN_START_S),
            start_timeout_s=max(self.site_timeout_s, STAND_IN_START_S),
        )
        self.recorder = NullRecorder()
        self.setup_log = SetupLog()
        self._open = False
        self._joined: dict[int, m.SiteInfo] = {}  # the sites that joined the job (index -> info)
        self.approval_wait_s = float(approval_wait_s)
        # what the job saw of the sites' own decisions: refusals (by site, request and rule, with
        # how often and when) and approvals (a site's operator admitted the job it waited on)
        self.refusals: list[dict] = []
        self.approvals: list[dict] = []
        self._waited: dict[int, float] = {}  # site index -> when it first said the job waits for approval
        self.echo = echo
        self.owns_relay = bool(owns_relay)
        if classifier_in_process is None:
            small = sum(int(X.size) for X in self.samples) <= STACKED_VALUES
            classifier_in_process = small and int(workers_per_site) == 1
        self.classifier_in_process = bool(classifier_in_process)
        self._started = False  # joined by every site (a warm backend answers start with their info)
        self._stand_ins_up = False

    @property
    def trains_in_process(self) -> bool:
        """True: the coordinator trains the L-BFGS domain classifier itself on the stacked
        published samples, which it holds (the same public optimum the stand-in actors reach
        data-parallel, without a round trip to them per step); see ``classifier_in_process``."""
        return self.classifier_in_process

    def _stand_ins(self) -> _StandIns:
        """The stand-in actors, started on first use."""
        if not self._stand_ins_up:
            self.stand_ins.start(self.recorder, _ActorSetupLog(self.setup_log))
            self._stand_ins_up = True
        return self.stand_ins

    # ------------------------------------------------------------------ lifecycle
    def _record(self, direction, site, method, message):
        self.recorder.record(direction, site, method, message)

    def start(self, recorder=None, setup_log: SetupLog | None = None):
        """Open the job at the relay, have every site join it, start the stand-in actors; wait
        up to ``approval_wait_s`` for the sites in approve mode to admit the job."""
        deadline = time.monotonic() + self.approval_wait_s
        told: set[str] = set()
        while True:
            try:
                return self._start(recorder, setup_log)
            except PrivacyError as exc:
                if exc.rule != "accept_jobs":
                    raise
                site = exc.site or "?"
                command = f"msa-fed site approve {self.job_id} --config site.toml"
                if time.monotonic() + APPROVAL_POLL_S > deadline:
                    raise PrivacyError(  # one argument: the line is the message as written
                        f"site {site} serves only the jobs its operator approves, and job {self.job_id} was not "
                        f"approved within {self.approval_wait_s:g} s ([run] approval_wait_s). On that site's "
                        f"machine run: {command}; then rerun the job",
                    ) from None
                if site not in told:
                    told.add(site)
                    self.echo(
                        f"site {site}: waits for its operator to approve job {self.job_id} (up to "
                        f"{self.approval_wait_s:g} s); on that site's machine run: {command}"
                    )
                time.sleep(APPROVAL_POLL_S)

    def _start(self, recorder=None, setup_log: SetupLog | None = None):
        self.recorder = recorder if recorder is not None else NullRecorder()
        self.setup_log = setup_log if setup_log is not None else SetupLog()
        if self._open and self._started:  # started already (a warm backend): the sites' info only
            return self._relay([(i, "info", None) for i in range(len(self.names))])
        connected = self.relay.open_job(self.job_id, self.names)
        self._open = True
        missing = [n for n in self.names if n not in connected]
        if missing:
            log.info("job %s: waiting up to %g s for site(s) %s to connect", self.job_id, self.site_timeout_s, missing)
        # a site that joined stays joined while another waits for its operator's approval: the
        # join is asked again only of the sites that have not joined (one audit line each)
        todo = [i for i in range(len(self.names)) if i not in self._joined]
        answers = self._relay([(i, "join_job", self.join[i]) for i in todo], waiting="accept_jobs")
        waiting = None
        for i, info in zip(todo, answers):
            if isinstance(info, PrivacyError):
                waiting = waiting or info
                self._waited.setdefault(i, time.time())
                continue
            X, name = self.samples[i], self.names[i]
            if info.name != name:
                raise SiteError(name, f"answered as site {info.name!r}")
            if (info.n_unlabeled, info.n_features) != X.shape:
                raise SiteError(
                    name,
                    f"holds {info.n_unlabeled} unlabelled points of width {info.n_features}, but its "
                    f"published sample has shape {X.shape}; republish it (the site's process "
                    "checks this at start too)",
                )
            self._joined[i] = info
            if i in self._waited:  # it waited for its operator, who admitted the job
                self.approvals.append(
                    {
                        "site": self.names[i],
                        "by": f"the operator of site {self.names[i]} (msa-fed site approve)",
                        "waited_since": self._waited.pop(i),
                        "admitted_at": time.time(),
                    }
                )
        if waiting is not None:
            raise waiting
        if not self.trains_in_process:  # the classifier's data-parallel training needs them
            self._stand_ins()
        self._started = True
        return [self._joined[i] for i in range(len(self.names))]

    def transcript(self) -> dict | None:
        """The sites' signed answers of a sealed job (the relay's sealer's record), else None."""
        sealer = getattr(self.relay, "sealer", None)
        return None if sealer is None else sealer.record()

    def shutdown(self):
        self._joined = {}
        up = self._stand_ins_up or bool(self.stand_ins.sites)
        self._started = self._stand_ins_up = False
        try:
            if up:  # never started for a job that needed none of their answers
                self.stand_ins.shutdown()
        finally:
            try:
                if self._open:
                    self._open = False
                    try:
                        self.relay.close_job(self.job_id)
                    except Exception as exc:  # noqa: BLE001 - the job is over either way
                        log.warning("job %s: closing it at the relay failed: %s", self.job_id, exc)
            finally:
                if self.owns_relay:
                    self.relay.close()

    # ------------------------------------------------------------------ calls
    def call_one(self, i: int, method: str, msg, replay: bool = True):
        if method in ACTOR_METHODS:
            return self._actor_call([i], method, [msg])[0]
        return self._relay([(i, method, msg)], replay=replay)[0]

    def call_all(self, method: str, msgs: list) -> list:
        if method in ACTOR_METHODS:
            return self._actor_call(list(range(len(self.names))), method, msgs)
        return self._relay([(i, method, msg) for i, msg in enumerate(msgs)])

    def call_all_then(self, method: str, msgs: list, then: str, then_msgs: list) -> tuple[list, list]:
        """``msgs[k]`` to site k, then ``then_msgs[k]`` to it, in one relay round: each site gets
        both requests on its stream in this order and answers them in turn (a site process answers
        one job's requests in the order they arrive).  (answers to ``method``, answers to ``then``),
        each in site order; an error in either raises as :meth:`call_all` would."""
        if method in ACTOR_METHODS or then in ACTOR_METHODS:
            raise ValueError("call_all_then carries requests for the site processes only")
        p = len(self.names)
        out = self._relay(
            [(i, method, msg) for i, msg in enumerate(msgs)] + [(i, then, x) for i, x in enumerate(then_msgs)]
        )
        return out[:p], out[p:]

    def call_shards(self, method: str, msg) -> list:
        if method not in ACTOR_METHODS:
            raise ValueError(f"{method!r} is not a classifier-training call")
        return self._stand_ins().call_shards(method, msg)

    def _actor_call(self, sites: list[int], method: str, msgs: list) -> list:
        if method == "unlabeled_sample":  # the published samples are here already (same bytes)
            out = []
            for i in sites:
                self._record("to_site", self.names[i], method, None)
                out.append(m.UnlabeledSample(X=self.samples[i]))
                self._record("from_site", self.names[i], method, out[-1])
            return out
        stand_ins = self._stand_ins()
        if len(sites) == len(self.names):
            return stand_ins.call_all(method, msgs)
        return [stand_ins.call_one(i, method, msg) for i, msg in zip(sites, msgs)]

    def _relay(self, todo: list[tuple[int, str, object]], replay: bool = True, waiting: str = "") -> list:
        """Send each (site, method, message) through the relay; the answers in order.

        Unreachable sites are retried until site_timeout_s after their first failure; a site
        that lost the job's state gets it replayed (when ``replay``).  A site's refusal under
        the rule ``waiting`` is returned in its place (a PrivacyError) instead of raised, so
        that the other sites' answers are kept."""
        for _, method, _ in todo:
            if method not in RELAY_METHODS:
                raise ValueError(f"{method!r} does not go to a site process")
        outs: list = [None] * len(todo)
        left = list(range(len(todo)))
        first_failure: dict[int, float] = {}
        rejoined: dict[int, int] = {}
        for j in left:
            i, method, msg = todo[j]
            self._record("to_site", self.names[i], method, msg)
        while left:
            now = time.monotonic()
            timeout = min(
                self.site_timeout_s - (now - first_failure[j]) if j in first_failure else self.site_timeout_s
                for j in left
            )
            calls = [(self.names[todo[j][0]], todo[j][1], todo[j][2]) for j in left]
            started = time.monotonic()
            results = self.relay.call(self.job_id, calls, max(0.5, timeout))
            retry = []
            replayed: set[int] = set()  # sites whose set-up this pass replayed (once for all their calls)
            for j, res in zip(left, results):
                i, method, msg = todo[j]
                name = self.names[i]
                if isinstance(res, SiteUnreachable):
                    if res.status not in TRANSIENT:
                        raise SiteError(name, f"the registry refused to relay {method}: {res.detail}")
                    since = first_failure.setdefault(j, started)  # a hung site: counted from the call
                    if time.monotonic() - since >= self.site_timeout_s:
                        if res.detail.startswith("the registry:"):  # the registry itself, not the site
                            raise SiteError(name, registry_gone(self.site_timeout_s, res.detail))
                        raise SiteError(
                            name,
                            f"no answer through the registry for {self.site_timeout_s:g} s "
                            f"(site_timeout_s; {res.detail}); is its 'msa-fed site serve' "
                            "running? Once it is back, rerun the job: it resumes from "
                            "its checkpoint_dir",
                        )
                    retry.append(j)
                elif isinstance(res, wire.RemoteError):
                    if res.kind == SiteStateLost.__name__ and replay and method != "join_job":
                        rejoined[j] = rejoined.get(j, 0) + 1
                        if rejoined[j] > MAX_REJOINS:
                            raise SiteError(name, f"lost the job's state {MAX_REJOINS} times in a row during {method}")
                        if i not in replayed:
                            replayed.add(i)
                            self._rejoin(i)
                        retry.append(j)
                        continue
                    if res.kind == PeerFault.__name__ and res.site:  # a peer's predictor, at this site
                        raise PeerFault(res.site, f"{res.text} (at site {name!r})")
                    if res.kind == PrivacyError.__name__ and res.rule:  # a policy's refusal, typed
                        refusal = PrivacyError(res.rule, res.site or name, res.detail)
                        self._note_refusal(name, method, res.rule, res.detail)
                        if waiting and res.rule == waiting:
                            outs[j] = refusal
                            continue
                        raise refusal
                    cls = _REMOTE_ERRORS.get(res.kind)
                    if cls is not None:
                        raise cls(res.text)
                    raise SiteError(name, f"{method} failed: {res.kind}: {res.text}")
                else:
                    why = _check_answer(method, res, len(self.names))
                    if why:
                        raise SiteError(name, f"sent an answer to {method} that is not allowed: {why}")
                    outs[j] = res
                    self._record("from_site", name, method, res)
            if retry and len(retry) == len(left) and all(j in first_failure for j in retry):
                time.sleep(RETRY_PAUSE_S)
            left = retry
        return outs

    def _note_refusal(self, site: str, method: str, rule: str, detail: str) -> None:
        """Keep a site's refusal for the job's record: one entry per site, request and rule, with
        how often and when (first, last); the site's detail cut to one short line (another
        party's text: the report escapes it)."""
        now = time.time()
        for r in self.refusals:
            if (r["site"], r["request"], r["rule"]) == (site, method, rule):
                r["count"] += 1
                r["last"] = now
                return
        line = " ".join(str(detail).split())[:MAX_DETAIL_CHARS]
        self.refusals.append(
            {
                "site": site,
                "request": method,
                "rule": str(rule)[:64],
                "detail": line,
                "count": 1,
                "first": now,
                "last": now,
            }
        )

    def consortium(self) -> dict:
        """What the job saw of the sites' decisions (the model's info, the report's section)."""
        return {"refusals": [dict(r) for r in self.refusals], "approvals": [dict(a) for a in self.approvals]}

    def _rejoin(self, i: int):
        """Site i restarted and lost the job: join it again and replay its setup."""
        log.warning("site %s restarted; replaying the job's setup to it", self.names[i])
        self._relay([(i, "join_job", self.join[i])], replay=False)
        for method, msg in self.setup_log.entries():
            if method in _SITE_SETUP:
                self._relay([(i, method, msg)], replay=False)


def registry_gone(timeout_s: float, detail: str) -> str:
    """The one line of a job whose registry stayed unreachable past site_timeout_s."""
    return (
        f"the registry did not answer for {timeout_s:g} s (site_timeout_s; {detail}). Once it is back, run "
        "the same job file again: with [run] checkpoint_dir set it resumes where it stopped"
    )


def _finite(a, shape) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.kind in "fiu" and a.shape == shape and bool(np.all(np.isfinite(a)))


def _check_answer(method: str, msg, p: int) -> str:
    """ "" when ``msg`` is an answer the coordinator accepts for ``method`` from a site process
    (its type, and the shapes of its sums for a job of p sites), else what is wrong with it.
    A site is another party: its answers are checked before any use."""
    want = ANSWER_TYPES[method]
    if type(msg) is not want:
        return f"a {type(msg).__name__} where a {want.__name__} was expected"
    if isinstance(msg, m.SiteInfo):
        if min(msg.n_features, msg.n_labeled, msg.n_unlabeled) < 0:
            return "negative counts"
        if msg.classes is not None and (msg.classes.ndim != 1 or msg.classes.size > 1 << 16):
            return "classes must be a short vector"
    elif isinstance(msg, m.QhatPartial):
        if not _finite(msg.sums, (p,)) or msg.n < 0:
            return f"Qhat partial sums must be {p} finite numbers"
    elif isinstance(msg, m.DCPartial):
        L = msg.sums.L
        rows = L.shape[:1] if isinstance(L, np.ndarray) and L.ndim == 2 and 1 <= L.shape[0] <= p else ()
        for name in ("L", "dL", "u", "du", "v", "dv"):  # one z, or a batch of at most p (rows first)
            v = getattr(msg.sums, name)
            shape = rows + ((p,) if name in ("L", "u", "v") else (p, p))
            if v is not None and not _finite(v, shape):
                return f"DC sum {name} must be a finite array of shape {shape}"
    elif isinstance(msg, m.BoundMax):
        if not np.isfinite(msg.value):
            return "the bound must be finite"
    elif isinstance(msg, m.HarmAnswer):
        c = msg.combined
        if not (isinstance(c, np.ndarray) and c.ndim == 1 and 1 <= c.size <= p + 1 and _finite(c, c.shape)):
            return f"a verdict holds 1 to {p + 1} finite losses"
    return ""
