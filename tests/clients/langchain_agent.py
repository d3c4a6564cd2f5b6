"""LangChain running its own tool loop through visor (tests/it/clients.rs),
streamed, with the chat model named by argv[1]:

  openai     langchain-openai's ChatOpenAI, on Chat Completions
  anthropic  langchain-anthropic's ChatAnthropic, on Messages

The loop is LangChain's documented one: bind_tools, stream and add up the
chunks, run each tool call with `tool.invoke(tool_call)` (a ToolMessage),
until an answer without tool calls. Tools: `screenshot` answers standard
content blocks, a text and an image (`{"type": "image", "base64": …,
"mime_type": "image/png"}`), `read_notes` the text of a file. Prints
{"final": ..., "turns": N}.
"""

import base64
import json
import os
import sys

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool

mode = sys.argv[1]


@tool
def screenshot() -> list:
    """Screenshot of the app."""
    with open(os.environ["VISOR_PNG"], "rb") as f:
        b64 = base64.b64encode(f.read()).decode()
    return [
        {"type": "text", "text": "The screenshot:"},
        {"type": "image", "base64": b64, "mime_type": "image/png"},
    ]


@tool
def read_notes() -> str:
    """Read the notes file."""
    with open(os.environ["VISOR_NOTES"]) as f:
        return f.read()


if mode == "openai":
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=os.environ["VISOR_MODEL"],
        base_url=os.environ["VISOR_BASE"],  # http://127.0.0.1:PORT/v1
        api_key="sk-client-test",
        streaming=True,
        max_retries=0,
        timeout=30,
    )
elif mode == "anthropic":
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(
        model=os.environ["VISOR_MODEL"],
        base_url=os.environ["VISOR_ROOT"],  # http://127.0.0.1:PORT, no /v1
        api_key="sk-ant-client-test",
        streaming=True,
        max_tokens=1024,
        max_retries=0,
        timeout=30,
    )
else:
    raise SystemExit(f"unknown mode {mode}")

tools = {t.name: t for t in [screenshot, read_notes]}
model = llm.bind_tools(list(tools.values()))
messages = [
    SystemMessage("You are a test agent."),
    HumanMessage("Look at the app, then read the notes twice."),
]
turns = 0
while True:
    turns += 1
    if turns > 8:
        raise SystemExit("the loop did not end")
    msg = None
    for chunk in model.stream(messages):
        msg = chunk if msg is None else msg + chunk
    if msg is None:
        raise SystemExit("the model streamed nothing")
    messages.append(msg)
    if not msg.tool_calls:
        print(json.dumps({"final": str(msg.text), "turns": turns}))
        break
    for call in msg.tool_calls:
        messages.append(tools[call["name"]].invoke(call))
