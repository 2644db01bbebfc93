"""``msa-fed model report``: the HTML a person opens, checked in a real headless browser."""

from __future__ import annotations

import base64
import html
import io
import re
import shutil
import subprocess

import numpy as np
import pytest
from ops_helpers import RegistryProcess, cli, issue_tokens
from PIL import Image

import msa_fed

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from demo_sites import demo_sites

    tmp = tmp_path_factory.mktemp("report")
    sites, _ = demo_sites(3)
    model = msa_fed.fit_dmsa(sites, task="classification")
    model_dir = model.save(tmp / "model")
    db = tmp / "registry.db"
    (tmp / "admin_token").write_text(issue_tokens(db, [])["admin"])
    with RegistryProcess(db) as reg:
        common = ("--registry", reg.address, "--insecure", "--admin-token-file", tmp / "admin_token")
        rc, _, err = cli("model", "upload", model_dir, *common)
        assert rc == 0, err
        rc, out, err = cli("model", "report", "1", "--out", tmp / "report.html", *common)
        assert rc == 0 and "written to" in out, err
        rc, _, err = cli("model", "report", "2", "--out", tmp / "none.html", *common)
        assert rc == 1 and err.strip() == "error: NOT_FOUND: no combined model stored (version 2)"
    return tmp / "report.html", model, model_dir


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float64)


def test_report_holds_z_losses_sites_sha256_and_four_plots(report):
    path, model, model_dir = report
    text = path.read_text()
    assert "msa_fed combined model 1" in text
    # each site's loss is the one the site measured on its own labelled data (its verdict)
    measured = model.info["site_check"]["combined"]
    assert len(measured) == len(model.site_names)
    for name, z, loss in zip(model.site_names, model.z, measured):
        assert f"<td>{name}</td><td>{z:.4f}</td><td>{loss:.4f}</td>" in text
    import json

    for sha in json.loads((model_dir / "manifest.json").read_text())["predictor_sha256"]:
        assert sha in text
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', text)
    assert [alt for alt, _ in images] == [
        "mixture weights z",
        "per-site losses",
        "solver convergence",
        "classifier convergence",
    ]
    for alt, b64 in images:
        pixels = _pixels(base64.b64decode(b64))
        assert pixels.std() > 10, f"plot {alt!r} is blank"
    assert "no iterations recorded" not in html.unescape(text)  # both convergence curves have data
    assert "http://" not in text and "https://" not in text  # self-contained


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(report, tmp_path):
    path, _, _ = report
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,2200",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            path.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert shot.is_file(), proc.stderr[-2000:]
    pixels = _pixels(shot.read_bytes())
    assert pixels.shape == (2200, 1280)
    assert pixels.std() > 20, "the screenshot is blank"
    # the plots were drawn: many rows hold non-white pixels, well below the header
    inked_rows = np.flatnonzero((pixels < 200).sum(axis=1) > 20)
    assert inked_rows.size > 400 and inked_rows.max() > 700
