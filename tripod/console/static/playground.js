// The playground: a streamed chat against this server's (or fleet's) /v1/chat/completions or
// /v1/responses (the API chosen; with Responses the server keeps the conversation: each turn sends
// only its input and the previous response's id), with sampling controls, an optional JSON schema,
// and the request shown as curl and as Python.

import { apiKey, getJSON, postSSE } from "./api.js";

const $ = (id) => document.getElementById(id);

export class Playground {
  constructor() {
    this.history = [];  // chat: the messages so far
    this.previousId = null;  // responses: the id of the last answer (previous_response_id)
    this.controller = null;
    for (const id of ["pg-model", "pg-api", "pg-system", "pg-temperature", "pg-top_p", "pg-max_tokens", "pg-seed", "pg-schema", "pg-input"]) {
      $(id).addEventListener("input", () => this.showRequest());
    }
    $("pg-send").onclick = () => this.send();
    $("pg-stop").onclick = () => this.controller?.abort();
    $("pg-clear").onclick = () => this.clear();
    $("pg-api").addEventListener("change", () => this.clear());  // (the two keep a conversation differently)
    $("pg-input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); this.send(); }
    });
  }

  async load() {
    if (this.loaded) return;
    const models = await getJSON("/v1/models");
    $("pg-model").innerHTML = models.data.map((m) => `<option>${m.id}</option>`).join("");
    this.loaded = true;
    this.showRequest();
  }

  clear() {
    this.history = [];
    this.previousId = null;
    $("pg-transcript").innerHTML = "";
    this.showRequest();
  }

  get api() { return $("pg-api").value; }

  get path() { return this.api === "responses" ? "/v1/responses" : "/v1/chat/completions"; }

  // The request body for the conversation so far plus `text`; throws on a schema that is not JSON.
  body(text) {
    return this.api === "responses" ? this.responsesBody(text) : this.chatBody(text);
  }

  // The JSON schema asked for (null: free text); throws when it is not JSON.
  schema() {
    const schemaText = $("pg-schema").value.trim();
    if (!schemaText) return null;
    try {
      return JSON.parse(schemaText);
    } catch (e) {
      throw new Error(`the JSON schema is not valid JSON: ${e.message}`);
    }
  }

  responsesBody(text) {
    const body = { model: $("pg-model").value, input: text, stream: true };
    if ($("pg-system").value.trim()) body.instructions = $("pg-system").value;
    if (this.previousId) body.previous_response_id = this.previousId;
    for (const [k, name] of [["temperature", "temperature"], ["top_p", "top_p"], ["max_tokens", "max_output_tokens"], ["seed", "seed"]]) {
      const v = $(`pg-${k}`).value === "" ? NaN : Number($(`pg-${k}`).value);
      if (!Number.isNaN(v)) body[name] = v;
    }
    const schema = this.schema();
    if (schema) body.text = { format: { type: "json_schema", name: "answer", schema, strict: true } };
    return body;
  }

  chatBody(text) {
    const num = (id) => ($(id).value === "" ? null : Number($(id).value));
    const messages = [];
    if ($("pg-system").value.trim()) messages.push({ role: "system", content: $("pg-system").value });
    messages.push(...this.history, { role: "user", content: text });
    const body = { model: $("pg-model").value, messages, stream: true, stream_options: { include_usage: true } };
    for (const k of ["temperature", "top_p", "max_tokens", "seed"]) {
      const v = num(`pg-${k}`);
      if (v !== null && !Number.isNaN(v)) body[k] = v;
    }
    const schema = this.schema();
    if (schema) body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
    return body;
  }

  showRequest() {
    let body;
    try {
      body = this.body($("pg-input").value || "Hello!");
      $("pg-schema-error").textContent = "";
    } catch (e) {
      $("pg-schema-error").textContent = e.message;
      return;
    }
    const base = `${location.origin}`;
    const json = JSON.stringify(body, null, 2);
    const auth = apiKey() ? ` \\\n  -H "Authorization: Bearer $TRIPOD_API_KEY"` : "";
    $("pg-curl").textContent = `curl -N ${base}${this.path} \\\n  -H "Content-Type: application/json"${auth} \\\n` +
      `  -d '${json.replace(/'/g, "'\\''")}'`;
    if (this.api === "responses") {
      $("pg-python").textContent = responsesPython(base, body);
      return;
    }
    const { model, messages, stream, stream_options, ...rest } = body;
    const kw = Object.entries(rest).map(([k, v]) => `    ${k}=${py(v, 4)},`).join("\n");
    $("pg-python").textContent = `import os\nfrom openai import OpenAI\n\n` +
      `client = OpenAI(base_url="${base}/v1", api_key=os.environ.get("TRIPOD_API_KEY", "unused"))\n` +
      `stream = client.chat.completions.create(\n    model=${py(model, 4)},\n    messages=${py(messages, 4)},\n` +
      `    stream=True,\n    stream_options=${py(stream_options, 4)},\n${kw}\n)\n` +
      `for chunk in stream:\n    if chunk.choices and chunk.choices[0].delta.content:\n` +
      `        print(chunk.choices[0].delta.content, end="", flush=True)\n`;
  }

  bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.innerHTML = `<div class="role">${role}</div><div class="text"></div><div class="check"></div>`;
    div.querySelector(".text").textContent = text;
    $("pg-transcript").appendChild(div);
    $("pg-transcript").scrollTop = 1e9;
    return div;
  }

  async send() {
    const text = $("pg-input").value.trim();
    if (!text || this.controller) return;
    $("pg-error").textContent = "";
    let body;
    try {
      body = this.body(text);
    } catch (e) {
      $("pg-error").textContent = e.message;
      return;
    }
    this.showRequest();
    $("pg-input").value = "";
    this.bubble("user", text);
    const out = this.bubble("assistant", "");
    const answer = out.querySelector(".text");
    out.dataset.done = "0";
    out.dataset.chunks = "0";
    this.controller = new AbortController();
    $("pg-send").disabled = true;
    $("pg-stop").disabled = false;
    const t0 = performance.now();
    let first = null, usage = null, finish = null, chunks = 0;
    try {
      const show = (piece) => {
        first ??= performance.now();
        answer.textContent += piece;
        out.dataset.chunks = String(++chunks);
        $("pg-transcript").scrollTop = 1e9;
      };
      if (this.api === "responses") {
        let id = null;
        await postSSE("/v1/responses", body, (ev) => {
          if (ev.type === "error") throw new Error(ev.message || JSON.stringify(ev));
          if (ev.type === "response.output_text.delta" && ev.delta) show(ev.delta);
          if (ev.type === "response.failed") throw new Error(ev.response?.error?.message || "the response failed");
          if (ev.type === "response.completed" || ev.type === "response.incomplete") {
            id = ev.response.id;
            finish = ev.type === "response.completed" ? "stop" : "length";
            const u = ev.response.usage;
            if (u) usage = { completion_tokens: u.output_tokens, prompt_tokens: u.input_tokens,
                             prompt_tokens_details: { cached_tokens: u.input_tokens_details?.cached_tokens } };
          }
        }, this.controller.signal);
        if (id) this.previousId = id;  // the next turn continues this one (the server has it stored)
      } else {
        await postSSE("/v1/chat/completions", body, (ev) => {
          if (ev.error) throw new Error(ev.error.message || JSON.stringify(ev.error));
          if (ev.usage) usage = ev.usage;
          for (const ch of ev.choices || []) {
            if (ch.delta?.content) show(ch.delta.content);
            if (ch.finish_reason) finish = ch.finish_reason;
          }
        }, this.controller.signal);
        this.history.push({ role: "user", content: text }, { role: "assistant", content: answer.textContent });
      }
    } catch (e) {
      $("pg-error").textContent = e.name === "AbortError" ? "stopped" : e.message;
    } finally {
      const t1 = performance.now();
      const n = usage?.completion_tokens ?? chunks;
      const rate = first !== null && n > 1 && t1 > first ? ((n - 1) * 1000) / (t1 - first) : null;
      $("pg-stats").textContent = first === null ? "" : `TTFT ${(first - t0).toFixed(0)} ms · ${n} tokens` +
        (rate ? ` · ${rate.toFixed(1)} tok/s` : "") + (finish ? ` · finish: ${finish}` : "") +
        (usage?.prompt_tokens_details?.cached_tokens ? ` · ${usage.prompt_tokens_details.cached_tokens} prompt tokens cached` : "");
      if (body.response_format || body.text?.format) {
        const check = out.querySelector(".check");
        try {
          JSON.parse(answer.textContent);
          check.textContent = "✓ valid JSON (constrained by the schema)";
          check.className = "check ok";
        } catch {
          check.textContent = finish === "length" ? "✗ cut by max_tokens before the JSON closed" : "✗ not JSON";
          check.className = "check bad";
        }
      }
      out.dataset.finish = finish ?? "";
      out.dataset.done = "1";
      this.controller = null;
      $("pg-send").disabled = false;
      $("pg-stop").disabled = true;
    }
  }
}

