"""Helpers shared by the control-plane tests: tiny ONNX models and test certificates."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from msa_fed.artifacts.predictors import META_CLASSES, META_KIND, META_N_FEATURES
from msa_fed.control.registry.public import ARTIFACT_REFUSED

# all a client may learn about a refused artifact: the fixed reason and an incident id
ARTIFACT_REFUSED_DETAILS = re.compile(re.escape(ARTIFACT_REFUSED) + r" \(incident [0-9a-f]{12}\)")


def linear_onnx(weights, bias: float = 0.0, *, metadata: dict | None = None, padding: int = 0) -> bytes:
    """ONNX regression predictor y = X @ weights + bias, output (n, 1), with the msa_fed declaration.

    ``padding`` adds an unused initializer of that many float32 values (to make big artifacts).
    """
    w = np.asarray(weights, dtype=np.float32).reshape(-1, 1)
    extra = [numpy_helper.from_array(np.arange(padding, dtype=np.float32), "padding")] if padding else []
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([bias], np.float32), "B")] + extra,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    props = {META_KIND: "regression", META_N_FEATURES: str(w.shape[0])} if metadata is None else metadata
    helper.set_model_props(model, props)
    return model.SerializeToString()


def softmax_onnx(weights, *, classes=None, softmax: bool = True, metadata: dict | None = None) -> bytes:
    """ONNX probabilities predictor softmax(X @ weights), weights (d, n_classes)."""
    w = np.asarray(weights, dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["logits" if softmax else "p"])]
    if softmax:
        nodes.append(helper.make_node("Softmax", ["logits"], ["p"], axis=1))
    graph = helper.make_graph(
        nodes,
        "softmax",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", w.shape[0]])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["n", w.shape[1]])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    classes = list(range(w.shape[1])) if classes is None else classes
    props = (
        {META_KIND: "probabilities", META_N_FEATURES: str(w.shape[0]), META_CLASSES: json.dumps(classes)}
        if metadata is None
        else metadata
    )
    helper.set_model_props(model, props)
    return model.SerializeToString()


@dataclass
class Pki:
    """PEM bytes of a test CA, a server certificate for localhost/127.0.0.1 and a client certificate."""

    ca: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes
    ca_key: bytes = b""

    def client(self, common_name: str, dns_names=()) -> tuple[bytes, bytes]:
        """(certificate, key) PEM of another client certificate signed by this CA."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from pki import leaf

        ca = x509.load_pem_x509_certificate(self.ca)
        ca_key = serialization.load_pem_private_key(self.ca_key, None)
        return leaf(ca, ca_key, common_name, "client", [x509.DNSName(n) for n in dns_names])

    def write(self, folder) -> dict:
        paths = {}
        for name in ("ca", "server_cert", "server_key", "client_cert", "client_key"):
            path = folder / f"{name}.pem"
            path.write_bytes(getattr(self, name))
            paths[name] = str(path)
        return paths


def make_pki(common_name: str = "msa-fed test CA") -> Pki:
    """A fresh CA (EC P-256) with one server and one client certificate, valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from pki import leaf, new_ca, pem_key

    ca_cert, ca_key = new_ca(common_name)
    server_cert, server_key = leaf(
        ca_cert,
        ca_key,
        "localhost",
        "server",
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_cert, client_key = leaf(ca_cert, ca_key, "site-a", "client", None)
    return Pki(
        ca_cert.public_bytes(serialization.Encoding.PEM),
        server_cert,
        server_key,
        client_cert,
        client_key,
        pem_key(ca_key),
    )
