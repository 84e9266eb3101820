// Node's official `openai` package against a running router: node client.mjs <base_url>
// Prints one JSON line with what each call saw; any exception fails the run (exit code 1).
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "unused", maxRetries: 0 });
const weather = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Current weather in a city",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};

const results = {};
results.retrieve = (await client.models.retrieve("gpt-4o-mini")).id;
const models = [];
for await (const model of client.models.list()) models.push(model.id);
results.models = models;

const chat = await client.chat.completions.create({
  model: "gpt-4o-mini",
  messages: [{ role: "user", content: "a b c" }],
});
results.chat = chat.choices[0].message.content;

const called = await client.chat.completions.create({
  model: "echo",
  messages: [{ role: "user", content: "weather in Paris?" }],
  tools: [weather],
  tool_choice: "required",
});
const call = called.choices[0].message.tool_calls[0];
JSON.parse(call.function.arguments);
results.tool = call.function.name;

const runner = client.chat.completions.stream({
  model: "echo",
  messages: [{ role: "user", content: "weather in Oslo?" }],
  tools: [weather],
  tool_choice: { type: "function", function: { name: "get_weather" } },
});
const final = await runner.finalChatCompletion();
results.streamed_tool = final.choices[0].message.tool_calls[0].function.name;

try {
  await client.chat.completions.create({ model: "nope", messages: [{ role: "user", content: "x" }] });
  results.not_found = "no error";
} catch (error) {
  if (!(error instanceof OpenAI.NotFoundError) || error.param !== "model") throw error;
  results.not_found = error.status;
}
console.log(JSON.stringify(results));
