"""vLLM plugin (entry point ``vllm.general_plugins``): registers ``KvbmConnector`` by name.

vLLM calls :func:`register` in every process it starts (API server, EngineCore, workers), so
``--kv-transfer-config '{"kv_connector": "KvbmConnector", "kv_role": "kv_both"}'`` needs no module path.
Importing this module imports nothing heavy: the connector itself loads when vLLM first creates it.
"""

from __future__ import annotations

CONNECTOR_NAME = "KvbmConnector"


def register() -> None:
    """Register the connector with vLLM's KV-connector factory; calling it again is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvbm.integrations.vllm", "KvbmConnector")
    except ValueError:  # already registered (plugins may load more than once per process)
        pass
