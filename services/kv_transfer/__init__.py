"""KV connectors: where KV blocks come from and go to besides this engine's own cache.

``--kv-transfer-config`` (vLLM's JSON) names a connector registered in ``services/registry.py``.
Each connector has two halves, as vLLM's KVConnectorBase_V1 (``base.py``): one in the
scheduler (which prompt tokens an outside source supplies, what to hold when a request
finishes) and one in every worker rank (the KV tensors, the transfers themselves).
"""
