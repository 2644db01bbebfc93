"""The job file: TOML tables -> a validated :class:`JobConfig` holding a :class:`FitConfig`.

Every key of every table is checked here, before the job does any network work (no registry
call, no predictor download, no Ray): a wrong type, a value out of range, an unknown key or
table, each is a :class:`msa_fed.errors.ConfigError` whose message names the table and the key
("[model] mu must be a number > 0; got 'x'").  The keys are documented once, in
cluster/README.md ("Job file"); their checks are the fields' own
(:mod:`msa_fed.runtime.config`, :class:`ClassifierConfig`, :class:`SolverConfig`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from msa_fed.control.transport.address import is_loopback, parse_address, transport_of
from msa_fed.core.config import WHEN_HARMED
from msa_fed.core.options import (
    Flag,
    FlagOr,
    Integer,
    Number,
    Optional,
    Text,
    TextList,
    check_value,
    option,
    option_meta,
)
from msa_fed.errors import ConfigError
from msa_fed.runtime.config import ClassifierConfig, FitConfig, RayConfig, SolverConfig, fit_options, job_place

_JOB, _FIT, _CLASSIFIER, _SOLVER, _RAY = "job", "fit", "classifier", "solver", "ray"
_TARGETS = {_FIT: FitConfig, _CLASSIFIER: ClassifierConfig, _SOLVER: SolverConfig, _RAY: RayConfig}


@dataclass(frozen=True)
class JobConfig:
    """A job file, validated (see the module docstring and cluster/README.md)."""

    name: str = option("msa", "name of the job, recorded in the stored model's manifest", Text(nonempty=True))
    registry: str = option("", "HOST:PORT of the registry", Text(), job="registry.address")
    tls_ca: str | None = option(
        None, "CA certificate of the registry (PEM file)", Optional(Text(nonempty=True)), job="registry"
    )
    insecure: bool = option(False, "plaintext gRPC to a loopback registry", Flag(), job="registry")
    tls_cert: str | None = option(
        None,
        "client certificate for a registry that requires one (mutual TLS; PEM file)",
        Optional(Text(nonempty=True)),
        job="registry",
    )
    tls_key: str | None = option(
        None, "private key of tls_cert (PEM file)", Optional(Text(nonempty=True)), job="registry"
    )
    server_name: str | None = option(
        None,
        "name to check the registry's certificate against (default: the host of address)",
        Optional(Text(nonempty=True)),
        job="registry",
    )
    timeout: float = option(30.0, "seconds per registry call", Number(0.0, open_low=True), job="registry")
    job_key: str | None = option(
        None,
        "the consortium's job key (msa-fed job keygen): seal the job's traffic end to end",
        Optional(Text(nonempty=True)),
        job="sealing",
    )
    seal_sites: tuple = option(
        (), "each site's pinned sealing-key fingerprint, as NAME=SHA256", TextList(), job="sealing.sites"
    )
    allow_unsealed: bool = option(
        False,
        "federated topology: send the job's requests unsealed, for sites that opted out of sealing "
        "(allow_unsealed = true in their site.toml); the registry reads and could forge them",
        Flag(),
        job="sealing",
    )
    planned_queries: int = option(
        10000,
        "the most labelled-data queries the job sends each site (part of what sites approve)",
        Integer(1),
        job="sealing.queries",
    )
    admin_token_file: str | None = option(
        None, "file holding the admin token", Optional(Text(nonempty=True)), job="registry"
    )
    sites: tuple = option((), "registered sites to combine (empty: all)", TextList(), job="run")
    site_data: str = option(
        "{site}.npz",
        "path template of each site's data on the site's node",
        Text(contains="{site}"),
        job="run",
    )
    output_version: str = option("", "name of this result, recorded in the stored model's manifest", Text(), job="run")
    influence: bool | str = option(
        WHEN_HARMED,
        "the influence report with the model (each site's loss with and without each other site; about "
        f'10 to 30 more evaluations per site): true (always), false, or "{WHEN_HARMED}" (only once a '
        "site's verdict shows it harmed); always whenever influence_margin is set",
        FlagOr(WHEN_HARMED),
        job="run",
    )
    influence_margin: float | None = option(
        None,
        "refuse to store a model in which including a site raises another site's loss by more than "
        "this fraction (influence report; none: store and report only)",
        Optional(Number(0.0, open_low=True)),
        job="run",
    )
    approval_wait_s: float = option(
        600.0,
        "federated topology: how long the job waits for the operator of a site in approve mode to "
        "approve it (seconds; 0: not at all)",
        Number(0.0),
        job="run",
    )
    fit: FitConfig = option(None, "the fit (model, privacy, run, classifier and solver tables)")
    #: where each value came from, for messages: {field: "[table] key" or "--flag"}
    origin: dict = field(default_factory=dict, compare=False, repr=False)
    #: True on the copy :meth:`validate` returns: it is not checked again (a copy made from it
    #: with ``dataclasses.replace`` is a new config, checked anew)
    validated: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self):
        if self.fit is None:
            object.__setattr__(self, "fit", FitConfig(runtime="ray"))

    # the fit's fields, read where the job used to keep them
    @property
    def task(self) -> str:
        return self.fit.task

    @property
    def checkpoint_dir(self) -> str | None:
        return self.fit.checkpoint_dir

    @property
    def topology(self) -> str:
        return self.fit.topology

    def _label(self, name: str, default: str) -> str:
        return self.origin.get(name, default)

    @classmethod
    def from_toml(cls, path, **overrides) -> JobConfig:
        """Read and validate a job file; ``overrides`` (registry, tls_ca, insecure,
        admin_token_file: the command-line flags, None when not given) take precedence."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"job file {str(path)!r} not found" if not path.exists() else f"job file {str(path)!r} is not a file"
            )
        try:
            doc = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"job file {str(path)!r} is not valid TOML: {exc}") from None
        try:
            return from_document(doc, **overrides)
        except ConfigError as exc:
            raise ConfigError(f"job file {str(path)!r}: {exc}") from None

    def client_tls(self) -> dict:
        """The options of the job's registry connections: plaintext or TLS, with the client
        certificate when the job file or the command line gives one (mutual TLS), the server name
        and the timeout per call."""
        return {**transport_of(self), "timeout": self.timeout}

    def connection_labels(self) -> dict[str, str]:
        """How messages about the registry connection name each option: the job file's key, or
        the flag that set it (``msa_fed.control.transport.connection.diagnose_tls``)."""
        return {
            "address": self._label("registry", "[registry] address"),
            "insecure": self._label("insecure", "[registry] insecure"),
            "tls_ca": self._label("tls_ca", "[registry] tls_ca"),
            "tls_cert": self._label("tls_cert", "[registry] tls_cert"),
            "tls_key": self._label("tls_key", "[registry] tls_key"),
        }

    def validate(self) -> JobConfig:
        """A checked copy of this config, every field checked (ConfigError naming the table and
        key; values normalised); no network.  This config is left as it is; a validated one is
        returned unchanged."""
        if self.validated:
            return self
        labels = {name: label for (target, name), label in LABELS.items() if target == _JOB}
        values = {}
        for f in fields(self):
            if f.name in labels:
                label = self._label(f.name, labels[f.name])
                try:
                    values[f.name] = check_value(JobConfig, f.name, getattr(self, f.name), label=label)
                except (TypeError, ValueError) as exc:
                    raise ConfigError(str(exc)) from None
        checked = replace(self, **values)
        # the fit makes the report (always where a margin refuses models on it)
        influence = True if checked.influence_margin is not None else checked.influence
        if isinstance(checked.fit, FitConfig) and checked.fit.influence != influence:
            checked = replace(checked, fit=replace(checked.fit, influence=influence))
        checked._check()
        object.__setattr__(checked, "validated", True)  # the new copy, before anyone holds it
        return checked

    def _check(self) -> None:
        """The checks across fields, on the checked values."""
        if not isinstance(self.fit, FitConfig):
            raise ConfigError(f"fit must be a FitConfig; got {self.fit!r}")
        _validate_fit(self.fit)
        if len(set(self.sites)) != len(self.sites):
            raise ConfigError(f"[run] sites names a site twice: {list(self.sites)}")
        if self.fit.topology == "federated":
            from msa_fed.control.relay import JOB_ID_PATTERN

            if not JOB_ID_PATTERN.match(self.name):
                raise ConfigError(
                    f"job name {self.name!r} is the job's id at the registry's relay (sites approve jobs by "
                    "it): use 1-128 letters, digits, '_', '.', ':' or '-'"
                )
        if not self.registry:
            raise ConfigError("no registry address: give --registry or [registry] address in the job file")
        host, _ = parse_address(self.registry, self._label("registry", "[registry] address"))
        insecure = self._label("insecure", "[registry] insecure = true")
        if self.insecure and self.tls_ca is not None:
            raise ConfigError(
                f"{insecure} and {self._label('tls_ca', '[registry] tls_ca')} are mutually exclusive (plaintext or TLS)"
            )
        if self.insecure and not is_loopback(host):
            raise ConfigError(
                f"{insecure} would send the admin token in plaintext to {host!r}; plaintext is only "
                "allowed towards a loopback registry (127.0.0.1, ::1 or localhost)"
            )
        if self.tls_ca is not None and not Path(self.tls_ca).is_file():
            raise ConfigError(
                f"{self._label('tls_ca', '[registry] tls_ca')} {self.tls_ca!r} is not a readable file; "
                "expected the registry's CA certificate (PEM)"
            )
        self._validate_client_cert()
        self._validate_sealing()

    def _validate_client_cert(self) -> None:
        cert, key = self._label("tls_cert", "[registry] tls_cert"), self._label("tls_key", "[registry] tls_key")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(f"{cert} and {key} go together (the client certificate and its key)")
        if self.tls_cert is not None and self.insecure:
            raise ConfigError(f"{cert} needs TLS; {self._label('insecure', '[registry] insecure = true')} is plaintext")
        for label, path in ((cert, self.tls_cert), (key, self.tls_key)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{label} {path!r} is not a readable file (PEM)")

    def _validate_sealing(self) -> None:
        label = self._label("job_key", "[sealing] job_key")
        if self.job_key is not None and not Path(self.job_key).is_file():
            raise ConfigError(f"{label} {self.job_key!r} is not a readable file (msa-fed job keygen)")
        if self.seal_sites and self.job_key is None:
            raise ConfigError(f"[sealing] sites pins sealing keys, but no {label} signs the job")
        if self.allow_unsealed and self.job_key is not None:
            raise ConfigError(f"{label} seals the job; [sealing] allow_unsealed = true sends it unsealed: give one")
        pins = self.seal_pins
        if len(pins) != len(self.seal_sites):
            raise ConfigError(f"[sealing] sites names a site twice: {list(self.seal_sites)}")

    def check_sealed(self) -> None:
        """A federated job is sealed end to end unless ``[sealing] allow_unsealed = true`` says
        otherwise: a ConfigError naming the keys to set when it holds no job key (no network)."""
        if self.fit.topology != "federated" or self.job_key is not None or self.allow_unsealed:
            return
        raise ConfigError(
            f"job {self.name!r} is not sealed, and sites serve sealed jobs only: give the consortium's "
            f"job key ({self._label('job_key', '[sealing] job_key')} or --job-key; msa-fed job keygen) and "
            'each site\'s sealing-key fingerprint ([sealing] sites = ["NAME=SHA256", ...]); or, only for '
            "sites that set allow_unsealed = true, set [sealing] allow_unsealed = true (the registry then "
            "reads and could forge the job's traffic)"
        )

    @property
    def seal_pins(self) -> dict[str, str]:
        """{site: pinned sealing-key fingerprint} of ``[sealing] sites``."""
        out = {}
        for item in self.seal_sites:
            name, sep, fp = item.partition("=")
            fp = fp.strip().lower()
            if not sep or not name.strip() or len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp):
                raise ConfigError(f"[sealing] sites entries are NAME=SHA256 (64 hex digits); got {item[:100]!r}")
            out[name.strip()] = fp
        return out


