"""Upper bounds on every size carried by a bus payload, in one place (DESIGN §9).

Anything that can publish on the bus could otherwise make a router allocate, loop or compare on a
number it chose: a join with ``dp_size`` 10^6 would create a million candidate slots and slow every
selection. The event models in :mod:`controlplane.protocol.events` refuse a payload past any of
these bounds at decode, naming the field, so the message is dropped before it reaches any state.

The bounds are generous for real deployments (today's largest data-parallel engines run well under
a thousand ranks; vLLM block sizes are 16..256 tokens) and small enough that the worst accepted
payload costs a router little. NATS's own ``max_payload`` (1 MiB by default) bounds a message's
bytes; these bound what the bytes may say.
"""

from __future__ import annotations

U64_MAX = 2**64 - 1

# Worker records (membership).
MAX_DP_SIZE = 1024  # data-parallel ranks of one worker
MAX_BLOCK_SIZE = 4096  # tokens per KV block
MAX_KV_TOTAL_BLOCKS = 2**32  # KV blocks of one worker (all ranks)
MAX_BATCHED_TOKENS = 2**24  # max_num_batched_tokens
MAX_URL_CHARS = 2048
MAX_TOKENIZER_CHARS = 1024  # a tokenizer name or a model folder path
MAX_ENGINE_CHARS = 64
MAX_CACHE_TIERS = 8

# Per-rank load figures in heartbeats (tokens, blocks, requests).
MAX_LOAD_VALUE = 2**40

# KV events and dumps.
MAX_KV_EVENT_BLOCKS = 65536  # blocks stored or removed by one event (NATS max_payload binds first by default)
MAX_KV_DUMP_BLOCKS = 2**22  # blocks of one rank in a full dump

# Routers (status, ACKs) and policy events.
MAX_ROUTER_MODELS = 4096  # a router may serve a large catalogue (issue 10: 1000 models)
MAX_ID_CHARS = 256  # actor, request id
MAX_DETAIL_CHARS = 4096  # an ACK's or NACK's detail
MAX_DOCUMENT_KEYS = 64  # parameters in a policy document or in its changes
# A router's bookings shared with its peers (router.peers): ranks with bookings in one message.
MAX_ROUTER_LOAD_RANKS = 8192
MAX_ROUTER_LOAD_EVENTS = 4096  # expected-returns events of each kind in one message
MAX_ROUTER_LOAD_BYTES = 512 * 1024  # refused before decoding past it
