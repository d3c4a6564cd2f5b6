"""The official `anthropic` Python SDK in a tool loop that sets no
cache_control, through visor to an Anthropic-kind upstream
(tests/it/clients.rs): each turn's `x-visor-cache` header and the usage the
provider reported. Prints {"turns": N, "cache": [...], "read": [...], "written": [...]}.
"""

import json
import os

import anthropic

client = anthropic.Anthropic(
    base_url=os.environ["VISOR_ROOT"],
    api_key="sk-ant-client-test",
    max_retries=0,
    timeout=30,
)
system = "You are a careful coding agent. " + "Follow the project's rules. " * 300
tools = [
    {
        "name": "sh",
        "description": "Run a shell command and return its output",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    }
]

messages = [{"role": "user", "content": "Make the tests pass."}]
out = {"turns": 0, "cache": [], "read": [], "written": []}
while True:
    out["turns"] += 1
    if out["turns"] > 8:
        raise SystemExit("the loop did not end")
    raw = client.messages.with_raw_response.create(
        model=os.environ["VISOR_MODEL"],
        max_tokens=256,
        system=system,
        tools=tools,
        messages=messages,
    )
    msg = raw.parse()
    out["cache"].append(raw.headers.get("x-visor-cache"))
    out["read"].append(msg.usage.cache_read_input_tokens or 0)
    out["written"].append(msg.usage.cache_creation_input_tokens or 0)
    messages.append({"role": "assistant", "content": msg.content})
    if msg.stop_reason != "tool_use":
        break
    results = [
        {"type": "tool_result", "tool_use_id": b.id, "content": "ok " * 50}
        for b in msg.content
        if b.type == "tool_use"
    ]
    messages.append({"role": "user", "content": results})
print(json.dumps(out))