def job_schema(root: type = FitConfig) -> dict[str, dict[str, tuple[str, str]]]:
    """table -> key -> (target config, field): the job's own keys and every option of the fit's
    tree that its declaration places in the job file (:func:`msa_fed.runtime.config.fit_options`)."""
    schema: dict[str, dict[str, tuple[str, str]]] = {}
    for f in fields(JobConfig):  # the job's own keys
        place = job_place(option_meta(f, "job"), f.name)
        if place is not None:
            schema.setdefault(place[0], {})[place[1]] = (_JOB, f.name)
    for opt in fit_options(root):
        if opt.job is not None:
            table, key = opt.job
            schema.setdefault(table, {})[key] = (_FIT if len(opt.path) == 1 else opt.path[0], opt.path[-1])
    return schema


SCHEMA = job_schema()
TOP_LEVEL = {"name": (_JOB, "name")}
#: (target config, field) -> its name in the job file, "[table] key" (a top-level key: its name)
LABELS = {(target, name): f"[{table}] {key}" for table, keys in SCHEMA.items() for key, (target, name) in keys.items()}
LABELS.update({target: key for key, target in TOP_LEVEL.items()})


def _validate_fit(fit: FitConfig) -> None:
    """FitConfig.validate with each message naming the job file's table and key."""
    parts = ((_CLASSIFIER, fit.classifier), (_SOLVER, fit.solver), (_RAY, fit.ray), (_FIT, fit))
    for target, obj in parts:
        try:
            obj.validate()
        except (TypeError, ValueError) as exc:
            raise ConfigError(_named(str(exc), target)) from None


