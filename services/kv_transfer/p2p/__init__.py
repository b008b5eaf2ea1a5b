"""``p2p``: a decode instance pulls a prefill instance's KV blocks straight from its workers.

The flow (``actorserve pd-proxy`` drives it, as vLLM's NixlConnector proxy does):

1. The prefill instance gets the request with ``max_tokens=1`` and
   ``kv_transfer_params: {"do_remote_decode": true}``. When it finishes, its scheduler
   does not free the blocks: it *holds* them (``P2PHold`` to every worker rank) and
   answers with params naming them: ``remote_request_id``, ``remote_block_ids``,
   ``remote_block_generations``, ``remote_host``/``remote_port`` (rank r's side channel
   is ``remote_port + r``), ``tp_size``, ``remote_engine_id``.
2. The decode instance gets the original request with those params. While it is queued,
   its scheduler renews the lease (``KVRenew``, every third of ``lease_s``). Once it has
   blocks for the prompt (all but the last token, which it computes itself to sample),
   the request waits (``WAITING_FOR_REMOTE_KVS``) while each worker rank pulls its shard
   layer by layer (``KVPull``; K and V of one layer per message, into the decode
   cache as each arrives) and then acknowledges (``KVRelease``).
3. A prefill rank stops serving a hold when it is released, or when ``lease_s`` passes
   with no pull or renewal, and reports it; once every rank has, the prefill scheduler
   frees the blocks. A pull for a hold that is gone, or for blocks whose generation
   differs from the hold's (freed and reused), is refused: the decode side then computes
   the prompt itself. It never decodes from KV it did not get whole.

The data goes worker to worker (never through the proxy or a scheduler). The connector
is the halves here: ``scheduler.py`` (holds, loads, renewals, reports), ``worker.py`` (the
side channel's server and the pulls), ``holds.py`` (a prefill rank's leases). The bytes
move by a transport (``services/kv_transfer/transport.py``), over the ZeroMQ side channel
(``side_channel.py``) that carries the protocol above for every transport.
``kv_connector_extra_config``: ``lease_s`` (60), ``pull_timeout_s`` (30: the longest
wait for the next layer before the pull counts as failed), ``transport`` ("zmq": raw KV
bytes on the side channel; "nixl": the decode rank READs the blocks over NIXL,
``nixl_transport.py``, both sides need it); the sim worker's simulated link is chosen by
the backend (``sim_transport.py``).
"""

from services.kv_transfer.p2p.scheduler import (
    P2PConnectorScheduler,
    RemotePrefill,
    prompt_hash,
)
from services.kv_transfer.p2p.worker import P2PConnectorWorker

__all__ = ["P2PConnectorScheduler", "P2PConnectorWorker", "RemotePrefill", "prompt_hash"]
