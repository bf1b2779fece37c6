"""TLS on the bus (``rudder up --tls``): a fleet works over TLS, and a client that does not trust
the bus CA, or speaks plaintext, is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from bus.connect import BusOptions, connect
from bus.identities import Identity, IdentityKind
from cli.embedded import LocalBus
from controlplane.protocol.errors import LogUnavailable
from tests import buskit
from tests.support_router.fleet import chat, mock_fleet

pytestmark = pytest.mark.timeout(90)
MODEL = "tls/model"


@pytest.fixture(scope="module")
def tls_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBus]:
    bus = LocalBus(tmp_path_factory.mktemp("tlsbus"), authority=buskit.authority(), tls=True)
    bus.start()
    try:
        yield bus
    finally:
        bus.stop()


async def test_a_fleet_runs_over_tls(tls_bus: LocalBus) -> None:
    assert tls_bus.url.startswith("tls://") and tls_bus.tls is not None
    async with mock_fleet(tls_bus.url, MODEL, nats_ca=tls_bus.tls.ca) as router:
        body = await chat(router.url, MODEL)
        assert body["usage"]["completion_tokens"] == 3


async def test_plaintext_and_untrusted_clients_are_refused(tls_bus: LocalBus, tmp_path: Path) -> None:
    creds = buskit.creds_for(Identity(IdentityKind.CONTROLPLANE))
    plain = tls_bus.url.replace("tls://", "nats://")
    with pytest.raises((nats.errors.Error, OSError, LogUnavailable)):
        await nats.connect(plain, user_credentials=str(creds), allow_reconnect=False, connect_timeout=2,
                           tls_handshake_first=False)
    stranger = LocalBus(tmp_path, authority=buskit.authority(), tls=True)  # another CA
    assert stranger.tls is not None
    with pytest.raises(LogUnavailable):
        await connect(BusOptions(servers=(tls_bus.url,), creds=creds, ca=stranger.tls.ca,
                                 initial_timeout_s=3))