def _named(text: str, target: str) -> str:
    """A config message that starts with a field's name ("method='dca' applies ...", "features
    must ...") with the field's job-file name in its place ("[solver] method='dca' ...")."""
    head, sep, rest = text.partition(" ")
    name = head.split("=", 1)[0]
    label = LABELS.get((target, name))
    return text if label is None else label + head[len(name) :] + sep + rest


def from_document(doc: dict, **overrides) -> JobConfig:
    """The JobConfig of a parsed job file (a dict of tables) and the command-line overrides."""
    known = set(SCHEMA) | set(TOP_LEVEL)
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ConfigError(f"unknown table(s) or key(s) {unknown}; expected {sorted(known)}")
    values: dict[str, dict[str, Any]] = {_JOB: {}, _FIT: {}, _CLASSIFIER: {}, _SOLVER: {}, _RAY: {}}
    for key, (target, name) in TOP_LEVEL.items():
        if key in doc:
            values[target][name] = _checked(target, name, doc[key], key)
    for table, keys in SCHEMA.items():
        if table not in doc:
            continue
        content = doc[table]
        if not isinstance(content, dict):
            raise ConfigError(f"[{table}] must be a table; got {content!r}")
        extra = sorted(set(content) - set(keys))
        if extra:
            # a field of this table's configuration that its declaration puts in another table
            moved = [f"{key} is set in {LABELS[(table, key)].split(' ')[0]}" for key in extra if (table, key) in LABELS]
            hint = f" ({'; '.join(moved)})" if moved else ""
            raise ConfigError(f"unknown key(s) {extra} in [{table}]{hint}; expected some of {sorted(keys)}")
        for key, value in content.items():
            target, name = keys[key]
            values[target][name] = _checked(target, name, value, f"[{table}] {key}")
    _check_topology_keys(doc.get("run", {}), values[_FIT].get("topology", FitConfig().topology))
    origin = {}
    flags = {
        "registry": "--registry",
        "tls_ca": "--tls-ca",
        "insecure": "--insecure",
        "admin_token_file": "--admin-token-file",
        "tls_cert": "--tls-cert",
        "tls_key": "--tls-key",
        "server_name": "--server-name",
        "timeout": "--timeout",
        "job_key": "--job-key",
    }
    for name, value in overrides.items():
        if name not in flags:
            raise TypeError(f"unknown override {name!r}")
        if value is not None:
            values[_JOB][name] = value
            origin[name] = flags[name]
    for name in PATH_FIELDS:  # "~/..." is the home folder of the user who runs the job
        if isinstance(values[_JOB].get(name), str):
            values[_JOB][name] = os.path.expanduser(values[_JOB][name])
    if isinstance(values[_FIT].get("checkpoint_dir"), str):
        values[_FIT]["checkpoint_dir"] = os.path.expanduser(values[_FIT]["checkpoint_dir"])
    fit = FitConfig(
        runtime="ray",
        classifier=ClassifierConfig(**values[_CLASSIFIER]),
        solver=SolverConfig(**values[_SOLVER]),
        ray=RayConfig(**values[_RAY]),
        **values[_FIT],
    )
    return JobConfig(fit=fit, origin=origin, **values[_JOB]).validate()


