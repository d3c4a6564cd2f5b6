// The official `openai` Node SDK in a Chat Completions tool loop, streamed,
// through visor (tests/it/clients.rs). Tools: `screenshot` answers an image
// (a tool message with an image_url part, as LlamaIndex-style agents send
// it), `read_notes` the text of a file. Prints {"final": …, "turns": N}.
import OpenAI from "openai";
import { readFileSync } from "node:fs";

const client = new OpenAI({
  baseURL: process.env.VISOR_BASE,
  apiKey: "sk-client-test",
  maxRetries: 0,
  timeout: 30_000,
});
const model = process.env.VISOR_MODEL;
const tools = [
  { type: "function", function: { name: "screenshot", description: "Screenshot of the app", parameters: { type: "object", properties: {} } } },
  { type: "function", function: { name: "read_notes", description: "Read the notes file", parameters: { type: "object", properties: {} } } },
];
function run(name) {
  if (name === "screenshot") {
    const b64 = readFileSync(process.env.VISOR_PNG).toString("base64");
    return [
      { type: "text", text: "The screenshot:" },
      { type: "image_url", image_url: { url: `data:image/png;base64,${b64}` } },
    ];
  }
  if (name === "read_notes") return readFileSync(process.env.VISOR_NOTES, "utf8");
  throw new Error(`unknown tool ${name}`);
}

const messages = [
  { role: "system", content: "You are a test agent." },
  { role: "user", content: "Look at the app, then read the notes twice." },
];
let turns = 0;
for (;;) {
  if (++turns > 8) throw new Error("the loop did not end");
  const stream = await client.chat.completions.create({
    model, messages, tools, stream: true, stream_options: { include_usage: true },
  });
  let text = "";
  const calls = [];
  let finish = null;
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    text += choice.delta?.content ?? "";
    for (const tc of choice.delta?.tool_calls ?? []) {
      calls[tc.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } };
      const c = calls[tc.index];
      if (tc.id) c.id = tc.id;
      if (tc.function?.name) c.function.name += tc.function.name;
      if (tc.function?.arguments) c.function.arguments += tc.function.arguments;
    }
    finish = choice.finish_reason ?? finish;
  }
  if (finish !== "tool_calls") {
    console.log(JSON.stringify({ final: text, turns }));
    break;
  }
  messages.push({ role: "assistant", content: text || null, tool_calls: calls });
  for (const c of calls) {
    messages.push({ role: "tool", tool_call_id: c.id, content: run(c.function.name) });
  }
}
