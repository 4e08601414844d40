"""The health server's bearer token (``health_token_file``): the probes stay open, the rest
answers 401 without the token, and off loopback a daemon does not start without one unless
the operator opts out."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from daemon_fixtures import P_ENGINE, metric, running_daemon

from pushsvc.config import load_config
from pushsvc.engine.fake import FakeEngine
from pushsvc.errors import ConfigError
from pushsvc.proxy.app import Proxy
from pushsvc.proxy.config import load_proxy_config
from pushsvc.proxy.upstream import UpstreamError

TOKEN = "0123456789abcdef0123456789abcdef"
BASE_ENV = {"XDG_RUNTIME_DIR": "/run/user/1000"}


def _token_file(tmp_path: Path, text: str = TOKEN + "\n", mode: int = 0o600) -> str:
    path = tmp_path / "health.token"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


async def _get(daemon, path: str, token: str | None = None) -> tuple[int, str]:
    url = f"http://{daemon.config.health_host}:{daemon.health.port}{path}"
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        return resp.status, await resp.text()


@pytest.mark.asyncio
async def test_with_a_token_only_the_probes_answer_without_it(tmp_path: Path) -> None:
    async with running_daemon(FakeEngine(), P_ENGINE, health_token_file=_token_file(tmp_path)) as d:
        for path in ("/healthz", "/readyz"):
            assert (await _get(d, path))[0] in (200, 503), path
        for path in ("/metrics", "/v1/info", "/v1/requests"):
            status, body = await _get(d, path)
            assert status == 401 and "Bearer" in body, path
            assert (await _get(d, path, "wrong-token-of-some-length"))[0] == 401
            assert (await _get(d, path, TOKEN[:-1]))[0] == 401  # a prefix is not the token
            assert (await _get(d, path, TOKEN))[0] == 200, path
        assert metric(d, "pushsvc_rejected_connections_total", listener="health", reason="unauthorized") == 9


@pytest.mark.asyncio
async def test_without_a_token_on_loopback_everything_answers() -> None:
    async with running_daemon(FakeEngine(), P_ENGINE) as d:
        assert (await _get(d, "/metrics"))[0] == 200


def test_off_loopback_the_health_server_needs_a_token_or_the_opt_out(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env=BASE_ENV, overrides={"health_host": "0.0.0.0"})
    assert info.value.field == "health_token_file" and "insecure_health" in str(info.value)
    cfg = load_config(None, env=BASE_ENV, overrides={"health_host": "0.0.0.0", "insecure_health": True})
    assert cfg.insecure_health
    cfg = load_config(None, env=BASE_ENV, overrides={"health_host": "0.0.0.0",
                                                     "health_token_file": _token_file(tmp_path)})
    assert cfg.health_token_file


@pytest.mark.parametrize(("text", "mode", "why"), [
    (TOKEN, 0o644, "accessible by group or others"),
    ("short\n", 0o600, "shorter than"),
    ("\n", 0o600, "is empty"),
])
def test_a_token_file_follows_the_secret_file_rules(tmp_path: Path, text: str, mode: int, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env=BASE_ENV, overrides={"health_token_file": _token_file(tmp_path, text, mode)})
    assert info.value.field == "health_token_file" and why in str(info.value)


@pytest.mark.asyncio
async def test_the_proxy_reads_a_guarded_p_daemons_info_with_the_token_it_was_given(tmp_path: Path) -> None:
    """A P daemon whose health server listens beyond loopback has a token; the proxy's
    ``--prefill-daemon`` must send it, or D's legs never learn where P's daemon is."""
    token = _token_file(tmp_path)
    async with running_daemon(FakeEngine(), P_ENGINE, health_token_file=token) as d:
        daemon_url = f"http://{d.config.health_host}:{d.health.port}"
        for token_file, answered in ((None, False), (token, True)):
            proxy = Proxy(load_proxy_config({
                "prefill": ["http://127.0.0.1:1"], "prefill_daemon": [daemon_url], "decode": ["http://127.0.0.1:2"],
                "port": 0, "health_interval_s": 0, "prefill_daemon_token_file": token_file}))
            await proxy.startup(web.Application())
            try:
                backend = proxy.prefill.pick()
                if answered:
                    coords = await proxy.infos.refresh(backend)
                    assert coords.engine_id == P_ENGINE
                else:
                    with pytest.raises(UpstreamError) as info:
                        await proxy.infos.refresh(backend)
                    assert info.value.status == 401
            finally:
                await proxy.cleanup(web.Application())


def test_a_prefill_daemon_token_without_a_prefill_daemon_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_proxy_config({"prefill": ["http://127.0.0.1:1"], "prefill_daemon": [], "decode": ["http://127.0.0.1:2"],
                           "port": 0,
                           "prefill_daemon_token_file": _token_file(tmp_path)})
    assert info.value.field == "prefill_daemon_token_file"
