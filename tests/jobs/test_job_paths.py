"""A job file's "~" is the home folder of whoever runs the job, checked before any network work or
Ray; Ray's local token file is made private."""

from __future__ import annotations

import os
import stat

import pytest

from msa_fed.errors import ConfigError
from msa_fed.jobs.config import JobConfig, read_token_file
from msa_fed.runtime.ray_actors import private_ray_token


def test_tilde_in_a_job_file_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "admin_token").write_text("mft1.admin.admin.secret\n")
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    job = tmp_path / "job.toml"
    job.write_text(
        'name = "j"\n[registry]\naddress = "registry.example.org:7443"\ntls_ca = "~/ca.pem"\n'
        'admin_token_file = "~/admin_token"\n[run]\ntopology = "cluster"\ncheckpoint_dir = "~/ckpt"\n'
    )
    config = JobConfig.from_toml(job)
    assert config.admin_token_file == str(tmp_path / "admin_token") and config.tls_ca == str(tmp_path / "ca.pem")
    assert config.checkpoint_dir == str(tmp_path / "ckpt")
    assert read_token_file(config.admin_token_file) == "mft1.admin.admin.secret"
    assert read_token_file("~/admin_token") == "mft1.admin.admin.secret"  # the flag's value too
    # a missing token file is named at once, before any network work
    job.write_text(job.read_text().replace("~/admin_token", "~/missing_token"))
    with pytest.raises(ConfigError, match="not found"):
        read_token_file(JobConfig.from_toml(job).admin_token_file)


def test_rays_token_file_is_made_private(tmp_path):
    token = tmp_path / "auth_token"
    token.write_text("secret")
    os.chmod(token, 0o644)
    assert private_ray_token(token) is True
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert private_ray_token(token) is False  # already private
    link = tmp_path / "link"
    link.symlink_to(token)
    assert private_ray_token(link) is False  # a link is not followed
    assert private_ray_token(tmp_path / "absent") is False
