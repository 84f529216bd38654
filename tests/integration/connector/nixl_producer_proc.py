"""A P process for the transfer-core tests: a real NIXL producer driven by JSON lines on stdin.

Commands (one JSON object per line): ``{"cmd": "finish", "key", "request_id", "blocks"}``,
``{"cmd": "abort", "key", "reason"}``, ``{"cmd": "released"}`` (prints the released ids),
``{"cmd": "records"}``, ``{"cmd": "exit"}``. On start it prints ``{"port": N}``.
Block ``b`` of region ``r`` is filled with the float ``1000 * r + b`` (P's pattern).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.nixl_backend import NixlEndpoint
from disagg_router.connector.producer import PushProducer
from disagg_router.connector.specs import SendAbort, SendSpec
from tests.integration.connector.nixl_layouts import make_regions


def main() -> None:
    num_blocks, block_floats, lease_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    arrays, layout = make_regions(num_blocks, block_floats)
    for r, arr in enumerate(arrays):
        arr[:] = (1000 * r + np.arange(num_blocks, dtype=np.float32))[:, None]
    endpoint = NixlEndpoint("p-agent", layout)
    cfg = ConnectorConfig(side_channel_port=0, lease_s=lease_s, registration_ttl_s=lease_s)
    producer = PushProducer(endpoint, "p-engine", cfg)
    print(json.dumps({"port": producer.port}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "finish":
            producer.add_finished(SendSpec(cmd["request_id"], cmd["key"], tuple(cmd["blocks"])))
            print(json.dumps({"ok": True}), flush=True)
        elif cmd["cmd"] == "abort":
            producer.abort(SendAbort(cmd["key"], cmd["reason"]))
            print(json.dumps({"ok": True}), flush=True)
        elif cmd["cmd"] == "released":
            print(json.dumps({"released": sorted(producer.take_released())}), flush=True)
        elif cmd["cmd"] == "records":
            recs = [r.__dict__ for r in producer.take_records()]
            print(json.dumps({"records": recs}), flush=True)
        else:
            break
    producer.close()
    endpoint.close()


if __name__ == "__main__":
    main()
