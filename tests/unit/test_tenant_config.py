"""daemon.tenants and the default sockets in the config: YAML, KVBM_* overrides, errors naming the field."""

from __future__ import annotations

import pytest

from kvbm.config import default_run_dir, load_config
from kvbm.errors import ConfigError


def test_default_sockets_are_ipc_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = load_config(environ={})
    assert cfg.daemon.endpoint == f"ipc://{tmp_path}/kvbm/run/kvbm.sock"
    assert cfg.daemon.events_endpoint == f"ipc://{tmp_path}/kvbm/run/events.sock"
    assert default_run_dir().name == "run"


def test_tenants_from_the_environment():
    env = {"KVBM_DAEMON_TENANTS": '[{name: a, token_file: /t/a, models: ["team-a/*"], max_inflight: 8}]'}
    (t,) = load_config(environ=env).daemon.tenants
    assert (t.name, t.token_file, t.models, t.max_inflight, t.max_workers) == ("a", "/t/a", ["team-a/*"], 8, 64)


@pytest.mark.parametrize(("tenants", "field"), [
    ('[{name: a, token_file: /t/a}]', "daemon.tenants[0].models"),
    ('[{name: a, token_file: /t/a, models: [m]}, {name: a, token_file: /t/b, models: [m]}]', "daemon.tenants[1].name"),
    ('[{name: a, token_file: /t/a, models: [m], max_workers: many}]', "daemon.tenants[0].max_workers"),
    ('[{name: a, token_file: /t/a, models: [m], max_inflight: 0}]', "daemon.tenants[0].max_inflight"),
    ('{name: a}', "daemon.tenants"),
])
def test_a_bad_tenant_is_an_error_naming_its_field(tenants, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_config(environ={"KVBM_DAEMON_TENANTS": tenants})


def test_the_connector_finds_the_daemon_on_its_default_socket(tmp_path, monkeypatch):
    from kvbm.integrations.vllm.config import ConnectorConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for var in ("KVBM_DAEMON", "KVBM_DAEMON_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert ConnectorConfig.parse({}).endpoint() == load_config(environ={}).daemon.endpoint


def test_a_default_socket_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    import os

    from needs import require

    from kvbm.security import prepare_ipc

    require("otheruid", os.geteuid() == 0, "not root: cannot give the directory to another uid")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    run = default_run_dir()
    run.mkdir(parents=True)
    os.chown(run, 65534, 65534)  # someone else made it first: its sockets would be theirs to reach
    with pytest.raises(ConfigError, match=r"daemon\.endpoint: .* must be a directory of this user"):
        prepare_ipc(load_config(environ={}).daemon.endpoint, "endpoint")
    os.chown(run, os.geteuid(), os.getegid())
    run.chmod(0o755)
    prepare_ipc(load_config(environ={}).daemon.endpoint, "endpoint")  # ours but opened: closed again
    assert run.stat().st_mode & 0o777 == 0o700
