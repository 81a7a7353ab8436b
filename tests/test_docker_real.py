"""The same pull against a real Docker daemon and a real container (opt-in).

Runs only with ``WSYNC_REAL_DOCKER=1`` and a daemon answering ``GET /_ping`` at
``$DOCKER_HOST`` (default ``unix:///var/run/docker.sock``); otherwise it is skipped,
saying which.  It creates a container from ``$WSYNC_DOCKER_IMAGE`` (default
``alpine:3``, pulled if missing; busybox tools are enough for wsync), copies a workspace
in through the transport's own stdin (``tar -x``), pulls it back with ``wsync pull
docker://...``, compares, and removes the container whatever happened.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import urllib.parse
from pathlib import Path

import pytest

from helpers import assert_exact, options
from wsync.engine.pull import pull_uri
from wsync.transports import docker_http
from wsync.transports.docker import DockerTransport
from wsync.transports.docker_protocol import parse_docker_host
from wsync.uri import parse

IMAGE = os.environ.get("WSYNC_DOCKER_IMAGE", "alpine:3")


def _daemon_or_skip() -> str:
    host = os.environ.get("DOCKER_HOST", "") or "unix:///var/run/docker.sock"
    if os.environ.get("WSYNC_REAL_DOCKER") != "1":
        pytest.skip("opt-in: set WSYNC_REAL_DOCKER=1 to pull from a real docker container")
    endpoint = parse_docker_host(host)

    async def ping() -> int:
        async with asyncio.timeout(5):
            return (await docker_http.request(endpoint, "GET", "/_ping")).status

    try:
        status = asyncio.run(ping())
    except (OSError, TimeoutError) as err:
        pytest.skip(f"no Docker daemon answers at {host}: {err}")
    if status != 200:
        pytest.skip(f"the Docker daemon at {host} answered /_ping with HTTP {status}")
    return host


def _tree(root: Path) -> Path:
    (root / "src" / "pkg").mkdir(parents=True)
    for i in range(50):
        (root / "src" / "pkg" / f"m{i}.py").write_text(f"X = {i}\n" * 30)
    (root / "blob.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    (root / "link").symlink_to("src/pkg/m1.py")
    (root / "name with spaces").write_text("x\n")
    (root / "empty").mkdir()
    return root


async def _api(host: str, method: str, path: str, body: object = None) -> docker_http.Answer:
    data = json.dumps(body).encode() if body is not None else None
    return await docker_http.request(parse_docker_host(host), method, path, data)


def test_pull_from_a_real_container_is_exact(tmp_path: Path) -> None:
    host = _daemon_or_skip()
    ws = _tree(tmp_path / "ws")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(ws, arcname=".")

    async def main() -> None:
        quoted = urllib.parse.quote(IMAGE, safe="")
        if (await _api(host, "GET", f"/images/{quoted}/json")).status == 404:
            name, _, tag = IMAGE.partition(":")
            pulled = await _api(
                host, "POST", f"/images/create?fromImage={name}&tag={tag or 'latest'}"
            )
            if pulled.status != 200:
                pytest.skip(f"cannot pull {IMAGE}: HTTP {pulled.status}")
        created = await _api(
            host, "POST", "/containers/create", {"Image": IMAGE, "Cmd": ["sleep", "3600"]}
        )
        assert created.status == 201, created.body
        cid = json.loads(created.body)["Id"]
        try:
            assert (await _api(host, "POST", f"/containers/{cid}/start")).status in (204, 304)
            uri = f"docker://{cid[:12]}/work"
            transport = DockerTransport.from_uri(parse(uri), {"docker_host": host})
            try:
                copied = await transport.exec(
                    ["sh", "-c", "mkdir -p /work && tar -xf - -C /work"],
                    stdin=buffer.getvalue(),
                    timeout=120,
                )
                assert copied.exit_status == 0, copied
            finally:
                await transport.aclose()
            dest = tmp_path / "out"
            result = await pull_uri(uri, dest, options(tmp_path), {"docker_host": host})
            assert result.ok
            assert_exact(ws, dest)
        finally:
            await _api(host, "DELETE", f"/containers/{cid}?force=1")

    asyncio.run(main())
