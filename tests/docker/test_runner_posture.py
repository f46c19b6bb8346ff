"""The isolation posture, read from inside the container and from the engine."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import docker
import pytest

from sandbox_runner import SandboxSpec
from sandbox_runner.docker_backend import INIT_TARGET, DockerBackend

Eid = Callable[[], str]
SpecFactory = Callable[..., SandboxSpec]


def status_fields(text: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.decode().splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def interfaces(proc_net_dev: bytes) -> list[str]:
    lines = proc_net_dev.decode().splitlines()[2:]  # two header lines
    return [line.split(":")[0].strip() for line in lines if line.strip()]


def test_capabilities_no_new_privs_seccomp(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    res = runner.run(make_spec("cat /proc/self/status"), execution_id=eid())
    status = status_fields(res.stdout)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[cap] == "0000000000000000", cap
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2"  # filter mode: the engine's default profile


def root_mount_options(proc_mounts: bytes) -> list[str]:
    roots = [ln.split() for ln in proc_mounts.decode().splitlines() if ln.split()[1:2] == ["/"]]
    return roots[-1][3].split(",")


def test_root_is_mounted_read_only(runner: DockerBackend, make_spec: SpecFactory, eid: Eid) -> None:
    res = runner.run(make_spec("cat /proc/mounts"), execution_id=eid())
    assert "ro" in root_mount_options(res.stdout)


def test_runs_as_nobody(runner: DockerBackend, make_spec: SpecFactory, eid: Eid) -> None:
    res = runner.run(make_spec("id -u; id -g"), execution_id=eid())
    assert res.stdout.split() == [b"65534", b"65534"]


def test_only_loopback_interface(runner: DockerBackend, make_spec: SpecFactory, eid: Eid) -> None:
    res = runner.run(make_spec("cat /proc/net/dev"), execution_id=eid())
    assert interfaces(res.stdout) == ["lo"]


@pytest.mark.parametrize(
    "script",
    [
        "ping -c1 -W1 1.1.1.1",
        "wget -q -T 2 -O - http://1.1.1.1/",
        "nslookup example.com",
        "nc -w 2 1.1.1.1 53 </dev/null",
    ],
    ids=["ping", "wget", "dns", "tcp"],
)
def test_network_is_unreachable(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, script: str
) -> None:
    res = runner.run(make_spec(script, timeout_ms=8000), execution_id=eid())
    assert res.exit_code not in (0, None), res.stdout
    assert not res.timed_out, "should fail at once, not hang"


def test_cannot_see_host_processes_or_devices(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    res = runner.run(make_spec("ls /proc; echo ---; ls /dev"), execution_id=eid())
    procs, _, devs = res.stdout.decode().partition("---")
    pids = [p for p in procs.split() if p.isdigit()]
    assert len(pids) <= 4, f"only the tool's own processes should be visible: {pids}"
    for forbidden in ("sda", "vda", "nvme0", "mem", "kmsg", "shm"):
        assert forbidden not in devs.split()


def test_engine_side_host_config(
    runner: DockerBackend,
    make_spec: SpecFactory,
    eid: Eid,
    docker_client: docker.DockerClient,
    run_id: str,
) -> None:
    execution_id = eid()
    seen: dict[str, Any] = {}

    def sink(stream: str, chunk: bytes) -> None:
        if not seen:  # inspect while it is still running
            seen.update(docker_client.api.inspect_container(f"toolreg-{execution_id}"))

    spec = make_spec("echo up; sleep 0.5", memory_mb=100, cpu_millis=250, pids=20, tmpfs_mb=3)
    runner.run(spec, execution_id=execution_id, on_output=sink)
    hc, cfg = seen["HostConfig"], seen["Config"]
    assert hc["NetworkMode"] == "none"
    assert hc["ReadonlyRootfs"] is True
    assert hc["CapDrop"] == ["ALL"] and not hc["CapAdd"]
    assert hc["SecurityOpt"] == ["no-new-privileges"]
    assert hc["Privileged"] is False
    assert not hc.get("Devices") and not hc.get("Binds")
    # The one host mount is the init, read-only; it is the process and the tool its argv.
    assert runner.init_path is not None
    assert hc["Mounts"] == [
        {
            "Type": "bind",
            "Source": str(runner.init_path),
            "Target": INIT_TARGET,
            "ReadOnly": True,
        }
    ]
    assert cfg["Entrypoint"] == [INIT_TARGET]
    assert cfg["Cmd"] == ["sh", "-c", "echo up; sleep 0.5"]
    assert hc["Memory"] == hc["MemorySwap"] == 100 * 1024 * 1024
    assert hc["NanoCpus"] == 250_000_000
    assert hc["PidsLimit"] == 20
    assert hc["IpcMode"] == "none"
    assert hc["Tmpfs"] == {"/tmp": "rw,noexec,nosuid,nodev,size=3m"}
    assert {u["Name"] for u in hc["Ulimits"]} == {"nofile", "fsize"}
    assert hc["LogConfig"]["Type"] == "none"
    assert hc["Runtime"] == "runc"
    assert hc["AutoRemove"] is False
    assert cfg["User"] == "65534:65534"
    assert cfg["OpenStdin"] is True and cfg["StdinOnce"] is True and cfg["Tty"] is False
    labels = cfg["Labels"]
    assert labels["io.toolreg.managed"] == "true"
    assert labels["io.toolreg.execution-id"] == execution_id
    assert labels["io.toolreg.instance"] == runner.instance_id
    assert labels["io.toolreg.test-run"] == run_id
    for key in ("owner-pid", "owner-start", "owner-boot", "owner-host", "owner-pidns", "deadline"):
        assert labels[f"io.toolreg.{key}"], key
    assert seen["Name"] == f"/toolreg-{execution_id}"


def test_many_threads_share_one_runner(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    # A slow tool on one thread must not hold up another thread's quick one.
    slow_done = threading.Event()

    def slow() -> None:
        runner.run(make_spec("sleep 3"), execution_id=eid())
        slow_done.set()

    t = threading.Thread(target=slow)
    t.start()
    res = runner.run(make_spec("echo quick"), execution_id=eid())
    assert res.stdout == b"quick\n"
    assert not slow_done.is_set()
    t.join(10)
