"""Property-based fuzzing through real gRPC: definitions, argument documents and
approval tokens, malformed and valid. No INTERNAL/UNKNOWN, no crash, and every
rejection names its reason."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.app import App
from registry_server.api.config import ServerConfig
from registry_server.api.server import create_server
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair
from registry_server.wire import convert
from tests.security.conftest import sign_request

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
APPROVER = "fuzzer"
NO_IMAGE = "toolreg/fuzz-none"  # never exists: valid calls fail fast, no container starts
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@dataclass
class Server:
    stub: pb_grpc.ToolRegistryStub
    private_key: bytes
    app: App


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("fuzz-data")
    private, public = generate_keypair()
    (data / "approvers").mkdir()
    (data / "approvers" / f"{APPROVER}.pub").write_text(public)
    server, port, app = create_server(
        ServerConfig(host="127.0.0.1", port=0, data_dir=data, max_warm=0)
    )
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    stub = pb_grpc.ToolRegistryStub(channel)
    for name, level in (("fuzz_args", "safe"), ("fuzz_danger", "dangerous")):
        tool = parse_definition(
            {
                "name": name,
                "description": f"fuzz target {name}",
                "parameters": {
                    "type": "object",
                    "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
                    "required": ["text"],
                    "additionalProperties": False,
                },
                "safety_level": level,
                "sandbox": {"image": NO_IMAGE, "command": ["cat"]},
            }
        )
        stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool), replace=True))
    yield Server(stub, private, app)
    # The server survived everything: it still answers.
    names = {t.name for t in stub.ListTools(pb.ListToolsRequest(), timeout=10).tools}
    assert {"fuzz_args", "fuzz_danger"} <= names
    channel.close()
    server.stop(grace=None).wait()
    app.close()


def _reason(err: grpc.Call) -> str:
    """The reason a rejection gives: its field violations, else its message."""
    status = rpc_status.from_call(err)
    fields: list[str] = []
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                br = error_details_pb2.BadRequest()
                detail.Unpack(br)
                fields += [f"{v.field}: {v.description}" for v in br.field_violations]
    return "; ".join(fields) or (err.details() or "")


# ------------------------------------------------------------------ definitions

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
valid_names = st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True)
names = valid_names | st.text(max_size=80)
schemas = st.one_of(
    st.just('{"type": "object"}'),
    st.builds(
        lambda props, req: json.dumps({"type": "object", "properties": props, "required": req}),
        st.dictionaries(
            st.text(max_size=6),
            st.sampled_from([{"type": "string"}, {"type": "integer"}, {}]),
            max_size=3,
        ),
        st.lists(st.text(max_size=6), max_size=2),
    ),
    json_values.map(json.dumps),
    st.text(max_size=60),
)
int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
limits = st.builds(
    pb.ResourceLimits,
    memory_mb=st.integers(-10, 10**6) | int64s,
    cpu_millis=st.integers(-10, 10**5) | int64s,
    pids=st.integers(-10, 10**4) | int64s,
    timeout_ms=st.integers(-10, 10**7) | int64s,
    output_bytes=st.integers(-10, 10**9) | int64s,
)
sandboxes = st.builds(
    pb.SandboxSpec,
    image=st.sampled_from(["toolreg/base", NO_IMAGE, "", "UPPER/Case:tag"]) | st.text(max_size=40),
    command=st.lists(st.text(max_size=20), max_size=4),
    env=st.dictionaries(st.text(max_size=12), st.text(max_size=20), max_size=3),
    limits=limits,
)
random_tools = st.builds(
    pb.Tool,
    name=names,
    description=st.text(max_size=100),
    parameters_json=schemas,
    safety_level=st.integers(-5, 10),
    categories=st.lists(
        st.from_regex(r"[a-z][a-z0-9_-]{0,10}", fullmatch=True) | st.text(max_size=12),
        max_size=4,
    ),
    sandbox=sandboxes,
    warm_pool=st.integers(-(2**31), 2**31 - 1),
)
valid_tools = st.builds(
    pb.Tool,
    name=valid_names,
    description=st.text(
        st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=60
    ),
    parameters_json=st.sampled_from(
        ['{"type": "object"}', '{"type": "object", "properties": {"a": {"type": "string"}}}']
    ),
    safety_level=st.integers(0, 3),
    categories=st.lists(
        st.from_regex(r"[a-z][a-z0-9_-]{0,10}", fullmatch=True), max_size=3, unique=True
    ),
    sandbox=st.builds(
        pb.SandboxSpec,
        image=st.just(NO_IMAGE),
        command=st.just(["cat"]),
        env=st.dictionaries(
            st.from_regex(r"[A-Z][A-Z0-9_]{0,8}", fullmatch=True), st.text(max_size=10), max_size=2
        ),
        limits=st.builds(
            pb.ResourceLimits,
            memory_mb=st.integers(0, 64),
            timeout_ms=st.integers(0, 5000),
        ),
    ),
    warm_pool=st.just(0),
)
TOOL_FIELDS = [f.name for f in pb.Tool.DESCRIPTOR.fields if f.name != "digest"]


def _break_one(valid: pb.Tool, broken: pb.Tool, index: int) -> pb.Tool:
    """A valid tool with one field taken from a random one."""
    out = pb.Tool()
    out.CopyFrom(valid)
    field = TOOL_FIELDS[index % len(TOOL_FIELDS)]
    out.ClearField(field)
    described = pb.Tool.DESCRIPTOR.fields_by_name[field]
    if described.is_repeated:  # categories, secrets
        getattr(out, field).extend(getattr(broken, field))
    elif described.message_type is not None:  # sandbox, network
        getattr(out, field).CopyFrom(getattr(broken, field))
    else:
        setattr(out, field, getattr(broken, field))
    return out


tools = st.one_of(
    valid_tools,
    st.builds(_break_one, valid_tools, random_tools, st.integers(0, 100)),
    random_tools,
)


@FUZZ
@given(tool=tools, replace=st.booleans())
def test_register_accepts_or_names_the_field(
    fuzz_server: Server, tool: pb.Tool, replace: bool
) -> None:
    if tool.name in ("fuzz_args", "fuzz_danger"):
        return  # keep the fixture's targets intact
    try:
        fuzz_server.stub.RegisterTool(
            pb.RegisterToolRequest(tool=tool, replace=replace), timeout=10
        )
    except grpc.RpcError as err:
        assert isinstance(err, grpc.Call)
        assert err.code() in {
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.ALREADY_EXISTS,
        }, f"{err.code()}: {err.details()}"
        assert _reason(err).strip(), f"{err.code()} without a reason"
        event(f"refused {err.code().name}")
    else:
        event("registered")


# ---------------------------------------------------------------------- arguments

argument_docs = st.one_of(
    st.text(max_size=80),
    json_values.map(json.dumps),
    st.builds(
        lambda text, n, extra: json.dumps({"text": text, "n": n, **extra}),
        st.text(max_size=20) | st.integers(),
        st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
        st.dictionaries(st.text(max_size=5), json_values, max_size=2),
    ),
    st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=30)),
)
ARG_STATUSES = {
    pb.EXECUTION_STATUS_INVALID_ARGUMENTS,
    pb.EXECUTION_STATUS_SANDBOX_ERROR,  # valid arguments: the image does not exist
}


@FUZZ
@given(doc=argument_docs)
def test_arguments_get_a_result_never_an_rpc_error(fuzz_server: Server, doc: str) -> None:
    try:
        result = fuzz_server.stub.ExecuteTool(
            pb.ExecuteToolRequest(name="fuzz_args", arguments_json=doc), timeout=30
        )
    except grpc.RpcError as err:
        assert isinstance(err, grpc.Call)
        assert err.code() not in BAD_CODES, f"{err.code()}: {err.details()}"
        # Arguments too large for the server are the only other acceptable refusal.
        assert err.code() in {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert err.details()
        return
    assert result.status in ARG_STATUSES, (result.status, result.error)
    event(pb.ExecutionStatus.Name(result.status))
    assert not result.success
    assert result.error.strip()


# ------------------------------------------------------------------------- tokens


def _valid_token(server: Server, doc: str) -> str:
    first = server.stub.ExecuteTool(
        pb.ExecuteToolRequest(name="fuzz_danger", arguments_json=doc), timeout=30
    )
    assert first.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, first.error
    return sign_request(server.private_key, APPROVER, first.approval_request, ttl_s=60)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _mutate(token: str, how: int, pos: int, extra: str) -> str:
    """A different token derived from a valid one."""
    head, body, sig = token.split(".")
    kind = how % 8
    if kind == 0:  # flip one character
        i = pos % len(token)
        c = "A" if token[i] != "A" else "B"
        out = token[:i] + c + token[i + 1 :]
    elif kind == 1:  # truncate
        out = token[: pos % len(token)]
    elif kind == 2:  # change one claim, keep the old signature
        claims = json.loads(_unb64(body))
        key = sorted(claims)[pos % len(claims)]
        claims[key] = (
            extra if not isinstance(claims[key], str) or claims[key] != extra else extra + "x"
        )
        out = f"{head}.{_b64(json.dumps(claims).encode())}.{sig}"
    elif kind == 3:  # alg none, no signature
        out = f"{_b64(json.dumps({'alg': 'none', 'typ': 'JWT'}).encode())}.{body}."
    elif kind == 4:  # re-encode the payload with padding / standard alphabet
        out = f"{head}.{base64.b64encode(_unb64(body)).decode()}.{sig}"
    elif kind == 5:  # flip a bit of the signature
        raw = bytearray(_unb64(sig))
        raw[pos % len(raw)] ^= 1 << (pos % 8)
        out = f"{head}.{body}.{_b64(bytes(raw))}"
    elif kind == 6:  # swap parts
        out = f"{body}.{head}.{sig}"
    else:  # append junk
        out = token + (extra or ".")
    return out if out != token else token + "x"


ALLOWED_DENIALS = {pb.EXECUTION_STATUS_APPROVAL_DENIED, pb.EXECUTION_STATUS_APPROVAL_REQUIRED}


def _check_refused(server: Server, doc: str, tokens: list[str]) -> None:
    result = server.stub.ExecuteTool(
        pb.ExecuteToolRequest(name="fuzz_danger", arguments_json=doc, approval_tokens=tokens),
        timeout=30,
    )
    assert result.status in ALLOWED_DENIALS, (result.status, result.error, tokens)
    assert not result.success
    event(pb.ExecutionStatus.Name(result.status))
    if result.status == pb.EXECUTION_STATUS_APPROVAL_DENIED:
        assert result.error.strip()


@FUZZ
@given(
    tokens=st.lists(
        st.text(max_size=120)
        | st.from_regex(
            r"[A-Za-z0-9_-]{1,40}\.[A-Za-z0-9_-]{1,60}\.[A-Za-z0-9_-]{0,40}", fullmatch=True
        ),
        min_size=1,
        max_size=3,
    )
)
def test_random_tokens_are_refused(fuzz_server: Server, tokens: list[str]) -> None:
    _check_refused(fuzz_server, '{"text": "x"}', tokens)


@FUZZ
@given(
    how=st.integers(0, 7),
    pos=st.integers(0, 10_000),
    extra=st.text(max_size=12),
    # few distinct calls: each is one pending request of this caller, and a
    # caller may hold at most 32 (every example still gets a fresh token)
    n=st.integers(0, 15),
)
def test_mutated_tokens_are_refused(
    fuzz_server: Server, how: int, pos: int, extra: str, n: int
) -> None:
    doc = json.dumps({"text": "mutate", "n": n})
    token = _valid_token(fuzz_server, doc)
    _check_refused(fuzz_server, doc, [_mutate(token, how, pos, extra)])
