"""The federated topology over TLS, as it is deployed.

- mutual TLS: each site process presents a certificate naming its site; a process holding site
  A's token and B's certificate is refused; the relay works end to end over the secure channel;
- network namespaces (root only): each site process runs in its own network namespace whose one
  interface (a veth pair with private 10.213.k.0/30 addresses made for the test) reaches only the
  registry's address, as a hospital firewall allowing one outgoing connection would; the
  federated job runs through them and gives the z of runtime="local"; from inside a namespace
  neither another site's network nor the host's other addresses are reachable.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import uuid

import grpc
import numpy as np
import pytest
from fedhelpers import local_kwargs, make_pki, site_files, tcp_sockets  # noqa: E402

from msa_fed.boundary.proto import relay_pb2 as pb
from msa_fed.boundary.proto import relay_pb2_grpc as pb_grpc
from msa_fed.control.server import TlsConfig
from msa_fed.federation.local import LocalFederation
from msa_fed.federation.relay_client import RelayClient

NAMES = ("east", "north")


@pytest.fixture
def files():  # per test (under a second): make test runs this file's two tests on two workers
    return site_files(NAMES + ("west",), seed=2)


def test_mutual_tls_binds_the_stream_to_the_certified_site(tmp_path, files):
    pki = make_pki(tmp_path / "pki", clients=NAMES + ("operator",))
    tls = TlsConfig.from_files(pki["server_cert"], pki["server_key"], pki["ca"])
    certs = {n: (pki[f"{n}_cert"], pki[f"{n}_key"]) for n in NAMES}
    two = {n: files[n] for n in NAMES}
    with LocalFederation(
        tmp_path / "fed",
        two,
        tls=tls,
        tls_ca=pki["ca"],
        client_certs=certs,
        sealed=False,  # a plain relay client
    ) as fed:
        fed.wait_connected(timeout=180)
        admin = dict(tls_ca=pki["ca"], tls_cert=pki["operator_cert"], tls_key=pki["operator_key"])
        with RelayClient(fed.address, fed.admin_token, **admin) as relay:
            relay.open_job("tls-job", list(NAMES))
            res = relay.call("tls-job", [(n, "ping", None) for n in NAMES], 30)
            assert [r.kind for r in res] == ["SiteStateLost", "SiteStateLost"]  # the site processes answered
        # east's token with north's certificate: refused at the Hello
        creds = grpc.ssl_channel_credentials(
            open(pki["ca"], "rb").read(), open(pki["north_key"], "rb").read(), open(pki["north_cert"], "rb").read()
        )
        channel = grpc.secure_channel(fed.address, creds)
        out: queue.Queue = queue.Queue()
        out.put(pb.SiteToRelay(hello=pb.Hello(site="east")))
        call = pb_grpc.RelayStub(channel).Connect(
            iter(out.get, None), metadata=(("authorization", f"Bearer {fed.tokens['east']}"),)
        )
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "certificate names 'north', not site 'east'" in info.value.details()
        out.put(None)
        channel.close()
        assert fed.connected() == sorted(NAMES)


# ---------------------------------------------------------------------- network namespaces
def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60, check=check)


def _netns_usable() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); not root here"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"mfp{uuid.uuid4().hex[:6]}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot create a network namespace here: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


def _free_octets(n: int) -> list[int]:
    """n third octets k whose 10.213.k.0/30 no interface of this host holds now (a run killed
    before its teardown leaves its namespaces and their addresses behind)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    used = {int(m) for m in re.findall(r"\b10\.213\.(\d+)\.\d+/", out)}
    free = [k for k in range(256) if k not in used]
    start = uuid.uuid4().int % len(free)
    return (free[start:] + free[:start])[:n]


@pytest.fixture
def namespaces():
    why = _netns_usable()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:4]
    octets = _free_octets(len(NAMES) + 1)
    made = []  # (namespace, host interface)
    nets = {}
    try:
        for k, name in enumerate(NAMES + ("west",)):
            ns, host_if, ns_if = f"mf{tag}{k}", f"mfh{tag}{k}", f"mfn{tag}{k}"
            _ip("netns", "add", ns)
            made.append((ns, None))
            _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            made[-1] = (ns, host_if)
            _ip("link", "set", ns_if, "netns", ns)
            host_ip, site_ip = f"10.213.{octets[k]}.1", f"10.213.{octets[k]}.2"
            _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
            _ip("link", "set", host_if, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{site_ip}/30", "dev", ns_if)
            _ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            nets[name] = (ns, host_ip, site_ip)
        yield nets
    finally:
        for ns, host_if in made:
            _ip("netns", "del", ns, check=False)
            if host_if:
                _ip("link", "del", host_if, check=False)


def _connect_from(ns: str, host: str, port: int) -> str:
    """Try a TCP connection from inside namespace ``ns``; "ok" or the error's name."""
    code = (
        "import socket,sys\n"
        "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print('ok')\n"
        "except OSError as e:\n print(type(e).__name__, e.errno)"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code, host, str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() or out.stderr.strip()


def test_sites_in_their_own_network_namespaces(namespaces, tmp_path, files):
    from fedhelpers import fit_config

    from msa_fed.core.domain_classifier import ClassifierConfig
    from msa_fed.runtime.coordinator import Coordinator
    from msa_fed.runtime.local import LocalSites

    names = sorted(namespaces)
    pki = make_pki(tmp_path / "pki", server_ips=["127.0.0.1"] + [namespaces[n][1] for n in names])
    tls = TlsConfig.from_files(pki["server_cert"], pki["server_key"])
    launcher = {n: ["ip", "netns", "exec", namespaces[n][0]] for n in names}
    model = _run_in_namespaces(namespaces, tmp_path, files, names, pki, tls, launcher)
    kw, preds, _ = local_kwargs(files, names)
    config = fit_config(task="classification", classifier=ClassifierConfig(mu=1e-3), solver={"objective": "minmax"})
    with Coordinator(LocalSites(kw), preds, config) as c:
        local = c.fit()
    np.testing.assert_allclose(model.z, local.z, rtol=0, atol=1e-9)


def _run_in_namespaces(namespaces, tmp_path, files, names, pki, tls, launcher):
    from fedhelpers import job_config, output_dir

    from msa_fed.jobs.run import run_job

    with LocalFederation(
        tmp_path / "fed",
        {n: files[n] for n in names},
        tls=tls,
        tls_ca=pki["ca"],
        listen="0.0.0.0:0",
        site_host=lambda n: namespaces[n][1],
        launcher=launcher,
    ) as fed:
        fed.wait_connected(timeout=180)
        port = fed.server.port
        for n in names:
            ns, host_ip, _ = namespaces[n]
            assert _connect_from(ns, host_ip, port) == "ok"  # the registry's address: reachable
            other = namespaces[[x for x in names if x != n][0]][1]
            assert _connect_from(ns, other, port).startswith("OSError")  # another site's network: no route
            assert _connect_from(ns, "127.0.0.1", port).startswith("ConnectionRefusedError")  # its own loopback
            assert not [s for s in tcp_sockets(fed.procs[n].pid) if s[0] == "0A"]
        job = job_config("netns", fed.address, tls_ca=pki["ca"], **fed.sealing())
        _, model = run_job(job, fed.admin_token, verbose=False, log=lambda *_: None, output_dir=output_dir(fed.workdir))
        # samples this small: the coordinator trains, no stand-in actors, so no Ray (which would fork
        # its processes from this one while it runs gRPC threads)
        assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
        return model
