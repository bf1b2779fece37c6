"""The routing cost: the number a KV-aware selection minimises over the eligible dp ranks of a pool.

Every candidate rank gets one cost for the request, lower is better, and DESIGN §5's pick chooses
among them (temperature 0: the least, ties at random; T > 0: a Boltzmann draw). There are two
costs; the routing mode says which (:attr:`router.settings.RoutingMode.cost`, applied in
:mod:`router.choose`):

- the time cost (:mod:`router.cost.time`; modes ``kv``, the default, and ``kv-time``): the
  predicted time to the request's first token on that rank, in ms of its worker's timing model,
  plus what the request costs the requests running there and those expected to arrive. It also
  gives the predicted TTFT that a request's TTFT objective is checked against, in either mode;
- the block cost (:mod:`router.cost.blocks`; mode ``kv-blocks``): DESIGN §5's, the rank's prefill
  and decode load in KV blocks less the blocks of the prompt it already holds.

Each cost has two forms, side by side in its module: a scalar one that walks the candidates in
Python (the quicker for a few dozen ranks) and a vectorised one over the numpy columns of a
:class:`router.loadvec.LoadTable` (the quicker from about a hundred). The two forms give the same
costs (the block cost bit for bit, the time cost up to float rounding) for the same candidates in
the same order, so a pick breaks ties with the same random draw either way. What both costs
share (their inputs, the pick) is :mod:`router.cost.common`.

Pure: no I/O, no clock.
"""
