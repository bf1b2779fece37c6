"""The mock engine as the agent sees it: the simulated core plus its HTTP server."""

from __future__ import annotations

import asyncio

from controlplane.protocol.events import KvDumpRank, RankLoad
from worker.engines.base import EngineInfo, KvSink
from worker.engines.mock.api import MockApi
from worker.engines.mock.engine import MockCore
from worker.engines.mock.timing import advertised_timing
from worker.engines.mock.tokenizer import load_tokenizer
from worker.httpserver import HttpServer, advertised_url
from worker.settings import WorkerSettings


class MockEngine:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.core: MockCore | None = None
        self.api: MockApi | None = None
        self._http: HttpServer | None = None

    async def start(self, kv_sink: KvSink) -> EngineInfo:
        s = self.settings
        # A model folder's tokenizer reads files (and imports transformers): off the event loop.
        tok = await asyncio.to_thread(load_tokenizer, s.mock.tokenizer)
        self.core = MockCore(s.mock, dp_size=s.dp_size, role=s.role, kv_sink=kv_sink,
                             token_source=tok.output_token)
        self.api = MockApi(self.core, model=s.model, instance_id=s.instance_id, tokenizer=tok)
        self._http = HttpServer(self.api.app, host=s.host, port=s.port)
        self.core.start()
        try:
            await self._http.start()
        except BaseException:
            await self.core.stop()
            raise
        return EngineInfo(
            url=advertised_url(host=s.host, port=self._http.port, advertise_host=s.advertise_host),
            block_size=s.mock.block_size, kv_total_blocks=s.mock.num_blocks,
            max_num_batched_tokens=s.mock.max_num_batched_tokens, dp_size=s.dp_size,
            tokenizer=tok.name, engine="mock",
            timing=advertised_timing(s.mock),
        )

    async def stop(self) -> None:
        if self.core is not None:
            self.core.stopped = True  # /health answers 503 while in-flight requests drain
        if self._http is not None:
            await self._http.stop()
        if self.core is not None:
            await self.core.stop()

    def load(self) -> list[RankLoad]:
        return [] if self.core is None else self.core.load()

    def dump(self) -> list[KvDumpRank]:
        return [] if self.core is None else self.core.dump()

    @property
    def partial_view(self) -> bool:
        return False

    def healthy(self) -> bool:
        return self.core is not None and not self.core.stopped  # in-process: it serves while it runs
