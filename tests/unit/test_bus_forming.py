"""What a JetStream cluster still forming answers is retried until a deadline (bus.streams)."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.errors import APIError, BadRequestError, ServiceUnavailableError

from bus.streams import _raise_unless_forming


async def test_a_forming_clusters_answers_are_retried_until_the_deadline_others_raised_at_once() -> None:
    now = asyncio.get_running_loop().time()
    forming = [
        BadRequestError(code=400, err_code=10005, description="no suitable peers for placement, peer offline"),
        APIError(code=500, err_code=10008, description="JetStream system temporarily unavailable"),
        ServiceUnavailableError(code=503, description="no responders"),
    ]
    for exc in forming:
        _raise_unless_forming(exc, now + 60)  # retried: no raise
        with pytest.raises(type(exc)):
            _raise_unless_forming(exc, now - 1)  # past the deadline: raised
    other = BadRequestError(code=400, err_code=10058, description="stream name already in use")
    with pytest.raises(BadRequestError):
        _raise_unless_forming(other, now + 60)
