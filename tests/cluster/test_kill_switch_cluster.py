"""The kill switch across servers: three `toolreg serve` processes on one
PostgreSQL. A tool disabled or deleted through server 0 is refused by
servers 1 and 2 within a second (the change is announced on commit and each
server reloads the tool); enabling it through another server makes it
callable everywhere again; an open request made through one server is voided
for all of them."""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.wire import convert
from tests.cluster.conftest import Cluster, StartCluster, wait_for
from tests.factories import tool

ARGS = json.dumps({"message": "hi"})
WRITE_ARGS = json.dumps({"path": "kill-switch.txt", "content": "never"})
WITHIN_S = 1.0  # seconds every server has to follow


def shows(cluster: Cluster, index: int, state: str) -> Callable[[], bool]:
    """Whether server ``index`` holds cluster_tool "enabled", "disabled" or
    "deleted" (one GetTool: a cheap probe, where a call could run a container)."""

    def check() -> bool:
        try:
            found = cluster.stub(index, "agent").GetTool(pb.GetToolRequest(name="cluster_tool"))
        except grpc.RpcError as err:
            return state == "deleted" and err.code() == grpc.StatusCode.NOT_FOUND
        return state == ("disabled" if found.disabled else "enabled")

    return check


def answers(cluster: Cluster, index: int, status: int) -> Callable[[], bool]:
    """Whether a call of cluster_tool through server ``index`` ends in ``status``."""

    def check() -> bool:
        result = cluster.stub(index, "agent").ExecuteTool(
            pb.ExecuteToolRequest(name="cluster_tool", arguments_json=ARGS), timeout=30
        )
        return int(result.status) == status

    return check


def test_a_disable_and_a_delete_through_one_server_are_refused_by_the_others_within_a_second(
    start_cluster: StartCluster,
) -> None:
    cluster = start_cluster(3)
    made = tool(name="cluster_tool", description="Registered through server 0.")
    cluster.stub(0, "team").RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(made)))
    for index in (1, 2):
        wait_for(
            f"server {index} runs cluster_tool",
            answers(cluster, index, pb.EXECUTION_STATUS_OK),
            WITHIN_S * 5,
        )
    # an open approval request made through server 1 for a tool about to be disabled
    asked = cluster.stub(1, "agent").ExecuteTool(
        pb.ExecuteToolRequest(name="write_file", arguments_json=WRITE_ARGS)
    )
    assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, asked.error

    cluster.stub(0, "admin").SetToolEnabled(
        pb.SetToolEnabledRequest(name="cluster_tool", enabled=False, reason="incident 12")
    )
    cluster.stub(0, "admin").SetToolEnabled(
        pb.SetToolEnabledRequest(name="write_file", enabled=False, reason="incident 12")
    )

    for index in (1, 2):
        took = wait_for(f"server {index} disables cluster_tool", shows(cluster, index, "disabled"),
                        WITHIN_S)  # fmt: skip
        print(f"server {index} held the tool disabled after {took * 1000:.0f} ms")
        stub = cluster.stub(index, "agent")
        refused = stub.ExecuteTool(pb.ExecuteToolRequest(name="cluster_tool", arguments_json=ARGS))
        assert refused.status == pb.EXECUTION_STATUS_TOOL_DISABLED
        assert refused.error == "Tool 'cluster_tool' is disabled: incident 12"
        listed = {t.name: t for t in stub.ListTools(pb.ListToolsRequest()).tools}
        assert listed["cluster_tool"].disabled
        assert listed["cluster_tool"].disabled_reason == "incident 12"
        schemas = json.loads(stub.GetToolSchemas(pb.GetToolSchemasRequest()).schemas_json)
        assert "cluster_tool" not in {s["function"]["name"] for s in schemas}
    voided = cluster.stub(2, "agent").GetApprovalRequest(
        pb.GetApprovalRequestRequest(id=asked.approval_request.id)
    )
    assert (voided.state, voided.voided_reason) == (
        "VOIDED",
        "tool 'write_file' was disabled: incident 12",
    )

    cluster.stub(1, "admin").SetToolEnabled(
        pb.SetToolEnabledRequest(name="cluster_tool", enabled=True)
    )
    for index in (0, 2):
        wait_for(f"server {index} enables cluster_tool", shows(cluster, index, "enabled"), WITHIN_S)
        assert answers(cluster, index, pb.EXECUTION_STATUS_OK)()

    cluster.stub(0, "team").DeleteTool(pb.DeleteToolRequest(name="cluster_tool", reason="gone"))

    for index in (1, 2):
        took = wait_for(f"server {index} deletes cluster_tool", shows(cluster, index, "deleted"),
                        WITHIN_S)  # fmt: skip
        print(f"server {index} held the tool deleted after {took * 1000:.0f} ms")
        assert answers(cluster, index, pb.EXECUTION_STATUS_TOOL_NOT_FOUND)()
        names = {
            t.name for t in cluster.stub(index, "agent").ListTools(pb.ListToolsRequest()).tools
        }
        assert "cluster_tool" not in names
