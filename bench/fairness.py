"""A quiet client's latency while another floods the server, against the
same client's latency on the idle server, in one run (docs/how-to/tenants.md).

One server with a policy naming two executing clients and no quotas (so the
built-in share applies), the sizes the starvation was found at: 4 sandbox
slots, a queue of 32, no warm pool. The flooder loops 3 s calls from 40
threads; the quiet client makes quick calls one at a time."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.common import OUR_PIDS, RPC_TIMEOUT_S, summary, summary_table, timed_ms
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from tests.factories import sha

ROOT = Path(__file__).resolve().parents[1]
SLOTS, QUEUE, FLOOD_THREADS, SLOW_S = 4, 32, 40, 3
TOKENS = {"flood": "bench-flood", "quiet": "bench-quiet"}


def run(calls: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="toolreg-bench-fair-"))
    policy = base / "policy.yaml"
    clients = [
        {"id": cid, "token_sha256": sha(token), "roles": ["execute", "register"],
         "max_safety_level": "cautious"}
        for cid, token in TOKENS.items()
    ]  # fmt: skip
    policy.write_text(yaml.safe_dump({"audience": "bench-fair", "clients": clients}))
    env_args = ("--policy", str(policy))
    env = {**os.environ, "TOOLREG_MAX_SANDBOXES": str(SLOTS), "TOOLREG_MAX_QUEUED": str(QUEUE),
           "TOOLREG_MAX_WARM": "0"}  # fmt: skip
    server = spawn_server(base / "data", *env_args, cwd=ROOT, env=env)
    OUR_PIDS.add(server.pid)
    try:
        stubs = {
            who: pb_grpc.ToolRegistryStub(open_channel(server.address, token=token))
            for who, token in TOKENS.items()
        }
        for name, command in (("slow", f"sleep {SLOW_S}; echo slow"), ("quick", "echo quick")):
            tool = parse_definition({
                "name": name, "description": name, "parameters": {"type": "object"},
                "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", command]},
            })  # fmt: skip
            stubs["flood"].RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))

        def quick() -> None:
            result = stubs["quiet"].ExecuteTool(
                pb.ExecuteToolRequest(name="quick", arguments_json="{}"), timeout=RPC_TIMEOUT_S
            )
            if not result.success:
                raise RuntimeError(f"quick call failed: {result.error}")

        quick()  # first call: images into the page cache
        idle = [timed_ms(quick) for _ in range(calls)]
        stop = threading.Event()
        outcomes: list[str] = []

        def flood() -> None:
            while not stop.is_set():
                try:
                    stubs["flood"].ExecuteTool(
                        pb.ExecuteToolRequest(name="slow", arguments_json="{}"), timeout=60
                    )
                    outcomes.append("ok")
                except grpc.RpcError as err:
                    outcomes.append(err.code().name)
                    time.sleep(0.05)

        threads = [threading.Thread(target=flood, daemon=True) for _ in range(FLOOD_THREADS)]
        for thread in threads:
            thread.start()
        time.sleep(SLOW_S + 1)
        flooded = [timed_ms(quick) for _ in range(calls)]
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        server.stop()
    idle_s, flood_s = summary(idle), summary(flooded)
    return {
        "calls": calls,
        "rows": [
            {"what": "quiet client, idle server", **idle_s},
            {"what": "quiet client, under the flood", **flood_s},
        ],
        "ratio_p50": round(flood_s["p50_ms"] / idle_s["p50_ms"], 2),
        "flood_ok": outcomes.count("ok"),
        "flood_refused": outcomes.count("RESOURCE_EXHAUSTED"),
    }


def report_md(sec: dict[str, Any]) -> list[str]:
    heading = f"One client floods, another calls ({sec['calls']} quick calls each way)"
    lines = summary_table(heading, "quick call", sec["rows"])
    lines += [
        "",
        f"Under the flood / idle, p50: **{sec['ratio_p50']}x**. The flooder ({FLOOD_THREADS}"
        f" threads of {SLOW_S} s calls, {SLOTS} slots, a queue of {QUEUE}, no quotas in the"
        f" policy: the built-in share) had {sec['flood_ok']} calls run and"
        f" {sec['flood_refused']} refused with RESOURCE_EXHAUSTED meanwhile.",
    ]
    return lines
