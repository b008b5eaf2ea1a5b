"""KV connectors by name (``--kv-transfer-config '{"kv_connector": NAME, ...}'``).

Each name maps to ``"module:SchedulerHalf"`` and ``"module:WorkerHalf"``; modules are
imported only when chosen. Adding a connector is one new module and one line here;
``Scheduler.schedule()`` never changes for it.
"""

from __future__ import annotations

KV_CONNECTORS: dict[str, tuple[str, str]] = {
    "p2p": (
        "services.kv_transfer.p2p:P2PConnectorScheduler",
        "services.kv_transfer.p2p:P2PConnectorWorker",
    ),
    "offload": (
        "services.kv_transfer.offload:OffloadConnectorScheduler",
        "services.kv_transfer.offload:OffloadConnectorWorker",
    ),
    "storage": (
        "services.kv_transfer.storage:StorageConnectorScheduler",
        "services.kv_transfer.storage:StorageConnectorWorker",
    ),
    "multi": (
        "services.kv_transfer.multi:MultiConnectorScheduler",
        "services.kv_transfer.multi:MultiConnectorWorker",
    ),
}
