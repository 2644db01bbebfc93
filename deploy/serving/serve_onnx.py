"""A minimal HTTP prediction service for an exported combined model (``msa-fed model export``).

Needs Python 3.9+ with onnxruntime and numpy only (no msa_fed, no torch):

    python -m venv venv && venv/bin/pip install onnxruntime numpy
    venv/bin/python serve_onnx.py model.onnx --port 8080

    curl -s localhost:8080/predict -d '{"X": [[0.0, 2.0], [2.0, 0.0]]}'
    {"probabilities": [[...], [...]], "label": [0, 1]}

Endpoints:

- ``POST /predict``  body ``{"X": [[x_1, ..., x_d], ...]}`` (at most ``--max-rows`` rows of
  finite numbers); answers the model's outputs by name: ``probabilities`` and ``label``
  (classification) or ``prediction`` (regression).
- ``GET /metadata``  the model's input width, outputs and its ``msa_fed.*`` metadata (sites, z,
  eta, the sha256 of each predictor, the registry version it was exported from).
- ``GET /health``    ``{"status": "ok"}``.

Errors are ``{"error": "<fixed reason>"}`` with status 400, 404, 411, 413 or 500; no library
text or traceback is ever sent.  Plaintext HTTP is served on a loopback address only; any other
``--host`` needs ``--tls-cert`` and ``--tls-key`` (PEM).  The address is printed as the first
line of standard output (``listening on http://HOST:PORT``; ``--port 0`` picks a free port).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import math
import ssl
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import onnxruntime as ort

log = logging.getLogger("serve_onnx")
MAX_BODY_BYTES = 32 * 2**20


class Model:
    """The exported graph: one input ``X`` (n, d), outputs by name."""

    def __init__(self, path: str, threads: int = 1):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self.session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
        (inp,) = self.session.get_inputs()
        self.input_name = inp.name
        self.dtype = np.float64 if inp.type == "tensor(double)" else np.float32
        self.width = int(inp.shape[1])
        self.outputs = [o.name for o in self.session.get_outputs()]
        meta = self.session.get_modelmeta().custom_metadata_map
        self.metadata = {
            "input": {"name": inp.name, "type": inp.type, "width": self.width},
            "outputs": self.outputs,
            "msa_fed": {k: _maybe_json(v) for k, v in sorted(meta.items()) if k.startswith("msa_fed.")},
        }

    def predict(self, rows) -> dict:
        X = np.asarray(rows, dtype=self.dtype)
        results = self.session.run(self.outputs, {self.input_name: X})
        return {name: value.tolist() for name, value in zip(self.outputs, results)}


def _maybe_json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class BadRequest(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def parse_rows(body: bytes, width: int, max_rows: int) -> list:
    """The batch of a request body, checked: a list of 1..max_rows rows of ``width`` finite numbers."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadRequest(400, "the body is not valid JSON") from None
    rows = doc.get("X") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise BadRequest(400, 'the body must be {"X": [[...], ...]} with at least one row')
    if len(rows) > max_rows:
        raise BadRequest(413, f"at most {max_rows} rows per request")
    for row in rows:
        if not isinstance(row, list) or len(row) != width:
            raise BadRequest(400, f"every row must be a list of {width} numbers")
        for v in row:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise BadRequest(400, "every value must be a finite number")
    return rows


def make_handler(model: Model, max_rows: int):
    class Handler(BaseHTTPRequestHandler):
        server_version = "msa-fed-onnx"
        sys_version = ""
        timeout = 30  # seconds a client may take to send its request (a short body never stalls a thread)

        def log_message(self, format, *args):  # noqa: A002 - the base class's signature
            log.info("%s %s", self.address_string(), format % args)

        def _send(self, status: int, doc: dict) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's naming
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/metadata":
                self._send(200, model.metadata)
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):  # noqa: N802
            try:
                if self.path != "/predict":
                    raise BadRequest(404, "not found")
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit():
                    raise BadRequest(411, "a Content-Length header is required")
                if int(length) > MAX_BODY_BYTES:
                    raise BadRequest(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
                rows = parse_rows(self.rfile.read(int(length)), model.width, max_rows)
                try:
                    answer = model.predict(rows)
                except Exception:  # noqa: BLE001 - logged here, a fixed reason to the client
                    log.exception("prediction failed")
                    raise BadRequest(500, "the model could not answer this batch") from None
                self._send(200, answer)
            except BadRequest as exc:
                self._send(exc.status, {"error": exc.reason})

    return Handler


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="serve an exported msa_fed combined model over HTTP")
    parser.add_argument("model", help="the .onnx file written by 'msa-fed model export'")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--max-rows", type=int, default=100_000, help="rows per request (default 100000)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime threads per request (default 1)")
    parser.add_argument("--tls-cert", help="certificate (PEM); required with --tls-key off loopback")
    parser.add_argument("--tls-key", help="private key (PEM)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    tls = bool(args.tls_cert and args.tls_key)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if not tls and not _loopback(args.host):
        parser.error(f"plaintext HTTP is served on loopback only; give --tls-cert/--tls-key to listen on {args.host}")
    model = Model(args.model, threads=args.threads)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(model, args.max_rows))
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(args.tls_cert, args.tls_key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    host, port = server.server_address[:2]
    print(f"listening on {'https' if tls else 'http'}://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