#: the job's fields that name files on the driver's machine ("~" expanded)
PATH_FIELDS = ("tls_ca", "tls_cert", "tls_key", "admin_token_file", "job_key")

#: [run] keys that only one topology uses: giving one under the other is an error, not ignored
#: (ray_address and data_channel apply to both: the federated topology's stand-in actors run on Ray too)
TOPOLOGY_ONLY = {"site_timeout_s": "federated", "approval_wait_s": "federated"}


def _check_topology_keys(run: dict, topology: str) -> None:
    for key, only in TOPOLOGY_ONLY.items():
        if key in run and topology != only:
            raise ConfigError(f"[run] {key} applies only to topology = {only!r}; this job's topology is {topology!r}")


def _checked(target: str, name: str, value, label: str):
    cls = JobConfig if target == _JOB else _TARGETS[target]
    try:
        return check_value(cls, name, value, label=label)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def read_token_file(path: str | None, what: str = "--admin-token-file") -> str:
    if not path:
        raise ConfigError(f"{what} is required")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{what}: {path!r} not found" if not p.exists() else f"{what}: {path!r} is not a file")
    try:
        token = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what}: {path!r} is unreadable ({exc})") from None
    if not token:
        raise ConfigError(f"{what}: {path!r} is empty")
    check_admin_token(token, what)
    return token


def check_admin_token(token: str, what: str = "the admin token") -> None:
    """A site's token given where the admin token belongs is named as such (the registry would
    only answer that the sites are not visible to it)."""
    from msa_fed.control.registry.tokens import parse_token

    parsed = parse_token(token)
    if parsed is not None and parsed[0].role != "admin":
        raise ConfigError(
            f"{what} holds a token of {parsed[0]}, not an admin token; the job needs the "
            "registry's admin token (msa-fed admin issue-token --admin)"
        )
