"""What the fleet's parts share in one process, below all of them: the engine deployment's
name, the routers' registry (the ingress reads their state for /metrics), and the relabelling
of a replica's Prometheus text. Kept apart so that serve.py, which builds the application
from the ingress, and the ingress, which reads the routers, do not import each other."""
from __future__ import annotations

import re
from typing import Any

ENGINE_DEPLOYMENT = "EngineReplica"
# Routers living in this process, by deployment name: the ingress reads their state for /metrics.
ROUTER_REGISTRY: dict[str, Any] = {}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?$")


def label_exposition(text: str, replica: str, seen_meta: set[str]) -> list[str]:
    """A replica's Prometheus text with `replica="..."` on every sample; HELP/TYPE lines once per family."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            key = " ".join(parts[:3])
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and key not in seen_meta:
                seen_meta.add(key)
                out.append(line)
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2), m.group(3)
        inner = labels[1:-1] if labels else ""
        extra = f'replica="{replica}"'
        out.append(f"{name}{{{inner + ',' if inner else ''}{extra}}} {value}")
    return out