// The Responses request as the official openai client's call (streamed, the text as it comes).
function responsesPython(base, body) {
  const { stream, ...rest } = body;
  const kw = Object.entries(rest).map(([k, v]) => `    ${k}=${py(v, 4)},`).join("\n");
  return `import os\nfrom openai import OpenAI\n\n` +
    `client = OpenAI(base_url="${base}/v1", api_key=os.environ.get("TRIPOD_API_KEY", "unused"))\n` +
    `stream = client.responses.create(\n${kw}\n    stream=True,\n)\n` +
    `for event in stream:\n    if event.type == "response.output_text.delta":\n` +
    `        print(event.delta, end="", flush=True)\n    elif event.type == "response.completed":\n` +
    `        print("\\nresponse id (previous_response_id for the next turn):", event.response.id)\n`;
}

// A JSON value as a Python literal (True/False/None; JSON strings are valid Python strings),
// indented as the code around it (`indent` spaces).
function py(v, indent) {
  const pad = " ".repeat(indent);
  if (v === null || v === undefined) return "None";
  if (v === true || v === false) return v ? "True" : "False";
  if (typeof v !== "object") return JSON.stringify(v);
  const items = Array.isArray(v) ? v.map((x) => py(x, indent + 4))
    : Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}: ${py(x, indent + 4)}`);
  const [open, close] = Array.isArray(v) ? ["[", "]"] : ["{", "}"];
  if (!items.length) return open + close;
  return `${open}\n${items.map((s) => `${pad}    ${s},`).join("\n")}\n${pad}${close}`;
}
