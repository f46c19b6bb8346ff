"""Pages across servers: three servers on one PostgreSQL behind HAProxy. A
page token one server issued is accepted by the others (the key is the
store's), so a client paging through the load balancer, whose pages land on
any server, lists every tool once; and pages asked of each server in turn
do too, while tools are registered through another."""

from __future__ import annotations

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.client.registry_client import open_channel
from tests.cluster.conftest import wait_for
from tests.cluster.test_load_balancer import Balanced, balanced  # noqa: F401 (a fixture)
from tests.factories import tool
from tests.integration.test_interop_node import TOKENS

COUNT = 40
NAMES = [f"paged_{i:02d}" for i in range(COUNT)]


def stub(address: str) -> pb_grpc.ToolRegistryStub:
    return pb_grpc.ToolRegistryStub(open_channel(address, token=TOKENS["agent"]))


def names(reply: pb.ListToolsResponse) -> list[str]:
    return [t.name for t in reply.tools]


def test_pages_go_to_any_server(balanced: tuple[Balanced, bytes]) -> None:  # noqa: F811
    lb, _ = balanced
    admin = lb.client("admin")
    for name in NAMES:
        admin.register_tool(tool(name=name, categories=["paged"]))
    stubs = [stub(s.address) for s in lb.servers]
    wanted = pb.ListToolsRequest(categories=["paged"], page_size=1_000)
    for each in stubs:  # every server has heard of every registration
        wait_for(
            "all tools on every server", lambda each=each: names(each.ListTools(wanted)) == NAMES
        )

    # each page asked of the next server, tools registered meanwhile through another
    listed: list[str] = []
    extra: list[str] = []
    token, turn = "", 0
    while True:
        request = pb.ListToolsRequest(categories=["paged"], page_size=3, page_token=token)
        reply = stubs[turn % 3].ListTools(request)
        listed += names(reply)
        token, turn = reply.next_page_token, turn + 1
        if not token:
            break
        if turn % 4 == 0:
            extra.append(f"paged_{turn:02d}_x")
            admin.register_tool(tool(name=extra[-1], categories=["paged"]))
    assert [n for n in listed if n in NAMES] == NAMES
    assert len(listed) == len(set(listed)) and turn >= COUNT // 3

    every = sorted(NAMES + extra)
    for each in stubs:  # the extra tools too, before the listings below are compared
        wait_for(
            "the same tools everywhere", lambda each=each: names(each.ListTools(wanted)) == every
        )

    # through HAProxy: the Python client follows every page, whichever server answers
    agent = lb.client("agent")
    through = [t.name for t in agent.list_tool_definitions(categories=["paged"], page_size=2)]
    assert through == every
    schemas = agent.tool_schemas(categories=["paged"], page_size=1)
    assert [s["function"]["name"] for s in schemas] == through
