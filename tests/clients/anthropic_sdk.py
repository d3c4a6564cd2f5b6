"""The official `anthropic` Python SDK in a streamed Messages tool loop
through visor (tests/it/clients.rs). Tools: `screenshot` answers a tool_result
holding an image block (base64 PNG), `read_notes` the text of a file.
Prints {"final": ..., "turns": N}.
"""

import base64
import json
import os

import anthropic

client = anthropic.Anthropic(
    base_url=os.environ["VISOR_ROOT"],  # http://127.0.0.1:PORT, the SDK adds /v1/messages
    api_key="sk-ant-client-test",
    max_retries=0,
    timeout=30,
)
empty = {"type": "object", "properties": {}}
tools = [
    {"name": "screenshot", "description": "Screenshot of the app", "input_schema": empty},
    {"name": "read_notes", "description": "Read the notes file", "input_schema": empty},
]


def run(name: str):
    if name == "screenshot":
        with open(os.environ["VISOR_PNG"], "rb") as f:
            b64 = base64.b64encode(f.read()).decode()
        return [
            {"type": "text", "text": "The screenshot:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        ]
    if name == "read_notes":
        with open(os.environ["VISOR_NOTES"]) as f:
            return f.read()
    raise ValueError(name)


messages = [{"role": "user", "content": "Look at the app, then read the notes twice."}]
turns = 0
while True:
    turns += 1
    if turns > 8:
        raise SystemExit("the loop did not end")
    with client.messages.stream(
        model=os.environ["VISOR_MODEL"],
        max_tokens=1024,
        system="You are a test agent.",
        messages=messages,
        tools=tools,
    ) as stream:
        msg = stream.get_final_message()
    messages.append({"role": "assistant", "content": msg.content})
    if msg.stop_reason != "tool_use":
        text = "".join(b.text for b in msg.content if b.type == "text")
        print(json.dumps({"final": text, "turns": turns}))
        break
    results = [
        {"type": "tool_result", "tool_use_id": b.id, "content": run(b.name)}
        for b in msg.content
        if b.type == "tool_use"
    ]
    messages.append({"role": "user", "content": results})
