// The Vercel AI SDK (`ai`) running a streamed tool loop through visor
// (tests/it/clients.rs), with the provider named by argv[2]:
//   openai-chat       @ai-sdk/openai, Chat Completions  (createOpenAI().chat)
//   openai-responses  @ai-sdk/openai, Responses         (createOpenAI().responses)
//   anthropic         @ai-sdk/anthropic, Messages        (createAnthropic)
// Tools: `screenshot` answers an image through toModelOutput (a `file` part
// with image/png data), `read_notes` the text of a file.
// Prints {"final": …, "steps": N}.
import { streamText, tool, jsonSchema, stepCountIs } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createAnthropic } from "@ai-sdk/anthropic";
import { readFileSync } from "node:fs";

const mode = process.argv[2];
const base = process.env.VISOR_BASE; // http://127.0.0.1:PORT/v1
const name = process.env.VISOR_MODEL;
const apiKey = "sk-client-test";
let model;
if (mode === "openai-chat") model = createOpenAI({ baseURL: base, apiKey }).chat(name);
else if (mode === "openai-responses") model = createOpenAI({ baseURL: base, apiKey }).responses(name);
else if (mode === "anthropic") model = createAnthropic({ baseURL: base, apiKey })(name);
else throw new Error(`unknown mode ${mode}`);

const empty = jsonSchema({ type: "object", properties: {}, additionalProperties: false });
const tools = {
  screenshot: tool({
    description: "Screenshot of the app",
    inputSchema: empty,
    execute: async () => ({ png: readFileSync(process.env.VISOR_PNG).toString("base64") }),
    toModelOutput: ({ output }) => ({
      type: "content",
      value: [
        { type: "text", text: "The screenshot:" },
        { type: "file", data: { type: "data", data: output.png }, mediaType: "image/png" },
      ],
    }),
  }),
  read_notes: tool({
    description: "Read the notes file",
    inputSchema: empty,
    execute: async () => readFileSync(process.env.VISOR_NOTES, "utf8"),
  }),
};

let failed = null;
const result = streamText({
  model,
  system: "You are a test agent.",
  prompt: "Look at the app, then read the notes twice.",
  tools,
  maxRetries: 0,
  stopWhen: stepCountIs(8),
  onError: ({ error }) => { failed = error; },
});
const text = await result.text;
const steps = await result.steps;
if (failed) {
  console.error(failed);
  process.exit(1);
}
console.log(JSON.stringify({ final: text, steps: steps.length }));
