"""The library's own exception types.

Every error a user can cause is one of these (or a plain ``ValueError`` /
``TypeError`` raised at an input boundary).  The CLI prints ``error: <message>``
and exits non-zero for any ``MsaFedError``; it never shows a traceback for one.
"""


class MsaFedError(Exception):
    """Base class of every msa_fed error."""


class ConfigError(MsaFedError, ValueError):
    """A configuration value or input is invalid; the message names it."""


class TlsError(ConfigError):
    """A TLS mistake between a client and the registry (a wrong CA, a missing or foreign client
    certificate, a name mismatch, plaintext against TLS or the reverse), in words naming the option
    and the file to fix.  A configuration mistake, not an outage: never retried."""


class JobCancelled(MsaFedError):
    """An admin cancelled the job (``msa-fed job cancel``): the message says who and when."""


class JobInterrupted(KeyboardInterrupt):
    """The job's driver was stopped by a signal (SIGTERM) or Ctrl-C; the message says which."""


class ArtifactError(MsaFedError, ValueError):
    """A frozen-predictor artifact or saved model is malformed, too large, or not what it declares.

    ``public_message`` is a fixed reason written by msa_fed (never a library's error text, never
    bytes read from a file), safe to return to the party that sent the artifact;
    ``incident_id`` names the server-side log record that holds ``detail`` (library text,
    offsets, ...).  ``str(exc)`` is the public message followed by the incident id.  A server
    returns ``public_message`` and ``incident_id`` only; ``detail`` stays in its log.
    """

    def __init__(self, message: str, incident_id: str | None = None, detail: str | None = None):
        import secrets

        self.public_message = str(message)
        self.incident_id = incident_id or secrets.token_hex(6)
        self.detail = detail
        super().__init__(f"{self.public_message} [incident {self.incident_id}]")

    def __reduce__(self):  # picklable with its three fields (Ray ships errors between processes)
        return (type(self), (self.public_message, self.incident_id, self.detail))


class PrivacyError(MsaFedError):
    """A request would make a site reveal more than the privacy contract allows.

    ``rule`` names the policy rule that refused (e.g. ``"concentration"``, ``"theta_norm"``);
    ``site`` the refusing site ("" when not known); ``detail`` says what was measured.
    ``PrivacyError(message)`` with one argument still works (rule "", site "").
    """

    def __init__(self, *args):
        if len(args) == 3:
            rule, site, detail = (str(a) for a in args)
            text = f"site {site!r} refuses {detail} (rule: {rule})" if site else f"refused: {detail} (rule: {rule})"
        else:
            rule, site, detail = "", "", " ".join(str(a) for a in args)
            text = detail
        super().__init__(text)
        self.rule, self.site, self.detail = rule, site, detail
        self._args = args

    def __reduce__(self):  # picklable with its arguments (Ray ships errors between processes)
        return (type(self), tuple(self._args))


class SiteError(MsaFedError):
    """A site failed (crashed, unreachable, refused); ``site`` names it."""

    def __init__(self, site: str, message: str):
        super().__init__(f"site {site!r}: {message}")
        self.site = site
        self.message = message

    def __reduce__(self):  # picklable with its two arguments (Ray ships errors between processes)
        return (type(self), (self.site, self.message))


class RegistryError(MsaFedError):
    """The control-plane registry refused or failed a request."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self):
        return (type(self), (self.code, self.message))


class PeerFault(MsaFedError):
    """Another party misbehaved: its predictor broke a limit, or its answer is not one an honest
    party could give.  ``site`` names that party (never the one that noticed); the message is
    one line (e.g. ``site 'b''s predictor exceeded 2 s on 512 rows``)."""

    def __init__(self, site: str, message: str):
        super().__init__(message)
        self.site = site
        self.message = message

    def __reduce__(self):
        return (type(self), (self.site, self.message))


#: the packages that only the coordinator's side needs (``pip install "msa_fed[coordinator]"``); a
#: site installed with ``pip install msa_fed`` alone has none of them (scipy comes with the DP
#: accountant, and only its DP accounting imports it)
COORDINATOR_PACKAGES = frozenset({"torch", "ray", "sklearn", "scipy", "skl2onnx", "tqdm"})
COORDINATOR_INSTALL = "pip install 'msa_fed[coordinator]'"


class MissingExtra(MsaFedError, ImportError):
    """``what`` needs a package of the coordinator extra that is not installed here: one line that
    names the package and the install command."""

    def __init__(self, what: str, package: str):
        super().__init__(f"{what} needs the coordinator extra ({package} is not installed): {COORDINATOR_INSTALL}")
        self.what, self.package = what, package

    def __reduce__(self):
        return (type(self), (self.what, self.package))


def missing_extra(exc: BaseException, what: str) -> MissingExtra | None:
    """The :class:`MissingExtra` that ``exc`` (a failed import) stands for, or None when it is not
    a missing package of the coordinator extra."""
    name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    top = (name or "").split(".")[0]
    return MissingExtra(what, top) if top in COORDINATOR_PACKAGES else None


def require_coordinator(what: str, packages: tuple[str, ...] = ("torch", "sklearn", "scipy")) -> None:
    """Raise :class:`MissingExtra` unless ``packages`` of the coordinator extra are installed
    (found, not imported: the check costs no import)."""
    import importlib.util

    for package in packages:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # an import hook that refuses it, a broken install
            found = False
        if not found:
            raise MissingExtra(what, package)
