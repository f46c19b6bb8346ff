"""What OCSF 1.4.0 requires of the event classes toolreg exports, written
down from the schema (ocsf-schema v1.4.0: events/base_event.json with
includes/classification.json and includes/occurrence.json, the category
files, events/system/process_activity.json, events/iam/authentication.json,
events/iam/authorize_session.json,
events/iam/user_access.json, events/application/api_activity.json, and the
objects they use), not from toolreg's code: the tests check each exported
event against it.

Each class's "required" attributes, the required attributes of the objects
toolreg fills in, their at_least_one / just_one constraints, and the
enumerations the events use (category of each class, activity ids, status
and severity ids). These sets are the same in 1.3.0 through 1.7.0, except
that IAM classes gained `actor` (recommended) in 1.4.0, which is why the
events declare 1.4.0."""

from __future__ import annotations

from typing import Any

VERSION = "1.4.0"
BASE_REQUIRED = {"activity_id", "category_uid", "class_uid", "metadata", "severity_id", "time",
                 "type_uid"}  # fmt: skip
CLASSES: dict[int, dict[str, Any]] = {
    0: {"name": "Base Event", "category": 0, "required": set(), "activities": {0, 99}},
    1007: {
        "name": "Process Activity", "category": 1,
        "required": {"actor", "device", "process"},
        "activities": {0, 1, 2, 3, 4, 5, 99},  # Launch, Terminate, Open, Inject, Set User ID
    },
    3002: {
        "name": "Authentication", "category": 3,
        "required": {"user"},
        # Logon, Logoff, Authentication Ticket, Service Ticket Request, Service Ticket Renew
        "activities": {0, 1, 2, 3, 4, 5, 99},
        "at_least_one": ("service", "dst_endpoint"),
    },
    3003: {
        "name": "Authorize Session", "category": 3,
        "required": {"user"},
        "activities": {0, 1, 2, 99},  # Assign Privileges, Assign Groups
        "just_one": ("privileges", "group"),
    },
    3005: {
        "name": "User Access Management", "category": 3,
        "required": {"privileges", "user"},
        "activities": {0, 1, 2, 99},  # Assign Privileges, Revoke Privileges
    },
    6003: {
        "name": "API Activity", "category": 6,
        "required": {"actor", "api", "src_endpoint"},
        "activities": {0, 1, 2, 3, 4, 99},  # Create, Read, Update, Delete
    },
}  # fmt: skip
# object -> (required attributes, at_least_one)
OBJECTS: dict[str, tuple[set[str], tuple[str, ...]]] = {
    "metadata": ({"product", "version"}, ()),
    "product": (set(), ("name", "uid")),
    "api": ({"operation"}, ()),
    "actor": (set(), ("process", "user", "invoked_by", "session", "app_name", "app_uid")),
    "user": (set(), ("account", "name", "uid")),
    "process": (set(), ("pid", "uid")),
    "device": ({"type_id"}, ("ip", "uid", "name", "hostname", "instance_uid", "interface_uid",
                             "interface_name")),
    "src_endpoint": (set(), ("ip", "uid", "name", "hostname", "svc_name", "instance_uid",
                             "interface_uid", "interface_name", "domain")),
    "resource": (set(), ("name", "uid")),
    "service": (set(), ("name", "uid")),
    "dst_endpoint": (set(), ("ip", "uid", "name", "hostname", "svc_name", "instance_uid",
                             "interface_uid", "interface_name", "domain")),
}  # fmt: skip
STATUS_IDS = {0, 1, 2, 99}
SEVERITY_IDS = {0, 1, 2, 3, 4, 5, 6, 99}


def problems(event: dict[str, Any]) -> list[str]:
    """What the event lacks or gets wrong against the table above ([] when none)."""
    found: list[str] = []
    class_uid = event.get("class_uid")
    spec = CLASSES.get(class_uid) if isinstance(class_uid, int) else None
    if spec is None:
        return [f"class_uid {class_uid!r} is not one of {sorted(CLASSES)}"]
    for name in sorted(BASE_REQUIRED | spec["required"]):
        if event.get(name) in (None, "", [], {}):
            found.append(f"{spec['name']}: required attribute {name} missing")
    if event.get("category_uid") != spec["category"]:
        found.append(f"category_uid {event.get('category_uid')} is not {spec['category']}")
    if event.get("activity_id") not in spec["activities"]:
        found.append(f"activity_id {event.get('activity_id')} is not one of {spec['name']}'s")
    if event.get("type_uid") != class_uid * 100 + event.get("activity_id", -1):
        found.append(f"type_uid {event.get('type_uid')} is not class_uid * 100 + activity_id")
    if event.get("status_id", 0) not in STATUS_IDS:
        found.append(f"status_id {event.get('status_id')}")
    if event.get("severity_id") not in SEVERITY_IDS:
        found.append(f"severity_id {event.get('severity_id')}")
    if not isinstance(event.get("time"), int):
        found.append("time is not an integer (milliseconds since the epoch)")
    if "at_least_one" in spec and not any(event.get(a) for a in spec["at_least_one"]):
        found.append(f"at least one of {spec['at_least_one']} must be present")
    for name in ("count", "start_time", "end_time"):  # base event (occurrence) integers
        if name in event and not isinstance(event[name], int):
            found.append(f"{name} is not an integer")
    if "just_one" in spec and sum(1 for a in spec["just_one"] if a in event) != 1:
        found.append(f"just one of {spec['just_one']} must be present")
    metadata = event.get("metadata") or {}
    if metadata.get("version") != VERSION:
        found.append(f"metadata.version {metadata.get('version')!r}")
    objects = {**{k: event.get(k) for k in OBJECTS}, "product": metadata.get("product")}
    actor = event.get("actor")
    if isinstance(actor, dict) and isinstance(actor.get("user"), dict):
        objects["actor.user"] = actor["user"]
    for name, value in objects.items():
        if value is None:
            continue
        required, at_least_one = OBJECTS[name.split(".")[-1]]
        if not isinstance(value, dict):
            found.append(f"{name} is not an object")
            continue
        for attribute in sorted(required):
            if value.get(attribute) in (None, ""):
                found.append(f"{name}.{attribute} missing")
        if at_least_one and not any(value.get(a) not in (None, "") for a in at_least_one):
            found.append(f"{name} has none of {at_least_one}")
    for resource in event.get("resources") or []:
        if not any(resource.get(a) for a in ("name", "uid")):
            found.append("a resource has neither name nor uid")
    if not isinstance(event.get("privileges", []), list):
        found.append("privileges is not an array")
    return found
