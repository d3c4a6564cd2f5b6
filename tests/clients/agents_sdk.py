"""The OpenAI Agents SDK (`openai-agents`) running a tool loop through visor
(tests/it/clients.rs), streamed, with the model API named by argv[1]:

  responses  the SDK's default (Responses), via set_default_openai_client
  chat       Chat Completions, via RunConfig(model_provider=OpenAIProvider(...))

Tools: `screenshot` answers a ToolOutputImage (a PNG data URL), `read_notes`
the text of a file. Prints {"final": ..., "turns": N}.
"""

import asyncio
import base64
import json
import os
import sys

from openai import AsyncOpenAI

from agents import (
    Agent,
    OpenAIProvider,
    RunConfig,
    Runner,
    ToolOutputImage,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)

mode = sys.argv[1]
base = os.environ["VISOR_BASE"]  # http://127.0.0.1:PORT/v1
set_tracing_disabled(True)


@function_tool
def screenshot() -> ToolOutputImage:
    """Screenshot of the app."""
    with open(os.environ["VISOR_PNG"], "rb") as f:
        b64 = base64.b64encode(f.read()).decode()
    return ToolOutputImage(image_url=f"data:image/png;base64,{b64}")


@function_tool
def read_notes() -> str:
    """Read the notes file."""
    with open(os.environ["VISOR_NOTES"]) as f:
        return f.read()


agent = Agent(
    name="tester",
    instructions="You are a test agent.",
    model=os.environ["VISOR_MODEL"],
    tools=[screenshot, read_notes],
)

if mode == "responses":
    client = AsyncOpenAI(base_url=base, api_key="sk-client-test", max_retries=0, timeout=30)
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("responses")
    run_config = RunConfig()
elif mode == "chat":
    provider = OpenAIProvider(base_url=base, api_key="sk-client-test", use_responses=False)
    run_config = RunConfig(model_provider=provider)
else:
    raise SystemExit(f"unknown mode {mode}")


async def main() -> None:
    result = Runner.run_streamed(
        agent, "Look at the app, then read the notes twice.", max_turns=8, run_config=run_config
    )
    async for _ in result.stream_events():
        pass
    print(json.dumps({"final": result.final_output, "turns": result.current_turn}))


asyncio.run(main())
